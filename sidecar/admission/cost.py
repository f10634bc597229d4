"""What a request costs the cluster that serves it: its expected tokens, not 1.

Expected tokens = prompt tokens + the answer's expected length. The answer is bounded by the
request's max_tokens, but most answers stop well short of it: each route learns how far, as
the mean ratio of answered completion tokens to the max_tokens asked (requests without a
max_tokens: the mean answer length). Until a route has answers the bound itself counts (or
`default_answer_tokens` without one), which over-counts: safe for admission.

A cluster's slots count in units of the mean expected cost of the requests offered to it (all
that ask, admitted or not: a mean over the admitted alone drifts to whatever the limit lets
through, small requests under load, until a large one counts for the whole cluster and never
finds it empty), so the limit (in requests) keeps its meaning on average, while an 8k-token
request takes as many slots as it is larger than the mean, and a 100-token one a fraction (never more than the whole limit: a lone large request
still runs). Pure: no clock, no I/O.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

from sidecar.scheduling._validate import count, positive, require


@dataclass(frozen=True)
class CostConfig:
    default_answer_tokens: int = 256  # a request with no max_tokens on a route with no answers yet
    alpha: float = 0.05               # weight of the newest answer in a route's means
    cluster_alpha: float = 0.02       # weight of the newest request in a cluster's mean cost
    min_slots: float = 0.05           # the least a request counts for, in slots
    max_routes: int = 1024            # routes remembered (least recently used forgotten)

    def __post_init__(self) -> None:
        count("CostConfig.default_answer_tokens", self.default_answer_tokens)
        for name in ("alpha", "cluster_alpha", "min_slots"):
            positive(f"CostConfig.{name}", getattr(self, name))
            require(getattr(self, name) <= 1, f"CostConfig.{name}", "must be <= 1", getattr(self, name))
        count("CostConfig.max_routes", self.max_routes)


@dataclass
class _Route:
    ratio: float | None = None    # answered completion tokens / max_tokens asked
    length: float | None = None   # answered completion tokens, of requests without max_tokens


class AnswerLengths:
    """Per route: how long answers turn out, to correct max_tokens (bounded in routes)."""

    def __init__(self, config: CostConfig | None = None) -> None:
        self.config = config or CostConfig()
        self._routes: OrderedDict[str, _Route] = OrderedDict()

    def expected_tokens(self, route: str, prompt_tokens: int, max_tokens: int | None) -> float:
        seen = self._routes.get(route)
        if max_tokens:
            ratio = seen.ratio if seen is not None and seen.ratio is not None else 1.0
            answer = max_tokens * ratio
        else:
            length = seen.length if seen is not None else None
            answer = self.config.default_answer_tokens if length is None else length
        return float(max(0, prompt_tokens) + answer)

    def observe(self, route: str, max_tokens: int | None, completion_tokens: int) -> None:
        """An answer came whole with `completion_tokens`."""
        seen = self._routes.pop(route, None) or _Route()
        self._routes[route] = seen
        while len(self._routes) > self.config.max_routes:
            self._routes.popitem(last=False)
        a = self.config.alpha
        if max_tokens:
            ratio = min(1.0, max(0, completion_tokens) / max_tokens)
            seen.ratio = ratio if seen.ratio is None else seen.ratio + a * (ratio - seen.ratio)
        else:
            n = float(max(0, completion_tokens))
            seen.length = n if seen.length is None else seen.length + a * (n - seen.length)


class ClusterCosts:
    """Each cluster's mean expected cost of the requests offered to it, and a request's cost in its slots."""

    def __init__(self, config: CostConfig | None = None) -> None:
        self.config = config or CostConfig()
        self._mean: dict[str, float] = {}

    def slots(self, cluster: str, tokens: float | None, limit: int) -> float:
        """What a request of `tokens` expected tokens counts for on `cluster` (1 when unknown)."""
        mean = self._mean.get(cluster)
        if tokens is None or not mean:
            return 1.0
        return min(float(max(1, limit)), max(self.config.min_slots, tokens / mean))

    def offered(self, cluster: str, tokens: float | None, limit: int) -> None:
        """A request of `tokens` expected tokens asks for a slot on `cluster`, whose limit is `limit`.

        A request counts for at most the whole limit, so a sample moves the mean by at most
        `limit` times it (the first, as `limit` default answers): one huge max_tokens (a client's
        number, refused or not) cannot shrink every other request to `min_slots` and let the
        cluster take many times its limit."""
        if tokens is None or not math.isfinite(tokens) or tokens <= 0:
            return
        mean = self._mean.get(cluster)
        reference = self.config.default_answer_tokens if mean is None else mean
        tokens = min(tokens, reference * max(1, limit))
        self._mean[cluster] = tokens if mean is None else mean + self.config.cluster_alpha * (tokens - mean)
