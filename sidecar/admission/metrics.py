"""Admission metrics: what the gate and the token limiters report, behind a narrow interface.

`AdmissionMetrics` is what they call; `PrometheusAdmissionMetrics` exports to prometheus_client's
default registry (names sluice_admission_*, durations in seconds); tests pass a fake.
Label values are bounded: classes and reasons come from config and `REASONS`, clusters from route
settings, and tenants are capped (`TenantLabels`): past the cap they count as "_other".
"""
from __future__ import annotations

from typing import Protocol

from prometheus_client import Counter, Gauge, Histogram

OTHER_TENANTS = "_other"


class AdmissionMetrics(Protocol):
    def queue_depth(self, priority: str, depth: int) -> None: ...
    def admitted(self, priority: str, wait_s: float, queued: bool) -> None: ...
    def refused(self, priority: str, reason: str) -> None: ...
    def degraded(self, priority: str, wait_s: float) -> None: ...
    def concurrency(self, cluster: str, limit: int, in_flight: int) -> None: ...
    def tokens(self, tenant: str, route: str, kind: str, tokens: int) -> None:
        """kind: "estimated" at admission; "added" or "refunded" (tokens >= 0) when corrected."""
    def token_store(self, shared: bool) -> None: ...


class NullMetrics:
    def queue_depth(self, priority: str, depth: int) -> None: pass
    def admitted(self, priority: str, wait_s: float, queued: bool) -> None: pass
    def refused(self, priority: str, reason: str) -> None: pass
    def degraded(self, priority: str, wait_s: float) -> None: pass
    def concurrency(self, cluster: str, limit: int, in_flight: int) -> None: pass
    def tokens(self, tenant: str, route: str, kind: str, tokens: int) -> None: pass
    def token_store(self, shared: bool) -> None: pass


QUEUE_DEPTH = Gauge("sluice_admission_queue_depth", "Requests waiting in the admission queue, by class.", ["class"])
WAIT_SECONDS = Histogram(
    "sluice_admission_wait_seconds", "Time admitted requests waited for a slot, by class (0 when none free was waited for).",
    ["class"], buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
ADMITTED = Counter(
    "sluice_admission_admitted_total", "Requests given a slot, by class and whether they queued first.",
    ["class", "queued"])
REFUSED = Counter("sluice_admission_refused_total", "Requests refused, by class and reason.", ["class", "reason"])
DEGRADED = Counter(
    "sluice_admission_degraded_total", "Requests sent to a fallback instead of waiting longer or being refused, by class.", ["class"])
LIMIT = Gauge("sluice_admission_concurrency_limit", "Current adaptive concurrency limit, by cluster.", ["cluster"])
IN_FLIGHT = Gauge("sluice_admission_in_flight", "Requests holding a slot, by cluster.", ["cluster"])
TOKENS = Counter(
    "sluice_admission_tokens_total", "Tokens charged to tenants' budgets, by tenant, route and kind: estimated at "
    "admission, then added or refunded by the real usage (used = estimated + added - refunded); tenants past the "
    f"label cap count as {OTHER_TENANTS!r}.", ["tenant", "route", "kind"])
TOKEN_STORE_SHARED = Gauge(
    "sluice_admission_token_store_shared", "1 while token limits are kept in Redis, 0 while on the local fallback.")


class TenantLabels:
    """The first `max_tenants` tenants seen keep their own label value; the rest share one."""

    def __init__(self, max_tenants: int = 100) -> None:
        self._max = max_tenants
        self._known: set[str] = set()

    def __call__(self, tenant: str) -> str:
        if tenant in self._known:
            return tenant
        if len(self._known) < self._max:
            self._known.add(tenant)
            return tenant
        return OTHER_TENANTS


class PrometheusAdmissionMetrics:
    def __init__(self, max_tenant_labels: int = 100) -> None:
        self._tenant = TenantLabels(max_tenant_labels)

    def queue_depth(self, priority: str, depth: int) -> None:
        QUEUE_DEPTH.labels(priority).set(depth)

    def admitted(self, priority: str, wait_s: float, queued: bool) -> None:
        ADMITTED.labels(priority, "true" if queued else "false").inc()
        WAIT_SECONDS.labels(priority).observe(wait_s)

    def refused(self, priority: str, reason: str) -> None:
        REFUSED.labels(priority, reason).inc()

    def degraded(self, priority: str, wait_s: float) -> None:
        DEGRADED.labels(priority).inc()
        WAIT_SECONDS.labels(priority).observe(wait_s)

    def concurrency(self, cluster: str, limit: int, in_flight: int) -> None:
        LIMIT.labels(cluster).set(limit)
        IN_FLIGHT.labels(cluster).set(in_flight)

    def tokens(self, tenant: str, route: str, kind: str, tokens: int) -> None:
        if tokens > 0:
            TOKENS.labels(self._tenant(tenant), route, kind).inc(tokens)

    def token_store(self, shared: bool) -> None:
        TOKEN_STORE_SHARED.set(1 if shared else 0)
