"""Adaptive concurrency limit of one upstream cluster: how many requests the sidecar lets through
to it at once, moved by the latency it observes. A pure state machine: no clock, no I/O.

Feed it one sample per finished request: `on_sample(latency_s, ok, in_flight, now)`, where
`in_flight` is the cluster's count when that request was sent (its own slot included). For LLM
traffic feed the time to first byte: it grows with queueing at the upstream, while the whole
latency grows with the answer's length and says little about load.

Two algorithms (`LimiterConfig.algorithm`):

gradient -- Netflix concurrency-limits' Gradient2:
    long     = average latency: the plain mean of the first `warmup` samples, then an EWMA with
               alpha = 2 / (long_window + 1); when long > 2 x sample (latency has recovered after a
               long overload) long is cut by 5% per sample so the baseline catches up quickly
    gradient = clamp(tolerance x long / sample, 0.5, 1.0)
    target   = limit x gradient + queue_size
    limit    = (1 - smoothing) x limit + smoothing x target
  Latency at or below tolerance x the long-term average lets the limit grow by about
  smoothing x queue_size per sample; latency above it shrinks the limit in proportion, never by
  more than half a step.

aimd -- additive increase, multiplicative decrease:
    ok and latency <= latency_target_s: limit + 1
    latency > latency_target_s:         limit x backoff_ratio

Rules common to both:
  - A failure (ok=False: 5xx, reset, timeout) multiplies the limit by backoff_ratio; its latency
    is not a sample.
  - Multiplicative cuts happen at most once per backoff_interval_s: one overload episode that fails
    many requests together costs one cut, not one per request (TCP cuts once per round trip).
  - The limit grows only while the cluster is used (in_flight >= limit / 2): an idle cluster says
    nothing about how much more it could take.
  - A hint from the upstream's own metrics: upstream_waiting > 0 (e.g. vLLM num_requests_waiting,
    summed over the cluster) means its batch slots are full, so the limit does not grow.
  - The limit stays within [min_limit, max_limit]; `limit` is its integer part.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from sidecar.scheduling._validate import count, non_negative, positive, require

ALGORITHMS = ("gradient", "aimd")


@dataclass(frozen=True)
class LimiterConfig:
    algorithm: str = "gradient"
    initial_limit: int = 16
    min_limit: int = 1
    max_limit: int = 256
    backoff_ratio: float = 0.9  # multiplicative cut on failures (and aimd's latency over target)
    backoff_interval_s: float = 1.0  # at most one cut per this many seconds
    # gradient
    smoothing: float = 0.2
    tolerance: float = 1.5  # latency up to tolerance x long-term average counts as no queueing
    queue_size: float = 4.0  # growth allowance per step, in requests
    long_window: int = 600  # samples in the long-term latency average
    warmup: int = 10  # samples averaged plainly before the EWMA takes over
    # aimd
    latency_target_s: float = 2.0

    def __post_init__(self) -> None:
        require(self.algorithm in ALGORITHMS, "LimiterConfig.algorithm", f"must be one of {ALGORITHMS}", self.algorithm)
        count("LimiterConfig.min_limit", self.min_limit)
        count("LimiterConfig.max_limit", self.max_limit)
        require(self.min_limit <= self.max_limit, "LimiterConfig.max_limit", "must be >= min_limit", self.max_limit)
        count("LimiterConfig.initial_limit", self.initial_limit)
        require(self.min_limit <= self.initial_limit <= self.max_limit, "LimiterConfig.initial_limit",
                "must be within [min_limit, max_limit]", self.initial_limit)
        positive("LimiterConfig.backoff_ratio", self.backoff_ratio)
        require(self.backoff_ratio < 1, "LimiterConfig.backoff_ratio", "must be < 1", self.backoff_ratio)
        non_negative("LimiterConfig.backoff_interval_s", self.backoff_interval_s)
        positive("LimiterConfig.smoothing", self.smoothing)
        require(self.smoothing <= 1, "LimiterConfig.smoothing", "must be <= 1", self.smoothing)
        positive("LimiterConfig.tolerance", self.tolerance)
        require(self.tolerance >= 1, "LimiterConfig.tolerance", "must be >= 1", self.tolerance)
        non_negative("LimiterConfig.queue_size", self.queue_size)
        count("LimiterConfig.long_window", self.long_window)
        count("LimiterConfig.warmup", self.warmup)
        positive("LimiterConfig.latency_target_s", self.latency_target_s)


class ConcurrencyLimiter:
    def __init__(self, config: LimiterConfig | None = None) -> None:
        self.config = config or LimiterConfig()
        self._limit = float(self.config.initial_limit)
        self._long: float | None = None  # gradient's long-term latency average
        self._samples = 0
        self._last_cut = -math.inf

    @property
    def limit(self) -> int:
        return max(self.config.min_limit, int(self._limit))

    @property
    def long_latency_s(self) -> float | None:
        """Gradient's long-term latency average; None before the first sample (and with aimd)."""
        return self._long

    def on_sample(
        self, latency_s: float | None, ok: bool, in_flight: int, now: float, upstream_waiting: float | None = None
    ) -> int:
        """One request finished; returns the new limit. A bad latency (None, NaN, negative) on a
        success is ignored."""
        cfg = self.config
        if not ok:
            self._cut(now)
        elif _valid(latency_s):
            may_grow = in_flight >= self._limit / 2 and not (upstream_waiting and upstream_waiting > 0)
            if cfg.algorithm == "aimd":
                if latency_s > cfg.latency_target_s:
                    self._cut(now)
                elif may_grow:
                    self._set(self._limit + 1)
            else:
                self._gradient(latency_s, in_flight, may_grow)
        return self.limit

    def _gradient(self, sample: float, in_flight: int, may_grow: bool) -> None:
        cfg = self.config
        self._samples += 1
        if self._long is None:
            self._long = sample
        elif self._samples <= cfg.warmup:
            self._long += (sample - self._long) / self._samples
        else:
            self._long += 2 / (cfg.long_window + 1) * (sample - self._long)
        if sample > 0 and self._long / sample > 2:
            self._long *= 0.95
        if in_flight < self._limit / 2:
            return  # app-limited: nothing learned (Gradient2 changes nothing either)
        gradient = 1.0 if sample <= 0 else max(0.5, min(1.0, cfg.tolerance * self._long / sample))
        target = self._limit * gradient + cfg.queue_size
        new = (1 - cfg.smoothing) * self._limit + cfg.smoothing * target
        self._set(new if may_grow else min(new, self._limit))

    def _cut(self, now: float) -> None:
        if now - self._last_cut >= self.config.backoff_interval_s:
            self._last_cut = now
            self._set(self._limit * self.config.backoff_ratio)

    def _set(self, limit: float) -> None:
        self._limit = max(float(self.config.min_limit), min(float(self.config.max_limit), limit))


def _valid(seconds: float | None) -> bool:
    return isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds >= 0
