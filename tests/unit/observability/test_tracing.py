"""W3C traceparent on the upstream request, and OpenTelemetry spans when they are on."""
import asyncio

import pytest

from sidecar.observability import tracing
from sidecar.request.context import RequestContext
from sidecar.extproc.events import ImmediateReply, Plan
from sidecar.pipeline import Pipeline
from sidecar.service.server import ExternalProcessor
from sidecar.observability.tracing import TraceParent, Tracing, new_traceparent, parse_traceparent
from tests.support.ext_proc_stream import CHAT_HEADERS, FakeRoute, chat_body, chat_messages, run_stream, upstream_headers

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
INCOMING = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


@pytest.mark.parametrize("value, parsed", [
    (INCOMING, TraceParent(TRACE_ID, "00f067aa0ba902b7", True)),
    (f"00-{TRACE_ID}-00f067aa0ba902b7-00", TraceParent(TRACE_ID, "00f067aa0ba902b7", False)),
    (f"01-{TRACE_ID}-00f067aa0ba902b7-03-future", TraceParent(TRACE_ID, "00f067aa0ba902b7", True)),
    (f" {INCOMING} ", TraceParent(TRACE_ID, "00f067aa0ba902b7", True)),
    (None, None), ("", None), ("garbage", None),
    (f"ff-{TRACE_ID}-00f067aa0ba902b7-01", None),              # forbidden version
    (f"00-{TRACE_ID}-00f067aa0ba902b7-01-extra", None),        # version 00 has exactly 4 fields
    (f"00-{'0' * 32}-00f067aa0ba902b7-01", None),              # all-zero trace id
    (f"00-{TRACE_ID}-{'0' * 16}-01", None),                    # all-zero parent id
    (f"00-{TRACE_ID.upper()}-00f067aa0ba902b7-01", None),      # upper-case hex
    (f"00-{TRACE_ID[:-1]}-00f067aa0ba902b7-01", None),         # short trace id
])
def test_parse_traceparent(value, parsed):
    assert parse_traceparent(value) == parsed


def test_new_traceparent_is_valid_and_round_trips():
    made = new_traceparent(True)
    assert parse_traceparent(made.header()) == made
    assert made.header().endswith("-01") and new_traceparent(False).header().endswith("-00")
    assert new_traceparent(True).trace_id != made.trace_id


def context(headers) -> RequestContext:
    return RequestContext(headers={**CHAT_HEADERS, **headers})


def test_incoming_traceparent_is_left_to_envoy():
    trace = Tracing().begin(context({"traceparent": INCOMING}))
    assert trace.trace_id == TRACE_ID and not trace.forward
    assert trace.plan(Plan(cluster="a")) == Plan(cluster="a")


@pytest.mark.parametrize("headers", [{}, {"traceparent": "00-broken"}])
def test_missing_or_invalid_traceparent_gets_a_new_one(headers):
    trace = Tracing(sample_ratio=1.0).begin(context(headers))
    plan = trace.plan(Plan(cluster="a", request_headers=(("x-envoy-upstream-rq-timeout-ms", "5000"),)))
    sent = dict(plan.request_headers)
    assert parse_traceparent(sent["traceparent"]) == trace.traceparent
    assert trace.traceparent.sampled and sent["x-envoy-upstream-rq-timeout-ms"] == "5000"


@pytest.mark.parametrize("draw, sampled", [(0.09, True), (0.1, False), (0.5, False)])
def test_new_traces_are_sampled_at_the_configured_ratio(draw, sampled):
    assert Tracing(sample_ratio=0.1, rng=lambda: draw).begin(context({})).traceparent.sampled is sampled


def test_answered_requests_send_nothing_upstream():
    plan = Plan(reply=ImmediateReply(503, b"{}"))
    assert Tracing().begin(context({})).plan(plan) is plan


def test_span_helper_is_a_no_op_without_a_traced_request():
    with tracing.span("embed", tier="semantic") as inside:
        assert inside is None


async def test_traceparent_reaches_the_upstream_request_headers():
    servicer = ExternalProcessor(Pipeline(FakeRoute()), tracing=Tracing())
    sent = upstream_headers(await run_stream(servicer, chat_messages(chat_body("hi"))))
    assert parse_traceparent(sent["traceparent"]) is not None
    kept = upstream_headers(await run_stream(servicer, chat_messages(
        chat_body("hi"), {**CHAT_HEADERS, "traceparent": INCOMING})))
    assert "traceparent" not in kept          # Envoy forwards the client's own, unchanged


# --- with OpenTelemetry (the `otel` extra) ---------------------------------------------------

@pytest.fixture
def spans():
    pytest.importorskip("opentelemetry.sdk.trace")
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ParentBased(TraceIdRatioBased(1.0)))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield Tracing(1.0, provider.get_tracer("test"), provider), exporter
    provider.shutdown()


async def test_request_span_with_parse_decide_and_stage_children(spans):
    traced, exporter = spans

    def embed():
        with tracing.span("sluice.embed", model="minilm"):
            pass

    servicer = ExternalProcessor(Pipeline(FakeRoute(during=embed)), tracing=traced)
    sent = upstream_headers(await run_stream(servicer, chat_messages(
        chat_body("hi"), {**CHAT_HEADERS, "traceparent": INCOMING})))
    await asyncio.sleep(0)
    by_name = {s.name: s for s in exporter.get_finished_spans()}
    assert set(by_name) == {"sluice.request", "sluice.parse", "sluice.decide", "sluice.embed"}
    request = by_name["sluice.request"]
    assert f"{request.context.trace_id:032x}" == TRACE_ID                  # the client's trace
    assert f"{request.parent.span_id:016x}" == "00f067aa0ba902b7"
    assert by_name["sluice.parse"].parent.span_id == request.context.span_id
    assert by_name["sluice.decide"].parent.span_id == request.context.span_id
    assert by_name["sluice.embed"].parent.span_id == by_name["sluice.decide"].context.span_id
    assert dict(request.attributes) == {
        "sluice.request_id": "req-1", "sluice.route": "default", "sluice.cluster": "upstream_a",
        "sluice.outcome": "routed", "http.response.status_code": 200,
        "gen_ai.request.model": "demo-model", "sluice.stream": False}
    # Upstream, the sidecar's request span is the parent.
    assert sent["traceparent"] == f"00-{TRACE_ID}-{request.context.span_id:016x}-01"


async def test_unsampled_parent_records_nothing_but_still_propagates(spans):
    traced, exporter = spans
    servicer = ExternalProcessor(Pipeline(FakeRoute()), tracing=traced)
    sent = upstream_headers(await run_stream(servicer, chat_messages(
        chat_body("hi"), {**CHAT_HEADERS, "traceparent": INCOMING[:-2] + "00"})))
    assert exporter.get_finished_spans() == ()
    assert parse_traceparent(sent["traceparent"]).trace_id == TRACE_ID
    assert not parse_traceparent(sent["traceparent"]).sampled


async def test_server_error_marks_the_span(spans):
    traced, exporter = spans
    servicer = ExternalProcessor(Pipeline(FakeRoute()), tracing=traced)
    await run_stream(servicer, chat_messages(chat_body("hi"), status=503))
    request = next(s for s in exporter.get_finished_spans() if s.name == "sluice.request")
    assert request.status.status_code.name == "ERROR"


def test_spans_are_off_without_an_endpoint_and_without_the_packages(monkeypatch, caplog):
    from sidecar.config import SidecarConfig

    assert not Tracing.from_config(SidecarConfig()).spans
    for name in ("opentelemetry.sdk.trace", "opentelemetry.exporter.otlp.proto.grpc.trace_exporter"):
        monkeypatch.setitem(__import__("sys").modules, name, None)     # as if not installed
    traced = Tracing.from_config(SidecarConfig(otlp_endpoint="http://127.0.0.1:4317"))
    assert not traced.spans and "not installed" in caplog.text
    assert traced.begin(context({})).traceparent is not None


def test_otlp_exporter_is_built_when_installed():
    pytest.importorskip("opentelemetry.exporter.otlp.proto.grpc.trace_exporter")
    from sidecar.config import SidecarConfig

    traced = Tracing.from_config(SidecarConfig(otlp_endpoint="http://127.0.0.1:9", trace_sample_ratio=1.0))
    try:
        assert traced.spans and traced.begin(context({})).recording
    finally:
        traced.close()


def test_adding_the_traceparent_keeps_every_other_field_of_the_plan():
    import dataclasses

    from sidecar.extproc.events import BodyMode, ImmediateReply
    plan = Plan(cluster="a", reply=ImmediateReply(200, b"{}"), body=b"x", request_headers=(("k", "v"),),
                response_headers=(("r", "1"),), response_body=BodyMode.STREAMED)
    assert len(dataclasses.fields(Plan)) == 6, "Plan.with_request_header lists the fields by position"
    assert plan.with_request_header("traceparent", "00-1") == dataclasses.replace(
        plan, request_headers=(("k", "v"), ("traceparent", "00-1")))


class WhyDirector(FakeRoute):
    """Decides as a cache miss routed to upstream_a, with its reasons recorded."""

    async def admitted(self, ctx):
        from sidecar.request.decision_record import CacheWhy, TimeoutWhy
        from sidecar.scheduling import Decision
        from sidecar.scheduling.scorers import ScoreBreakdown
        ctx.cache_status = "miss"
        ctx.why.cache = CacheWhy("below_threshold", 0.81)
        ctx.why.timeout = TimeoutWhy(30000, "seed")
        ctx.why.picked = Decision("upstream_a", role="primary", scores={"upstream_a": ScoreBreakdown(0.9)},
                                  dropped={"upstream_b": "breaker open"})
        await super().admitted(ctx)


async def test_request_span_carries_the_decision_record(spans):
    traced, exporter = spans
    servicer = ExternalProcessor(Pipeline(WhyDirector()), tracing=traced)
    await run_stream(servicer, chat_messages(chat_body("a private prompt"), {**CHAT_HEADERS, "traceparent": INCOMING}))
    await asyncio.sleep(0)
    [request] = [s for s in exporter.get_finished_spans() if s.name == "sluice.request"]
    attributes = dict(request.attributes)
    assert attributes["sluice.cache.verdict"] == "miss" and attributes["sluice.cache.reason"] == "below_threshold"
    assert attributes["sluice.cache.similarity"] == 0.81
    assert tuple(attributes["sluice.candidates.scored"]) == ("upstream_a",)
    assert tuple(attributes["sluice.candidates.score"]) == (0.9,)
    assert tuple(attributes["sluice.candidates.dropped"]) == ("upstream_b",)
    assert tuple(attributes["sluice.candidates.dropped_by"]) == ("breaker open",)
    assert attributes["sluice.timeout.ms"] == 30000 and attributes["sluice.timeout.from"] == "seed"
    assert "private" not in repr(attributes)
