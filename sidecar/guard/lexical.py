"""Cheap lexical features for the injection classifier: hashed character n-grams.

The MiniLM embedding says what a prompt is about; it blurs the few words that make an order
out of a question ("ignore the above and ...", "you are now DAN"). Character n-grams of the
folded text (sidecar/guard/normalize.py) keep them, in any script, and need no vocabulary:
each n-gram is hashed into one of `DIM` buckets and the classifier learns a weight per bucket
(an n-gram that recurs counts each time; `score` divides by the square root of the count, and
judges a long text by its most suspect stretch as well as as a whole).
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


WINDOW = 200   # chosen on validation attacks appended to validation documents (eval: "appended")


def _folded_points(text: str) -> np.ndarray:
    folded = " ".join(fold(text).split())
    if len(folded) > MAX_CHARS:
        folded = folded[:MAX_CHARS // 2] + " " + folded[-MAX_CHARS // 2:]
    return np.frombuffer((" " + folded + " ").encode("utf-32-le", "surrogatepass"), np.uint32).astype(np.uint64)


def _by_order(points: np.ndarray) -> list[np.ndarray]:
    """For each order, the bucket of the n-gram starting at each position."""
    out = []
    with np.errstate(over="ignore"):        # the hashes wrap around 2**64 by design
        rolling = np.zeros(len(points), np.uint64)
        for n in range(1, max(ORDERS) + 1):
            # rolling[i] hashes points[i : i + n]
            rolling = rolling[:len(points) - n + 1] * _PRIME + points[n - 1:]
            if n in ORDERS:
                out.append((((rolling ^ np.uint64(n)) * _MIX) >> np.uint64(64 - DIM_BITS)).astype(np.int64))
    return out


def buckets(text: str) -> np.ndarray:
    """The bucket of each character n-gram of the text (int64, in no useful order)."""
    by_order = _by_order(_folded_points(text))
    return np.concatenate(by_order) if by_order else np.zeros(0, np.int64)


def score(weights: np.ndarray, text: str) -> float:
    """The lexical part of the classifier's logit: the weights of the text's n-grams summed and
    divided by the square root of their count (0 for a text without any); for a text longer
    than `WINDOW` characters, the highest such score of the whole text and of every stretch of
    `WINDOW` characters. An order appended to a pasted document scores as it would alone: over
    the whole text, the document's ordinary n-grams would outweigh it."""
    points = _folded_points(text)
    by_order = _by_order(points)
    if not by_order or not len(by_order[0]):
        return 0.0
    # The weights of the n-grams starting at each position, and how many start there.
    total, count = np.zeros(len(points)), np.zeros(len(points))
    for index in by_order:
        total[:len(index)] += weights[index]
        count[:len(index)] += 1
    best = total.sum() / np.sqrt(count.sum())
    if len(points) > WINDOW:
        sums = np.concatenate(([0.0], np.cumsum(total)))
        counts = np.concatenate(([0.0], np.cumsum(count)))
        window = (sums[WINDOW:] - sums[:-WINDOW]) / np.sqrt(np.maximum(counts[WINDOW:] - counts[:-WINDOW], 1))
        best = max(best, window.max())
    return float(best)
