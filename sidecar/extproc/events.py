"""What the processor consumes (events) and produces (replies): plain data, no protobuf.

The codec (sidecar/extproc/codec.py) is the only place that maps these to and from Envoy's
ProcessingRequest / ProcessingResponse.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Mapping

from sidecar.route_settings import RouteSettings, RouteSettingsError


class Phase(enum.Enum):
    REQUEST_HEADERS = "request_headers"
    REQUEST_BODY = "request_body"
    RESPONSE_HEADERS = "response_headers"
    RESPONSE_BODY = "response_body"


# --- events -------------------------------------------------------------------------------

@dataclass(frozen=True)
class RequestHeaders:
    headers: Mapping[str, str]          # lower-case names; repeated headers joined with ","
    end_of_stream: bool
    route: RouteSettings | RouteSettingsError | None = None  # the matched route's settings
    route_name: str = ""  # Envoy's name of the matched route


@dataclass(frozen=True)
class RequestBody:
    body: bytes
    end_of_stream: bool


@dataclass(frozen=True)
class ResponseHeaders:
    headers: Mapping[str, str]
    end_of_stream: bool


@dataclass(frozen=True)
class ResponseBody:
    body: bytes
    end_of_stream: bool


Event = RequestHeaders | RequestBody | ResponseHeaders | ResponseBody


# --- replies ------------------------------------------------------------------------------

class BodyMode(enum.Enum):
    NONE = "none"
    BUFFERED = "buffered"
    STREAMED = "streamed"


@dataclass(frozen=True)
class ModeOverride:
    """Per-request change of what Envoy sends next (needs allow_mode_override in Envoy)."""
    request_body: BodyMode | None = None
    response_headers: bool | None = None   # False: do not send response headers
    response_body: BodyMode | None = None


@dataclass(frozen=True)
class Continue:
    """Let the request or response go on, with optional header and body changes."""
    phase: Phase
    set_headers: tuple[tuple[str, str], ...] = ()
    remove_headers: tuple[str, ...] = ()
    clear_route_cache: bool = False
    body: bytes | None = None           # replaces the buffered body when not None
    mode: ModeOverride | None = None
    dynamic_metadata: tuple[tuple[str, float | str], ...] = ()   # Envoy dynamic metadata, namespace "sluice"


@dataclass(frozen=True)
class ImmediateReply:
    """Answer the client now; the request never reaches an upstream."""
    status: int
    body: bytes
    headers: tuple[tuple[str, str], ...] = field(default=(("content-type", "application/json"),))


Reply = Continue | ImmediateReply


@dataclass(frozen=True)
class Plan:
    """What the pipeline decided for a chat request."""
    cluster: str | None = None                    # steer here; None keeps the route's default
    reply: ImmediateReply | None = None           # answer now instead of going upstream
    body: bytes | None = None                     # rewritten request body (e.g. model changed)
    request_headers: tuple[tuple[str, str], ...] = ()   # for Envoy and the upstream
    # Added to the client's response: by the sidecar when it reads the response headers, else
    # by Envoy from dynamic metadata, which envoy.yaml.tmpl maps for x-sluice-cluster,
    # x-sluice-degraded and x-sluice-cache only (the stages read the answer for any other).
    response_headers: tuple[tuple[str, str], ...] = ()
    response_body: BodyMode | None = None         # ask Envoy for the response body (capture)

    def with_request_header(self, name: str, value: str) -> "Plan":
        # Positional, not dataclasses.replace: this runs on every request.
        return Plan(self.cluster, self.reply, self.body, self.request_headers + ((name, value),),
                    self.response_headers, self.response_body)


@dataclass(frozen=True)
class Decide:
    """Outside work the processor asks for: the pipeline must produce a Plan (see server)."""
    context: object   # sidecar.request.context.RequestContext


@dataclass(frozen=True)
class SkipResponse:
    """The pipeline needs none of this request's answer: Envoy is asked for no response headers
    (the plan's then travel as dynamic metadata)."""


class ProtocolError(Exception):
    """An event arrived that the processor's state does not allow (Envoy misconfigured or a bug)."""
