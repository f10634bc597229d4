from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from sidecar.extproc import codec
from sidecar.extproc.events import (BodyMode, Continue, ImmediateReply, ModeOverride, Phase, RequestBody,
                            RequestHeaders)
from tests.unit.pipeline.test_route_settings import envoy_attribute


def test_decodes_headers_with_raw_values_and_route_settings():
    request = pb.ProcessingRequest(request_headers=pb.HttpHeaders(
        headers=base_pb2.HeaderMap(headers=[
            base_pb2.HeaderValue(key=":path", raw_value=b"/v1/chat/completions"),
            base_pb2.HeaderValue(key="X-Multi", raw_value=b"1"),
            base_pb2.HeaderValue(key="x-multi", raw_value=b"2"),
            base_pb2.HeaderValue(key="x-bad", raw_value=b"\xff"),
            base_pb2.HeaderValue(key="authorization", raw_value=b"Bearer sk-\xe9\xe8\xc3\xa9")]),
        end_of_stream=False))
    request.attributes["envoy.filters.http.ext_proc"].fields["xds.route_metadata"].string_value = \
        envoy_attribute({"name": "r", "candidates": [{"cluster": "a"}]})
    event = codec.decode(request)
    assert isinstance(event, RequestHeaders) and not event.end_of_stream
    assert event.headers == {":path": "/v1/chat/completions", "x-multi": "1,2", "x-bad": "\\xff",
                             "authorization": "Bearer sk-\\xe9\\xe8\u00e9"}   # invalid bytes stay distinct
    assert event.route.name == "r"


def test_decodes_body_and_ignores_trailers():
    assert codec.decode(pb.ProcessingRequest(request_body=pb.HttpBody(body=b"{}", end_of_stream=True))) \
        == RequestBody(b"{}", True)
    assert codec.decode(pb.ProcessingRequest(request_trailers=pb.HttpTrailers())) is None


def test_encodes_body_replacement_with_content_length():
    response = codec.encode(Continue(Phase.REQUEST_BODY, body=b"12345"))
    common = response.request_body.response
    assert common.body_mutation.body == b"12345"
    assert [(h.header.key, h.header.raw_value) for h in common.header_mutation.set_headers] == [
        ("content-length", b"5")]


def test_mode_override_starts_from_configured_mode():
    response = codec.encode(Continue(Phase.REQUEST_HEADERS, mode=ModeOverride(
        request_body=BodyMode.NONE, response_headers=False)))
    mode = response.mode_override
    assert mode.request_body_mode == mode_pb2.ProcessingMode.NONE
    assert mode.response_header_mode == mode_pb2.ProcessingMode.SKIP
    assert mode.request_header_mode == mode_pb2.ProcessingMode.SEND


def test_encodes_immediate_reply():
    response = codec.encode(ImmediateReply(400, b'{"error": {}}'))
    assert response.immediate_response.status.code == 400
    assert response.immediate_response.body == b'{"error": {}}'
