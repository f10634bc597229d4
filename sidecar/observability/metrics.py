"""Prometheus metrics of the sidecar (names prefixed sluice_, durations in seconds)."""
from __future__ import annotations

import time
import weakref

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily

REQUESTS = Counter(
    "sluice_requests_total", "Requests seen by the sidecar, by route, chosen cluster and outcome.",
    ["route", "cluster", "outcome", "status_class"])
MESSAGE_SECONDS = Histogram(
    "sluice_ext_proc_message_seconds", "Time the sidecar spent answering one ext_proc message.",
    ["phase"], buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5))
OPEN_STREAMS = Gauge("sluice_open_streams", "ext_proc streams (requests) open now.")
PROTOCOL_ERRORS = Counter(
    "sluice_protocol_errors_total", "ext_proc streams ended because a message was out of order.")
INTERNAL_ERRORS = Counter(
    "sluice_internal_errors_total", "ext_proc messages whose handling raised (a bug), by message kind: "
    "the request was refused or passed on per SLUICE_ON_INTERNAL_ERROR.", ["phase"])


def message_timer(event_type: type):
    """The ext_proc time histogram child of one message kind."""
    return child(MESSAGE_SECONDS, event_type.__name__)


_CHILDREN: dict = {}


def child(metric, *labels: str):
    """metric.labels(*labels), remembered: labels() is ~1.5 µs a call and the hot paths ask for
    the same few children again and again (bounded all the same)."""
    key = (metric, labels)
    found = _CHILDREN.get(key)
    if found is None:
        if len(_CHILDREN) > 10_000:
            _CHILDREN.clear()
        found = _CHILDREN[key] = metric.labels(*labels)
    return found


def count_request(route: str, cluster: str, outcome: str, status: int | None, read: bool = True) -> None:
    """sluice_requests_total += 1. read=False: the answer was not read (feedback sampling), so
    its status is not known here."""
    label = status_class(status) if read or status is not None else "unread"
    child(REQUESTS, route, cluster, outcome, label).inc()


def status_class(status: int | None) -> str:
    return f"{status // 100}xx" if status else "none"

# Scheduler (per upstream cluster): read from the scheduler when Prometheus scrapes, not written
# on every request (a windowed P95 per request cost more than the rest of the routing path).
class SchedulerCollector:
    """Gauges of every live route stage's scheduler, computed at scrape time."""

    def __init__(self) -> None:
        self.directors: weakref.WeakSet = weakref.WeakSet()

    def collect(self):
        in_flight = GaugeMetricFamily("sluice_scheduler_in_flight", "Requests this sidecar has in flight, by cluster.", labels=["cluster"])
        score = GaugeMetricFamily("sluice_scheduler_score", "Last score of the cluster (0..1), by cluster.", labels=["cluster"])
        p95 = GaugeMetricFamily("sluice_scheduler_ttfb_p95_seconds", "Windowed P95 time to first byte, by cluster.", labels=["cluster"])
        breaker = GaugeMetricFamily("sluice_scheduler_breaker_state", "Circuit breaker: 0 closed, 1 half-open, 2 open.", labels=["cluster"])
        now = time.monotonic()
        for director in list(self.directors):
            for cluster, snap in director.scheduler.snapshot(now).items():
                in_flight.add_metric([cluster], snap.in_flight)
                if snap.ttfb_p95_s is not None:
                    p95.add_metric([cluster], snap.ttfb_p95_s)
            for cluster, value in director.last_scores.items():
                score.add_metric([cluster], value)
            for cluster, state in director.scheduler.breaker_states(now).items():
                breaker.add_metric([cluster], BREAKER_VALUES[state.value])
        yield from (in_flight, score, p95, breaker)


BREAKER_VALUES = {"closed": 0, "half_open": 1, "open": 2}
SCHEDULERS = SchedulerCollector()
REGISTRY.register(SCHEDULERS)
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
CACHE_UNREADABLE = Counter("sluice_cache_unreadable_total", "Stored entries (answers, index vectors, a verifier's token states) and relayed answers this version cannot read (another version's, corrupt): skipped, served as misses.")
CACHE_FALSE_HIT_REPORTS = Counter("sluice_cache_false_hit_reports_total", "Cached answers reported wrong for the prompt they served, by tier and by who reported (client, admin).", ["route", "tier", "source"])
CACHE_MEMORY = Gauge("sluice_cache_memory_bytes", "Bytes the cache holds in this process, by part of its budget (store, profiles, memos, token_states).", ["part"])
CACHE_MEMORY_BUDGET = Gauge("sluice_cache_memory_budget_bytes", "Each part's share of the cache's byte budget (SLUICE_CACHE_MAX_MIB).", ["part"])
CACHE_FOLLOWERS = Counter("sluice_cache_dedup_followers_total", "Requests that waited for an identical in-flight request.")
ADMISSION_REFUSED = Counter("sluice_admission_requests_refused_total", "Requests refused by admission control, by route and reason (rpm, tpm, queue_full, deadline, expired, ...).", ["route", "reason"])

# Operations.
CONFIG_RELOADS = Counter("sluice_config_reloads_total", "Config reloads (SIGHUP or file change), by result: ok or error (running settings kept).", ["result"])
