"""Assembles the sidecar's parts from its config: the pipeline's stages, cache, embedding model.

`build()` returns an App whose `start()` loads what is heavy (the embedding model) before the
server reports SERVING, and whose `close()` releases connections at shutdown.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass, field

from sidecar.config import SidecarConfig
from sidecar.pipeline import Pipeline
from sidecar.pipeline.route_stage import RouteStage

log = logging.getLogger("sluice.app")

# How long a cluster's measured time to first byte counts for admission's deadline refusals: a
# slow answer's estimate that refuses every request with a deadline would never be replaced,
# so after this long without a new measurement the next request goes through and measures.
TTFT_ESTIMATE_MAX_AGE_S = 10.0


@dataclass
class App:
    pipeline: Pipeline
    embedder: object | None = None
    closers: list = field(default_factory=list)
    scheduler: object | None = None     # for the Admin service: clusters, scores, breakers
    store: object | None = None         # the cache store (the Admin service purges through the pipeline's cache)

    async def start(self) -> None:
        """Raises ModelLoadError when the embedding model cannot be loaded (a failed start)."""
        if self.embedder is not None:
            await self.embedder.warm_up()
            log.info("embedding model ready")
        for part in self.closers:
            if hasattr(part, "start"):
                await part.start()

    async def close(self) -> None:
        for part in reversed(self.closers):
            await part.close()
        if self.embedder is not None:
            await self.embedder.close()


def build(config: SidecarConfig) -> App:
    # A random key serves one replica alone: with Redis, SidecarConfig requires cache_secret.
    secret = config.cache_secret.encode() if config.cache_secret else os.urandom(32)
    # One fast-failing client (redis_timeout_s, no retries) for dedup leases and rate limits; the
    # cache store makes its own (it also needs a long-blocking one for its event stream).
    redis, shared = None, []
    if config.redis_url:
        from sidecar.admission import connect
        redis = connect(config.redis_url, config.redis_timeout_s, cluster=config.redis_cluster)
        shared = [_SharedRedis(redis)]
    routing = RouteStage()
    routing.admission = _admission(config, routing, secret, redis)
    if not config.cache:
        # No embedding model without the cache: the guard's injection classifier judges its
        # requests by their n-grams alone (sluice_guard_text_only_total).
        return App(Pipeline(routing, guard=_guard(None)), closers=shared, scheduler=routing.scheduler)
    from sidecar.cache.budget import BytePool
    from sidecar.cache.equivalence import forget_profiles
    from sidecar.cache.false_hits import MemoryFalseHits, RedisFalseHits
    from sidecar.cache.inflight import InFlight
    from sidecar.pipeline.cache_stage import CacheRuntime, CacheStage

    budget = _budget(config)            # one budget, its shares: sidecar/cache/budget.py
    forget_profiles(budget.profiles)
    embedder = _embedder(config)
    if config.redis_url:
        from sidecar.cache.inflight_redis import RedisInFlight
        from sidecar.cache.redis_store import RedisSettings, RedisStore
        store = RedisStore(RedisSettings(url=config.redis_url, cluster=config.redis_cluster,
                                         timeout_s=config.redis_timeout_s,
                                         connect_timeout_s=config.redis_timeout_s), _limits(config))
        inflight = RedisInFlight(redis, InFlight(), op_timeout_s=config.redis_timeout_s)
        false_hits = RedisFalseHits(redis, local=MemoryFalseHits(budget.false_hits))
        closers = [*shared, store, _Closing(inflight.aclose)]
    else:
        from sidecar.cache.memory_store import MemoryStore
        store = MemoryStore(_limits(config))
        inflight = InFlight()
        false_hits = MemoryFalseHits(budget.false_hits)
        closers = [store]
    memo_pool = BytePool(budget.memos)
    from sidecar.cache.token_states import TokenStates
    token_states = TokenStates(budget.token_states)
    _export_memory(budget, store, memo_pool, token_states)
    from sidecar.guard.embeddings import SharedEmbeddings
    shared_embedder = None if embedder is None else SharedEmbeddings(embedder)
    runtime = CacheRuntime(store=store, inflight=inflight, embedder=shared_embedder, secret=secret,
                           false_hits=false_hits, memo_pool=memo_pool, token_states=token_states,
                           model_has_states=None if embedder is None else (lambda: embedder.has_states))
    return App(Pipeline(routing, CacheStage(runtime), _guard(shared_embedder)), embedder, closers,
               scheduler=routing.scheduler, store=store)


def _embedder(config: SidecarConfig):
    if not config.semantic:
        return None
    from sidecar.embedding import EmbeddingService, EmbeddingSettings
    return EmbeddingService(EmbeddingSettings.from_env())


def _guard(embedder):
    """The guard, before every other stage (sidecar/pipeline/guard_stage.py); it shares the cache's
    embeddings so the injection classifier costs no second model run."""
    from sidecar.guard.embeddings import SharedEmbeddings
    from sidecar.pipeline.guard_stage import GuardStage
    if embedder is not None and not isinstance(embedder, SharedEmbeddings):
        embedder = SharedEmbeddings(embedder)
    return GuardStage(embedder)


def _admission(config: SidecarConfig, routing: RouteStage, secret: bytes, redis):
    """The gate (queue + per-cluster concurrency limits) and the per-tenant rate limits; routes
    turn admission on in their settings. Expected time to first byte comes from the scheduler."""
    from sidecar.admission import (Gate, GateConfig, LocalTokenLimiter, PrometheusAdmissionMetrics,
                                   RedisTokenLimiter, TokenLimitsConfig)
    from sidecar.pipeline.admission_stage import Admission

    signals = routing.scheduler.signals
    metrics = PrometheusAdmissionMetrics()
    gate = Gate(GateConfig(reserved_top_slots=config.admission_reserved_slots), metrics=metrics,
                expected_ttft=lambda cluster: signals.expected_ttfb(cluster, time.monotonic(), TTFT_ESTIMATE_MAX_AGE_S))
    tokens = (RedisTokenLimiter(redis, TokenLimitsConfig(redis_timeout_s=config.redis_timeout_s), metrics=metrics)
              if redis is not None
              else LocalTokenLimiter(metrics=metrics))
    return Admission(gate, tokens, secret)


def _budget(config: SidecarConfig):
    from sidecar.cache.budget import CacheBudget
    return CacheBudget(int(config.cache_max_mib * 2**20))


def _export_memory(budget, store, memo_pool, token_states) -> None:
    """sluice_cache_memory_bytes and its budget, by part, read at each scrape."""
    from sidecar.observability import metrics
    from sidecar.cache.equivalence import cached_profile_bytes
    for part, held, share in (("store", lambda: store.nbytes, budget.store),
                              ("profiles", cached_profile_bytes, budget.profiles),
                              ("memos", lambda: memo_pool.used, budget.memos),
                              ("token_states", lambda: token_states.nbytes, budget.token_states)):
        metrics.CACHE_MEMORY.labels(part).set_function(held)
        metrics.CACHE_MEMORY_BUDGET.labels(part).set(share)


def _limits(config: SidecarConfig):
    from sidecar.cache.store import StoreLimits
    return StoreLimits(max_entries=config.cache_max_entries,
                       max_entries_per_scope=min(config.cache_max_entries, 20_000),
                       max_bytes=_budget(config).store)


class _SharedRedis:
    """The dedup and rate-limit client, connected (for a cluster: its slot map loaded) at start
    rather than by the first requests, whose calls have redis_timeout_s each; closed at shutdown."""

    START_TIMEOUT_S = 2.0

    def __init__(self, client) -> None:
        self.client = client

    async def start(self) -> None:
        deadline = time.monotonic() + self.START_TIMEOUT_S
        while True:
            try:
                await self.client.ping()
                return
            except Exception as exc:  # noqa: BLE001 - any failure: the parts fall back on their own
                if time.monotonic() >= deadline:
                    log.warning("redis not reachable at start (%s: %s): in-flight dedup and rate limits "
                                "stay within this replica until it is", type(exc).__name__, exc)
                    return
            await asyncio.sleep(0.1)

    async def close(self) -> None:
        await self.client.aclose()


class _Closing:
    """A part whose shutdown is a coroutine function other than `close`."""

    def __init__(self, close) -> None:
        self._close = close

    async def close(self) -> None:
        await self._close()
