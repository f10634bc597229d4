"""W3C trace context for the upstream request, and OpenTelemetry spans when OTLP export is on.

Every chat request the sidecar sends upstream carries a `traceparent`:
- a valid incoming one is kept: Envoy forwards it untouched (with spans on, the sidecar's request
  span becomes the parent: same trace id, the sidecar's span id);
- a missing or invalid one is replaced by a new trace (random ids; sampled flag set for
  `trace_sample_ratio` of them), so the upstream's and the sidecar's logs share a trace id.

Spans (`sluice.request` with `sluice.parse` and `sluice.decide` under it) exist only when
SLUICE_OTLP_ENDPOINT is set and the OpenTelemetry SDK and OTLP exporter are installed (the
`otel` extra); they are imported here lazily, so with tracing off nothing of them is loaded.
Stages of the pipeline add their own with `with tracing.span("embed"): ...`, a no-op unless
the current request is traced.
"""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import os
import random
import re
import time
from dataclasses import dataclass

from sidecar.request.context import RequestContext
from sidecar.request.decision_record import record, span_attributes
from sidecar.extproc.events import Plan

log = logging.getLogger("sluice.tracing")
TRACEPARENT = "traceparent"
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")
_NOOP = contextlib.nullcontext()
_current: contextvars.ContextVar["RequestTrace | None"] = contextvars.ContextVar("sluice_trace", default=None)


@dataclass(frozen=True)
class TraceParent:
    trace_id: str   # 32 lower-case hex digits
    span_id: str    # 16 lower-case hex digits: the parent of the next hop
    sampled: bool

    def header(self) -> str:
        return f"00-{self.trace_id}-{self.span_id}-{'01' if self.sampled else '00'}"


def parse_traceparent(value: str | None) -> TraceParent | None:
    """The header's trace context, or None when it is absent or invalid (W3C Trace Context:
    version ff, all-zero ids, upper-case hex, or a version-00 header with extra fields)."""
    if not value:
        return None
    match = _TRACEPARENT.fullmatch(value.strip())
    if match is None:
        return None
    version, trace_id, span_id, flags, extra = match.groups()
    if version == "ff" or (version == "00" and extra) or trace_id == "0" * 32 or span_id == "0" * 16:
        return None
    return TraceParent(trace_id, span_id, bool(int(flags, 16) & 1))


def new_traceparent(sampled: bool, randbytes=os.urandom) -> TraceParent:
    ids = randbytes(24).hex()
    return TraceParent(ids[:32], ids[32:], sampled)


def span(name: str, **attributes):
    """A child span of the current request's, for a stage of the pipeline (cache, embed,
    queue, schedule); a no-op context manager unless the request is traced."""
    trace = _current.get()
    return _NOOP if trace is None else trace.child(name, attributes)


class RequestTrace:
    """One request's trace context: what goes upstream, and its span when spans are on."""

    def __init__(self, traceparent: TraceParent, forward: bool, request_span=None, tracer=None) -> None:
        self.traceparent = traceparent
        self.forward = forward       # False: the client's own traceparent goes upstream as it is
        self._span = request_span
        self._tracer = tracer

    @property
    def trace_id(self) -> str:
        return self.traceparent.trace_id

    @property
    def recording(self) -> bool:
        return self._span is not None and self._span.is_recording()

    def plan(self, plan: Plan) -> Plan:
        """The plan with the traceparent among the upstream request's headers."""
        if not self.forward or plan.reply is not None or any(k == TRACEPARENT for k, _ in plan.request_headers):
            return plan
        return plan.with_request_header(TRACEPARENT, self.traceparent.header())

    def start(self, decide) -> asyncio.Future:
        """The pipeline's work (a coroutine) as a task; when traced, under a `sluice.decide`
        span that tracing.span() calls inside it attach to."""
        if not self.recording:
            return asyncio.ensure_future(decide)
        from opentelemetry import trace as otel

        decide_span = self._tracer.start_span("sluice.decide", context=otel.set_span_in_context(self._span))
        context = contextvars.copy_context()
        context.run(_enter, self, otel.set_span_in_context(decide_span))
        task = asyncio.get_running_loop().create_task(decide, context=context)
        task.add_done_callback(lambda _: decide_span.end())
        return task

    def child(self, name: str, attributes: dict):
        return self._tracer.start_as_current_span(name, attributes=attributes or None)

    def finish(self, ctx: RequestContext) -> None:
        """Ends the request span with the decision's attributes (never the prompt)."""
        if self._span is None:
            return
        if self._span.is_recording():
            self._span.set_attributes(decision_attributes(ctx))
            if ctx.status is not None and ctx.status >= 500:
                from opentelemetry.trace import Status, StatusCode
                self._span.set_status(Status(StatusCode.ERROR, f"HTTP {ctx.status}"))
        self._span.end()


def _enter(trace: RequestTrace, otel_context) -> None:
    from opentelemetry import context

    _current.set(trace)
    context.attach(otel_context)


def trace_id_of(headers) -> str | None:
    """The trace id of a request's own traceparent, if valid."""
    incoming = parse_traceparent(headers.get(TRACEPARENT))
    return incoming.trace_id if incoming is not None else None


def decision_attributes(ctx: RequestContext) -> dict:
    attributes = {"sluice.request_id": ctx.request_id, "sluice.route": ctx.route_name}
    optional = {
        "sluice.cluster": ctx.cluster,
        "sluice.outcome": ctx.outcome.value if ctx.outcome is not None else None,
        "sluice.cache": ctx.cache_status,
        "http.response.status_code": ctx.status,
        "gen_ai.request.model": ctx.logged_model,
        "sluice.stream": ctx.chat.stream if ctx.chat is not None else None,
    }
    decision = ctx.why.picked
    if decision is not None:
        optional.update({"sluice.degraded": getattr(decision, "degraded", None),
                         "sluice.probe": getattr(decision, "probe", None),
                         "sluice.role": getattr(decision, "role", None)})
    attributes.update((k, v) for k, v in optional.items() if v is not None)
    # The decision record (sidecar/request/decision_record.py), as in the request log line.
    attributes.update(span_attributes(record(ctx)))
    return attributes


class Tracing:
    """Process-wide: how new traces are sampled, and the OpenTelemetry tracer when spans are on."""

    def __init__(self, sample_ratio: float = 0.1, tracer=None, provider=None,
                 rng=random.random, randbytes=random.randbytes) -> None:
        self.sample_ratio = sample_ratio
        self._tracer = tracer
        self._provider = provider
        self._rng = rng
        self._randbytes = randbytes

    @classmethod
    def from_config(cls, config) -> "Tracing":
        provider = otlp_provider(config.otlp_endpoint, config.trace_sample_ratio) if config.otlp_endpoint else None
        tracer = provider.get_tracer("sluice") if provider is not None else None
        return cls(config.trace_sample_ratio, tracer, provider)

    @property
    def spans(self) -> bool:
        return self._tracer is not None

    def begin(self, ctx: RequestContext, parse_s: float = 0.0) -> RequestTrace:
        """The trace of a parsed chat request; `parse_s`: how long parsing took (just now)."""
        incoming = parse_traceparent(ctx.headers.get(TRACEPARENT))
        if self._tracer is None:
            if incoming is not None:
                return RequestTrace(incoming, forward=False)
            return RequestTrace(new_traceparent(self._rng() < self.sample_ratio, self._randbytes), forward=True)
        return self._begin_span(ctx, incoming is not None, parse_s)

    def _begin_span(self, ctx: RequestContext, has_parent: bool, parse_s: float) -> RequestTrace:
        from opentelemetry import trace as otel
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        parent = TraceContextTextMapPropagator().extract(ctx.headers) if has_parent else None
        now_ns = time.time_ns()
        started_ns = now_ns - int((time.monotonic() - ctx.started) * 1e9)
        request_span = self._tracer.start_span(
            "sluice.request", context=parent, kind=otel.SpanKind.SERVER, start_time=started_ns,
            attributes={"sluice.request_id": ctx.request_id, "sluice.route": ctx.route_name})
        if request_span.is_recording() and parse_s > 0:
            self._tracer.start_span("sluice.parse", context=otel.set_span_in_context(request_span),
                                    start_time=now_ns - int(parse_s * 1e9)).end(end_time=now_ns)
        sc = request_span.get_span_context()
        traceparent = TraceParent(f"{sc.trace_id:032x}", f"{sc.span_id:016x}", sc.trace_flags.sampled)
        return RequestTrace(traceparent, forward=True, request_span=request_span, tracer=self._tracer)

    def close(self) -> None:
        """Flushes spans not yet exported (at shutdown)."""
        if self._provider is not None:
            self._provider.shutdown()


def otlp_provider(endpoint: str, sample_ratio: float):
    """A TracerProvider exporting over OTLP/gRPC, or None when OpenTelemetry is not installed."""
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
    except ImportError as exc:
        log.warning("SLUICE_OTLP_ENDPOINT is set but OpenTelemetry is not installed (pip install "
                    "opentelemetry-sdk opentelemetry-exporter-otlp-proto-grpc): no spans, traceparent only (%s)", exc)
        return None
    provider = TracerProvider(resource=Resource.create({"service.name": "sluice"}),
                              sampler=ParentBased(TraceIdRatioBased(sample_ratio)))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    log.info("OpenTelemetry spans exported to %s (new traces sampled at %.3g)", endpoint, sample_ratio)
    return provider
