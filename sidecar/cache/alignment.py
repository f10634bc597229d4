"""Token alignment: does each word of one prompt have a counterpart in the other?

A sentence embedding is the mean of the model's per-token vectors, so one changed word among
twenty moves it little.  The per-token vectors keep that word: for each token of one prompt,
how close is the nearest token of the other (a BERTScore-style greedy alignment)?

`align_features` gives the learned verifier (sidecar/cache/verifier.py) four numbers from the
greedy matching of two prompts' token states after MiniLM's first STATES_LAYERS layers, which
the embedding engine returns beside the vector when asked (docs/semantic-verifier-experiments.md,
section 2).
"""
from __future__ import annotations

import numpy as np

__all__ = ["ALIGN_FEATURES", "STATES_LAYERS", "unit_tokens", "align_features"]

# The layer whose output states the verifier aligns: the embedder computes them on its way to
# the vector, and the experiments measured the split after four of MiniLM's six layers best.
STATES_LAYERS = 4
ALIGN_FEATURES = ("align_mean_min", "align_mean_max", "align_worst_min", "align_worst_max")


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
