"""Token alignment: does each word of one prompt have a counterpart in the other?

A sentence embedding is the mean of the model's per-token vectors (its last hidden
states), so one changed word among twenty moves it little.  The per-token vectors
keep that word: the "same question?" decision can ask, for each content token of one
prompt, how close the nearest token of the other prompt is (a BERTScore-style greedy
alignment), and refuse a hit when too many tokens have no counterpart.

Measured in docs/semantic-checks.md.  `content_states` turns one model run's output
into what `unaligned` compares; sidecar.cache.equivalence applies the limit.
`run_content_states` is that run, offline (scripts/tune_semantic.py, tests).

`align_features` is the learned verifier's use of the same idea (sidecar/cache/verifier.py):
four numbers from the greedy matching of two prompts' token states after MiniLM's first
STATES_LAYERS layers, which the embedding engine returns beside the vector when asked
(docs/semantic-verifier-experiments.md, section 2).
"""
from __future__ import annotations

import string
from collections.abc import Callable, Sequence

import numpy as np

from sidecar.cache.stopwords import STOPWORDS

__all__ = ["content_states", "unaligned", "run_content_states", "ALIGN_FEATURES", "STATES_LAYERS",
           "unit_tokens", "align_features"]

# The layer whose output states the verifier aligns: the embedder computes them on its way to
# the vector, and the experiments measured the split after four of MiniLM's six layers best.
STATES_LAYERS = 4
ALIGN_FEATURES = ("align_mean_min", "align_mean_max", "align_worst_min", "align_worst_max")

_SPECIAL = frozenset({"[CLS]", "[SEP]", "[PAD]", "[UNK]", "[MASK]"})


def _is_content(piece: str) -> bool:
    if piece in _SPECIAL:
        return False
    if piece.startswith("##"):          # the rest of a word: as much content as its start
        return True
    if all(c in string.punctuation for c in piece):
        return False
    return piece not in STOPWORDS


def content_states(token_ids: Sequence[int], states: np.ndarray,
                   id_to_token: Callable[[int], str | None]) -> np.ndarray:
    """The unit-length hidden states of a prompt's content tokens, [k, dim] float32.

    token_ids: the ids the model read; states: its last hidden states for them,
    [len(token_ids), dim]; id_to_token: the tokenizer's id -> word piece.  Special
    tokens, punctuation and stop words (sidecar/cache/stopwords.py) are left
    out: "the" aligns with anything and says nothing.
    """
    keep = [i for i, tid in enumerate(token_ids) if _is_content(id_to_token(int(tid)) or "[UNK]")]
    rows = np.asarray(states, dtype=np.float32)[keep]
    norms = np.linalg.norm(rows, axis=1, keepdims=True)
    return rows / np.maximum(norms, 1e-12)


def unaligned(a: np.ndarray, b: np.ndarray, floor: float) -> int:
    """Content tokens of one prompt with no token of the other at cosine >= floor.

    The larger count of the two directions, so symmetric.  a, b: `content_states`
    rows.  A prompt without content tokens aligns with anything; every content token
    of the other prompt then counts.
    """
    if len(a) == 0 or len(b) == 0:
        return max(len(a), len(b))
    sims = a @ b.T
    return int(max((sims.max(axis=1) < floor).sum(), (sims.max(axis=0) < floor).sum()))


def run_content_states(encoder, texts: Sequence[str]) -> list[np.ndarray]:
    """Content-token states of texts in one model run of `encoder` (sidecar.embedding's
    Encoder: same tokenizer, truncation and session as the served vectors), float32.

    Blocking, and not for a thread that shares the encoder: offline use only.  A text
    with nothing to embed raises NothingToEmbed, as Encoder.tokenize does.
    """
    ids = [encoder.tokenize(text) for text in texts]
    hidden, _ = encoder.hidden_states(ids)
    return [content_states(row_ids, hidden[row, :len(row_ids)], encoder.tokenizer.id_to_token)
            for row, row_ids in enumerate(ids)]


def unit_tokens(states: np.ndarray | None) -> np.ndarray | None:
    """A text's token states [tokens, dim] (any float type, with [CLS] first and [SEP] last)
    -> its word pieces' unit rows, float32; None for no states or no word piece."""
    if states is None or len(states) < 3:
        return None
    rows = np.asarray(states[1:-1], dtype=np.float32)
    return rows / np.maximum(np.linalg.norm(rows, axis=1, keepdims=True), 1e-6)


def align_features(a: np.ndarray | None, b: np.ndarray | None) -> np.ndarray:
    """ALIGN_FEATURES of two texts' `unit_tokens` (symmetric): each direction's mean best
    match (min, max) and its worst-matched token's best match (min, max), since one changed
    entity or number leaves one token without a partner. Zeros when either has none."""
    if a is None or b is None or len(a) == 0 or len(b) == 0:
        return np.zeros(len(ALIGN_FEATURES))
    sim = a @ b.T
    best_a, best_b = sim.max(1), sim.max(0)
    means = (float(best_a.mean()), float(best_b.mean()))
    worst = (float(best_a.min()), float(best_b.min()))
    return np.array([min(means), max(means), min(worst), max(worst)])
