"""What the cache and route stages count, behind narrow interfaces (as sidecar/admission/metrics.py).

The stages take one; the Prometheus ones export to the default registry's metrics declared in
sidecar/observability/metrics.py; tests may pass a fake. Label values are bounded: routes and
clusters come from the settings, reasons and tiers from the code.
"""
from __future__ import annotations

from typing import Protocol

from sidecar.observability import metrics as m


class CacheMetrics(Protocol):
    def lookup(self, route: str, result: str) -> None:
        """A chat request's cache result: exact, semantic, coalesced, miss, or a bypass reason."""
    def saved_tokens(self, route: str, tokens: int) -> None: ...
    def stored(self, route: str) -> None: ...
    def not_stored(self, route: str, reason: str) -> None: ...
    def semantic_verdict(self, reason: str) -> None: ...
    def embedding_skipped(self, reason: str) -> None: ...
    def unreadable(self) -> None: ...
    def false_hit_reported(self, route: str, tier: str, source: str) -> None: ...
    def follower(self) -> None: ...


class PrometheusCacheMetrics:
    def lookup(self, route: str, result: str) -> None:
        m.child(m.CACHE_LOOKUPS, route, result).inc()

    def saved_tokens(self, route: str, tokens: int) -> None:
        m.child(m.CACHE_SAVED_TOKENS, route).inc(tokens)

    def stored(self, route: str) -> None:
        m.child(m.CACHE_STORED, route).inc()

    def not_stored(self, route: str, reason: str) -> None:
        m.child(m.CACHE_NOT_STORED, route, reason).inc()

    def semantic_verdict(self, reason: str) -> None:
        m.child(m.CACHE_SEMANTIC_VERDICTS, reason).inc()

    def embedding_skipped(self, reason: str) -> None:
        m.child(m.CACHE_EMBED_SKIPPED, reason).inc()

    def unreadable(self) -> None:
        m.CACHE_UNREADABLE.inc()

    def false_hit_reported(self, route: str, tier: str, source: str) -> None:
        m.child(m.CACHE_FALSE_HIT_REPORTS, route, tier, source).inc()

    def follower(self) -> None:
        m.CACHE_FOLLOWERS.inc()


class RouteMetrics(Protocol):
    def degraded(self, route: str) -> None: ...
    def unavailable(self, route: str) -> None: ...
    def admission_refused(self, route: str, reason: str) -> None: ...
    def breaker_transition(self, cluster: str, state: str) -> None: ...


class PrometheusRouteMetrics:
    def degraded(self, route: str) -> None:
        m.child(m.DEGRADED, route).inc()

    def unavailable(self, route: str) -> None:
        m.child(m.UNAVAILABLE, route).inc()

    def admission_refused(self, route: str, reason: str) -> None:
        m.child(m.ADMISSION_REFUSED, route, reason).inc()

    def breaker_transition(self, cluster: str, state: str) -> None:
        m.child(m.BREAKER_TRANSITIONS, cluster, state).inc()
