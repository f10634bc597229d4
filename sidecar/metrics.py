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

# Scheduler (per upstream cluster).
CLUSTER_IN_FLIGHT = Gauge("sluice_scheduler_in_flight", "Requests this sidecar has in flight, by cluster.", ["cluster"])
CLUSTER_SCORE = Gauge("sluice_scheduler_score", "Last score of the cluster (0..1), by cluster.", ["cluster"])
CLUSTER_TTFB_P95 = Gauge("sluice_scheduler_ttfb_p95_seconds", "Windowed P95 time to first byte, by cluster.", ["cluster"])
BREAKER_STATE = Gauge("sluice_scheduler_breaker_state", "Circuit breaker: 0 closed, 1 half-open, 2 open.", ["cluster"])
BREAKER_TRANSITIONS = Counter("sluice_scheduler_breaker_transitions_total", "Breaker transitions, by cluster and new state.", ["cluster", "state"])
UNAVAILABLE = Counter("sluice_scheduler_unavailable_total", "Requests refused with 503: no candidate cluster available.", ["route"])
DEGRADED = Counter("sluice_scheduler_degraded_total", "Requests sent to a fallback cluster.", ["route"])

# Cache and in-flight dedup.
CACHE_LOOKUPS = Counter("sluice_cache_requests_total", "Chat requests by cache result: exact, semantic, coalesced, miss, or a bypass reason.", ["route", "result"])
CACHE_SAVED_TOKENS = Counter("sluice_cache_saved_tokens_total", "Prompt + completion tokens answered without an upstream call.", ["route"])
CACHE_STORED = Counter("sluice_cache_stored_total", "Answers captured and stored.", ["route"])
CACHE_NOT_STORED = Counter("sluice_cache_not_stored_total", "Answers not stored, by reason (status, partial, finish_reason, ...).", ["route", "reason"])
CACHE_SEMANTIC_VERDICTS = Counter("sluice_cache_semantic_checks_total", "Semantic candidates by the check that decided (ok = served).", ["reason"])
CACHE_EMBED_SKIPPED = Counter("sluice_cache_embedding_skipped_total", "Requests that skipped the semantic tier because embedding failed.", ["reason"])
CACHE_FOLLOWERS = Counter("sluice_cache_dedup_followers_total", "Requests that waited for an identical in-flight request.")
ADMISSION_REFUSED = Counter("sluice_admission_requests_refused_total", "Requests refused by admission control, by route and reason (rpm, tpm, queue_full, deadline, expired, ...).", ["route", "reason"])

# Operations.
CONFIG_RELOADS = Counter("sluice_config_reloads_total", "Config reloads (SIGHUP or file change), by result: ok or error (running settings kept).", ["result"])
