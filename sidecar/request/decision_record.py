"""The decision record: why a request was answered, routed, held or refused, in one place.

Each stage writes its own piece on the request's `Why` as it decides (the cache its verdict,
admission its class, wait and limit, routing the timeout it chose and from what); the
scheduler's Decision already holds every candidate's score and the filter that dropped it.
`record()` puts them together once per request, for the request log line, `sluice admin tail`
and the request span. Never the prompt: the request log adds it only with prompt logging on.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Protocol


class Scored(Protocol):
    @property
    def total(self) -> float: ...


class Picked(Protocol):
    """What the record reads of the scheduler's decision (sidecar.scheduling.Decision, a layer
    above): every candidate's score, the filter that dropped each, the pick's role."""
    @property
    def scores(self) -> Mapping[str, Scored]: ...
    @property
    def dropped(self) -> Mapping[str, str]: ...
    @property
    def role(self) -> str | None: ...
    @property
    def degraded(self) -> bool: ...
    @property
    def probe(self) -> bool: ...


@dataclass(frozen=True)
class CacheWhy:
    reason: str                          # the check that decided: exact, ok, below_threshold, no_store, ...
    similarity: float | None = None      # cosine of the nearest stored prompt, when one was compared
    verifier_score: float | None = None  # the same-question verifier's score, where one ran


@dataclass(frozen=True)
class AdmissionWhy:
    priority: str                        # the class the request waited in
    result: str                          # admitted | refused:<reason> | degraded
    waited_ms: float
    cluster_limit: int | None = None     # the cluster's concurrency limit when a slot was given
    in_flight: int | None = None         # requests on that cluster, this one included


@dataclass(frozen=True)
class TimeoutWhy:
    ms: int
    source: str   # observed (TTFB and tokens/s) | seed (prompt size, model) | route_min | route_max | client_deadline


@dataclass
class Why:
    cache: CacheWhy | None = None
    admission: AdmissionWhy | None = None
    timeout: TimeoutWhy | None = None
    picked: Picked | None = None         # the scheduler's decision the request was routed on
    unavailable: Picked | None = None    # the scheduler's decision when no cluster could take it


def record(ctx) -> dict:
    """The request's decision record as plain data (keys present only when that stage decided).

    Built for every request with the request log on, so kept lean: the cluster picked is the
    log line's own `cluster`; each scorer's part is in the route's debug header, not here."""
    why: Why = ctx.why
    out: dict = {}
    cache = why.cache
    if cache is not None:
        part = {"verdict": ctx.cache_status, "reason": cache.reason}
        if cache.similarity is not None:
            part["similarity"] = round(cache.similarity, 4)
        if cache.verifier_score is not None:
            part["verifier_score"] = round(cache.verifier_score, 4)
        out["cache"] = part
    decision = why.picked if why.picked is not None else why.unavailable
    if decision is not None:
        if decision.scores:
            out["scores"] = {cluster: round(s.total, 3) for cluster, s in decision.scores.items()}
        if decision.dropped:
            out["dropped"] = dict(decision.dropped)
        if decision.role is not None and (decision.degraded or decision.probe or decision.role != "primary"):
            out["picked"] = {"role": decision.role, "degraded": decision.degraded, "probe": decision.probe}
    a = why.admission
    if a is not None:
        part = {"class": a.priority, "result": a.result, "waited_ms": round(a.waited_ms, 1)}
        if a.cluster_limit is not None:
            part["limit"], part["in_flight"] = a.cluster_limit, a.in_flight
        out["admission"] = part
    if why.timeout is not None:
        out["timeout"] = {"ms": why.timeout.ms, "from": why.timeout.source}
    return out


def span_attributes(rec: dict) -> dict:
    """The record flattened into OpenTelemetry attribute names and scalar values."""
    attributes = {}
    for section in ("cache", "admission", "timeout", "picked"):
        for key, value in (rec.get(section) or {}).items():
            attributes[f"sluice.{section}.{key}"] = value
    scores, dropped = rec.get("scores") or {}, rec.get("dropped") or {}
    if scores:
        attributes["sluice.candidates.scored"] = list(scores)
        attributes["sluice.candidates.score"] = [float(v) for v in scores.values()]
    if dropped:
        attributes["sluice.candidates.dropped"] = list(dropped)
        attributes["sluice.candidates.dropped_by"] = list(dropped.values())
    return attributes
