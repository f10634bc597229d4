"""The request path in one place: the stages a chat request goes through, in order.

    parse (the processor) -> guard -> cache: policy, lookup, dedup
        -> schedule -> admission -> route and timeout

Scheduling comes before admission: admission asks the clusters for a slot in the order the
scheduler ranked them (and a route without admission goes from the pick straight to routing).

`Pipeline` holds the stages (one each per process); an `Exchange` is one request's way through
them. The exchange keeps each stage's piece of the request (the guard's findings, the cache's
capture) and receives every response event, so no stage calls another and the processor keeps
only the protocol. Most requests are decided without waiting (`decide_now`); `decide` awaits
what waits (a large body's scan, the embedder, Redis, an in-flight twin, the admission queue)
and goes on from the stage that had to wait: a stage's verdict is worked out once.
"""
from __future__ import annotations

import dataclasses
from typing import Protocol

from sidecar.pipeline.admission_stage import AdmissionState, RouteAdmission
from sidecar.pipeline.cache_stage import CacheStage, CacheState, Capture
from sidecar.pipeline.route_config import RouteConfig
from sidecar.pipeline.route_stage import RouteState
from sidecar.pipeline.schedule_stage import Scheduled
from sidecar.request.context import RequestContext
from sidecar.extproc.events import Continue, Plan, Reply
from sidecar.pipeline.guard_stage import GuardStage, GuardState


class ScheduleStage(Protocol):
    """Which cluster (sidecar/pipeline/schedule_stage.py)."""

    def target(self, ctx: RequestContext) -> RouteConfig | Plan:
        """The route's config, or the plan that keeps Envoy's default cluster."""

    def schedule(self, ctx: RequestContext, config: RouteConfig, admitting: bool = False) -> Scheduled | Plan: ...


class AdmissionStage(Protocol):
    """A slot for the scheduled request, or a wait, or a refusal (sidecar/pipeline/admission_stage.py)."""

    def settings(self, ctx: RequestContext) -> RouteAdmission | None:
        """None: the route does not admit."""

    async def admit(self, ctx: RequestContext, state: AdmissionState, scheduled: Scheduled,
                    settings: RouteAdmission) -> Scheduled | Plan: ...


class RouteStage(Protocol):
    """The stages after the cache (sidecar/pipeline/route_stage.py builds them over one scheduler):
    schedule, admit where the route admits, route and timeout; then the feedback of what happened."""

    schedule: ScheduleStage
    admit: AdmissionStage | None

    def route(self, ctx: RequestContext, state: RouteState, scheduled: Scheduled) -> Plan: ...

    def reads_response(self, ctx: RequestContext) -> bool: ...

    def on_response_headers(self, ctx: RequestContext, state: RouteState) -> None: ...

    def on_response_body(self, ctx: RequestContext, state: RouteState, chunk: bytes, end_of_stream: bool) -> None: ...

    def on_finish(self, ctx: RequestContext, state: RouteState) -> None: ...


class Pipeline:
    def __init__(self, route: RouteStage, cache: CacheStage | None = None, guard: GuardStage | None = None):
        self.route, self.cache, self.guard = route, cache, guard

    def exchange(self, ctx: RequestContext) -> Exchange:
        return Exchange(self, ctx)

    def reload(self) -> None:
        """SIGHUP: the guard re-reads its word files."""
        if self.guard is not None:
            self.guard.reload()

    @property
    def report_false_hit(self):
        """Admin ReportFalseHit, where the cache is on."""
        return None if self.cache is None else self.cache.report_false_hit


class Exchange:
    def __init__(self, pipeline: Pipeline, ctx: RequestContext):
        self.ctx = ctx
        self._guard_stage, self._cache_stage, self._route_stage = pipeline.guard, pipeline.cache, pipeline.route
        # Each stage's piece of the request; the request context keeps only its facts and record.
        self.guard: GuardState | None = None     # the guard's verdict, once scanned
        self.cache = CacheState()                # the cache's verdict, and how the request goes upstream
        self.route = RouteState()                # admission's and the scheduler's, and the answer's feedback

    @property
    def sent_at(self) -> float | None:
        """When the request went upstream (None: it did not, or no route stage steered it)."""
        return self.route.sent_at

    # --- the request --------------------------------------------------------------------

    def reads_response(self) -> bool:
        """Asked at the request headers, before the body: whether Envoy should send this
        request's response headers (its status, time to first byte). When False, the plan's
        response headers reach the client through dynamic metadata (Plan.response_headers)."""
        if self._cache_stage is not None and self._cache_stage.reads_response(self.ctx):
            return True
        return self._route_stage.reads_response(self.ctx)

    def decide_now(self) -> Plan | None:
        """The stages in order, as far as they go without waiting; None: await `decide`."""
        ctx = self.ctx
        if self._guard_stage is not None:
            if self.guard is None:
                self.guard = self._guard_stage.scan_now(ctx)
                if self.guard is None:
                    return None                          # a large body: scanned off the loop
            if self.guard.reply is not None:
                return self.guard.reply                  # blocked
            if self.guard.injection_due:
                return None                              # the embedding is awaited
        if self._cache_stage is not None and self.cache.upstream is None:
            verdict = self._cache_stage.look_now(ctx, self.cache)
            if verdict is None:
                return None                              # the lookup may wait
            if isinstance(verdict, Plan):
                return verdict                           # answered from the cache
            self.cache.upstream = verdict
        plan = self._route_now()
        return None if plan is None else self._passed_on(plan)

    def _route_now(self) -> Plan | None:
        """Schedule and route, where the route does not admit; None: admission may queue, the
        servicer then awaits `decide` in a task. (Running the queue's first step outside a task
        would let code in it that captures the current task, such as asyncio.timeout, cancel
        the wrong one.)"""
        ctx, route = self.ctx, self._route_stage
        config = route.schedule.target(ctx)
        if isinstance(config, Plan):
            return config                                # Envoy's default cluster
        if route.admit is not None and route.admit.settings(ctx) is not None:
            return None
        scheduled = route.schedule.schedule(ctx, config)
        return scheduled if isinstance(scheduled, Plan) else route.route(ctx, self.route, scheduled)

    async def _route(self) -> Plan:
        """Schedule, admit (where the route admits: it may wait in the queue), route."""
        ctx, route = self.ctx, self._route_stage
        config = route.schedule.target(ctx)
        if isinstance(config, Plan):
            return config
        settings = None if route.admit is None else route.admit.settings(ctx)
        scheduled = route.schedule.schedule(ctx, config, admitting=settings is not None)
        if isinstance(scheduled, Plan):
            return scheduled                             # no cluster available: 503
        if settings is not None:
            self.route.admission = AdmissionState()
            scheduled = await route.admit.admit(ctx, self.route.admission, scheduled, settings)
            if isinstance(scheduled, Plan):
                return scheduled                         # refused
        return route.route(ctx, self.route, scheduled)

    async def decide(self) -> Plan:
        """The same stages, each awaited where it waits."""
        ctx = self.ctx
        if self._guard_stage is not None:
            if self.guard is None:
                self.guard = await self._guard_stage.scan(ctx)
            if self.guard.injection_due and self.guard.reply is None:
                await self._guard_stage.check_injection(ctx, self.guard)
            if self.guard.reply is not None:
                return self.guard.reply
        if self._cache_stage is not None and self.cache.upstream is None:
            verdict = await self._cache_stage.look(ctx, self.cache)
            if isinstance(verdict, Plan):
                return verdict
            self.cache.upstream = verdict
        try:
            plan = await self._route()
        except BaseException:                            # refused by a bug, or the client left
            if self.cache.upstream is not None:
                self.cache.upstream.abandon()
            raise
        return self._passed_on(plan)

    def _passed_on(self, plan: Plan) -> Plan:
        """The route stage's plan with what the earlier stages add to a request that goes on."""
        upstream = self.cache.upstream
        if upstream is not None:
            decision = self.route.decision
            plan = self._cache_stage.passed_on(self.ctx, upstream, plan, decision is not None and decision.degraded)
        if self.guard is not None:
            plan = self._guard_stage.passed_on(self.ctx, self.guard, plan)
        return plan

    # --- the response -------------------------------------------------------------------

    def on_response_headers(self) -> None:
        """After the processor recorded them (ctx.status, ctx.response_headers)."""
        self._route_stage.on_response_headers(self.ctx, self.route)   # time to first byte
        capture = self._capture()
        if capture is not None:
            self._cache_stage.on_response_headers(self.ctx, capture)

    def on_response_body(self, chunk: bytes, end_of_stream: bool, reply: Reply) -> Reply:
        """A chunk the plan asked for, after the processor's reply to it: the route stage
        reads its usage, the cache captures it; the end carries the usage to Envoy (dynamic
        metadata) for its access log and rate limits."""
        ctx = self.ctx
        self._route_stage.on_response_body(ctx, self.route, chunk, end_of_stream)
        capture = self._capture()
        if capture is not None:
            self._cache_stage.on_response_body(ctx, capture, chunk, end_of_stream)
        usage = ctx.usage
        # response_complete: the processor read this answer to its end (not a pass-through).
        if not (end_of_stream and ctx.response_complete and usage is not None and isinstance(reply, Continue)):
            return reply
        prompt, completion = usage
        return dataclasses.replace(reply, dynamic_metadata=reply.dynamic_metadata + (
            ("prompt_tokens", prompt), ("completion_tokens", completion), ("total_tokens", prompt + completion)))

    def finish(self) -> None:
        """Once per request when its stream ends, whatever happened."""
        self._route_stage.on_finish(self.ctx, self.route)
        capture = self._capture()
        if capture is not None:
            self._cache_stage.on_finish(self.ctx, capture)

    def _capture(self) -> Capture | None:
        upstream = self.cache.upstream
        return None if upstream is None else upstream.capture
