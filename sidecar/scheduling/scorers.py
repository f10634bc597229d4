"""Scorers: pure functions of one endpoint (and the pool it is scored in) to a value in [0, 1].

Higher is better. A scorer returns None when it has no opinion (the signal is unknown); the
endpoint's total is then the weighted mean of the scorers that have one:

    total = sum(weight_i * score_i) / sum(weight_i)   over the scorers with an opinion

which generalises the seed formula a*(1-cpu) + b*(1-gpu) + c*(1-latency). Scorers are registered
by type name, so a route config {"latency": 2, "load": 1} assembles them.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from sidecar.scheduling._validate import fraction, non_negative, positive, require
from sidecar.scheduling.model import Endpoint


@dataclass(frozen=True)
class ScoringConfig:
    latency_reference_s: float = 2.0  # P95 TTFB that scores 0
    load_reference: float = 8.0  # in-flight requests that score 0.5 on a cluster without max_in_flight
    latency_smoothing_s: float = 0.05  # added to P95s before comparing clusters with each other
    # Successes assumed before any observation: one failure out of one request is not a 100%
    # error rate (the breaker, with its minimum request count, judges small samples).
    error_prior_requests: float = 5.0
    queue_reference: float = 1.0  # waiting/running ratio that scores 0
    no_opinion_score: float = 0.5  # total of an endpoint no scorer has an opinion on
    # "geometric": total = prod(score_i ** w_i) ** (1 / sum w_i), so a cluster that is bad on one
    # axis (a 2 s tail) stays bad although it is fine on the others; "arithmetic" is the seed's
    # weighted sum, where agreeing scorers dilute the one that differs.
    combine: str = "geometric"

    def __post_init__(self) -> None:
        positive("ScoringConfig.latency_reference_s", self.latency_reference_s)
        positive("ScoringConfig.load_reference", self.load_reference)
        positive("ScoringConfig.latency_smoothing_s", self.latency_smoothing_s)
        non_negative("ScoringConfig.error_prior_requests", self.error_prior_requests)
        positive("ScoringConfig.queue_reference", self.queue_reference)
        fraction("ScoringConfig.no_opinion_score", self.no_opinion_score)
        require(self.combine in ("geometric", "arithmetic"), "ScoringConfig.combine",
                "must be 'geometric' or 'arithmetic'", self.combine)


Scorer = Callable[[Endpoint, Sequence[Endpoint], ScoringConfig], "float | None"]


def load_score(ep: Endpoint, pool: Sequence[Endpoint], config: ScoringConfig) -> float:
    """In-flight requests against the cluster's max_in_flight; without one, 1 / (1 + in_flight /
    load_reference). Not against the busiest of the pool: a fast cluster carries more requests
    at once simply because it gets more of them, and that is no reason to send them elsewhere."""
    in_flight = ep.signals.in_flight
    if ep.spec.max_in_flight:
        return 1 - in_flight / ep.spec.max_in_flight
    return 1 / (1 + in_flight / config.load_reference)


def latency_score(ep: Endpoint, pool: Sequence[Endpoint], config: ScoringConfig) -> float | None:
    """The lower of two views of P95 TTFB:
    absolute, 1 - P95 / reference (0 at or beyond the reference), and
    relative, (best P95 + s) / (P95 + s) against the fastest cluster of the pool, so that a
    cluster 30x slower than its peer scores low even when both are far under the reference
    (s, the smoothing, keeps millisecond differences from mattering)."""
    p95 = ep.signals.ttfb_p95_s
    if p95 is None:
        return None
    absolute = 1 - min(p95 / config.latency_reference_s, 1.0)
    best = min((e.signals.ttfb_p95_s for e in pool if e.signals.ttfb_p95_s is not None), default=p95)
    s = config.latency_smoothing_s
    return min(absolute, (best + s) / (p95 + s))


def errors_score(ep: Endpoint, pool: Sequence[Endpoint], config: ScoringConfig) -> float | None:
    """1 - failures / (requests + prior): the error rate, damped while requests are few."""
    rate, requests = ep.signals.error_rate, ep.signals.requests_in_window
    if rate is None:
        return None
    return 1 - rate * requests / (requests + config.error_prior_requests)


def queue_score(ep: Endpoint, pool: Sequence[Endpoint], config: ScoringConfig) -> float | None:
    """From the upstream's own metrics: queued per running request, and KV-cache headroom."""
    load = ep.signals.upstream
    if load is None:
        return None
    queue = None
    if load.waiting is not None:
        ratio = load.waiting / max(load.running or 0.0, 1.0)
        queue = 1 - min(ratio / config.queue_reference, 1.0)
    return _mean_known(queue, _headroom(load.kv_cache_usage))


def gpu_score(ep: Endpoint, pool: Sequence[Endpoint], config: ScoringConfig) -> float | None:
    """Headroom in GPU utilisation and memory; no opinion when the cluster reports neither."""
    gpu = ep.signals.gpu
    return None if gpu is None else _mean_known(_headroom(gpu.utilisation), _headroom(gpu.memory_used))


SCORERS: dict[str, Scorer] = {
    "load": load_score,
    "latency": latency_score,
    "errors": errors_score,
    "queue": queue_score,
    "gpu": gpu_score,
}


def register_scorer(name: str, scorer: Scorer) -> None:
    require(name not in SCORERS, "scorer name", "is already registered", name)
    SCORERS[name] = scorer


@dataclass(frozen=True)
class ScoreBreakdown:
    total: float
    parts: Mapping[str, float | None] = field(default_factory=dict)  # scorer name -> clamped score


@dataclass(frozen=True)
class WeightedScorers:
    """Scorers assembled from a route config: scorer type name -> weight."""

    weights: Mapping[str, float]
    config: ScoringConfig = field(default_factory=ScoringConfig)

    def __post_init__(self) -> None:
        for name, weight in self.weights.items():
            require(name in SCORERS, f"scorers.{name}", f"is not a known scorer {sorted(SCORERS)}", name)
            non_negative(f"scorers.{name}", weight)
        require(any(w > 0 for w in self.weights.values()), "scorers", "need one weight > 0", dict(self.weights))
        object.__setattr__(self, "weights", MappingProxyType(dict(self.weights)))

    def score(self, pool: Sequence[Endpoint]) -> dict[str, ScoreBreakdown]:
        """Breakdown per cluster of every endpoint in the pool."""
        return {ep.cluster: self._score_one(ep, pool) for ep in pool}

    def _score_one(self, ep: Endpoint, pool: Sequence[Endpoint]) -> ScoreBreakdown:
        parts = {name: _clamp(SCORERS[name](ep, pool, self.config)) for name in self.weights}
        weighted = [(self.weights[n], s) for n, s in parts.items() if s is not None and self.weights[n] > 0]
        weight_sum = sum(w for w, _ in weighted)
        if not weighted:
            total = self.config.no_opinion_score
        elif self.config.combine == "geometric":
            # Floor at 1e-3 so one zero does not erase the cluster from the weighted pick entirely.
            total = math.exp(sum(w * math.log(max(s, 1e-3)) for w, s in weighted) / weight_sum)
        else:
            total = sum(w * s for w, s in weighted) / weight_sum
        return ScoreBreakdown(total=total, parts=MappingProxyType(parts))


def _headroom(used: float | None) -> float | None:
    return None if used is None else _clamp(1 - used)


def _mean_known(*values: float | None) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def _clamp(value: float | None) -> float | None:
    if value is None:
        return None
    if math.isnan(value):
        return 0.0
    return min(max(value, 0.0), 1.0)
