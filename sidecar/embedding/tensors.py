"""The numpy arrays in and out of the model: pad a batch, pool hidden states to unit vectors.

all-MiniLM-L6-v2's sentence vector is the mean of its last hidden states over the real
(unmasked) tokens, L2-normalised (sentence-transformers' Pooling(mean) + Normalize).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def pad_batch(token_ids: Sequence[Sequence[int]], pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """input_ids and attention_mask (int64, [batch, longest]) for texts of any lengths."""
    longest = max(len(ids) for ids in token_ids)
    input_ids = np.full((len(token_ids), longest), pad_id, dtype=np.int64)
    mask = np.zeros((len(token_ids), longest), dtype=np.int64)
    for row, ids in enumerate(token_ids):
        input_ids[row, :len(ids)] = ids
        mask[row, :len(ids)] = 1
    return input_ids, mask


def mean_pool_normalize(hidden: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """[batch, seq, dim] hidden states and [batch, seq] mask to [batch, dim] unit float32 rows."""
    weights = mask[..., None].astype(np.float32)
    summed = (hidden.astype(np.float32, copy=False) * weights).sum(axis=1)
    pooled = summed / np.maximum(weights.sum(axis=1), 1.0)
    norms = np.linalg.norm(pooled, axis=1, keepdims=True)
    return (pooled / np.maximum(norms, 1e-12)).astype(np.float32, copy=False)
