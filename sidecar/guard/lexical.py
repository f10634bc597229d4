"""Cheap lexical features for the injection classifier: hashed character n-grams.

The MiniLM embedding says what a prompt is about; it blurs the few words that make an order
out of a question ("ignore the above and ...", "you are now DAN"). Character n-grams of the
folded text (sidecar/guard/normalize.py) keep them, in any script, and need no vocabulary:
each n-gram is hashed into one of `DIM` buckets and the classifier learns a weight per bucket
(an n-gram that recurs counts each time; `score` divides by the square root of the count, and
judges a long text by its most suspect stretch as well as as a whole).
A text longer than `MAX_CHARS` is read at its start and end, where an order sits in a pasted
document.

The numpy code below is the definition; sidecar/guard/_ngrams.c computes the same buckets and
the same score bit for bit in one pass (a 2 KB prompt: ~20 µs with the weights in cache,
against ~130 for the numpy code), and is used where it was built from this checkout's
_ngrams.c (sidecar/guard/compiled.py decides, and holds the constants both state). `COMPILED`
says which runs. Bit for bit where numpy sums a float64 array in the pairwise order the C code
follows, as numpy 2.x does on any CPU (tests/unit/guard/test_guard_compiled.py checks the
installed one).
"""
from __future__ import annotations

import math

import numpy as np

from sidecar.guard.compiled import DIM_BITS, MAX_CHARS, MIX, ORDERS, PRIME, WINDOW
from sidecar.guard.compiled import NGRAMS as _ngrams
from sidecar.guard.normalize import fold

DIM = 1 << DIM_BITS
_PRIME = np.uint64(PRIME)
_MIX = np.uint64(MIX)
COMPILED = _ngrams is not None


def _folded_points(text: str) -> np.ndarray:
    folded = fold(text)
    if folded.isascii():
        return _ascii_points(folded.encode("ascii"))
    folded = " ".join(folded.split())
    if len(folded) > MAX_CHARS:
        folded = folded[:MAX_CHARS // 2] + " " + folded[-MAX_CHARS // 2:]
    return np.frombuffer((" " + folded + " ").encode("utf-32-le", "surrogatepass"), np.uint32).astype(np.uint64)


def _ascii_points(folded: bytes) -> np.ndarray:
    """What the general path computes, for ASCII text, in bytes: runs of whitespace as one space
    (fold keeps only tab, line feed and carriage return of the control characters, which
    bytes.split() splits on as str.split() does), a space at each end."""
    folded = b" ".join(folded.split())
    if len(folded) > MAX_CHARS:
        folded = folded[:MAX_CHARS // 2] + b" " + folded[-MAX_CHARS // 2:]
    return np.frombuffer(b" " + folded + b" ", np.uint8).astype(np.uint64)


_SHIFT = np.uint64(64 - DIM_BITS)


def _by_order(points: np.ndarray) -> list[np.ndarray]:
    """For each order, the bucket of the n-gram starting at each position."""
    flat, lengths = _hashed(points)
    return [flat[start:start + length] for start, length in zip(np.cumsum([0, *lengths[:-1]]).tolist(), lengths)]


def _hashed(points: np.ndarray) -> tuple[np.ndarray, list[int]]:
    """The buckets of every order's n-grams in one array (order by order; each order's length).
    One buffer, written in place: a third fewer numpy calls than an array per step."""
    lengths = [max(0, len(points) - n + 1) for n in ORDERS]
    flat = np.empty(sum(lengths), np.uint64)
    with np.errstate(over="ignore"):        # the hashes wrap around 2**64 by design
        rolling = points                    # rolling[i] hashes points[i : i + n], from n = 1
        at = 0
        for n in range(2, max(ORDERS) + 1):
            # An n-gram's hash is its (n-1)-gram's times the prime plus its last point.
            size = max(0, len(points) - n + 1)
            if n in ORDERS:
                step = flat[at:at + size]
                at += size
            else:
                step = np.empty(size, np.uint64)
            np.multiply(rolling[:size], _PRIME, out=step)
            step += points[n - 1:]
            rolling = step
        at = 0
        for n, size in zip(ORDERS, lengths):
            flat[at:at + size] ^= np.uint64(n)
            at += size
        flat *= _MIX
        flat >>= _SHIFT
    return flat.view(np.int64), lengths     # below 2**DIM_BITS: the same values as a cast


def buckets(text: str) -> np.ndarray:
    """The bucket of each character n-gram of the text (int64, in no useful order)."""
    if _ngrams is not None:
        return np.frombuffer(_ngrams.buckets(_ascii_or_folded(text)), np.int64)
    return numpy_buckets(text)


def numpy_buckets(text: str) -> np.ndarray:
    """`buckets` by the numpy code, whether or not the compiled one is there."""
    return _hashed(_folded_points(text))[0]


def _ascii_or_folded(text: str) -> str:
    # The compiled code folds ASCII itself (its fold of a folded text changes nothing).
    return text if text.isascii() else fold(text)


def score(weights: np.ndarray, text: str) -> float:
    """The lexical part of the classifier's logit: the weights of the text's n-grams summed and
    divided by the square root of their count (0 for a text without any); for a text longer
    than `WINDOW` characters, the highest such score of the whole text and of every stretch of
    `WINDOW` characters. An order appended to a pasted document scores as it would alone: over
    the whole text, the document's ordinary n-grams would outweigh it."""
    if _ngrams is not None and weights.dtype == np.float32 and weights.shape == (DIM,) and weights.flags.c_contiguous:
        return _ngrams.score(weights, _ascii_or_folded(text))
    return numpy_score(weights, text)


def numpy_score(weights: np.ndarray, text: str) -> float:
    """`score` by the numpy code, whether or not the compiled one is there."""
    points = _folded_points(text)
    flat, lengths = _hashed(points)
    return windowed(weights, flat, lengths, len(points))


def windowed(weights: np.ndarray, flat: np.ndarray, lengths: list[int], size: int,
             orders: tuple[int, ...] = ORDERS, tail_roots: tuple[float, ...] | None = None) -> float:
    """`score` of a text of `size` points from its n-grams' buckets (`_hashed`'s two results);
    `orders` and `tail_roots` are another n-gram definition's (scripts/exp_guard_lexical.py)."""
    if not lengths[0]:
        return 0.0
    # The weights of the n-grams starting at each position, the orders added in turn.
    gathered = weights.take(flat)
    total = np.zeros(size)
    at = 0
    for length in lengths:
        total[:length] += gathered[at:at + length]
        at += length
    best = total.sum() / math.sqrt(len(flat))      # every n-gram of the text
    if size > WINDOW:
        sums = np.empty(size + 1)
        sums[0] = 0.0
        np.cumsum(total, out=sums[1:])
        stretch = sums[WINDOW:] - sums[:-WINDOW]
        # Every stretch but the last few holds all orders' n-grams at each position, the same
        # count: the highest of them is the highest sum over that count's root.
        full = max(0, size - max(orders) + 1 - WINDOW + 1)      # stretches [0, full) are complete
        if full:
            best = max(best, stretch[:full].max() / math.sqrt(len(orders) * WINDOW))
            # The last few hold as many n-grams as the last few of any text this long.
            for value, root in zip(stretch[full:].tolist(), _TAIL_ROOTS if tail_roots is None else tail_roots):
                best = max(best, value / root)
        else:
            for start, value in enumerate(stretch.tolist()):
                best = max(best, value / math.sqrt(max(grams_in(start, start + WINDOW, size, orders), 1)))
    return float(best)


def grams_in(start: int, end: int, size: int, orders: tuple[int, ...] = ORDERS) -> int:
    """How many n-grams of a text of `size` points start at positions [start, end)."""
    return sum(max(0, min(end, size - n + 1) - start) for n in orders)


def tail_roots(orders: tuple[int, ...] = ORDERS) -> tuple[float, ...]:
    """The roots of the n-gram counts of the stretches after the complete ones, the same for
    every text with a complete one (counted here for one such length)."""
    return tuple(math.sqrt(max(grams_in(start, start + WINDOW, 2 * WINDOW, orders), 1))
                 for start in range(2 * WINDOW - max(orders) + 2 - WINDOW, WINDOW + 1))


_TAIL_ROOTS = tail_roots()
