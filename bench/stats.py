"""Intervals shared by the benches and the experiments (scripts/)."""
from __future__ import annotations

import math

import numpy as np

SEED = 22


def resamples(groups: dict, rounds: int, seed: int = SEED) -> list[dict]:
    """`rounds` bootstrap draws of `groups`, the same for the same seed: each draw maps every
    name to its row indices drawn with replacement, as many as there are, or, for a name given
    a list of index arrays (a fold's rows, a half's), each array drawn on its own. Two variants
    judged on the same draws give a paired interval of their difference."""
    rng = np.random.default_rng(seed)
    return [{name: [rng.choice(part, len(part)) for part in rows] if isinstance(rows, list) else rng.choice(rows, len(rows))
             for name, rows in groups.items()} for _ in range(rounds)]


def interval(values) -> np.ndarray:
    """The 95% interval of bootstrap values: their 2.5% and 97.5% quantiles (per column)."""
    return np.quantile(values, [0.025, 0.975], axis=0)


def wilson(hits: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of the rate `hits` / `n` (95% at the default z); (0, 1) when
    n is 0."""
    if n == 0:
        return (0.0, 1.0)
    p = hits / n
    d = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / d
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return (max(0.0, centre - half), min(1.0, centre + half))
