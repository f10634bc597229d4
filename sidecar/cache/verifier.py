"""The semantic verifier: P(same question) for a stored prompt and a new one.

The vector index proposes the nearest stored prompt above a recall-oriented cosine floor;
this model decides.  Its input is the pair's cosine and what the lexical checks of
sidecar.cache.equivalence find (all of them, as features, not as vetoes), plus a few
measures of how the two texts differ; its output is a probability.  The model is small
gradient-boosted trees (sidecar/models/verifier.json), trained by scripts/train_verifier.py
on pairs the project owns (data/semantic/: generated and hand-written) and calibrated on
held-out pairs, so that a route's `max_false_hit_rate` maps to a score threshold.

Pure numpy, no model run.  A model may also read ALIGN_FEATURES (sidecar/cache/alignment.py):
the greedy matching of the two prompts' token states after the embedder's first layers, which
the engine returns with the vector when asked; its file lists its features (and the layer of
the states it was trained on, `states_layers`), and a model whose features this code cannot
compute is refused at load.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from sidecar.cache.alignment import ALIGN_FEATURES, STATES_LAYERS, align_features, unit_tokens
from sidecar.cache.equivalence import Disagreements, disagreements, profile

__all__ = ["FEATURES", "Verifier", "features", "load_verifier", "MODEL_PATH", "WORDS_PATH", "NoStates"]

MODEL_PATH = Path(__file__).resolve().parents[1] / "models" / "verifier.json"
WORDS_PATH = Path(__file__).resolve().parents[1] / "models" / "verifier-words.json"

FEATURES = (
    "cosine", "numbers", "negation", "question_word", "comparison", "entities", "order", "symbols",
    "tense", "quantifiers", "case", "tail", "extra_max", "extra_min", "extra_both", "content_jaccard",
    "words_max", "length_ratio", "word_jaccard", "trigram_jaccard", "opposite_words", "exchanged",
    "first_word_same",
)

_WORD = re.compile(r"[^\W_]+(?:['’][^\W_]+)*")


@lru_cache(maxsize=1)
def _opposites() -> dict[str, frozenset[str]]:
    """Each word of the data file's opposite pairs -> its opposites (any language)."""
    pairs = json.loads(WORDS_PATH.read_text(encoding="utf-8"))["opposites"]
    out: dict[str, set[str]] = {}
    for x, y in pairs:
        out.setdefault(x, set()).add(y)
        out.setdefault(y, set()).add(x)
    return {w: frozenset(v) for w, v in out.items()}


def _words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def _trigrams(text: str) -> set[str]:
    t = " ".join(_words(text))
    return {t[i:i + 3] for i in range(max(1, len(t) - 2))}


def _jaccard(x: set, y: set) -> float:
    return len(x & y) / len(x | y) if x or y else 1.0


def features(a: str, b: str, cosine: float, found: Disagreements | None = None) -> np.ndarray:
    """The verifier's inputs for one pair, in FEATURES order (symmetric in a and b); `found`:
    the pair's disagreements, when the caller has them."""
    found = found if found is not None else disagreements(a, b)
    pa, pb = profile(a), profile(b)
    wa, wb = _words(a), _words(b)
    sa, sb = set(wa), set(wb)
    opposites = _opposites()
    only_a, only_b = sa - sb, sb - sa
    opposed = any(opposites.get(w, frozenset()) & only_b for w in only_a)
    # The same words in another order: "is every square a rectangle" / "... rectangle a square".
    exchanged = sorted(wa) == sorted(wb) and wa != wb
    return np.array([
        cosine, found.numbers, found.negation, found.question_word, found.comparison, found.entities,
        found.order, found.symbols, found.tense, found.quantifiers, found.case, found.tail,
        max(found.extra_a, found.extra_b), min(found.extra_a, found.extra_b),
        bool(found.extra_a and found.extra_b), _jaccard(set(pa.content), set(pb.content)),
        max(len(wa), len(wb)), min(len(wa), len(wb)) / max(1, len(wa), len(wb)),
        _jaccard(sa, sb), _jaccard(_trigrams(a), _trigrams(b)), opposed, exchanged,
        bool(wa and wb and wa[0] == wb[0]),
    ], dtype=np.float64)


@dataclass(frozen=True)
class Calibration:
    """Score thresholds measured for target false-hit rates (ascending rates)."""
    rates: tuple[float, ...]
    thresholds: tuple[float, ...]

    def threshold(self, max_false_hit_rate: float) -> float:
        """The threshold measured for the largest target at or under the given rate (a rate
        below every target gets the strictest); never looser than asked."""
        best = self.thresholds[0]
        for rate, threshold in zip(self.rates, self.thresholds):
            if rate <= max_false_hit_rate:
                best = threshold
        return best


class NoStates(Exception):
    """The model reads token alignment and a prompt's token states are missing."""


class Verifier:
    """Boosted trees over FEATURES (and ALIGN_FEATURES when `needs_states`); `score` is
    P(same question), `threshold` the score a hit needs for a target false-hit rate, `floor`
    the least cosine worth asking about."""

    def __init__(self, model: dict):
        names = tuple(model["features"])
        # Columns are read by position: the lexical ones first, then alignment when it is used.
        if names not in (FEATURES, FEATURES + ALIGN_FEATURES):
            unknown = sorted(set(names) - set(FEATURES) - set(ALIGN_FEATURES))
            raise ValueError(
                "verifier model: its features are not ones this code computes "
                f"({'unknown: ' + ', '.join(unknown) if unknown else 'another order or subset'}); "
                "retrain it (scripts/train_verifier.py)")
        self.features = names
        self.needs_states = names != FEATURES
        # States of another layer would feed the trees numbers they were never trained on.
        if self.needs_states and model.get("states_layers") != STATES_LAYERS:
            raise ValueError(
                f"verifier model: trained on the token states after layer {model.get('states_layers')!r}, "
                f"and the embedder gives those after layer {STATES_LAYERS}; retrain it "
                "(scripts/train_verifier.py)")
        trees = model["trees"]
        self.base = float(model["base"])
        self.feature = np.array([t["feature"] for t in trees], dtype=np.int64)     # [T, 2^d - 1]
        self.split = np.array([t["split"] for t in trees], dtype=np.float64)       # [T, 2^d - 1]
        self.leaf = np.array([t["leaf"] for t in trees], dtype=np.float64)         # [T, 2^d]
        self.depth = int(model["depth"])
        self.floor = float(model["floor"])
        cal = model["calibration"]
        self.calibration = Calibration(tuple(cal["rates"]), tuple(cal["thresholds"]))
        self.version = str(model.get("version", ""))
        self._rows = np.arange(len(trees))

    def logits(self, x: np.ndarray) -> np.ndarray:
        """Rows of features -> log-odds (vectorised over pairs and trees)."""
        x = np.atleast_2d(x)
        node = np.zeros((x.shape[0], len(self._rows)), dtype=np.int64)
        for _ in range(self.depth):
            f = self.feature[self._rows, node]                       # [n, T]
            s = self.split[self._rows, node]
            right = np.take_along_axis(x, f, axis=1) > s
            node = 2 * node + 1 + right
        leaves = self.leaf[self._rows, node - (2 ** self.depth - 1)]
        return self.base + leaves.sum(axis=1)

    def probabilities(self, x: np.ndarray) -> np.ndarray:
        return 1.0 / (1.0 + np.exp(-self.logits(x)))

    def row(self, a: str, b: str, cosine: float, found: Disagreements | None = None,
            states: tuple[np.ndarray | None, np.ndarray | None] | None = None) -> np.ndarray:
        """The model's inputs for one pair. `states`: the two prompts' token states from the
        embedder (in the order of the texts), read only when `needs_states`; NoStates when
        it needs them and one is missing."""
        x = features(a, b, cosine, found)
        if not self.needs_states:
            return x
        if states is None or states[0] is None or states[1] is None:
            raise NoStates("the verifier's model reads token states, and a prompt has none")
        return np.concatenate([x, align_features(unit_tokens(states[0]), unit_tokens(states[1]))])

    def threshold(self, max_false_hit_rate: float) -> float:
        return self.calibration.threshold(max_false_hit_rate)


@lru_cache(maxsize=1)
def load_verifier(path: str | None = None) -> Verifier:
    """The shipped model (or one at `path`), read once."""
    with open(path or MODEL_PATH, encoding="utf-8") as handle:
        return Verifier(json.load(handle))
