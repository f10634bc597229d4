"""The decision record: why a request was answered, routed, held or refused, in one place.

Each stage writes its own piece on the request's `Why` as it decides (the cache its verdict,
admission its class, wait and limit, routing the timeout it chose and from what); the
scheduler's Decision already holds every candidate's score and the filter that dropped it.
`record()` puts them together once per request, for the request log line, `sluice admin tail`
and the request span. Never the prompt: the request log adds it only with prompt logging on.
"""
from __future__ import annotations

from dataclasses import dataclass


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
    unavailable: object = None           # sidecar.scheduling.Decision when no cluster could take it


def record(ctx) -> dict:
    """The request's decision record as plain data (keys present only when that stage decided)."""
    why: Why = ctx.why
    out: dict = {}
    if why.cache is not None:
        out["cache"] = _drop_none({"verdict": ctx.cache_status, "reason": why.cache.reason,
                                   "similarity": _round(why.cache.similarity),
                                   "verifier_score": _round(why.cache.verifier_score)})
    decision = ctx.decision if ctx.decision is not None else why.unavailable
    if decision is not None:
        candidates = [{"cluster": cluster, "score": _round(s.total),
                       "parts": {n: _round(v) for n, v in s.parts.items()}}
                      for cluster, s in decision.scores.items()]
        candidates += [{"cluster": cluster, "dropped": reason} for cluster, reason in decision.dropped.items()]
        out["candidates"] = candidates
        out["picked"] = _drop_none({"cluster": decision.cluster, "role": decision.role,
                                    "degraded": decision.degraded or None, "probe": decision.probe or None})
    if why.admission is not None:
        a = why.admission
        out["admission"] = _drop_none({"class": a.priority, "result": a.result, "waited_ms": round(a.waited_ms, 1),
                                       "limit": a.cluster_limit, "in_flight": a.in_flight})
    if why.timeout is not None:
        out["timeout"] = {"ms": why.timeout.ms, "from": why.timeout.source}
    return out


def span_attributes(rec: dict) -> dict:
    """The record flattened into OpenTelemetry attribute names and scalar values."""
    attributes = {}
    for section in ("cache", "admission", "timeout", "picked"):
        for key, value in (rec.get(section) or {}).items():
            attributes[f"sluice.{section}.{key}"] = value
    candidates = rec.get("candidates") or []
    if candidates:
        attributes["sluice.candidates"] = [c["cluster"] for c in candidates]
        attributes["sluice.candidates.score"] = [float(c.get("score", -1.0)) for c in candidates]
        attributes["sluice.candidates.dropped"] = [c.get("dropped", "") for c in candidates]
    return attributes


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def _drop_none(values: dict) -> dict:
    return {k: v for k, v in values.items() if v is not None}
