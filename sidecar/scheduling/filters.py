"""Filters: drop the endpoints a request must not go to, each with a reason for the debug header."""
from __future__ import annotations

from collections.abc import Callable, Sequence

from sidecar.scheduling.model import BreakerState, Endpoint

Filter = Callable[[Endpoint], "str | None"]  # the reason to drop it, or None to keep it


def zero_weight(ep: Endpoint) -> str | None:
    return "weight 0" if ep.spec.weight == 0 else None


def breaker(ep: Endpoint) -> str | None:
    """Open breakers drop; half-open ones only pass when this request is due to be a probe."""
    if ep.breaker is BreakerState.OPEN:
        return "breaker open"
    if ep.breaker is BreakerState.HALF_OPEN and not ep.probe_due:
        return "breaker half-open, no probe due"
    return None


def saturated(ep: Endpoint) -> str | None:
    limit = ep.spec.max_in_flight
    if limit is not None and ep.signals.in_flight >= limit:
        return f"saturated ({ep.signals.in_flight}/{limit} in flight)"
    return None


DEFAULT_FILTERS: tuple[Filter, ...] = (zero_weight, breaker, saturated)


def apply_filters(
    endpoints: Sequence[Endpoint], filters: Sequence[Filter] = DEFAULT_FILTERS
) -> tuple[list[Endpoint], dict[str, str]]:
    """(endpoints kept, cluster -> reason for each one dropped); the first filter to object wins."""
    kept: list[Endpoint] = []
    dropped: dict[str, str] = {}
    for ep in endpoints:
        for f in filters:
            reason = f(ep)
            if reason is not None:
                dropped[ep.cluster] = reason
                break
        else:
            kept.append(ep)
    return kept, dropped
