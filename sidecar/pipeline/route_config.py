"""From a route's settings message to the scheduler's plain config (built once per route)."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from sidecar.engine_priority import EngineField, engine_field
from sidecar.route_settings import RouteSettings
from sidecar.scheduling import (BreakerConfig, CandidateSpec, PickerConfig, RoutePolicy,
                                ScoringConfig, TimeoutConfig)
from sidecar.scheduling.sampling import FeedbackSampler
from sidecar.scheduling.scheduler import DEFAULT_SCORER_WEIGHTS


@dataclass(frozen=True)
class RouteConfig:
    candidates: tuple[CandidateSpec, ...]
    policy: RoutePolicy
    breaker: BreakerConfig
    timeout: TimeoutConfig
    rewrite_model: bool
    debug_header: bool
    metrics_urls: tuple[tuple[str, str], ...]   # (cluster, url)
    gpu_indices: tuple[tuple[str, int], ...] = ()  # (cluster, local GPU index)
    engine_fields: tuple[tuple[str, EngineField], ...] = ()  # (cluster, where its engine reads a priority)
    # Mutable: counts the route's requests (one config per route settings object).
    feedback: FeedbackSampler = field(default_factory=FeedbackSampler, compare=False)
    retry_other_cluster: bool = False   # Envoy retries once on the runner-up (scheduling/retry.py)

    def engine_field(self, cluster: str) -> EngineField | None:
        return dict(self.engine_fields).get(cluster)

    @property
    def unbounded_candidates(self) -> tuple[CandidateSpec, ...]:
        """With admission on, saturation is the gate's business: requests queue for a slot."""
        return tuple(replace(c, max_in_flight=None) for c in self.candidates)


def _set(message, field: str, default):
    return getattr(message, field) if message.HasField(field) else default


def build_route_config(route: RouteSettings, route_name: str) -> RouteConfig:
    """Raises ValueError naming the field when a value is out of range."""
    s = route.scheduling
    candidates = tuple(
        CandidateSpec(cluster=c.cluster, role=c.role or "primary", model=c.model or None,
                      weight=_set(c, "weight", 1.0), max_in_flight=c.max_in_flight or None)
        for c in route.candidates)
    scoring = ScoringConfig()
    policy = RoutePolicy(
        name=route_name,
        scorers=dict(s.scorers) or dict(DEFAULT_SCORER_WEIGHTS),
        scoring=replace(scoring, latency_reference_s=_set(s, "latency_reference_s",
                                                          scoring.latency_reference_s)),
        picker=PickerConfig(kind=s.picker or "weighted_random",
                            hysteresis=_set(s, "hysteresis", PickerConfig().hysteresis)))
    b, d = s.breaker, BreakerConfig()
    breaker = BreakerConfig(
        window_s=_set(b, "window_s", d.window_s), min_requests=_set(b, "min_requests", d.min_requests),
        max_error_ratio=_set(b, "max_error_ratio", d.max_error_ratio),
        max_p95_latency_s=_set(b, "max_p95_latency_s", d.max_p95_latency_s),
        cooldown_s=_set(b, "cooldown_s", d.cooldown_s), probe_share=d.probe_share,
        close_after_successes=_set(b, "close_after_successes", d.close_after_successes),
        consecutive_failures=_set(b, "consecutive_failures", d.consecutive_failures))
    t = TimeoutConfig()
    timeout = replace(t, min_ms=_set(s.timeout, "min_ms", t.min_ms),
                      max_ms=_set(s.timeout, "max_ms", t.max_ms),
                      first_byte_ms=_set(s.timeout, "first_byte_ms", 0) or None)
    f, fd = s.feedback, FeedbackSampler()
    feedback = FeedbackSampler(read_all_per_s=_set(f, "read_all_per_s", fd.read_all_per_s),
                               then_one_in=_set(f, "then_one_in", fd.then_one_in))
    engine_fields = tuple(
        (c.cluster, f) for c in route.candidates
        if (f := engine_field(c.engine_priority.kind, c.engine_priority.field, c.engine_priority.higher_first)))
    return RouteConfig(candidates=candidates, engine_fields=engine_fields, policy=policy, breaker=breaker, timeout=timeout,
                     rewrite_model=_set(s, "rewrite_model", True), debug_header=s.debug_header,
                     metrics_urls=tuple((c.cluster, c.metrics_url) for c in route.candidates
                                        if c.metrics_url),
                     gpu_indices=tuple((c.cluster, c.gpu_index) for c in route.candidates
                                       if c.HasField("gpu_index")),
                     feedback=feedback, retry_other_cluster=s.retry_other_cluster)
