"""The route stage: route and timeout, after the schedule and admission stages; then the
feedback of what happened.

The last stage of the pipeline (sidecar/pipeline/exchange.py). Per request: the cluster the
earlier stages chose goes in the cluster header, with a per-request upstream timeout, the
model a fallback serves, an engine's priority field, and Envoy's retry on the runner-up where
the route asks. Response headers give time to first byte and success, the end of the stream
total latency; they drive the signals and the circuit breakers. A busy route reads a sample of
the answers (reads_response, sidecar/scheduling/sampling.py).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import dataclass
from typing import Callable

from sidecar import deadlines, engine_priority
from sidecar.observability.metrics import SCHEDULERS
from sidecar.admission import Permit
from sidecar.pipeline.admission_stage import Admission, AdmissionStage, AdmissionState, RouteAdmission
from sidecar.cache.answer import compact_json
from sidecar.cache.capture import IDENTITY_ENCODING, is_encoded
from sidecar.request.context import Outcome, RequestContext
from sidecar.engine_priority import EngineField
from sidecar.request.decision_record import TimeoutWhy
from sidecar.extproc.events import BodyMode, Plan
from sidecar.pipeline.metrics import PrometheusRouteMetrics, RouteMetrics
from sidecar.pipeline.schedule_stage import Scheduled, ScheduleStage
from sidecar.pipeline.usage import UsageMeter
from sidecar.extproc.processor import CLUSTER_HEADER
from sidecar.pipeline.route_config import RouteConfig
from sidecar.scheduling import BreakerTransition, Decision, Scheduler
from sidecar.scheduling.overdue import FirstByteWatch
from sidecar.scheduling.retry import retry_candidate, retry_cluster_name
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
    """The pipeline's stages after the cache: schedule (sidecar/pipeline/schedule_stage.py), admit
    (admission_stage.py, on routes with admission) and route; then the feedback of what happened.
    Built here because they share the scheduler; the exchange runs them in order."""

    def __init__(self, scheduler: Scheduler | None = None, clock: Callable[[], float] = time.monotonic,
                 scrape_interval_s: float | None = 2.0, admission: Admission | None = None,
                 metrics: RouteMetrics | None = None):
        self._metrics = metrics or PrometheusRouteMetrics()
        self.scheduler = scheduler or Scheduler(on_transition=self._on_transition)
        self.last_scores: dict[str, float] = {}
        SCHEDULERS.directors.add(self)
        self._clock = clock
        self._first_byte = FirstByteWatch()
        self.schedule = ScheduleStage(self.scheduler, clock, scrape_interval_s, self._first_byte, self._metrics)
        self.admit: AdmissionStage | None = None
        self.admission = admission
        self._streams_read = 0

    @property
    def admission(self) -> Admission | None:
        return None if self.admit is None else self.admit.admission

    @admission.setter
    def admission(self, admission: Admission | None) -> None:
        """Set once the gate exists (it reads the scheduler's signals: sidecar/service/app.py)."""
        self.admit = None if admission is None else AdmissionStage(admission, self.schedule, self._metrics)

    def reads_response(self, ctx: RequestContext) -> bool:
        """Read this request's answer? Always where something needs it (admission's slots and
        token budgets, the debug header, a breaker not closed or a failure streak, a route that does not
        steer), else as the route's feedback sampler says. Asked at the request headers."""
        config = self.schedule.config(ctx)
        if not isinstance(config, RouteConfig) or config.debug_header or self._admission_settings(ctx) is not None:
            return True
        return not self.scheduler.breakers_settled(config.candidates) or config.feedback.read(self._clock())

    # --- route and timeout ----------------------------------------------------------------

    def route(self, ctx: RequestContext, state: RouteState, scheduled: Scheduled) -> Plan:
        """The request goes to the scheduled cluster now: signals, timeout, headers, body."""
        config, decision, now, debug = scheduled.config, scheduled.decision, scheduled.at, scheduled.debug
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

    def _admission_settings(self, ctx: RequestContext) -> RouteAdmission | None:
        return None if self.admit is None else self.admit.settings(ctx)

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
        self.schedule.judge_overdue(now)
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

    def _remember_scores(self, decision: Decision) -> None:
        """Scores for the scrape-time gauges (sidecar.observability.metrics.SchedulerCollector)."""
        for cluster, breakdown in decision.scores.items():
            self.last_scores[cluster] = breakdown.total

    def _on_transition(self, t: BreakerTransition) -> None:
        log.warning("circuit breaker of %s: %s -> %s (%s: %s)", t.cluster, t.previous.value,
                    t.state.value, t.trigger, t.detail)
        self._metrics.breaker_transition(t.cluster, t.state.value)
