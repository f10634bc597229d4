"""The only module that touches Envoy's ext_proc protobuf messages.

decode(): ProcessingRequest -> event; encode(): reply -> ProcessingResponse.
"""
from __future__ import annotations

import functools

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from sidecar.extproc.events import (BodyMode, Continue, Event, ImmediateReply, ModeOverride, Phase, Reply,
                            RequestBody, RequestHeaders, ResponseBody, ResponseHeaders)
from sidecar.route_settings import settings_from_attribute

EXT_PROC_FILTER = "envoy.filters.http.ext_proc"
ROUTE_METADATA_ATTRIBUTE = "xds.route_metadata"
ROUTE_NAME_ATTRIBUTE = "xds.route_name"
METADATA_NAMESPACE = "sluice"
SIDECAR_REPLY_KEY = "sidecar_reply"

# BUFFERED asks for BUFFERED_PARTIAL: the whole body in one message when it fits Envoy's
# buffer, its first part otherwise (the rest flows on). A plain BUFFERED response past the
# limit stalls upstream reads until the route's timeout: a 504 for a long logprobs answer.
_BODY_MODES = {BodyMode.NONE: mode_pb2.ProcessingMode.NONE,
               BodyMode.BUFFERED: mode_pb2.ProcessingMode.BUFFERED_PARTIAL,
               BodyMode.STREAMED: mode_pb2.ProcessingMode.STREAMED}


def _headers(header_map) -> dict[str, str]:
    headers: dict[str, str] = {}
    for header in header_map.headers:
        # Envoy 1.40 fills raw_value; header values are bytes and need not be UTF-8. Bytes that
        # are not become \xNN escapes, not U+FFFD: two credentials that differ only in such
        # bytes stay two tenants. (A credential spelling "\xff" in ASCII meets the byte 0xFF,
        # which only someone who knows the other credential could use.)
        value = header.raw_value.decode("utf-8", "backslashreplace") if header.raw_value else header.value
        key = header.key.lower()
        headers[key] = f"{headers[key]},{value}" if key in headers else value
    return headers


def _route(request: pb.ProcessingRequest):
    """(route settings or error or None, Envoy route name) from the request attributes."""
    attributes = request.attributes.get(EXT_PROC_FILTER)
    if attributes is None:
        return None, ""
    fields = attributes.fields
    name = fields[ROUTE_NAME_ATTRIBUTE].string_value if ROUTE_NAME_ATTRIBUTE in fields else ""
    if ROUTE_METADATA_ATTRIBUTE not in fields:
        return None, name
    return settings_from_attribute(fields[ROUTE_METADATA_ATTRIBUTE].string_value), name


def decode(request: pb.ProcessingRequest) -> Event | None:
    """The event in `request`, or None for a kind Sluice never asks for (trailers)."""
    kind = request.WhichOneof("request")
    if kind == "request_headers":
        m = request.request_headers
        route, route_name = _route(request)
        return RequestHeaders(_headers(m.headers), m.end_of_stream, route=route, route_name=route_name)
    if kind == "request_body":
        return RequestBody(request.request_body.body, request.request_body.end_of_stream)
    if kind == "response_headers":
        m = request.response_headers
        return ResponseHeaders(_headers(m.headers), m.end_of_stream)
    if kind == "response_body":
        return ResponseBody(request.response_body.body, request.response_body.end_of_stream)
    return None


def _header_options(pairs) -> list[base_pb2.HeaderValueOption]:
    return [base_pb2.HeaderValueOption(
                header=base_pb2.HeaderValue(key=k, raw_value=v.encode()),
                append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)
            for k, v in pairs]


# Envoy replaces its whole processing mode with an override, so every override starts from the
# mode envoy/envoy.yaml.tmpl configures and changes only the fields the reply names.
CONFIGURED_MODE = mode_pb2.ProcessingMode(
    request_header_mode=mode_pb2.ProcessingMode.SEND,
    request_body_mode=mode_pb2.ProcessingMode.BUFFERED,
    response_header_mode=mode_pb2.ProcessingMode.SEND,
    response_body_mode=mode_pb2.ProcessingMode.NONE,
    request_trailer_mode=mode_pb2.ProcessingMode.SKIP,
    response_trailer_mode=mode_pb2.ProcessingMode.SKIP)


@functools.lru_cache(maxsize=None)     # few overrides exist; callers copy, never change it
def _mode(override: ModeOverride) -> mode_pb2.ProcessingMode:
    mode = mode_pb2.ProcessingMode()
    mode.CopyFrom(CONFIGURED_MODE)
    if override.request_body is not None:
        mode.request_body_mode = _BODY_MODES[override.request_body]
    if override.response_headers is not None:
        mode.response_header_mode = (mode_pb2.ProcessingMode.SEND if override.response_headers
                                     else mode_pb2.ProcessingMode.SKIP)
    if override.response_body is not None:
        mode.response_body_mode = _BODY_MODES[override.response_body]
    return mode


def _common(reply: Continue) -> pb.CommonResponse:
    common = pb.CommonResponse(clear_route_cache=reply.clear_route_cache)
    if reply.set_headers or reply.remove_headers:
        common.header_mutation.set_headers.extend(_header_options(reply.set_headers))
        common.header_mutation.remove_headers.extend(reply.remove_headers)
    if reply.body is not None:
        common.body_mutation.body = reply.body
        # A replaced body needs a matching length, else Envoy or the upstream fails the request.
        common.header_mutation.set_headers.extend(
            _header_options((("content-length", str(len(reply.body))),)))
    return common


def extend_message_timeout(seconds: float) -> pb.ProcessingResponse:
    """Asks Envoy to wait longer for the answer to the current message (max_message_timeout caps it)."""
    response = pb.ProcessingResponse()
    response.override_message_timeout.FromNanoseconds(int(seconds * 1e9))
    return response


def _metadata(items: tuple) -> struct_pb2.Struct:
    """Dynamic metadata in the "sluice" namespace (built anew: callers copy it into a reply)."""
    metadata = struct_pb2.Struct()
    metadata.update({METADATA_NAMESPACE: dict(items)})
    return metadata


# Marks an answer as the sidecar's: Envoy's local-reply mappers (envoy.yaml.tmpl) rewrite
# Envoy's own 429s into OpenAI's shape and must leave the sidecar's (already so) alone.
_SIDECAR_REPLY_METADATA = _metadata(((SIDECAR_REPLY_KEY, True),))
# Replies whose metadata takes few values (the cluster, the cache status) reuse one Struct.
_shared_metadata = functools.lru_cache(maxsize=256)(_metadata)


def encode(reply: Reply) -> pb.ProcessingResponse:
    if isinstance(reply, ImmediateReply):
        response = pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=reply.status),
            headers=pb.HeaderMutation(set_headers=_header_options(reply.headers)),
            body=reply.body))
        response.dynamic_metadata.CopyFrom(_SIDECAR_REPLY_METADATA)
        return response
    if not (reply.set_headers or reply.remove_headers or reply.dynamic_metadata) and reply.body is None:
        return _plain(reply.phase, reply.mode, reply.clear_route_cache)
    return _encode_continue(reply)


@functools.lru_cache(maxsize=None)     # phases x the few overrides; gRPC only reads the message
def _plain(phase: Phase, mode: ModeOverride | None, clear_route_cache: bool) -> pb.ProcessingResponse:
    """A reply that changes nothing but, at most, the mode and the route: the same every time."""
    return _encode_continue(Continue(phase, mode=mode, clear_route_cache=clear_route_cache))


def _encode_continue(reply: Continue) -> pb.ProcessingResponse:
    response = pb.ProcessingResponse()
    if reply.phase is Phase.REQUEST_HEADERS:
        response.request_headers.response.CopyFrom(_common(reply))
    elif reply.phase is Phase.REQUEST_BODY:
        response.request_body.response.CopyFrom(_common(reply))
    elif reply.phase is Phase.RESPONSE_HEADERS:
        response.response_headers.response.CopyFrom(_common(reply))
    else:
        response.response_body.response.CopyFrom(_common(reply))
    if reply.mode is not None:
        response.mode_override.CopyFrom(_mode(reply.mode))
    if reply.dynamic_metadata:
        # Envoy accepts it for namespaces in metadata_options.receiving_namespaces (the template
        # lists "sluice"); access logs and rate-limit filters read it from there. Token counts
        # vary too much to share a Struct; the response headers' values do not.
        if all(isinstance(value, str) for _, value in reply.dynamic_metadata):
            response.dynamic_metadata.CopyFrom(_shared_metadata(reply.dynamic_metadata))
        else:
            response.dynamic_metadata.update({METADATA_NAMESPACE: dict(reply.dynamic_metadata)})
    return response
