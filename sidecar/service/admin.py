"""The Admin gRPC service (proto/sluice/v1/admin.proto): clusters, cache purge, false-hit
reports, drain, tail.

Served on the ext_proc port; only loopback peers may call it unless SLUICE_ADMIN_REMOTE=true.
"""
from __future__ import annotations

import logging
import time
import urllib.parse
from dataclasses import dataclass
from typing import Awaitable, Callable, Mapping, Protocol

import grpc
from prometheus_client import REGISTRY

from sidecar.protos import admin_pb2, admin_pb2_grpc
from sidecar.observability.record_feed import Filter, RecordFeed

log = logging.getLogger("sluice.admin")


class ClusterView(Protocol):
    """What ListClusters reads: sidecar.scheduling.Scheduler."""

    def snapshot(self, now: float) -> Mapping[str, object]: ...

    def breaker_states(self, now: float) -> Mapping[str, object]: ...


class PurgeableStore(Protocol):
    """What PurgeCache needs: sidecar.pipeline.cache_stage.CacheStage, which purges the store
    and the token states kept beside its entries (purge_all is optional)."""

    async def purge_scope(self, scope: str) -> int: ...


@dataclass(frozen=True)
class DrainStarted:
    drain_delay_s: float
    grace_s: float
    already_draining: bool


def last_score(cluster: str) -> float | None:
    """The score the cluster got in its last pick, as exported (sluice_scheduler_score)."""
    return REGISTRY.get_sample_value("sluice_scheduler_score", {"cluster": cluster})


def is_loopback(peer: str) -> bool:
    """grpc peer strings: 'ipv4:127.0.0.1:5000', 'ipv6:%5B::1%5D:5000' (gRPC percent-encodes the
    brackets), 'unix:/path'."""
    kind, _, address = urllib.parse.unquote(peer).partition(":")
    if kind == "unix":
        return True
    host = address.rsplit(":", 1)[0].strip("[]")
    if kind == "ipv4":
        return host.startswith("127.")
    if kind == "ipv6":
        return host == "::1" or host.startswith("::ffff:127.")
    return False


class AdminService(admin_pb2_grpc.AdminServicer):
    def __init__(self, scheduler: ClusterView | None, store: PurgeableStore | None,
                 drain: Callable[[], DrainStarted], allow_remote: bool = False,
                 score: Callable[[str], float | None] = last_score, clock=time.monotonic,
                 report_false_hit: Callable[[str, str], Awaitable[object]] | None = None,
                 feed: RecordFeed | None = None) -> None:
        self._feed = feed
        self._scheduler = scheduler
        self._store = store
        self._drain = drain
        self._allow_remote = allow_remote
        self._score = score
        self._clock = clock
        self._report_false_hit = report_false_hit   # Pipeline.report_false_hit

    async def _check_peer(self, context) -> None:
        if not self._allow_remote and not is_loopback(context.peer()):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                "the Admin service answers loopback callers only (SLUICE_ADMIN_REMOTE)")

    async def ListClusters(self, request, context):
        await self._check_peer(context)
        response = admin_pb2.ListClustersResponse()
        if self._scheduler is None:
            return response
        now = self._clock()
        snapshots, breakers = self._scheduler.snapshot(now), self._scheduler.breaker_states(now)
        for name in sorted(set(snapshots) | set(breakers)):
            status = response.clusters.add(name=name, breaker=_state(breakers.get(name)))
            snap = snapshots.get(name)
            if snap is not None:
                status.in_flight = snap.in_flight
                status.requests_in_window = snap.requests_in_window
                if snap.ttfb_p95_s is not None:
                    status.ttfb_p95_s = snap.ttfb_p95_s
                if snap.error_rate is not None:
                    status.error_rate = snap.error_rate
            score = self._score(name)
            if score is not None:
                status.score = score
        return response

    async def PurgeCache(self, request, context):
        await self._check_peer(context)
        target = request.WhichOneof("target")
        if self._store is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "the cache is off (SLUICE_CACHE=false)")
        if target is None or (target == "scope" and not request.scope) or (target == "all" and not request.all):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "name a scope, or all")
        if target == "all":
            purge_all = getattr(self._store, "purge_all", None)
            if purge_all is None:
                await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                                    f"{type(self._store).__name__} cannot purge everything; purge a scope")
        try:
            deleted = await (purge_all() if target == "all" else self._store.purge_scope(request.scope))
        except Exception as exc:       # StoreUnavailable: the shared (Redis) tier is unreachable
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"cache store: {type(exc).__name__}: {exc}")
        log.warning("cache purged by %s: %s, %d entries", context.peer(),
                    "everything" if target == "all" else f"scope {request.scope}", deleted)
        return admin_pb2.PurgeCacheResponse(deleted=deleted)

    async def ReportFalseHit(self, request, context):
        await self._check_peer(context)
        if self._report_false_hit is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "the cache is off (SLUICE_CACHE=false)")
        if not request.scope or not request.prompt:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "name a scope and a prompt")
        try:
            found = await self._report_false_hit(request.scope, request.prompt)
        except Exception as exc:       # the store or the embedder unreachable: retry later
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"cache: {type(exc).__name__}: {exc}")
        response = admin_pb2.ReportFalseHitResponse(reported=found.tier is not None)
        if found.tier is not None:
            response.tier, response.stored_prompt = found.tier, found.entry.prompt
            if found.tier == "semantic" and found.similarity is not None:
                response.similarity = found.similarity
        return response

    async def Drain(self, request, context):
        await self._check_peer(context)
        started = self._drain()
        log.warning("drain requested by %s", context.peer())
        return admin_pb2.DrainResponse(drain_delay_s=started.drain_delay_s, grace_s=started.grace_s,
                                       already_draining=started.already_draining)


    async def Tail(self, request, context):
        await self._check_peer(context)
        if self._feed is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this sidecar keeps no request records")
        reader = self._feed.subscribe(Filter(request.route, request.cluster, request.outcome))
        if reader is None:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                "too many tails are reading (or the sidecar is draining)")
        log.info("tail opened by %s (route=%r cluster=%r outcome=%r)", context.peer(), request.route,
                 request.cluster, request.outcome)
        try:
            while (item := await reader.next()) is not None:
                yield admin_pb2.TailRecord(json=item[0], dropped=item[1])
        finally:
            self._feed.unsubscribe(reader)


def _state(state) -> str:
    return "closed" if state is None else getattr(state, "value", str(state))


def admin_parts(app) -> tuple[ClusterView | None, PurgeableStore | None]:
    """The scheduler and what purges the cache of an assembled App (None when absent)."""
    return app.scheduler, app.pipeline.cache
