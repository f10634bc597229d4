"""Choose an upstream cluster among a route's candidates by their static weights."""
from __future__ import annotations

import random
from typing import Sequence

DEFAULT_WEIGHT = 1.0


def pick_by_weight(candidates: Sequence, rng: random.Random) -> str | None:
    """Weighted random choice of a candidate's cluster; None when no candidate has weight > 0.

    `candidates` are sluice.v1.Candidate messages (a missing weight counts as DEFAULT_WEIGHT).
    """
    weights = [c.weight if c.HasField("weight") else DEFAULT_WEIGHT for c in candidates]
    total = sum(weights)
    if total <= 0:
        return None
    point = rng.random() * total
    for candidate, weight in zip(candidates, weights):
        point -= weight
        if point < 0 and weight > 0:
            return candidate.cluster
    return next(c.cluster for c, w in zip(reversed(candidates), reversed(weights)) if w > 0)
