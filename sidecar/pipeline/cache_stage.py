"""The cache stage: answer from cache, coalesce in-flight twins, capture fresh answers.

Between the guard and the route stage (sidecar/pipeline/exchange.py). Per chat request:
  1. bypass rules (no-store, time-sensitive, n > 1, tools, temperature, anonymous caller);
  2. exact tier: SHA-256 of scope + normalised prompt;
  3. semantic tier: nearest stored prompt in the same scope with cosine >= tau, and the cheap
     "same question?" checks (sidecar/cache/equivalence.py) must agree;
  4. in-flight dedup: a twin already upstream -> wait for its answer (bounded);
  5. miss: the route stage picks the cluster; Envoy is asked for the response body of a
     200 answer, which is captured, stored and handed to the waiting followers.
Every response carries x-sluice-cache: exact|semantic|coalesced|miss|bypass.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import numpy as np

from sidecar import deadlines
from sidecar.observability import tracing
from sidecar.pipeline.metrics import CacheMetrics, PrometheusCacheMetrics
from sidecar.cache.answer import CachedAnswer, decode_answer
from sidecar.cache.budget import BytePool
from sidecar.cache.capture import IDENTITY_ENCODING, NotCaptured, SseCapture, capture_json, response_refusal
from sidecar.cache.equivalence import EquivalenceSettings, Verdict
from sidecar.cache.same_question import candidate_floor, same_question
from sidecar.cache.token_states import TokenStates, decode_states, encode_states, max_encoded_bytes
from sidecar.cache.verifier import load_verifier
from sidecar.cache.false_hits import FEEDBACK_HEADER, MemoryFalseHits, pair_id
from sidecar.cache.inflight import Answered, Follow, Lead, Near, Promoted
from sidecar.cache.policy import TIME_SENSITIVE_WORDS, Bypass, CachePolicy, cache_decision
from sidecar.cache.replay import completion_id, hit_headers, json_body, sse_body
from sidecar.cache.request_memo import RequestMemo
from sidecar.cache.scope import CacheScope, exact_key, exact_key_in, prompt_text, scope_for
from sidecar.request.context import Outcome, RequestContext
from sidecar.request.decision_record import CacheWhy
from sidecar.observability.logs import Throttle
from sidecar.extproc.events import BodyMode, ImmediateReply, Plan
from sidecar.route_settings import PerSettings, RouteSettings, warn_unless_internal
from sidecar.tenancy import credential_header

log = logging.getLogger("sluice.cache")
CACHE_HEADER = "x-sluice-cache"
# Refusals of an answer that another try may not repeat (sidecar/cache/capture.py's reasons).
_TRANSIENT_REFUSALS = frozenset(("incomplete", "partial", "error", "invalid_json"))


# A rolling upgrade that changes the stored format would otherwise log on every hit.
_unreadable_warning = Throttle()


def readable(data: bytes, metrics: CacheMetrics) -> CachedAnswer | None:
    """The answer in stored or relayed bytes; None, a miss, for bytes this version cannot
    read: another version's format (replicas sharing Redis during an upgrade) or corrupt."""
    try:
        return decode_answer(data)
    except ValueError as exc:
        metrics.unreadable()
        if _unreadable_warning.due():
            log.warning("cached answer unreadable, served as a miss: %s", exc)
        return None


_check_failure_warning = Throttle()
# Another replica's states in a format this version cannot read (an upgrade), or corrupt.
_unreadable_states_warning = Throttle()


def checked_same_question(a: str, b: str, cosine: float, settings: EquivalenceSettings,
                          layer_states: tuple | None = None) -> Verdict:
    """same_question, and a miss should it fail on some odd prompt: a stored prompt is
    every later neighbour's, and an error would fail their streams too."""
    try:
        return same_question(a, b, cosine, settings, layer_states=layer_states)
    except Exception:
        if _check_failure_warning.due():
            log.exception("same-question check failed, served as a miss")
        return Verdict(False, "check_failed")


def semantic_threshold_unread(route: RouteSettings, policy: CachePolicy) -> bool:
    """Whether the route sets semantic_threshold where the verifier decides (its
    max_false_hit_rate, or the default, above 0), which does not read the threshold: the
    operator's setting would do nothing. `policy` is the route's (cache_policy)."""
    return route.cache.HasField("semantic_threshold") and policy.max_false_hit_rate > 0


def _warn_if_threshold_unread(route_name: str, route: RouteSettings, built: "RouteCache") -> None:
    """Said at load, as nothing else would say it (`sluice lint` says it before)."""
    policy = built.policy
    if built.semantic and semantic_threshold_unread(route, policy):
        log.warning("route %s sets cache.semantic_threshold, which only the lexical decision reads; "
                    "its semantic hits are decided by the verifier at max_false_hit_rate %g (set "
                    "max_false_hit_rate: 0 to keep the threshold, or remove it)", route_name,
                    policy.max_false_hit_rate)


def _reports_false_hit(ctx: RequestContext) -> bool:
    return ctx.headers.get(FEEDBACK_HEADER, "").strip() == "1"


@dataclass(frozen=True)
class RouteCache:
    policy: CachePolicy
    semantic: bool          # the semantic tier (and near-duplicate dedup) on this route
    # Verdicts on requests seen (mutable; one memo per route: settings object and name).
    requests: RequestMemo = field(compare=False)


def route_cache(route: RouteSettings, memo_pool: BytePool | None = None) -> RouteCache:
    """memo_pool: the bytes every route's request memo draws on (None: this memo's own)."""
    c = route.cache
    policy = cache_policy(route)
    return RouteCache(policy, c.semantic if c.HasField("semantic") else True,
                      RequestMemo(credential_header(policy.tenant_header), pool=memo_pool,
                                  size=lambda request: sys.getsizeof(request.prompt)))


def cache_policy(route: RouteSettings) -> CachePolicy:
    """The route's cache settings (proto sluice.v1.Cache) as a validated CachePolicy."""
    c, d = route.cache, CachePolicy()

    def get(name, default):
        return getattr(c, name) if c.HasField(name) else default

    return CachePolicy(
        enabled=get("enabled", d.enabled), semantic_threshold=get("semantic_threshold", d.semantic_threshold),
        max_false_hit_rate=get("max_false_hit_rate", d.max_false_hit_rate),
        ttl_s=get("ttl_s", d.ttl_s), allow_tools=c.allow_tools,
        max_temperature=get("max_temperature", d.max_temperature), shared=c.shared,
        tenant_header=c.tenant_header.lower(),
        time_sensitive_words=TIME_SENSITIVE_WORDS + tuple(c.time_sensitive_words),
        dedup=get("dedup", d.dedup), max_dedup_wait_s=get("max_dedup_wait_s", d.max_dedup_wait_s))


class CacheRequest(NamedTuple):
    bypass: Bypass | None            # None: serve and store
    scope: CacheScope | None         # None: not cacheable
    prompt: str
    key: str | None                  # exact key within the scope

    @property
    def untouched(self) -> bool:
        """Neither served from the cache nor stored in it: routing alone decides."""
        return self.scope is None or (self.bypass is not None and not self.bypass.may_store)


@dataclass(frozen=True)
class Lookup:
    tier: str | None                 # "exact", "semantic", or None for a miss
    reason: str                      # which check decided: exact, ok, below_threshold, numbers_differ, ...
    entry: object = None             # the stored Entry found (also for a refused semantic match)
    similarity: float | None = None
    vector: np.ndarray | None = None  # the prompt's embedding, when it was computed
    score: float | None = None       # the semantic verifier's P(same question), when it was asked
    states: np.ndarray | None = None  # the prompt's token states, when the verifier reads them


@dataclass
class Capture:
    """What a miss must do with its answer: store it, and hand it to followers."""
    scope: str
    key: str
    prompt: str
    vector: np.ndarray | None
    ttl_s: float
    stream: bool
    lead: Lead | None
    asked_at: float | None = None      # when the lookup missed (store clock): a purge since voids the put
    states: np.ndarray | None = None   # the prompt's token states, kept with the entry (TokenStates)
    sse: SseCapture | None = None
    body: bytearray = field(default_factory=bytearray)
    finished: bool = False

    def abandon(self) -> None:
        self.finished = True
        if self.lead is not None:
            self.lead.abandon()

    def release(self) -> None:
        """The answer came whole but may not be shared: the followers go upstream at once."""
        self.finished = True
        if self.lead is not None:
            self.lead.release()


@dataclass
class CacheRuntime:
    """Process-wide pieces of the cache."""
    store: object                      # sidecar.cache.store.CacheStore
    inflight: object                   # InFlight or RedisInFlight
    embedder: object | None = None     # EmbeddingService; None: exact tier only
    secret: bytes = field(default_factory=lambda: os.urandom(32))
    equivalence: EquivalenceSettings = field(default_factory=EquivalenceSettings)
    max_capture_bytes: int = 1 << 20
    false_hits: object = field(default_factory=MemoryFalseHits)   # sidecar.cache.false_hits.FalseHits
    memo_pool: BytePool | None = None  # the bytes every route's request memo draws on together
    # Stored prompts' token states for a verifier that aligns them (None: such a verifier misses).
    token_states: TokenStates | None = None
    # Whether the loaded embedding model gives token states (EmbeddingService.has_states), or
    # None while that is not known yet (the model still loading); itself None: no check.
    model_has_states: Callable[[], bool | None] | None = None


OFF = CacheWhy("off")                    # no cache on the route (or the sidecar)
EXACT = CacheWhy("exact", 1.0)


def _untouched_why(request: CacheRequest) -> CacheWhy:
    """Neither served nor stored: the bypass reason, or no scope (an anonymous caller)."""
    return CacheWhy(request.bypass.reason if request.bypass is not None else "anonymous")


def _debug(ctx: RequestContext) -> tuple[tuple[str, str], ...]:
    """The cache scope key (for `sluice admin purge --scope`) on routes with debug headers on."""
    route = ctx.route
    if ctx.cache_scope and isinstance(route, RouteSettings) and route.scheduling.debug_header:
        return (("x-sluice-cache-scope", ctx.cache_scope),)
    return ()


@dataclass
class Upstream:
    """The cache's verdict for a request it did not answer: how it goes upstream."""
    status: str                        # x-sluice-cache: miss or bypass
    capture: Capture | None = None     # what to do with the answer (a miss, or a bypass that may store)
    untouched: bool = False            # neither served nor stored: counted as a bypass once it goes on

    def abandon(self) -> None:
        """The request will not go upstream after all (refused, or the client left)."""
        if self.capture is not None:
            self.capture.abandon()
            self.capture = None


# Shared: they never capture and are never mutated.
BYPASS = Upstream("bypass")
UNTOUCHED = Upstream("bypass", untouched=True)


@dataclass(eq=False, slots=True)
class CacheState:
    """The cache's piece of one request (the exchange keeps it, sidecar/pipeline/exchange.py)."""
    request: CacheRequest | None = None  # its bypass verdict, scope and key, once worked out
    upstream: Upstream | None = None     # how it goes upstream, once the cache let it (and its capture)


class CacheStage:
    """The cache's stages of the pipeline (sidecar/pipeline/exchange.py): policy, lookup, dedup; then,
    for a request that goes upstream, its answer's capture."""

    def __init__(self, runtime: CacheRuntime, clock: Callable[[], float] = time.time,
                 metrics: CacheMetrics | None = None):
        self._rt = runtime
        self._clock = clock
        self._metrics = metrics or PrometheusCacheMetrics()
        # Stores that hold their entries in this process answer exact hits without awaiting.
        self._get_exact_now = getattr(runtime.store, "get_exact_now", None)
        # Stores that can drop one entry (the in-process one) lose an unreadable one at once.
        self._discard = getattr(runtime.store, "discard", None)
        self._route_cache_of = PerSettings()
        self._tasks: set[asyncio.Task] = set()
        self._warned_no_states = False
        # Verifier routes built before the model loaded: checked for states once it has.
        self._states_unchecked: list[str] = []

    # --- decision -----------------------------------------------------------------------

    def look_now(self, ctx: RequestContext, state: CacheState) -> Plan | Upstream | None:
        """Without waiting: a bypass on a route without the cache or for a request the cache
        may neither serve nor store (no-store, tools, anonymous, ...), and an exact hit from a
        store that holds its entries in this process. None where a lookup may wait (Redis, the
        embedder, an in-flight twin): then the pipeline awaits `look`."""
        settings = self._route_cache(ctx)
        if settings is None or not settings.policy.enabled:
            ctx.why.cache = OFF
            return BYPASS
        request = self._cache_request(ctx, state, settings)
        if request.untouched:
            ctx.why.cache = _untouched_why(request)
            return UNTOUCHED
        if self._get_exact_now is None or request.bypass is not None or _reports_false_hit(ctx):
            return None
        entry = self._get_exact_now(request.scope.key, request.key)
        if entry is not None and self._reported(request.scope.key, entry, request.key):
            entry = None
        answer = None if entry is None else self._replayable(entry)
        if answer is None:
            return None
        ctx.cache_scope = request.scope.key
        ctx.why.cache = EXACT
        return self._serve(ctx, answer, "exact", None, entry.stored_at)

    def reads_response(self, ctx: RequestContext) -> bool:
        """The cache reads every answer of its routes (to store it)."""
        settings = self._route_cache(ctx)
        return settings is not None and settings.policy.enabled

    async def look(self, ctx: RequestContext, state: CacheState) -> Plan | Upstream:
        """Policy, lookup (exact, then semantic), dedup: an answer, or how to go upstream."""
        settings = self._route_cache(ctx)
        if settings is None or not settings.policy.enabled:
            ctx.why.cache = OFF
            return BYPASS
        policy = settings.policy
        chat = ctx.chat
        request = self._cache_request(ctx, state, settings)
        if request.untouched:
            ctx.why.cache = _untouched_why(request)
            return UNTOUCHED
        bypass, scope, prompt, key = request
        ctx.cache_scope = scope.key
        vector = states = None
        lead: Lead | None = None
        try:
            if bypass is None:                                   # may serve from cache
                with tracing.span("sluice.cache"):
                    found = await self.lookup(scope.key, key, prompt, settings)
                ctx.why.cache = CacheWhy(found.reason, found.similarity, found.score)
                reported = _reports_false_hit(ctx)
                if reported:
                    await self._report(ctx.route_name, "client", scope.key, key, found, policy.ttl_s)
                    found = dataclasses.replace(found, tier=None)     # the repeat goes upstream
                    ctx.why.cache = dataclasses.replace(ctx.why.cache, reason="false_hit_reported")
                answer = None if found.tier is None else self._replayable(found.entry)
                if answer is not None:
                    return self._serve(ctx, answer, found.tier,
                                       found.similarity if found.tier == "semantic" else None,
                                       found.entry.stored_at)
                vector, states = found.vector, found.states
                # A report goes upstream (docs/false-hit-reports.md): a flight's answer, a near
                # twin's by the very decision reported wrong, would not be the fresh one it asks.
                if policy.dedup and not reported:
                    lead, answered = await self._coalesce(ctx, scope.key, key, prompt, vector, states, policy)
                    if answered is not None:
                        ctx.why.cache = dataclasses.replace(ctx.why.cache, reason="coalesced")
                        return self._serve(ctx, answered, "coalesced", None, self._clock())
            else:
                ctx.why.cache = CacheWhy(bypass.reason)
                self._metrics.lookup(ctx.route_name, bypass.reason)
                vector, states = (await self.embed_prompt(prompt, policy) if self._semantic(settings, prompt)
                                  else (None, None))
            capture = Capture(scope.key, key, prompt, vector, policy.ttl_s, chat.stream, lead,
                              asked_at=self._clock(), states=states)
            lead = None   # owned by the capture from here on
            return Upstream("miss" if bypass is None else "bypass", capture)
        finally:
            if lead is not None:       # cancelled (client left) or failed before the capture owned it
                lead.abandon()

    def _replayable(self, entry) -> CachedAnswer | None:
        """The entry's answer, or None (a miss: the request goes upstream) for one that cannot
        be replayed, which is dropped where the store allows: else a semantic neighbour would
        miss every lookup near it, and an exact one until an answer replaces it."""
        answer = readable(entry.answer, self._metrics)
        if answer is None and self._discard is not None:
            self._discard(entry.scope, entry.entry_id)
        return answer

    def _cache_request(self, ctx: RequestContext, state: CacheState, settings: RouteCache) -> CacheRequest:
        """The request's bypass verdict, scope and exact key: worked out once per request
        (decide_now, then decide when it could not answer), and once for byte-identical repeats
        (sidecar/cache/request_memo.py)."""
        request = state.request
        if request is None:
            policy = settings.policy

            def work_out() -> CacheRequest:
                chat = ctx.chat
                bypass = cache_decision(chat, ctx.headers, policy)
                prompt = prompt_text(chat)
                if bypass is not None and not bypass.may_store:
                    # Neither served nor stored: no scope (one would raise for a prompt
                    # without user text, which cache_decision bypasses as not_text).
                    return CacheRequest(bypass, None, prompt, None)
                scope = scope_for(chat, ctx.headers, policy, self._rt.secret, route=ctx.route_name)
                return CacheRequest(bypass, scope, prompt, None if scope is None else exact_key(scope, prompt))
            request = state.request = settings.requests.get(ctx.body, ctx.headers, work_out)
        return request

    def _route_cache(self, ctx: RequestContext) -> RouteCache | None:
        route = ctx.route
        if not isinstance(route, RouteSettings):
            return None
        # The route name is part of the key on purpose: each RouteCache holds a request memo
        # whose verdicts carry the route's scope, so two routes must never share one.
        return self._route_cache_of.get(route, self._build_route_cache, ctx.route_name)

    def _build_route_cache(self, route: RouteSettings, route_name: str) -> RouteCache | None:
        try:
            built = route_cache(route, self._rt.memo_pool)
        except ValueError as exc:
            log.error("invalid cache settings of route %s, cache off: %s", route_name, exc)
            return None
        warn_unless_internal(route_name, built.policy.tenant_header, "tenant")
        self._warn_if_no_states(route_name, built.policy)
        _warn_if_threshold_unread(route_name, route, built)
        return built

    def _warn_if_no_states(self, route_name: str, policy: CachePolicy) -> None:
        """Once, for the first route whose verifier reads token states when the model has none
        (a stale build/models falls back to the packaged model, which has no such output):
        every semantic candidate there is a miss, and nothing else would say why.  A route
        built before the model has loaded is checked at its first embedding after."""
        if (self._warned_no_states or self._rt.model_has_states is None
                or not self._wants_states(policy.max_false_hit_rate)):
            return
        self._check_states_of([route_name])

    def _check_states_of(self, route_names: list[str]) -> None:
        has_states = self._rt.model_has_states()
        if has_states is None:                      # not loaded yet: known at a later embedding
            self._states_unchecked = list(dict.fromkeys([*self._states_unchecked, *route_names]))
            return
        self._states_unchecked = []
        if has_states or self._warned_no_states:
            return
        self._warned_no_states = True
        log.warning("route %s has max_false_hit_rate > 0, and the embedding model has no token_states "
                    "output (a stale or missing build/models: `make all` builds the served one); its "
                    "semantic candidates are misses (verifier_no_states)", ", ".join(route_names))

    def _semantic(self, settings: RouteCache, prompt: str) -> bool:
        """Whether the prompt may have a semantic tier: not past max_prompt_chars, where every
        same-question check says no (so its embedding would be model time for nothing)."""
        return settings.semantic and len(prompt) <= self._rt.equivalence.max_prompt_chars

    async def _embed_states(self, prompt: str, with_states: bool) -> tuple[np.ndarray | None, np.ndarray | None]:
        """The prompt's vector and, when asked and the model has them, its token states."""
        if self._rt.embedder is None:
            return None, None
        try:
            with tracing.span("sluice.embed"):
                if not with_states:
                    return await self._rt.embedder.embed(prompt), None
                found = await self._rt.embedder.embed(prompt, with_states=True)
        except Exception as exc:   # EmbeddingUnavailable and anything else: skip the semantic tier
            self._metrics.embedding_skipped(type(exc).__name__)
            return None, None
        # A model without states gives a bare vector: the route's candidates are then misses,
        # said once (_warn_if_no_states), here for routes built while the model was loading.
        if self._states_unchecked:
            self._check_states_of(self._states_unchecked)
        return getattr(found, "vector", found), getattr(found, "states", None)

    def _wants_states(self, max_false_hit_rate: float) -> bool:
        """Whether a route with this rate has a verifier that reads token states (then the
        embedder returns them and stored entries keep them)."""
        return max_false_hit_rate > 0 and self._rt.token_states is not None and load_verifier().needs_states

    async def embed_prompt(self, prompt: str, policy: CachePolicy) -> tuple[np.ndarray | None, np.ndarray | None]:
        """The prompt's vector (None: the embedder is off or failed) and, when the route's
        verifier reads them, its token states."""
        return await self._embed_states(prompt, self._wants_states(policy.max_false_hit_rate))

    async def store(self, scope: str, key: str, prompt: str, vector: np.ndarray | None,
                    states: np.ndarray | None, answer: bytes, ttl_s: float,
                    asked_at: float | None = None) -> bool:
        """Stores an answer, and its prompt's token states (TokenStates) with it only when the
        store kept the entry: a put voided by a purge since `asked_at`, or refused, must leave
        no states behind, and a replaced entry never keeps its predecessor's."""
        kept = states is not None and vector is not None
        stored = await self._rt.store.put(scope, key, prompt, vector, answer, ttl_s, asked_at=asked_at,
                                          states=encode_states(states) if kept else None)
        held = self._rt.token_states
        if held is not None:
            if stored and kept:
                held.put(scope, key, states)
            else:
                held.discard(scope, key)
        return bool(stored)

    async def purge_scope(self, scope: str) -> int:
        """Admin purge of one scope: its entries and the token states kept beside them."""
        if self._rt.token_states is not None:      # first: the store may fail half-way (Redis)
            self._rt.token_states.purge_scope(scope)
        return await self._rt.store.purge_scope(scope)

    async def purge_all(self) -> int:
        """Admin purge of every scope (stores that can: both of this project's)."""
        if self._rt.token_states is not None:
            self._rt.token_states.clear()
        return await self._rt.store.purge_all()

    async def lookup(self, scope: str, key: str, prompt: str, settings: RouteCache) -> Lookup:
        """The cache's decision for a prompt in its scope: exact tier, then the nearest stored
        prompt with the same-question checks. `sluice cache-check` runs this same code."""
        entry = await self._rt.store.get_exact(scope, key)
        if entry is not None and not self._reported(scope, entry, key):
            return Lookup("exact", "exact", entry, 1.0)
        if not self._semantic(settings, prompt):
            return Lookup(None, "no_semantic_tier" if not settings.semantic else "too_long")
        checks = self._checks(settings.policy)
        wants_states = self._wants_states(checks.max_false_hit_rate)
        vector, states = await self._embed_states(prompt, wants_states)
        if vector is None:
            return Lookup(None, "embedding_unavailable")
        neighbour = await self._rt.store.nearest(scope, vector, candidate_floor(checks))
        if neighbour is None:
            return Lookup(None, "below_threshold", vector=vector, states=states)
        if neighbour.entry.entry_id == key:       # stored while this request was embedding
            if self._reported(scope, neighbour.entry, key):
                return Lookup(None, "reported_false_hit", neighbour.entry, vector=vector, states=states)
            return Lookup("exact", "exact", neighbour.entry, 1.0, vector, states=states)
        layer_states = None
        if wants_states:    # the stored prompt's, kept when it was stored, and this prompt's
            layer_states = (await self._stored_states(scope, neighbour.entry.entry_id, states), states)
        verdict = checked_same_question(neighbour.entry.prompt, prompt, neighbour.similarity, checks,
                                        layer_states)
        if verdict.hit and await self._rt.false_hits.known(
                scope, pair_id(neighbour.entry.entry_id, neighbour.entry.stored_at, key)):
            verdict = Verdict(False, "reported_false_hit", verdict.score)
        self._metrics.semantic_verdict(verdict.reason)
        return Lookup("semantic" if verdict.hit else None, verdict.reason, neighbour.entry,
                      neighbour.similarity, vector, verdict.score, states)

    async def _stored_states(self, scope: str, key: str, states: np.ndarray | None) -> np.ndarray | None:
        """A stored prompt's token states: this process's share, else those the store keeps
        beside the entry (another replica stored it, or they were evicted here), then kept in
        the share. None (the verifier's counted miss) for none, or for a value that is not
        states of this model's width: from outside this process, never trusted."""
        held = self._rt.token_states
        found = held.get(scope, key)
        if found is not None or states is None:     # no states of this prompt: nothing to compare
            return found
        dim = states.shape[1]
        data = (await self._rt.store.get_states(scope, [key], max_encoded_bytes(dim)))[0]
        if data is None:
            return None
        try:
            found = decode_states(data, dim)
        except ValueError as exc:
            self._metrics.unreadable()
            if _unreadable_states_warning.due():
                log.warning("stored token states unreadable, the candidate is a miss: %s", exc)
            return None
        held.put(scope, key, found)
        return found

    def _checks(self, policy: CachePolicy) -> EquivalenceSettings:
        """The sidecar's same-question settings with the route's threshold and false-hit rate."""
        return dataclasses.replace(self._rt.equivalence, threshold=policy.semantic_threshold,
                                   max_false_hit_rate=policy.max_false_hit_rate)

    def _reported(self, scope: str, entry, key: str) -> bool:
        """An exact entry reported wrong for its own prompt, as this process knows (exact hits
        answer without waiting; elsewhere the fresh answer the report fetched replaces it)."""
        return self._rt.false_hits.known_now(scope, pair_id(entry.entry_id, entry.stored_at, key))

    async def _report(self, route: str, source: str, scope: str, key: str, found: Lookup,
                      ttl_s: float) -> bool:
        """Remembers that what `found` served must not serve this prompt again; False when
        nothing would have been served (nothing to report)."""
        if found.tier is None:
            return False
        entry = found.entry
        await self._rt.false_hits.report(scope, pair_id(entry.entry_id, entry.stored_at, key), ttl_s)
        self._metrics.false_hit_reported(route, found.tier, source)
        log.warning("false hit reported by %s on route %s: a %s hit in scope %s", source, route,
                    found.tier, scope)
        return True

    async def report_false_hit(self, scope: str, prompt: str) -> Lookup:
        """Admin ReportFalseHit: what the scope would serve `prompt` (with the default cache
        settings of a route), remembered as a false hit from now on. A miss: nothing to report."""
        settings = RouteCache(CachePolicy(), True, RequestMemo(credential_header("")))
        key = exact_key_in(scope, prompt)
        found = await self.lookup(scope, key, prompt, settings)
        await self._report("admin", "admin", scope, key, found, CachePolicy().ttl_s)
        return found

    async def _coalesce(self, ctx, scope, key, prompt, vector, states, policy):
        """(lead, None) to go upstream leading (or alone); (None, answer) when a twin answered.
        A near twin is followed only where the same-question decision of the cache would serve
        one for the other: the verifier reads the leader's token states, kept with its flight,
        and this prompt's (`states`, from the lookup's embedding run)."""
        near = None
        if vector is not None:
            settings = self._checks(policy)

            def same(leader: str, cosine: float, leader_states) -> bool:
                return checked_same_question(leader, prompt, cosine, settings, (leader_states, states)).hit
            near = Near(vector, candidate_floor(settings), prompt, same=same, states=states)
        ticket = await self._rt.inflight.join(scope, key, near)
        if not isinstance(ticket, Follow):
            return ticket, None
        self._metrics.follower()
        outcome = await ticket.wait(deadlines.follow_for(time.monotonic(), ctx.started, ctx.client_deadline,
                                                         policy.max_dedup_wait_s))
        if isinstance(outcome, Answered):
            return None, readable(outcome.payload, self._metrics)      # unreadable (None): go upstream alone
        if isinstance(outcome, Promoted):
            return outcome.lead, None
        return None, None                       # timed out: go upstream alone

    def _serve(self, ctx: RequestContext, answer: CachedAnswer, tier: str, similarity: float | None,
               stored_at: float) -> Plan:
        now = self._clock()
        chat = ctx.chat
        ident = completion_id(random.randbytes(12))      # unique, not secret: no syscall needed
        if chat.stream:
            body = sse_body(answer, chat.model, now, ident, chat.include_usage)
        else:
            body = json_body(answer, chat.model, now, ident)
        ctx.outcome, ctx.cache_status = Outcome.ANSWERED, tier
        self._metrics.lookup(ctx.route_name, tier)
        self._metrics.saved_tokens(ctx.route_name, answer.prompt_tokens + answer.completion_tokens)
        headers = hit_headers(tier, similarity, now - stored_at, stream=chat.stream) + _debug(ctx)
        return Plan(reply=ImmediateReply(200, body, headers))

    def passed_on(self, ctx: RequestContext, upstream: Upstream, plan: Plan, degraded: bool) -> Plan:
        """The route stage's plan for a request the cache did not answer: its status header,
        and the answer's body asked for when it is captured (upstream.capture). `degraded`: the
        route stage sent it to a fallback."""
        status, capture = upstream.status, upstream.capture
        ctx.cache_status = status
        if status == "miss" or upstream.untouched:
            self._metrics.lookup(ctx.route_name, status)
        if plan.reply is not None:                      # refused (e.g. 503): nothing to capture
            upstream.abandon()
            return plan
        if capture is not None and degraded:
            # A fallback's answer (often another model's) must not be served later as the
            # answer of the model asked for, nor relayed to twins: they go on their own.
            self._refuse(ctx, capture, NotCaptured("degraded"))
            capture = upstream.capture = None
        extra = ((CACHE_HEADER, status), *_debug(ctx))
        if capture is None:
            return dataclasses.replace(plan, response_headers=plan.response_headers + extra)
        # A compressed answer could not be captured: ask the upstream for identity encoding.
        request_headers = plan.request_headers
        if IDENTITY_ENCODING not in request_headers:        # the usage meter may have asked
            request_headers += (IDENTITY_ENCODING,)
        return dataclasses.replace(
            plan, response_headers=plan.response_headers + extra, request_headers=request_headers,
            response_body=BodyMode.STREAMED if capture.stream else BodyMode.BUFFERED)

    # --- response -----------------------------------------------------------------------

    def on_response_headers(self, ctx: RequestContext, capture: Capture) -> None:
        refusal = response_refusal(ctx.response_headers, capture.stream)
        if refusal is not None:
            self._refuse(ctx, capture, refusal)
        elif capture.stream:
            capture.sse = SseCapture(self._rt.max_capture_bytes)

    def on_response_body(self, ctx: RequestContext, capture: Capture, chunk: bytes, end_of_stream: bool) -> None:
        if capture.finished:
            return
        if capture.sse is not None:
            capture.sse.feed(chunk)
            if capture.sse.refused:          # known mid-stream (a tool call, an error event):
                return self._refuse(ctx, capture, capture.sse.refused)   # twins need not wait
        elif not end_of_stream or len(capture.body) + len(chunk) > self._rt.max_capture_bytes:
            # JSON comes BUFFERED_PARTIAL: one message, and one without the end only when the
            # answer outgrew Envoy's buffer (the rest flows on to the client, not to us).
            return self._refuse(ctx, capture, NotCaptured("too_large"))
        else:
            capture.body += chunk
        # A stream is complete at `data: [DONE]`: the end of the body may reach us only after
        # the client has the whole answer (and asked again).
        if end_of_stream or (capture.sse is not None and capture.sse.done):
            self._finish(ctx, capture)

    def _finish(self, ctx: RequestContext, capture: Capture) -> None:
        now = self._clock()
        prompt = ctx.chat.text            # the whole chat, for the estimate when there is no usage
        answer = (capture.sse.finish(now, prompt_text=prompt) if capture.sse is not None
                  else capture_json(bytes(capture.body), now, prompt_text=prompt,
                                    max_bytes=self._rt.max_capture_bytes))
        if isinstance(answer, NotCaptured):
            return self._refuse(ctx, capture, answer)
        capture.finished = True
        if ctx.usage is None:           # no token budget read it (sidecar/pipeline/usage.py): for the metadata
            ctx.usage = (answer.prompt_tokens, answer.completion_tokens)
        payload = answer.to_bytes()
        if capture.lead is not None:
            capture.lead.complete(payload)
        task = asyncio.get_running_loop().create_task(self.store(
            capture.scope, capture.key, capture.prompt, capture.vector, capture.states, payload,
            capture.ttl_s, asked_at=capture.asked_at))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        self._metrics.stored(ctx.route_name)

    def _refuse(self, ctx: RequestContext, capture: Capture, refusal: NotCaptured) -> None:
        self._metrics.not_stored(ctx.route_name, refusal.reason)
        # A failure another try may not repeat (a 5xx, 408, 429, an answer cut off or broken)
        # is handed to one follower at a time: no herd on a struggling upstream. An answer that
        # came whole but may not be shared (a 4xx, private, a tool call, too large, ...) would
        # come the same way again: every follower goes at once rather than each in turn.
        status = ctx.status
        if refusal.reason in _TRANSIENT_REFUSALS or (
                refusal.reason == "status" and (status is None or status >= 500 or status in (408, 429))):
            capture.abandon()
        else:
            capture.release()

    def on_finish(self, ctx: RequestContext, capture: Capture) -> None:
        if not capture.finished:                            # partial, reset or client gone
            self._refuse(ctx, capture, NotCaptured("incomplete"))
