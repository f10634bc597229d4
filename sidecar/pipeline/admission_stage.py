"""The admission stage: per-tenant rate limits, then a slot on a cluster (or a wait in the
priority queue, or a fast refusal). It comes after the schedule stage, whose ranking of the
route's clusters is the order in which they are asked for a slot, and before the route stage;
see sidecar/admission/ for the queue, limiter and limits.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping, Sequence

from sidecar import deadlines
from sidecar.admission import (Degrade, Gate, Permit, RateLimitRule, RateLimits, Refusal,
                               TokenLimiter)
from sidecar.admission.cost import AnswerLengths
from sidecar.request.context import Outcome, RequestContext
from sidecar.engine_priority import class_ranks, engine_field
from sidecar.extproc.errors import error_reply
from sidecar.extproc.events import Plan
from sidecar.observability import tracing
from sidecar.pipeline.metrics import RouteMetrics
from sidecar.pipeline.schedule_stage import Scheduled, ScheduleStage
from sidecar.request.decision_record import AdmissionWhy
from sidecar.scheduling import Decision
from sidecar.route_settings import PerSettings, RouteSettings, warn_unless_internal
from sidecar.tenancy import ANONYMOUS, tenant_of
from sidecar.token_estimate import estimate_tokens

log = logging.getLogger("sluice.admission")


@dataclass(frozen=True)
class RouteAdmission:
    priority_header: str
    default_priority: str
    default_deadline_s: float
    limits: RateLimits
    # The caller as the route names it: the cache's tenant header (set by Envoy from a verified
    # identity) when the route has one, else Authorization, as the cache scope does.
    tenant_header: str = ""
    engine_ranks: Mapping[str, int] = field(default_factory=dict)  # class -> urgency rank, 0 first
    # To a fallback when the expected wait exceeds this (None: only instead of a refusal; 0: never).
    degrade_after_s: float | None = None
    # Tenant (as tenant_header names it) -> its weight among its class's tenants; others 1.
    tenant_weights: Mapping[str, int] = field(default_factory=dict)
    count_tokens: bool = False  # slots and shares count expected tokens (admission/cost.py)


@dataclass(eq=False, slots=True)
class AdmissionState:
    """Admission's piece of one request (the exchange keeps it, sidecar/pipeline/exchange.py)."""
    tenant: str | None = None            # keyed hash of the caller's credential
    priority_class: str | None = None    # the class it was admitted in (vip, standard, ...)
    token_estimate: int | None = None    # prompt tokens charged to the tenant's budget
    expected_tokens: float | None = None  # its cost, where the route counts tokens (admission/cost.py)
    permit: Permit | None = None         # a slot held on the cluster, given back at the end


def route_admission(route: RouteSettings, classes: Sequence[str] = ("vip", "standard", "batch")) -> RouteAdmission | None:
    a = route.admission
    if not a.enabled:
        return None
    deadline = a.default_deadline_s if a.HasField("default_deadline_s") else 60.0
    if not deadline > 0:
        raise ValueError(f"admission.default_deadline_s must be > 0, got {deadline}")
    degrade_after = a.degrade_after_s if a.HasField("degrade_after_s") else None
    if degrade_after is not None and not degrade_after >= 0:
        raise ValueError(f"admission.degrade_after_s must be >= 0, got {degrade_after}")
    return RouteAdmission(
        priority_header=a.priority_header.lower(), default_priority=a.default_priority or "standard",
        default_deadline_s=deadline,
        limits=RateLimits(requests_per_minute=a.requests_per_minute or None,
                          tokens_per_minute=a.tokens_per_minute or None),
        tenant_header=route.cache.tenant_header.lower(),
        engine_ranks=MappingProxyType(class_ranks(classes, dict(a.engine_ranks))),
        degrade_after_s=degrade_after,
        tenant_weights=MappingProxyType({t: w for t, w in a.tenant_weights.items() if w > 0}),
        count_tokens=a.count_tokens)


class Admission:
    def __init__(self, gate: Gate, tokens: TokenLimiter | None, secret: bytes):
        self.gate, self._tokens, self._secret = gate, tokens, secret
        self._pending: set[asyncio.Task] = set()
        self._settings_of = PerSettings()
        self._limited_routes: dict[str, RateLimits] = {}
        self.answer_lengths = AnswerLengths()

    def settings(self, route: RouteSettings, route_name: str) -> RouteAdmission | None:
        """None when the route has no admission, or bad admission settings (logged once per
        settings object, not on every request)."""
        settings = self._settings_of.get(route, self._build_settings, route_name)
        if settings is not None and self._limited_routes.get(route_name) != settings.limits:
            self._set_route_limits(route_name, settings.limits)
        return settings

    def _build_settings(self, route: RouteSettings, route_name: str) -> RouteAdmission | None:
        try:
            classes = self.gate.config.queue.names
            settings = route_admission(route, classes)
            if settings is not None and settings.default_priority not in classes:
                raise ValueError(f"admission.default_priority: expected one of {', '.join(classes)}, "
                                 f"got {settings.default_priority!r}")
        except ValueError as exc:
            log.error("invalid admission settings of route %s, admission off: %s", route_name, exc)
            settings = None
        if settings is not None:
            warn_unless_internal(route_name, settings.priority_header, "priority class")
        # With admission on, a candidate's max_in_flight caps the gate's adaptive limit
        # (requests then wait in the queue instead of being refused as saturated). The set is
        # replaced whole, so a reload that drops a cap or turns admission off frees the cluster.
        caps = {} if settings is None else {c.cluster: c.max_in_flight for c in route.candidates if c.max_in_flight}
        # A cluster whose engine preempts by priority makes room for a higher class itself.
        preempting = set() if settings is None else {c.cluster for c in route.candidates if _takes_priority(c)}
        self.gate.cap_route(route_name, caps, preempting)
        return settings

    def _set_route_limits(self, route_name: str, limits: RateLimits) -> None:
        """Route limits come from Envoy's route metadata: install them as the route's rule."""
        self._limited_routes[route_name] = limits
        for limiter in filter(None, (self._tokens, getattr(self._tokens, "fallback", None))):
            rules = tuple(r for r in limiter.config.rules if not (r.tenant is None and r.route == route_name))
            limiter.config = dataclasses.replace(limiter.config, rules=rules + (RateLimitRule(limits, route=route_name),))

    async def admit(self, ctx: RequestContext, state: AdmissionState, settings: RouteAdmission,
                    clusters: Sequence[str], can_degrade: bool = False) -> Permit | Refusal | Degrade:
        """Rate limits, then a slot on one of `clusters` (best first); may wait in the queue.
        `can_degrade`: the route has a healthy fallback, for what the gate would refuse as
        overloaded or what would wait past the route's degrade_after_s."""
        tenant = tenant_of(ctx.headers, self._secret, tenant_header=settings.tenant_header) or ANONYMOUS
        state.tenant = tenant
        priority = state.priority_class = self._priority(ctx, settings)
        if self._tokens is not None and (settings.limits.requests_per_minute or settings.limits.tokens_per_minute):
            estimate = estimate_tokens(ctx.chat.text)
            decision = await self._tokens.check(tenant, ctx.route_name, estimate)
            if not decision.allowed:
                refusal = decision.refusal()
                ctx.why.admission = AdmissionWhy(priority, f"refused:{refusal.reason}", 0.0)
                return refusal
            state.token_estimate = estimate
        if settings.count_tokens:
            state.expected_tokens = self.answer_lengths.expected_tokens(
                ctx.route_name, estimate_tokens(ctx.chat.text), ctx.chat.max_tokens)
        asked = time.monotonic()
        try:
            # Queued no longer than the sidecar may hold a request (Envoy's one extension of
            # its message timeout), whatever the deadline.
            result = await self.gate.acquire(clusters, priority, tenant,
                                             deadline=deadlines.admission_deadline(
                                                 ctx.started, ctx.client_deadline, settings.default_deadline_s),
                                             hold_until=deadlines.hold_until(ctx.started),
                                             allow_degrade=can_degrade and settings.degrade_after_s != 0,
                                             degrade_after_s=settings.degrade_after_s or None,
                                             tenant_weight=self._tenant_weight(ctx, settings),
                                             tokens=state.expected_tokens)
        except BaseException:               # the client left the queue: nothing was served
            self.refund(ctx, state)
            raise
        if isinstance(result, Refusal):     # refused at the gate: its budget was not spent
            self.refund(ctx, state)
        ctx.why.admission = self._why(priority, result, time.monotonic() - asked)
        return result

    def _why(self, priority: str, result: Permit | Refusal | Degrade, waited_s: float) -> AdmissionWhy:
        if isinstance(result, Permit):
            return AdmissionWhy(priority, "admitted", waited_s * 1000, self.gate.limit(result.cluster),
                                self.gate.in_flight(result.cluster))
        verdict = f"refused:{result.reason}" if isinstance(result, Refusal) else "degraded"
        return AdmissionWhy(priority, verdict, waited_s * 1000)

    def _priority(self, ctx: RequestContext, settings: RouteAdmission) -> str:
        """The class the route's priority header names (any case), else the route's default:
        a value no class has ("gold", "") does not fall to the gate-wide default."""
        named = (ctx.headers.get(settings.priority_header) or "").strip().lower() if settings.priority_header else ""
        return self.gate.config.queue.resolve(named, settings.default_priority)

    @staticmethod
    def _tenant_weight(ctx: RequestContext, settings: RouteAdmission) -> int:
        """Weights name tenants as the route's tenant header does (never a credential)."""
        if not settings.tenant_weights or not settings.tenant_header:
            return 1
        return settings.tenant_weights.get(ctx.headers.get(settings.tenant_header, ""), 1)

    def settle(self, ctx: RequestContext, state: AdmissionState) -> None:
        """Learn the route's answer length from a whole answer; correct the tenant's token
        budget with the answer's real usage (in the background)."""
        if state.expected_tokens is not None and ctx.usage is not None and ctx.response_complete and ctx.status == 200:
            self.answer_lengths.observe(ctx.route_name, ctx.chat.max_tokens, ctx.usage[1])
        if self._tokens is None or state.token_estimate is None or ctx.usage is None:
            return
        delta = sum(ctx.usage) - state.token_estimate
        self._in_background(self._tokens.adjust(state.tenant, ctx.route_name, delta))

    def refund(self, ctx: RequestContext, state: AdmissionState) -> None:
        """The request and its estimated tokens back to the tenant's budgets (in the background):
        the sidecar refused it after all."""
        if self._tokens is None or state.token_estimate is None:
            return
        estimate, state.token_estimate = state.token_estimate, None    # never settled as well
        self._in_background(self._tokens.refund(state.tenant, ctx.route_name, estimate))

    def _in_background(self, work) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)


class AdmissionStage:
    """Between the schedule stage and the route stage, on routes with admission: a slot on the
    scheduler's pick, else on the next best cluster of its tier that has one; a wait in the
    priority queue when all are at their limit; a fallback (degraded) or a refusal."""

    def __init__(self, admission: Admission, schedule: ScheduleStage, metrics: RouteMetrics):
        self.admission = admission
        self._schedule, self._scheduler = schedule, schedule.scheduler
        self._metrics = metrics

    def settings(self, ctx: RequestContext) -> RouteAdmission | None:
        """The route's admission settings; None: the route does not admit."""
        if not isinstance(ctx.route, RouteSettings):
            return None
        return self.admission.settings(ctx.route, ctx.route_name)

    async def admit(self, ctx: RequestContext, state: AdmissionState, scheduled: Scheduled,
                    settings: RouteAdmission) -> Scheduled | Plan:
        """The schedule stage's verdict with a slot held (maybe on another cluster, or degraded
        to a fallback), or the refusal."""
        decision = await self._admit(ctx, state, scheduled, settings)
        if not isinstance(decision, Decision):
            return decision                      # a refusal (Plan with a reply)
        if not decision.available:               # degraded with no fallback to go to: a 503
            self.admission.refund(ctx, state)
            return self._schedule.unavailable(ctx, decision, scheduled.debug)
        return dataclasses.replace(scheduled, decision=decision, at=self._schedule.clock())

    async def _admit(self, ctx: RequestContext, state: AdmissionState, scheduled: Scheduled,
                     settings: RouteAdmission) -> Decision | Plan:
        config, decision, scheduler = scheduled.config, scheduled.decision, self._scheduler
        ranked = sorted((c for c in decision.scores if c not in decision.dropped),
                        key=lambda c: (c != decision.cluster, -decision.scores[c].total))
        fallbacks = [c for c in config.candidates if c.role == "fallback"]
        healthy_fallback = decision.role != "fallback" and any(scheduler.breakers_closed([c]) for c in fallbacks)
        with tracing.span("sluice.queue"):
            try:
                result = await self.admission.admit(ctx, state, settings, ranked or [decision.cluster], healthy_fallback)
            except BaseException:
                scheduler.void_probe(decision)          # the client left the queue
                raise
        if not isinstance(result, Permit) or result.cluster != decision.cluster:
            scheduler.void_probe(decision)
        if isinstance(result, Refusal):
            ctx.outcome = Outcome.REFUSED
            self._metrics.admission_refused(ctx.route_name, result.reason)
            retry = str(max(1, math.ceil(result.retry_after_s or 1)))
            limited = result.status == 429
            return Plan(reply=error_reply(
                result.status, f"request refused by admission control ({result.reason}); retry later",
                type_="rate_limit_error" if limited else "server_error",
                code="rate_limited" if limited else "overloaded", headers=(("retry-after", retry),)))
        if isinstance(result, Degrade):
            if not fallbacks:
                return Decision.unavailable(1.0, {})
            return scheduler.pick(fallbacks, self._schedule.clock(), config.policy)
        state.permit = result
        if result.cluster == decision.cluster:
            return decision
        spec = next(c for c in config.candidates if c.cluster == result.cluster)
        return dataclasses.replace(decision, cluster=result.cluster, model_rewrite=spec.model, probe=False)


def _takes_priority(candidate) -> bool:
    """The candidate's engine takes a priority (bad settings are the routing plan's to report)."""
    p = candidate.engine_priority
    try:
        return engine_field(p.kind, p.field, p.higher_first) is not None
    except ValueError:
        return False
