"""Plain values shared by the scheduling core: what is known about a cluster, what a route offers."""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Literal

from sidecar.scheduling._validate import count, non_negative, require

Role = Literal["primary", "fallback"]
ROLES: tuple[Role, ...] = ("primary", "fallback")


class BreakerState(str, enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True)
class UpstreamLoad:
    """Load an upstream reports about itself (vLLM's Prometheus metrics); None where unknown."""

    waiting: float | None = None  # requests queued, summed over engines
    running: float | None = None  # requests being decoded, summed over engines
    kv_cache_usage: float | None = None  # fraction in [0, 1], mean over engines


@dataclass(frozen=True)
class GpuLoad:
    """GPU figures for a cluster (e.g. from DCGM or NVML); fractions in [0, 1], None where unknown."""

    utilisation: float | None = None
    memory_used: float | None = None


@dataclass(frozen=True)
class ClusterSnapshot:
    """What the signal tracker knows about one cluster at one instant. None: no observation yet."""

    cluster: str
    in_flight: int = 0
    ttfb_ewma_s: float | None = None
    ttfb_p95_s: float | None = None
    latency_ewma_s: float | None = None
    latency_p95_s: float | None = None
    requests_in_window: int = 0  # completions counted by error_rate
    error_rate: float | None = None
    tokens_per_s: float | None = None
    upstream: UpstreamLoad | None = None  # None when never reported or stale
    gpu: GpuLoad | None = None  # None when never reported or stale


@dataclass(frozen=True)
class CandidateSpec:
    """One cluster a route may send a request to."""

    cluster: str
    role: Role = "primary"
    model: str | None = None  # model name this cluster serves; the request is rewritten to it
    weight: float = 1.0  # static share relative to the other candidates; 0 = no traffic
    max_in_flight: int | None = None  # saturation limit; None = unlimited

    def __post_init__(self) -> None:
        require(bool(self.cluster), "CandidateSpec.cluster", "must be a non-empty name", self.cluster)
        require(self.role in ROLES, "CandidateSpec.role", f"must be one of {ROLES}", self.role)
        non_negative("CandidateSpec.weight", self.weight)
        if self.max_in_flight is not None:
            count("CandidateSpec.max_in_flight", self.max_in_flight)


@dataclass(frozen=True)
class Endpoint:
    """A candidate as the filters and scorers see it: its spec, its signals, its breaker."""

    spec: CandidateSpec
    signals: ClusterSnapshot
    breaker: BreakerState = BreakerState.CLOSED
    probe_due: bool = False  # half-open and this request may be a probe

    @property
    def cluster(self) -> str:
        return self.spec.cluster

