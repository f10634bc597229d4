"""Prometheus metrics of the sidecar (names prefixed sluice_, durations in seconds)."""
from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

REQUESTS = Counter(
    "sluice_requests_total", "Requests seen by the sidecar, by route, chosen cluster and outcome.",
    ["route", "cluster", "outcome", "status_class"])
MESSAGE_SECONDS = Histogram(
    "sluice_ext_proc_message_seconds", "Time the sidecar spent answering one ext_proc message.",
    ["phase"], buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5))
OPEN_STREAMS = Gauge("sluice_open_streams", "ext_proc streams (requests) open now.")
PROTOCOL_ERRORS = Counter(
    "sluice_protocol_errors_total", "ext_proc streams ended because a message was out of order.")


def status_class(status: int | None) -> str:
    return f"{status // 100}xx" if status else "none"
