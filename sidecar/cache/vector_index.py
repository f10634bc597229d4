"""Nearest stored vector of one scope: exact when small, sign-bit prefilter when large.

Vectors are unit float32 rows, so cosine similarity is a dot product.  A scope keeps one
contiguous matrix (grown and shrunk geometrically, rows swap-removed on delete: no
tombstones, no rebuild) and, beside it, one bit per dimension: the sign.  An index starts
with no rows allocated and grows from one: a cache may hold many scopes of one entry each
(one per tenant, system prompt or sampling seed), and each must cost about its entries.

- Up to `exact_max` rows the search is an exact matrix-vector product.
- Above it, a float32 scan is memory-bound (100k x 384 x 4 B = 154 MB read per query:
  6-10 ms here), so the search first computes the Hamming distance between sign bits
  (100k x 48 B = 4.8 MB), keeps the rows within a radius that a vector at
  `min_similarity` falls inside, and scores only those exactly.  For two unit vectors at
  angle t, a sign bit differs with probability t/pi (for isotropic data); the radius is
  that mean plus six standard deviations.  On real all-MiniLM-L6-v2 vectors the widest
  pair at cosine >= 0.8 differed in 102 of 384 bits against a radius of 127, so no
  neighbour a cache would serve is lost; unrelated prompts sit near 192.  A hit's
  similarity is always the exact float32 dot product, never an estimate.

bench/index.py measures both paths and the HNSW libraries that were weighed against them.
"""
from __future__ import annotations

import math

import numpy as np

__all__ = ["VectorIndex", "hamming_radius", "as_unit"]

DEFAULT_EXACT_MAX = 4096
_SHRINK_FLOOR = 16      # rows an index shrinks to at least: no churn at a scope's small sizes
# Rows scored exactly at most, when a low threshold or a dense cluster lets many through.
DEFAULT_MAX_CANDIDATES = 1024
_SIGMAS = 6.0
_NO_SCRATCH = np.empty(0, np.uint8)     # shared by every index at or below exact_max rows


def as_unit(vector: np.ndarray, dim: int) -> np.ndarray:
    """`vector` as a contiguous float32 unit vector of `dim`; ValueError if it cannot be."""
    v = np.asarray(vector, dtype=np.float32).reshape(-1)
    if v.shape[0] != dim:
        raise ValueError(f"vector: expected {dim} dimensions, got {v.shape[0]}")
    norm = float(np.linalg.norm(v))
    if not math.isfinite(norm) or norm == 0.0:
        raise ValueError("vector: must be finite and non-zero")
    return np.ascontiguousarray(v / norm) if abs(norm - 1.0) > 1e-4 else np.ascontiguousarray(v)


def hamming_radius(min_similarity: float, bits: int) -> int:
    """Most differing sign bits a vector at cosine >= `min_similarity` is expected to have."""
    s = min(1.0, max(-1.0, min_similarity))
    p = math.acos(s) / math.pi
    return min(bits, math.ceil(bits * p + _SIGMAS * math.sqrt(bits * p * (1.0 - p))))


class VectorIndex:
    """Unit vectors of one scope, by string key.  Not thread-safe (one event loop)."""

    def __init__(self, dim: int = 384, *, exact_max: int = DEFAULT_EXACT_MAX,
                 max_candidates: int = DEFAULT_MAX_CANDIDATES) -> None:
        if dim <= 0:
            raise ValueError(f"dim: must be > 0, got {dim}")
        if exact_max < 0:
            raise ValueError(f"exact_max: must be >= 0, got {exact_max}")
        if max_candidates <= 0:
            raise ValueError(f"max_candidates: must be > 0, got {max_candidates}")
        self.dim = dim
        self.exact_max = exact_max
        self.max_candidates = max_candidates
        self._words = (dim + 63) // 64
        self._keys: list[str] = []
        self._rows: dict[str, int] = {}
        self._alloc(0)

    def _alloc(self, capacity: int) -> None:
        n = len(self._keys)
        vecs = np.empty((capacity, self.dim), np.float32)
        bits = np.empty((self._words, capacity), np.uint64)  # word-major: one pass per word
        if n:
            vecs[:n] = self._vecs[:n]
            bits[:, :n] = self._bits[:, :n]
        self._vecs, self._bits = vecs, bits
        # Scratch of the sign-bit prefilter, which only runs above exact_max rows.
        if capacity > self.exact_max:
            self._dist = np.empty(capacity, np.uint16)
            self._xor = np.empty((self._words, capacity), np.uint64)
            self._count = np.empty((self._words, capacity), np.uint8)
        else:
            self._dist = self._xor = self._count = _NO_SCRATCH

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._rows

    @property
    def capacity(self) -> int:
        return self._vecs.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes held by the arrays' data (keys and the row map are extra, ~150 B a row)."""
        return sum(a.nbytes for a in (self._vecs, self._bits, self._dist, self._xor, self._count))

    def _sign_bits(self, v: np.ndarray) -> np.ndarray:
        packed = np.packbits(v > 0)
        padded = np.zeros(self._words * 8, np.uint8)
        padded[:packed.shape[0]] = packed
        return padded.view(np.uint64)

    def add(self, key: str, vector: np.ndarray) -> None:
        """Store `vector` under `key`, replacing what the key had."""
        v = as_unit(vector, self.dim)
        row = self._rows.get(key)
        if row is None:
            row = len(self._keys)
            if row == self.capacity:
                self._alloc(max(1, self.capacity * 2))
            self._keys.append(key)
            self._rows[key] = row
        self._vecs[row] = v
        self._bits[:, row] = self._sign_bits(v)

    def discard(self, key: str) -> bool:
        """Forget `key`; False if it was not there.  The last row moves into the hole."""
        row = self._rows.pop(key, None)
        if row is None:
            return False
        last = len(self._keys) - 1
        if row != last:
            moved = self._keys[last]
            self._keys[row] = moved
            self._rows[moved] = row
            self._vecs[row] = self._vecs[last]
            self._bits[:, row] = self._bits[:, last]
        self._keys.pop()
        if not self._keys:
            self._alloc(0)
        elif self.capacity > _SHRINK_FLOOR and len(self._keys) < self.capacity // 4:
            self._alloc(max(_SHRINK_FLOOR, self.capacity // 2))
        return True

    def clear(self) -> None:
        self._keys.clear()
        self._rows.clear()
        self._alloc(0)

    def vector(self, key: str) -> np.ndarray | None:
        row = self._rows.get(key)
        return None if row is None else self._vecs[row].copy()

    def search(self, vector: np.ndarray, min_similarity: float) -> tuple[str, float] | None:
        """The key whose vector is most similar to `vector`, if at least `min_similarity`."""
        n = len(self._keys)
        if n == 0:
            return None
        q = as_unit(vector, self.dim)
        if n <= self.exact_max:
            scores = self._vecs[:n] @ q
            best = int(np.argmax(scores))
            similarity = float(scores[best])
        else:
            candidates = self._candidates(q, n, min_similarity)
            if candidates.shape[0] == 0:
                return None
            scores = self._vecs[candidates] @ q
            pick = int(np.argmax(scores))
            best, similarity = int(candidates[pick]), float(scores[pick])
        if similarity < min_similarity:
            return None
        return self._keys[best], similarity

    def _candidates(self, q: np.ndarray, n: int, min_similarity: float) -> np.ndarray:
        dist, xor, count = self._dist[:n], self._xor[:, :n], self._count[:, :n]
        np.bitwise_xor(self._bits[:, :n], self._sign_bits(q)[:, None], out=xor)
        np.bitwise_count(xor, out=count)
        np.sum(count, axis=0, dtype=np.uint16, out=dist)
        radius = hamming_radius(min_similarity, self.dim)
        candidates = np.flatnonzero(dist <= radius)
        if candidates.shape[0] > self.max_candidates:
            nearest = np.argpartition(dist[candidates], self.max_candidates - 1)
            candidates = candidates[nearest[:self.max_candidates]]
        return candidates
