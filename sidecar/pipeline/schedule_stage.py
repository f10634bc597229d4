"""The schedule stage: which cluster takes a request, before admission and routing.

The route's settings as the scheduler's config (built once per settings object), then the
scheduler's pick over its candidates: filters, scores, picker (sidecar/scheduling/), a fallback
when the primaries are down. No cluster available: a fast 503. Admission comes after this
stage on purpose: it asks the clusters for a slot in the order the scheduler ranked them
(sidecar/pipeline/admission_stage.py).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Callable

from sidecar.extproc.errors import error_reply
from sidecar.extproc.events import Plan
from sidecar.observability import tracing
from sidecar.pipeline.metrics import RouteMetrics
from sidecar.pipeline.route_config import RouteConfig, build_route_config
from sidecar.request.context import Outcome, RequestContext
from sidecar.route_settings import PerSettings, RouteSettings, RouteSettingsError
from sidecar.scheduling import Decision, Scheduler
from sidecar.scheduling.gpu import GpuPoller
from sidecar.scheduling.overdue import FirstByteWatch
from sidecar.scheduling.scrape import Scraper

log = logging.getLogger("sluice.routing")


@dataclass(frozen=True, slots=True)
class Scheduled:
    """The schedule stage's verdict on a route that steers (and admission's, once it gave a
    slot): the route's config, the cluster picked, and when that decision stands."""
    config: RouteConfig
    decision: Decision
    at: float                                  # the scheduler's clock: the request is sent from here
    debug: tuple[tuple[str, str], ...] = ()    # x-sluice-debug, on routes that ask for it


class ScheduleStage:
    def __init__(self, scheduler: Scheduler, clock: Callable[[], float], scrape_interval_s: float | None,
                 first_byte: FirstByteWatch, metrics: RouteMetrics):
        self.scheduler = scheduler
        self.clock = clock
        self._metrics = metrics
        self._first_byte = first_byte          # the route stage's; overdue requests are judged before a pick
        self._scraper = (Scraper(scheduler.on_upstream_load, scrape_interval_s)
                         if scrape_interval_s else None)
        self._gpus = GpuPoller(scheduler.on_gpu_load) if scrape_interval_s else None
        self._configs = PerSettings()

    def target(self, ctx: RequestContext) -> RouteConfig | Plan:
        """The route's config, or the (empty) Plan that keeps Envoy's default cluster."""
        route = self.config(ctx)
        if isinstance(route, RouteConfig):
            self._keep_polled(route)
        if isinstance(route, RouteSettingsError):
            ctx.outcome = Outcome.INVALID_ROUTE
            return Plan()
        if not isinstance(route, RouteConfig):
            ctx.outcome = Outcome.DEFAULT
            return Plan()
        return route

    def schedule(self, ctx: RequestContext, config: RouteConfig, admitting: bool = False) -> Scheduled | Plan:
        """The scheduler's pick, or a 503 when no candidate can take the request. `admitting`:
        admission follows, and saturation is its business (the request queues for a slot)."""
        now = self.clock()
        decision, debug = self._pick(config, config.unbounded_candidates if admitting else config.candidates, now)
        if not decision.available:
            return self.unavailable(ctx, decision, debug)
        return Scheduled(config, decision, now, debug)

    def config(self, ctx: RequestContext) -> RouteConfig | RouteSettingsError | None:
        """The config of a route that steers; its error when its settings are invalid; None for
        a route without candidates (or without settings)."""
        route = ctx.route
        if isinstance(route, RouteSettings):
            return self._configs.get(route, self._build_config, ctx.route_name) if route.candidates else None
        return route if isinstance(route, RouteSettingsError) else None

    def unavailable(self, ctx: RequestContext, decision: Decision, debug: tuple) -> Plan:
        ctx.outcome = Outcome.REFUSED
        ctx.why.unavailable = decision
        self._metrics.unavailable(ctx.route_name)
        retry = str(max(1, math.ceil(decision.retry_after_s or 1)))
        return Plan(reply=error_reply(
            503, "no upstream cluster is available for this route; retry later",
            type_="server_error", code="upstream_unavailable", headers=(("retry-after", retry), *debug)))

    def judge_overdue(self, now: float) -> None:
        """Requests still without their first byte well past their cluster's usual time count
        as failures now (overdue.py): a hanging cluster trips its breaker within seconds."""
        for state in self._first_byte.take_overdue(now, lambda cluster: self.scheduler.signals.ttfb_p95(cluster, now)):
            state.first_byte_overdue = True
            self.scheduler.on_overdue(state.decision, now)

    def _keep_polled(self, config: RouteConfig) -> None:
        """The route's clusters' load sources stay polled (a poller drops a target that fails;
        the next request adds it back). Once per decision, not per lookup."""
        if self._scraper is not None:
            for cluster, url in config.metrics_urls:
                self._scraper.ensure(cluster, url)
        if self._gpus is not None:
            for cluster, index in config.gpu_indices:
                self._gpus.ensure(cluster, index)

    def _build_config(self, route: RouteSettings, route_name: str) -> RouteConfig | RouteSettingsError:
        try:
            config = build_route_config(route, route_name)
        except ValueError as exc:
            log.error("invalid route settings of route %s, using its default cluster: %s", route_name, exc)
            return RouteSettingsError(str(exc))
        for spec in config.candidates:
            self.scheduler.set_breaker_config(spec.cluster, config.breaker)
        return config

    def _pick(self, config: RouteConfig, candidates, now: float) -> tuple[Decision, tuple]:
        """The scheduler's decision and, when the route asks, its debug header."""
        self.judge_overdue(now)
        with tracing.span("sluice.schedule"):
            decision = self.scheduler.pick(candidates, now, config.policy)
        return decision, (("x-sluice-debug", decision.debug_header()),) if config.debug_header else ()
