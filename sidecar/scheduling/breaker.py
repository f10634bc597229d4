"""Circuit breaker per cluster: closed -> open -> half_open -> closed (or back to open).

Every transition is listed in `TRANSITIONS`; each one is returned as a `BreakerTransition` so
the caller can log it and export the state. No clock inside: `now` is passed in.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from sidecar.scheduling._validate import count, fraction, positive, require
from sidecar.scheduling.model import BreakerState
from sidecar.scheduling.signals import P95
from sidecar.scheduling.windows import OutcomeWindow, SampleWindow

CLOSED, OPEN, HALF_OPEN = BreakerState.CLOSED, BreakerState.OPEN, BreakerState.HALF_OPEN

# (state, trigger) -> next state. Anything else is a bug in this module.
TRANSITIONS: dict[tuple[BreakerState, str], BreakerState] = {
    (CLOSED, "tripped"): OPEN,
    (OPEN, "cooled_down"): HALF_OPEN,
    (HALF_OPEN, "probe_failed"): OPEN,
    (HALF_OPEN, "recovered"): CLOSED,
}


@dataclass(frozen=True)
class BreakerConfig:
    window_s: float = 30.0  # sliding window the error ratio and P95 latency are taken over
    min_requests: int = 10  # no verdict on fewer completions than this in the window
    max_error_ratio: float = 0.5  # trips when the ratio of failures exceeds this
    max_p95_latency_s: float | None = None  # trips when P95 latency of successes exceeds this
    cooldown_s: float = 15.0  # open this long before probing
    probe_share: float = 0.1  # share of requests sent as probes while half-open
    close_after_successes: int = 3  # consecutive probe successes that close the breaker
    # Trips after this many failures in a row, whatever the window holds: a cluster that turns
    # bad after a long healthy spell is seen within a few requests (Envoy's outlier detection
    # ejects on 5 consecutive 5xx by default). 0: the ratio alone.
    consecutive_failures: int = 5

    def __post_init__(self) -> None:
        positive("BreakerConfig.window_s", self.window_s)
        count("BreakerConfig.min_requests", self.min_requests)
        fraction("BreakerConfig.max_error_ratio", self.max_error_ratio)
        if self.max_p95_latency_s is not None:
            positive("BreakerConfig.max_p95_latency_s", self.max_p95_latency_s)
        positive("BreakerConfig.cooldown_s", self.cooldown_s)
        positive("BreakerConfig.probe_share", self.probe_share)
        fraction("BreakerConfig.probe_share", self.probe_share)
        count("BreakerConfig.close_after_successes", self.close_after_successes)
        require(isinstance(self.consecutive_failures, int) and self.consecutive_failures >= 0,
                "BreakerConfig.consecutive_failures", "must be an integer >= 0", self.consecutive_failures)

    @property
    def probe_interval(self) -> int:
        """One request in this many is a probe while half-open."""
        return max(1, round(1 / self.probe_share))


@dataclass(frozen=True)
class BreakerTransition:
    cluster: str
    previous: BreakerState
    state: BreakerState
    at: float
    trigger: str
    detail: str


class CircuitBreaker:
    def __init__(self, cluster: str, config: BreakerConfig | None = None) -> None:
        self.cluster = cluster
        self.config = config or BreakerConfig()
        self.state = CLOSED
        self._outcomes = OutcomeWindow(self.config.window_s)
        self._latencies = SampleWindow(self.config.window_s, max_samples=1024)
        self._opened_at = 0.0
        self._since_probe = 0  # requests offered since the last probe, while half-open
        self._successes = 0  # consecutive probe successes, while half-open
        self._failures_in_a_row = 0  # while closed

    def poll(self, now: float) -> BreakerTransition | None:
        """Move from open to half_open once the cool-down has passed."""
        if self.state is OPEN and now - self._opened_at >= self.config.cooldown_s:
            self._since_probe = self.config.probe_interval  # the first request after cool-down probes
            self._successes = 0
            return self._move("cooled_down", now, f"open for {now - self._opened_at:.1f}s")
        return None

    def retry_after_s(self, now: float) -> float | None:
        """Seconds until the cool-down ends; None unless open."""
        return max(0.0, self._opened_at + self.config.cooldown_s - now) if self.state is OPEN else None

    def offer_probe(self) -> bool:
        """Count a request that could go to this half-open cluster; True when it is due a probe.
        A due probe stays due until `start_probe` takes it."""
        if self.state is not HALF_OPEN:
            return False
        self._since_probe += 1
        return self._since_probe >= self.config.probe_interval

    def start_probe(self) -> None:
        self._since_probe = 0

    def void_probe(self) -> None:
        """A probe ended without a verdict (its client left, or its answer was not read): the
        next request that could go here probes at once."""
        if self.state is HALF_OPEN:
            self._since_probe = self.config.probe_interval

    @property
    def settled(self) -> bool:
        """Closed, and its last judged answer did not fail: nothing to watch closely."""
        return self.state is CLOSED and self._failures_in_a_row == 0

    def record(self, ok: bool, latency_s: float | None, now: float, probe: bool = False) -> BreakerTransition | None:
        """A request to this cluster ended. While half-open only probes count."""
        if self.state is CLOSED:
            return self._record_closed(ok, latency_s, now)
        if self.state is HALF_OPEN and probe:
            limit = self.config.max_p95_latency_s
            if not ok or (limit is not None and latency_s is not None and latency_s > limit):
                self._opened_at = now
                return self._move("probe_failed", now, "probe failed" if not ok else f"probe took {latency_s:.2f}s")
            self._successes += 1
            if self._successes >= self.config.close_after_successes:
                self._outcomes.clear()
                self._latencies.clear()
                self._failures_in_a_row = 0
                return self._move("recovered", now, f"{self._successes} probes succeeded")
        return None

    def _record_closed(self, ok: bool, latency_s: float | None, now: float) -> BreakerTransition | None:
        self._outcomes.add(now, ok)
        if ok and latency_s is not None and math.isfinite(latency_s):
            self._latencies.add(now, latency_s)
        self._failures_in_a_row = 0 if ok else self._failures_in_a_row + 1
        in_a_row = self.config.consecutive_failures
        if in_a_row and self._failures_in_a_row >= in_a_row:
            self._opened_at = now
            self._failures_in_a_row = 0
            return self._move("tripped", now, f"{in_a_row} failures in a row")
        total, failed = self._outcomes.counts(now)
        if total < self.config.min_requests:
            return None
        reason = None
        if failed / total > self.config.max_error_ratio:
            reason = f"error ratio {failed / total:.2f} > {self.config.max_error_ratio} over {total} requests"
        limit = self.config.max_p95_latency_s
        if reason is None and limit is not None and self._latencies.count(now) >= self.config.min_requests:
            p95 = self._latencies.quantile(P95, now)
            if p95 is not None and p95 > limit:
                reason = f"P95 latency {p95:.2f}s > {limit}s"
        if reason is None:
            return None
        self._opened_at = now
        return self._move("tripped", now, reason)

    def _move(self, trigger: str, now: float, detail: str) -> BreakerTransition:
        previous = self.state
        self.state = TRANSITIONS[(previous, trigger)]
        return BreakerTransition(self.cluster, previous, self.state, now, trigger, detail)

