"""Spans exported over OTLP/gRPC by a running sidecar to a collector (a fake one here).

Needs the OpenTelemetry SDK and OTLP exporter (not installed by default): skipped without them.
"""
import json
import time
import uuid
from concurrent import futures

import grpc
import pytest

from devtools.stack import free_port
from tests.support.e2e import post

pytest.importorskip("opentelemetry.sdk.trace")
pytest.importorskip("opentelemetry.exporter.otlp.proto.grpc.trace_exporter")
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2  # noqa: E402

EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


@pytest.fixture
def collector():
    """A gRPC server taking OTLP trace exports; yields (port, received spans)."""
    spans = []

    def export(request, context):
        for resource_spans in request.resource_spans:
            for scope_spans in resource_spans.scope_spans:
                spans.extend(scope_spans.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    handler = grpc.method_handlers_generic_handler("opentelemetry.proto.collector.trace.v1.TraceService", {
        "Export": grpc.unary_unary_rpc_method_handler(
            export, request_deserializer=trace_service_pb2.ExportTraceServiceRequest.FromString,
            response_serializer=trace_service_pb2.ExportTraceServiceResponse.SerializeToString)})
    server = grpc.server(futures.ThreadPoolExecutor(2), handlers=[handler])
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    yield port, spans
    server.stop(0)


def test_request_spans_reach_the_collector(make_stack, collector):
    port, spans = collector
    stack = make_stack(sidecar_env={"SLUICE_CACHE": "false", "SLUICE_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
                                    "OTEL_BSP_SCHEDULE_DELAY": "50"})
    trace_id = uuid.uuid4().hex
    body = json.dumps({"model": "demo-model", "messages": [{"role": "user", "content": "hi"}]}).encode()
    status, _, _ = post(stack, "/v1/chat/completions", body,
                        {"traceparent": f"00-{trace_id}-{uuid.uuid4().hex[:16]}-01"})
    assert status == 200
    deadline = time.monotonic() + 10
    while not any(s.name == "sluice.request" for s in spans) and time.monotonic() < deadline:
        time.sleep(0.05)
    mine = {s.name: s for s in spans if s.trace_id.hex() == trace_id}
    assert {"sluice.request", "sluice.parse", "sluice.decide"} <= set(mine)
    attributes = {a.key: a.value for a in mine["sluice.request"].attributes}
    assert attributes["sluice.route"].string_value == "chat"
    assert attributes["http.response.status_code"].int_value == 200
