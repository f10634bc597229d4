"""May the answer stored for one prompt serve another?  The semantic tier's decision.

Without the verifier: the embeddings' cosine clears the route's threshold and every check of
sidecar/cache/equivalence.py agrees. With a route's
`max_false_hit_rate` above 0 the learned verifier (sidecar/cache/verifier.py) decides instead,
its features being those checks' findings, with the checks in `verifier_vetoes` still able to
say no. Pure but for the verifier's model, loaded once.
"""

from __future__ import annotations

import re
import unicodedata

from sidecar.cache.equivalence import CHECK_ORDER, EquivalenceSettings, Verdict, disagreements, requirement
from sidecar.cache.verifier import NoStates, load_verifier

__all__ = ["same_question", "candidate_floor"]


def same_question(a_text: str, b_text: str, cosine: float,
                  settings: EquivalenceSettings,
                  layer_states: tuple[object, object] | None = None) -> Verdict:
    """May the answer stored for one prompt be served for the other?

    `cosine` is the similarity of the two prompts' embeddings.  Symmetric in the prompts.
    `layer_states`: the two prompts' token states from the embedding engine (sidecar.embedding's
    WithStates), in the order of the texts, for a verifier whose model reads them (without
    them: a miss, "verifier_no_states").  The reason names the first check that said no, or "ok".
    """
    if _unseen_difference(a_text, b_text, cosine):
        return Verdict(False, "unseen_words")
    if settings.max_false_hit_rate > 0:
        return _verified(a_text, b_text, cosine, settings, layer_states)
    if cosine < settings.threshold:
        return Verdict(False, "below_threshold")
    need = requirement(a_text, b_text, settings)
    if cosine < need.min_cosine:
        return Verdict(False, need.reason)
    return Verdict(True, "ok")


# Two different token sequences never embed this close (the nearest measured: 0.998, a
# spelling variant); the same sequence always does.
_SAME_VECTOR = 0.99999
_WORD = re.compile(r"[^\W_]+")


def _unseen_difference(a_text: str, b_text: str, cosine: float) -> bool:
    """The vectors are the same but the words differ beyond case and accents (which the
    model folds): the model saw no difference because it reads the differing words as
    [UNK] (서울에서 부산까지 / 대구까지, 낮추는 / 높이는), so its cosine vouches for nothing."""
    return cosine >= _SAME_VECTOR and _folded_words(a_text) != _folded_words(b_text)


def _folded_words(text: str) -> list[str]:
    decomposed = unicodedata.normalize("NFKD", text.casefold())
    return _WORD.findall("".join(c for c in decomposed if not unicodedata.combining(c)))


def candidate_floor(settings: EquivalenceSettings) -> float:
    """The least cosine of a stored prompt worth deciding on: the verifier's measured floor
    when it decides, else the threshold."""
    if settings.max_false_hit_rate > 0:
        return load_verifier().floor
    return settings.threshold


def _verified(a_text: str, b_text: str, cosine: float, settings: EquivalenceSettings,
              layer_states: tuple[object, object] | None) -> Verdict:
    """The verifier's decision: its score against the threshold calibrated for the route's
    false-hit rate, after the checks kept as vetoes."""
    verifier = load_verifier()
    if cosine < verifier.floor:
        return Verdict(False, "below_threshold")
    if max(len(a_text), len(b_text)) > settings.max_prompt_chars:
        return Verdict(False, "too_long")
    found = disagreements(a_text, b_text, settings.tail_prompt_words)
    if found.identifiers:
        return Verdict(False, "identifiers_differ")
    for switch, field_name, reason in CHECK_ORDER:
        if field_name in settings.verifier_vetoes and getattr(settings, switch) and getattr(found, field_name):
            return Verdict(False, reason)
    try:
        row = verifier.row(a_text, b_text, cosine, found, layer_states)
    except NoStates:
        return Verdict(False, "verifier_no_states")
    score = float(verifier.probabilities(row)[0])
    if score < verifier.threshold(settings.max_false_hit_rate):
        return Verdict(False, "verifier_rejected", score)
    return Verdict(True, "ok", score)
