"""A request's deadlines and the timeouts they bound, in one place: pure arithmetic.

Every time here is on the monotonic clock, as the request's arrival (`started`) is:
  - the client's budget: x-request-deadline-ms from its arrival;
  - the hold limit: the longest the sidecar keeps a request (queued, or waiting for a twin's
    answer) before it lets it go upstream or refuses it, tied to Envoy's message timeout;
  - a follower's wait for its leader's answer, and admission's deadline in the queue;
  - the upstream timeout: the scheduler's estimate (sidecar/scheduling/timeout.py, from the
    cluster's signals) cut to what the client's budget has left.
"""
from __future__ import annotations

import math
from typing import Mapping

# The client's budget for the whole request, in milliseconds from its arrival.
DEADLINE_HEADER = "x-request-deadline-ms"
# Envoy's message_timeout is 2 s (envoy/envoy.yaml.tmpl); a decision still pending after
# EXTEND_AFTER_S asks for EXTENDED_MESSAGE_TIMEOUT_S, which must not exceed max_message_timeout.
EXTEND_AFTER_S = 0.5
EXTENDED_MESSAGE_TIMEOUT_S = 60.0
# Envoy extends its message timeout once and then fails the request open, past admission: the
# sidecar decides well before, whatever the deadline.
HOLD_LIMIT_S = 55.0


def client_deadline(headers: Mapping[str, str], started: float) -> float | None:
    """When the client's budget runs out; None when it sent none or nothing usable."""
    try:
        budget_s = float(headers.get(DEADLINE_HEADER) or "nan") / 1000
    except ValueError:
        return None
    return started + budget_s if math.isfinite(budget_s) and budget_s >= 0 else None


def hold_until(started: float) -> float:
    """When the sidecar must have decided (HOLD_LIMIT_S from the arrival)."""
    return started + HOLD_LIMIT_S


def follow_for(now: float, started: float, client: float | None, route_limit_s: float) -> float:
    """How long a follower waits for its leader: the route's limit, and no longer than the
    client's budget has left or the sidecar may hold it; past it, it goes upstream itself."""
    hold = hold_until(started)
    deadline = hold if client is None else min(client, hold)
    return max(0.0, min(route_limit_s, deadline - now))


def admission_deadline(started: float, client: float | None, default_deadline_s: float) -> float:
    """The deadline admission queues against: the client's, else the route's default."""
    return started + default_deadline_s if client is None else client


def upstream_timeout_ms(estimate_ms: int, source: str, now: float, client: float | None) -> tuple[int, str]:
    """The scheduler's estimate (ms, what decided it), cut to the client's budget left: no
    answer is waited for past it (at least 1 ms: Envoy reads 0 as no timeout at all)."""
    if client is None:
        return estimate_ms, source
    left_ms = max(1, math.ceil((client - now) * 1000))
    return (left_ms, "client_deadline") if left_ms < estimate_ms else (estimate_ms, source)
