"""The route stage: admission, schedule, route and timeout; then the feedback of what happened.

The last stage of the pipeline (sidecar/pipeline/exchange.py). Per request: pick (filters,
scores, picker; fallback when primaries are down), set the cluster header and a per-request upstream timeout, rewrite the model for a fallback, answer 503 fast
when nothing is available. Response headers give time to first byte and success, the end of
the stream total latency; they drive the signals and the circuit breakers. A busy route reads
a sample of the answers (reads_response, sidecar/scheduling/sampling.py).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from dataclasses import dataclass
from typing import Callable

from sidecar import deadlines, engine_priority
from sidecar.observability import tracing
from sidecar.observability.metrics import SCHEDULERS
from sidecar.admission import Degrade, Permit, Refusal
from sidecar.pipeline.admission_stage import Admission, AdmissionState, RouteAdmission
from sidecar.cache.answer import compact_json
from sidecar.cache.capture import IDENTITY_ENCODING, is_encoded
from sidecar.request.context import Outcome, RequestContext
from sidecar.engine_priority import EngineField
from sidecar.request.decision_record import TimeoutWhy
from sidecar.extproc.events import BodyMode, Plan
from sidecar.pipeline.metrics import PrometheusRouteMetrics, RouteMetrics
from sidecar.pipeline.usage import UsageMeter
from sidecar.scheduling.gpu import GpuPoller
from sidecar.extproc.errors import error_reply
from sidecar.extproc.processor import CLUSTER_HEADER
from sidecar.pipeline.route_config import RouteConfig, build_route_config
from sidecar.route_settings import PerSettings, RouteSettings, RouteSettingsError
from sidecar.scheduling import BreakerTransition, Decision, Scheduler
from sidecar.scheduling.overdue import FirstByteWatch
from sidecar.scheduling.retry import retry_candidate, retry_cluster_name
from sidecar.scheduling.scrape import Scraper
from sidecar.token_estimate import estimate_tokens

log = logging.getLogger("sluice.routing")
TIMEOUT_HEADER = "x-envoy-upstream-rq-timeout-ms"
FIRST_BYTE_TIMEOUT_HEADER = "x-envoy-upstream-rq-per-try-timeout-ms"
ATTEMPT_COUNT_HEADER = "x-envoy-attempt-count"   # include_attempt_count_in_response (envoy.yaml.tmpl)
# One retry, only while no answer byte has gone to the client (Envoy never retries after): a
# refused or failed connection, a reset or a 5xx before the answer's headers, the per-try
# (first-byte) timeout. Set per request, on requests the sidecar steered only.
RETRY_HEADERS = (("x-envoy-retry-on", "5xx"), ("x-envoy-max-retries", "1"))
# Streams whose answer is read have one in this many read to the end (a reset mid-answer is a
# breaker failure); more would put the sidecar on every token's path.
STREAM_END_CHECK_ONE_IN = 8


@dataclass(eq=False, slots=True)
class RouteState:
    """The route stage's piece of one request (the exchange keeps it, sidecar/pipeline/exchange.py):
    what it decided, and what the answer has told it so far."""
    decision: Decision | None = None     # the scheduler's pick once routed (the retry's, once it answered)
    sent_at: float | None = None         # when the sidecar let the request go upstream
    admission: AdmissionState | None = None   # where the route admits: tenant, class, budget, slot
    usage_meter: UsageMeter | None = None     # reads the answer's usage, for admission's budgets
    retry_cluster: str | None = None     # where Envoy retries it if it fails before its first byte
    retried: bool = False                # Envoy's retry answered it (on retry_cluster)
    first_byte_overdue: bool = False     # judged a failure while waiting for its first byte
    judged: bool = False                 # its cluster's verdict is given (once: at 5xx headers or the end)

    @property
    def permit(self) -> Permit | None:
        return None if self.admission is None else self.admission.permit


def _ttfb(ctx: RequestContext, state: RouteState) -> float | None:
    """Time to first byte, from the moment the request left the sidecar: time queued in the
    gate is not the cluster's latency (counting it would shrink the limits that made it wait).
    None after Envoy's retry answered (the failed attempt's time is in it)."""
    if ctx.response_headers_at is None or state.sent_at is None or state.retried:
        return None
    return ctx.response_headers_at - state.sent_at


def _attempts(headers) -> int:
    """Envoy's attempt count of an answer (1 when absent or unreadable)."""
    value = headers.get(ATTEMPT_COUNT_HEADER, "1")
    return int(value) if value.isdigit() and len(value) < 4 else 1


def rewrite_model(body: bytes, model: str) -> bytes:
    """The body with another model; UTF-8, or ASCII escapes where the client sent a lone
    surrogate (JSON can carry one, UTF-8 cannot)."""
    return rewrite_body(body, model, (), None, None) or body


def rewrite_body(body: bytes, model: str | None, strip, write: EngineField | None,
                 priority: int | None) -> bytes | None:
    """The body with another model (when given) and the engine's priority field: every field
    in `strip` removed, `write` set to `priority`; None when nothing changed."""
    data = json.loads(body)
    changed = engine_priority.rewrite(data, strip, write, priority)
    if model is not None:
        data["model"], changed = model, True
    return compact_json(data) if changed else None


class RouteStage:
    def __init__(self, scheduler: Scheduler | None = None, clock: Callable[[], float] = time.monotonic,
                 scrape_interval_s: float | None = 2.0, admission: Admission | None = None,
                 metrics: RouteMetrics | None = None):
        self.admission = admission
        self._metrics = metrics or PrometheusRouteMetrics()
        self.scheduler = scheduler or Scheduler(on_transition=self._on_transition)
        self.last_scores: dict[str, float] = {}
        SCHEDULERS.directors.add(self)
        self._clock = clock
        self._scraper = (Scraper(self.scheduler.on_upstream_load, scrape_interval_s)
                         if scrape_interval_s else None)
        self._gpus = GpuPoller(self.scheduler.on_gpu_load) if scrape_interval_s else None
        self._configs = PerSettings()
        self._first_byte = FirstByteWatch()
        self._streams_read = 0

    # --- decision -----------------------------------------------------------------------

    def decide_now(self, ctx: RequestContext, state: RouteState) -> Plan | None:
        """The plan when deciding needs no waiting (the route has no admission), else None and
        the server awaits `decide` in a task. Most requests are decided here, without one."""
        route = self._resolve(ctx)
        if not isinstance(route, RouteConfig):
            return route
        if self._admission_settings(ctx) is not None:
            return None
        return self._schedule(ctx, state, route)

    async def decide(self, ctx: RequestContext, state: RouteState) -> Plan:
        route = self._resolve(ctx)
        if not isinstance(route, RouteConfig):
            return route
        admission = self._admission_settings(ctx)
        if admission is None:
            return self._schedule(ctx, state, route)
        return await self._schedule_admitted(ctx, state, route, admission)

    def reads_response(self, ctx: RequestContext) -> bool:
        """Read this request's answer? Always where something needs it (admission's slots and
        token budgets, the debug header, a breaker not closed or a failure streak, a route that does not
        steer), else as the route's feedback sampler says. Asked at the request headers."""
        config = self._config(ctx)
        if not isinstance(config, RouteConfig) or config.debug_header or self._admission_settings(ctx) is not None:
            return True
        return not self.scheduler.breakers_settled(config.candidates) or config.feedback.read(self._clock())

    def _resolve(self, ctx: RequestContext) -> RouteConfig | Plan:
        """The route's config, or the (empty) Plan that keeps Envoy's default cluster."""
        route = self._config(ctx)
        if isinstance(route, RouteConfig):
            self._keep_polled(route)
        if isinstance(route, RouteSettingsError):
            ctx.outcome = Outcome.INVALID_ROUTE
            return Plan()
        if not isinstance(route, RouteConfig):
            ctx.outcome = Outcome.DEFAULT
            return Plan()
        return route

    def _config(self, ctx: RequestContext) -> RouteConfig | RouteSettingsError | None:
        """The config of a route that steers; its error when its settings are invalid; None for
        a route without candidates (or without settings)."""
        route = ctx.route
        if isinstance(route, RouteSettings):
            return self._configs.get(route, self._build_config, ctx.route_name) if route.candidates else None
        return route if isinstance(route, RouteSettingsError) else None

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
        self._judge_overdue(now)
        with tracing.span("sluice.schedule"):
            decision = self.scheduler.pick(candidates, now, config.policy)
        return decision, (("x-sluice-debug", decision.debug_header()),) if config.debug_header else ()

    def _schedule(self, ctx: RequestContext, state: RouteState, config: RouteConfig) -> Plan:
        now = self._clock()
        decision, debug = self._pick(config, config.candidates, now)
        if not decision.available:
            return self._unavailable(ctx, decision, debug)
        return self._routed(ctx, state, config, decision, now, debug)

    async def _schedule_admitted(self, ctx: RequestContext, state: RouteState, config: RouteConfig,
                                 admission: RouteAdmission) -> Plan:
        decision, debug = self._pick(config, config.unbounded_candidates, self._clock())
        if not decision.available:
            return self._unavailable(ctx, decision, debug)
        admitted = state.admission = AdmissionState()
        decision = await self._admit(ctx, admitted, config, decision, admission)
        if not isinstance(decision, Decision):
            return decision                      # a refusal (Plan with a reply)
        if not decision.available:               # degraded with no fallback to go to: a 503
            self.admission.refund(ctx, admitted)
            return self._unavailable(ctx, decision, debug)
        return self._routed(ctx, state, config, decision, self._clock(), debug)

    def _routed(self, ctx: RequestContext, state: RouteState, config: RouteConfig, decision: Decision,
                now: float, debug: tuple) -> Plan:
        """The request goes to decision.cluster now: signals, timeout, headers."""
        self.scheduler.on_send(decision, now)
        if ctx.response_read:          # only a read answer's first byte is seen
            self._first_byte.add(decision.cluster, state, now)
        state.sent_at, state.decision = now, decision
        ctx.why.picked, ctx.outcome, ctx.cluster = decision, Outcome.ROUTED, decision.cluster
        self._remember_scores(decision)
        timeout_ms, source = deadlines.upstream_timeout_ms(*self.scheduler.timeout(
            decision, estimate_tokens(ctx.chat.text), ctx.chat.max_tokens, ctx.chat.model, now, config.timeout),
            now, ctx.client_deadline)
        ctx.why.timeout = TimeoutWhy(timeout_ms, source)
        body = self._body(ctx, state, config, decision)
        response_headers = [(CLUSTER_HEADER, decision.cluster), *debug]
        if decision.degraded:
            self._metrics.degraded(ctx.route_name)
            response_headers.append(("x-sluice-degraded", "1"))
        request_headers = ((TIMEOUT_HEADER, str(timeout_ms)),)
        first_byte_ms = config.timeout.first_byte_ms
        if first_byte_ms and first_byte_ms < timeout_ms:   # Envoy ignores one past the whole timeout
            request_headers += ((FIRST_BYTE_TIMEOUT_HEADER, str(first_byte_ms)),)
        cluster = decision.cluster
        retry = self._retry_to(ctx, state, config, decision)
        if retry is not None:
            state.retry_cluster = retry.cluster
            cluster = retry_cluster_name(decision.cluster, retry.cluster)
            request_headers += RETRY_HEADERS
        response_body = None
        admitted = state.admission
        if admitted is not None and (admitted.token_estimate is not None or admitted.expected_tokens is not None):
            state.usage_meter = UsageMeter(ctx.chat.stream, ctx.chat.text)   # read the answer's real usage
            request_headers += (IDENTITY_ENCODING,)
            response_body = BodyMode.STREAMED if ctx.chat.stream else BodyMode.BUFFERED
        elif ctx.response_read and self._checks_end(ctx):
            response_body = BodyMode.STREAMED if ctx.chat.stream else BodyMode.BUFFERED
        return Plan(cluster=cluster, body=body, request_headers=request_headers,
                    response_headers=tuple(response_headers), response_body=response_body)

    def _retry_to(self, ctx: RequestContext, state: RouteState, config: RouteConfig, decision: Decision):
        """The candidate Envoy retries on, or None: the route does not ask; an admission slot
        holds the request to its cluster; no other healthy candidate takes the same body."""
        if not config.retry_other_cluster or state.permit is not None:
            return None
        chosen_field = config.engine_field(decision.cluster)

        def model(cluster_model: str | None) -> str | None:
            return cluster_model if config.rewrite_model and cluster_model else ctx.chat.model

        def same_body(spec) -> bool:
            return model(spec.model) == model(decision.model_rewrite) and config.engine_field(spec.cluster) == chosen_field
        return retry_candidate(decision, config.candidates, lambda spec: self.scheduler.breakers_closed((spec,)),
                               same_body)

    def _checks_end(self, ctx: RequestContext) -> bool:
        """Read this answer to its end, to see a reset mid-answer (processor: response_body_read)?
        A JSON answer costs one more message: always. A stream costs one per chunk: one in
        STREAM_END_CHECK_ONE_IN of the streams whose headers are read."""
        if not ctx.chat.stream:
            return True
        self._streams_read += 1
        return self._streams_read % STREAM_END_CHECK_ONE_IN == 0

    def _body(self, ctx: RequestContext, state: RouteState, config: RouteConfig, decision: Decision) -> bytes | None:
        """The body to send instead of the client's, or None: the model the chosen cluster
        serves, and the request's class in its engine's priority field (the client's own value
        in any candidate's field removed)."""
        model = decision.model_rewrite
        if not (config.rewrite_model and model and model != ctx.chat.model):
            model = None
        if model is None and not config.engine_fields:
            return None
        write = config.engine_field(decision.cluster)
        settings = self._admission_settings(ctx) if write is not None else None
        priority = None
        priority_class = None if state.admission is None else state.admission.priority_class
        if settings is not None and priority_class in settings.engine_ranks:
            ranks = settings.engine_ranks
            priority = write.value(ranks[priority_class], max(ranks.values()))
        return rewrite_body(ctx.body, model, (f for _, f in config.engine_fields), write, priority)

    def _unavailable(self, ctx: RequestContext, decision: Decision, debug: tuple) -> Plan:
        ctx.outcome = Outcome.REFUSED
        ctx.why.unavailable = decision
        self._metrics.unavailable(ctx.route_name)
        retry = str(max(1, math.ceil(decision.retry_after_s or 1)))
        return Plan(reply=error_reply(
            503, "no upstream cluster is available for this route; retry later",
            type_="server_error", code="upstream_unavailable", headers=(("retry-after", retry), *debug)))

    def _admission_settings(self, ctx: RequestContext) -> RouteAdmission | None:
        if self.admission is None or not isinstance(ctx.route, RouteSettings):
            return None
        return self.admission.settings(ctx.route, ctx.route_name)

    async def _admit(self, ctx: RequestContext, state: AdmissionState, config: RouteConfig, decision: Decision,
                     settings: RouteAdmission) -> Decision | Plan:
        """A slot on the scheduler's choice, else on the next best cluster of the same tier
        that has one; waits in the priority queue when all are at their limit."""
        ranked = sorted((c for c in decision.scores if c not in decision.dropped),
                        key=lambda c: (c != decision.cluster, -decision.scores[c].total))
        fallbacks = [c for c in config.candidates if c.role == "fallback"]
        healthy_fallback = decision.role != "fallback" and any(self.scheduler.breakers_closed([c]) for c in fallbacks)
        with tracing.span("sluice.queue"):
            try:
                result = await self.admission.admit(ctx, state, settings, ranked or [decision.cluster], healthy_fallback)
            except BaseException:
                self.scheduler.void_probe(decision)         # the client left the queue
                raise
        if not isinstance(result, Permit) or result.cluster != decision.cluster:
            self.scheduler.void_probe(decision)
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
            return self.scheduler.pick(fallbacks, self._clock(), config.policy)
        state.permit = result
        if result.cluster == decision.cluster:
            return decision
        spec = next(c for c in config.candidates if c.cluster == result.cluster)
        return dataclasses.replace(decision, cluster=result.cluster, model_rewrite=spec.model, probe=False)

    # --- feedback -----------------------------------------------------------------------

    def on_response_headers(self, ctx: RequestContext, state: RouteState) -> None:
        now = self._clock()
        ctx.response_headers_at = now
        if state.usage_meter is not None and is_encoded(ctx.response_headers):
            state.usage_meter = None         # compressed after all: the estimate stands
        if state.decision is not None:
            self._first_byte.remove(state.decision.cluster, state)
            if state.retry_cluster is not None and _attempts(ctx.response_headers) > 1:
                self._retried(ctx, state, now)
            else:
                self.scheduler.on_first_byte(state.decision, now - state.sent_at, now)
            if ctx.status is not None and ctx.status >= 500:
                # A failure known now. Judged at the stream's end, it could come after the
                # client, which has its answer by then, sent its next request: a loaded
                # sidecar let a cluster answering only 5xx keep one or two more in a row.
                self._complete(ctx, state, now)

    def _retried(self, ctx: RequestContext, state: RouteState, now: float) -> None:
        """Envoy's retry answered: the first attempt failed before its first byte on the chosen
        cluster (a failure now, unless already judged overdue), and the rest of the request is
        the other cluster's. Its time to first byte includes the failed attempt: not a sample."""
        first = state.decision
        self.scheduler.on_complete(first, now - state.sent_at, False, now, judged=state.first_byte_overdue)
        retry = dataclasses.replace(first, cluster=state.retry_cluster, probe=False)
        self.scheduler.on_send(retry, now)
        state.decision, state.retry_cluster = retry, None
        ctx.why.picked, ctx.cluster = retry, retry.cluster
        state.first_byte_overdue, state.retried = False, True

    def on_response_body(self, ctx: RequestContext, state: RouteState, chunk: bytes, end_of_stream: bool) -> None:
        """Reads the answer's usage for token limits (any answer: the cache's capture refuses many)."""
        meter = state.usage_meter
        if meter is None:
            return
        usage = meter.feed(chunk, end_of_stream)
        if usage is not None:
            ctx.usage = usage

    def on_finish(self, ctx: RequestContext, state: RouteState) -> None:
        decision = state.decision
        ttfb = _ttfb(ctx, state)
        if ctx.usage is None and state.usage_meter is not None:
            ctx.usage = state.usage_meter.cut_short()
        admitted = state.admission
        if admitted is not None:
            if self.admission is not None:
                self.admission.settle(ctx, admitted)
            if admitted.permit is not None:     # the slot goes back whatever happened
                ok = ctx.status is None or ctx.status < 500
                admitted.permit.release(ttfb if ctx.status is not None else None, ok)
        if decision is None or state.judged:
            return
        self._complete(ctx, state, self._clock())

    def _complete(self, ctx: RequestContext, state: RouteState, now: float) -> None:
        """The request's verdict for its cluster (signals, breaker), given once."""
        decision: Decision = state.decision
        state.judged = True
        ttfb = _ttfb(ctx, state)
        # A client that gave up on a hanging cluster ends its request here: judged first.
        self._judge_overdue(now)
        self._first_byte.remove(decision.cluster, state)
        if ctx.status is None and state.first_byte_overdue:
            # Judged a failure while it hung (the client gave up, or Envoy's answer went unread).
            self.scheduler.on_complete(decision, now - state.sent_at, False, now, judged=True)
        elif ctx.status is None:
            # The client left before any answer (or Envoy never got one): no verdict.
            self.scheduler.on_abandon(decision)
        else:
            # Streams only: a JSON answer's headers come once the whole answer exists, so the
            # time after them is transfer, not generation (40,000 tokens/s for 200 tokens in 5 ms).
            streamed = ctx.chat is not None and ctx.chat.stream
            completion = ctx.usage[1] if streamed and ctx.usage is not None and ctx.response_complete else None
            # A read answer that never reached its end was cut (a reset mid-answer).
            cut = ctx.response_body_read and not ctx.response_complete
            self.scheduler.on_complete(decision, now - state.sent_at, ctx.status < 500 and not cut, now,
                                       completion_tokens=completion, ttfb_s=ttfb, judged=state.first_byte_overdue)

    def _judge_overdue(self, now: float) -> None:
        """Requests still without their first byte well past their cluster's usual time count
        as failures now (overdue.py): a hanging cluster trips its breaker within seconds."""
        for state in self._first_byte.take_overdue(now, lambda cluster: self.scheduler.signals.ttfb_p95(cluster, now)):
            state.first_byte_overdue = True
            self.scheduler.on_overdue(state.decision, now)

    def _remember_scores(self, decision: Decision) -> None:
        """Scores for the scrape-time gauges (sidecar.observability.metrics.SchedulerCollector)."""
        for cluster, breakdown in decision.scores.items():
            self.last_scores[cluster] = breakdown.total

    def _on_transition(self, t: BreakerTransition) -> None:
        log.warning("circuit breaker of %s: %s -> %s (%s: %s)", t.cluster, t.previous.value,
                    t.state.value, t.trigger, t.detail)
        self._metrics.breaker_transition(t.cluster, t.state.value)
