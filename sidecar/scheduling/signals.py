"""Per-cluster signals, fed by the events the sidecar sees; read through immutable snapshots.

No clock inside: every event carries `now` (seconds on a monotonic clock).
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TypeVar

from sidecar.scheduling._validate import count, fraction, positive
from sidecar.scheduling.model import ClusterSnapshot, GpuLoad, UpstreamLoad
from sidecar.scheduling.windows import Ewma, OutcomeWindow, SampleWindow

P95 = 0.95
_Load = TypeVar("_Load", UpstreamLoad, GpuLoad)


@dataclass(frozen=True)
class SignalConfig:
    latency_window_s: float = 60.0  # TTFB and latency P95 are over this window
    max_samples: int = 1024  # per window; the newest are kept
    ewma_alpha: float = 0.2
    error_window_s: float = 30.0
    load_stale_after_s: float = 15.0  # external load older than this is ignored

    def __post_init__(self) -> None:
        positive("SignalConfig.latency_window_s", self.latency_window_s)
        count("SignalConfig.max_samples", self.max_samples)
        positive("SignalConfig.ewma_alpha", self.ewma_alpha)
        fraction("SignalConfig.ewma_alpha", self.ewma_alpha)
        positive("SignalConfig.error_window_s", self.error_window_s)
        positive("SignalConfig.load_stale_after_s", self.load_stale_after_s)


class _Cluster:
    def __init__(self, config: SignalConfig) -> None:
        self.in_flight = 0
        self.ttfb_ewma = Ewma(config.ewma_alpha)
        self.ttfb = SampleWindow(config.latency_window_s, config.max_samples)
        self.latency_ewma = Ewma(config.ewma_alpha)
        self.latency = SampleWindow(config.latency_window_s, config.max_samples)
        self.outcomes = OutcomeWindow(config.error_window_s)
        self.tokens_per_s = Ewma(config.ewma_alpha)
        self.upstream: tuple[float, UpstreamLoad] | None = None
        self.gpu: tuple[float, GpuLoad] | None = None


class SignalTracker:
    """In-flight counts, TTFB and latency (EWMA and windowed P95), error rate, tokens/s and
    reported load per cluster. Bad samples (negative, NaN) are ignored, never raised."""

    def __init__(self, config: SignalConfig | None = None) -> None:
        self._config = config or SignalConfig()
        self._clusters: dict[str, _Cluster] = {}
        self._recent: dict[str, tuple[float, ClusterSnapshot]] = {}

    def on_send(self, cluster: str, now: float) -> None:
        self._get(cluster).in_flight += 1

    def on_first_byte(self, cluster: str, ttfb_s: float, now: float) -> None:
        if _valid(ttfb_s):
            c = self._get(cluster)
            c.ttfb_ewma.add(ttfb_s)
            c.ttfb.add(now, ttfb_s)

    def on_complete(
        self,
        cluster: str,
        latency_s: float,
        ok: bool,
        now: float,
        completion_tokens: int | None = None,
        ttfb_s: float | None = None,
    ) -> None:
        """A request ended. ok=False for 5xx, resets and timeouts; only successes feed latency
        and tokens/s. With ttfb_s given, tokens/s is measured over the decode time alone."""
        c = self._get(cluster)
        c.in_flight = max(0, c.in_flight - 1)
        c.outcomes.add(now, ok)
        if not ok or not _valid(latency_s):
            return
        c.latency_ewma.add(latency_s)
        c.latency.add(now, latency_s)
        decode_s = latency_s - ttfb_s if ttfb_s is not None and _valid(ttfb_s) else latency_s
        if completion_tokens and completion_tokens > 0 and decode_s > 0:
            c.tokens_per_s.add(completion_tokens / decode_s)

    def forget_errors(self, cluster: str) -> None:
        """The cluster's breaker closed after successful probes: its old failures no longer
        describe it, and would keep its score low until they left the window."""
        self._get(cluster).outcomes = OutcomeWindow(self._config.error_window_s)

    def on_abandon(self, cluster: str) -> None:
        """The client left before the upstream answered: no verdict on the cluster."""
        c = self._get(cluster)
        c.in_flight = max(0, c.in_flight - 1)

    def on_upstream_load(self, cluster: str, load: UpstreamLoad, now: float) -> None:
        self._get(cluster).upstream = (now, load)

    def on_gpu_load(self, cluster: str, load: GpuLoad, now: float) -> None:
        self._get(cluster).gpu = (now, load)

    def in_flight(self, cluster: str) -> int:
        c = self._clusters.get(cluster)
        return 0 if c is None else c.in_flight

    def recent_snapshot(self, cluster: str, now: float, max_age_s: float = 0.1) -> ClusterSnapshot:
        """A snapshot at most `max_age_s` old, for readers of slow signals (P95, tokens/s) that
        run on every request, such as the timeout rule; in_flight may be that old too."""
        cached = self._recent.get(cluster)
        if cached is not None and 0 <= now - cached[0] < max_age_s:
            return cached[1]
        snapshot = self.cluster_snapshot(cluster, now)
        self._recent[cluster] = (now, snapshot)
        return snapshot

    def expected_ttfb(self, cluster: str, now: float, max_age_s: float) -> float | None:
        """The cluster's time to first byte (EWMA) if a request measured it in the last
        `max_age_s`; None otherwise. An estimate that refuses every request would never be
        measured again: it must lapse, so that one gets through and measures anew."""
        c = self._clusters.get(cluster)
        newest = None if c is None else c.ttfb.newest_at()
        if newest is None or now - newest > max_age_s:
            return None
        return c.ttfb_ewma.value

    def ttfb_p95(self, cluster: str, now: float) -> float | None:
        """P95 time to first byte over the latency window; None without measurements there."""
        c = self._clusters.get(cluster)
        return None if c is None else c.ttfb.quantile(P95, now)

    def cluster_snapshot(self, cluster: str, now: float) -> ClusterSnapshot:
        c = self._clusters.get(cluster)
        if c is None:
            return ClusterSnapshot(cluster=cluster)
        total, failed = c.outcomes.counts(now)
        return ClusterSnapshot(
            cluster=cluster,
            in_flight=c.in_flight,
            ttfb_ewma_s=c.ttfb_ewma.value,
            ttfb_p95_s=c.ttfb.quantile(P95, now),
            latency_ewma_s=c.latency_ewma.value,
            latency_p95_s=c.latency.quantile(P95, now),
            requests_in_window=total,
            error_rate=failed / total if total else None,
            tokens_per_s=c.tokens_per_s.value,
            upstream=self._fresh(c.upstream, now),
            gpu=self._fresh(c.gpu, now),
        )

    def snapshot(self, now: float, clusters: Iterable[str] | None = None) -> Mapping[str, ClusterSnapshot]:
        """Snapshots of the named clusters (default: every cluster seen so far)."""
        names = self._clusters if clusters is None else clusters
        return MappingProxyType({name: self.cluster_snapshot(name, now) for name in names})

    def _get(self, cluster: str) -> _Cluster:
        c = self._clusters.get(cluster)
        if c is None:
            c = self._clusters[cluster] = _Cluster(self._config)
        return c

    def _fresh(self, reported: tuple[float, _Load] | None, now: float) -> _Load | None:
        if reported is None or now - reported[0] > self._config.load_stale_after_s:
            return None
        return reported[1]


def _valid(seconds: float) -> bool:
    return isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds >= 0
