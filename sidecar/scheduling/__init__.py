"""Sluice's scheduling core: pure, no gRPC, asyncio or I/O. Time and randomness are passed in.

Request path:
    decision = scheduler.pick(candidates, now)          # Decision, or Decision.unavailable(...)
    scheduler.on_send(decision, now); ...on_first_byte(decision, ttfb_s, now)
    scheduler.on_complete(decision, latency_s, ok, now, completion_tokens)
"""
from sidecar.scheduling.breaker import BreakerConfig, BreakerTransition, CircuitBreaker
from sidecar.scheduling.model import BreakerState, CandidateSpec, ClusterSnapshot, Endpoint, GpuLoad, UpstreamLoad
from sidecar.scheduling.picker import PickerConfig
from sidecar.scheduling.prometheus_text import upstream_load
from sidecar.scheduling.scheduler import Decision, RoutePolicy, Scheduler, SchedulerConfig
from sidecar.scheduling.scorers import SCORERS, ScoreBreakdown, ScoringConfig, register_scorer
from sidecar.scheduling.signals import SignalConfig, SignalTracker
from sidecar.scheduling.timeout import TimeoutConfig, upstream_timeout_ms

__all__ = [
    "BreakerConfig", "BreakerState", "BreakerTransition", "CandidateSpec", "CircuitBreaker",
    "ClusterSnapshot", "Decision", "Endpoint", "GpuLoad", "PickerConfig", "RoutePolicy",
    "SCORERS", "Scheduler", "SchedulerConfig", "ScoreBreakdown", "ScoringConfig", "SignalConfig",
    "SignalTracker", "TimeoutConfig", "UpstreamLoad", "register_scorer", "upstream_load",
    "upstream_timeout_ms",
]
