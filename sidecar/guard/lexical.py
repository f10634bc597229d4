"""Cheap lexical features for the injection classifier: hashed character n-grams.

The MiniLM embedding says what a prompt is about; it blurs the few words that make an order
out of a question ("ignore the above and ...", "you are now DAN"). Character n-grams of the
folded text (sidecar/guard/normalize.py) keep them, in any script, and need no vocabulary:
each n-gram is hashed into one of `DIM` buckets and the classifier learns a weight per bucket
(an n-gram that recurs counts each time; `score` divides by the square root of the count, so a
long text is not judged by its length).
All in numpy over the code points (no Python loop per character), so a 2 KB prompt costs tens
of microseconds. A text longer than `MAX_CHARS` is read at its start and end, where an order
sits in a pasted document.
"""
from __future__ import annotations

import numpy as np

from sidecar.guard.normalize import fold

DIM_BITS = 18
DIM = 1 << DIM_BITS
ORDERS = (3, 4, 5)
MAX_CHARS = 8192
_PRIME = np.uint64(0x100000001B3)
_MIX = np.uint64(0x9E3779B97F4A7C15)


def buckets(text: str) -> np.ndarray:
    """The bucket of each character n-gram of the text (int64, in no useful order)."""
    folded = " ".join(fold(text).split())
    if len(folded) > MAX_CHARS:
        folded = folded[:MAX_CHARS // 2] + " " + folded[-MAX_CHARS // 2:]
    points = np.frombuffer((" " + folded + " ").encode("utf-32-le", "surrogatepass"), np.uint32).astype(np.uint64)
    out = []
    with np.errstate(over="ignore"):        # the hashes wrap around 2**64 by design
        rolling = np.zeros(len(points), np.uint64)
        for n in range(1, max(ORDERS) + 1):
            # rolling[i] hashes points[i : i + n]
            rolling = rolling[:len(points) - n + 1] * _PRIME + points[n - 1:]
            if n in ORDERS:
                out.append(((rolling ^ np.uint64(n)) * _MIX) >> np.uint64(64 - DIM_BITS))
    return np.concatenate(out).astype(np.int64) if out else np.zeros(0, np.int64)


def score(weights: np.ndarray, text: str) -> float:
    """The lexical part of the classifier's logit: the mean weight of the text's n-grams,
    scaled by the square root of their count (0 for a text without any)."""
    index = buckets(text)
    return float(weights[index].sum() / np.sqrt(len(index))) if len(index) else 0.0
