"""Sans-IO processor for one request: Envoy's ext_proc events in, replies out.

No gRPC or asyncio here (see ../shared/STYLE.md, h11): the server feeds events decoded by the
codec and sends back the replies. Legal moves live in one table, TRANSITIONS; any other event
raises ProtocolError.
"""
from __future__ import annotations

import enum
import random
from dataclasses import dataclass
from typing import Callable

from sidecar.chat import BadRequest, ChatRequest, parse_chat_request
from sidecar.events import (BodyMode, Continue, Event, ImmediateReply, ModeOverride, Phase,
                            ProtocolError, Reply, RequestBody, RequestHeaders, ResponseBody,
                            ResponseHeaders)
from sidecar.openai_errors import error_reply
from sidecar.picking import pick_by_weight
from sidecar.route_settings import RouteSettings, RouteSettingsError

CLUSTER_HEADER = "x-sluice-cluster"
_SHARED_RNG = random.Random()   # seeding a Random per request costs ~10 µs
CHAT_PATH_SUFFIX = "/chat/completions"


class State(enum.Enum):
    START = "start"
    AWAIT_REQUEST_BODY = "await_request_body"
    AWAIT_RESPONSE_HEADERS = "await_response_headers"
    AWAIT_RESPONSE_BODY = "await_response_body"
    PASSTHROUGH = "passthrough"   # not ours: continue whatever Envoy still sends
    DONE = "done"


class Outcome(enum.Enum):
    ROUTED = "routed"                  # the sidecar chose the cluster
    DEFAULT = "default"                # no steering configured: the route's default cluster
    INVALID_ROUTE = "invalid_route"    # bad route settings: the route's default cluster
    PASSTHROUGH = "passthrough"        # not a chat completion: untouched
    BAD_REQUEST = "bad_request"        # answered 400 by the sidecar


# (state, event type) -> handler name. Everything else is a protocol error.
TRANSITIONS: dict[tuple[State, type], str] = {
    (State.START, RequestHeaders): "_on_request_headers",
    (State.AWAIT_REQUEST_BODY, RequestBody): "_on_request_body",
    (State.AWAIT_RESPONSE_HEADERS, ResponseHeaders): "_on_response_headers",
    (State.AWAIT_RESPONSE_BODY, ResponseBody): "_on_response_body",
    **{(State.PASSTHROUGH, kind): "_on_passthrough"
       for kind in (RequestBody, ResponseHeaders, ResponseBody)},
}


@dataclass
class RequestRecord:
    """What happened to the request, for metrics and the request log."""
    route: str = "default"
    outcome: Outcome | None = None
    cluster: str | None = None
    status: int | None = None
    model: str | None = None
    stream: bool = False


class RequestProcessor:
    def __init__(self, rng: random.Random | None = None,
                 pick: Callable[[RouteSettings, ChatRequest], str | None] | None = None):
        self._rng = rng or _SHARED_RNG
        self._pick = pick or (lambda route, chat: pick_by_weight(route.candidates, self._rng))
        self.state = State.START
        self.record = RequestRecord()
        self._route: RouteSettings | RouteSettingsError | None = None
        self._body = bytearray()

    def handle(self, event: Event) -> Reply:
        handler = TRANSITIONS.get((self.state, type(event)))
        if handler is None:
            raise ProtocolError(f"{type(event).__name__} not allowed in state {self.state.value}")
        return getattr(self, handler)(event)

    # --- request ------------------------------------------------------------------------

    def _on_request_headers(self, event: RequestHeaders) -> Reply:
        self._route = event.route
        settings_name = event.route.name if isinstance(event.route, RouteSettings) else ""
        self.record.route = settings_name or event.route_name or "default"
        path = event.headers.get(":path", "").split("?", 1)[0]
        is_chat = (event.headers.get(":method") == "POST" and path.endswith(CHAT_PATH_SUFFIX))
        if is_chat and event.end_of_stream:
            return self._reject(BadRequest("request body is empty; expected a JSON chat completion request"))
        if not is_chat:
            # Ask Envoy for nothing more about this request: no body, no response headers.
            self.state = State.PASSTHROUGH
            self.record.outcome = Outcome.PASSTHROUGH
            return Continue(Phase.REQUEST_HEADERS, mode=ModeOverride(
                request_body=BodyMode.NONE, response_headers=False))
        self.state = State.AWAIT_REQUEST_BODY
        return Continue(Phase.REQUEST_HEADERS)

    def _on_request_body(self, event: RequestBody) -> Reply:
        self._body += event.body
        if not event.end_of_stream:
            return Continue(Phase.REQUEST_BODY)
        try:
            chat = parse_chat_request(bytes(self._body))
        except BadRequest as exc:
            return self._reject(exc)
        self.record.model, self.record.stream = chat.model, chat.stream
        self.state = State.AWAIT_RESPONSE_HEADERS
        return self._route_request(chat)

    def _reject(self, error: BadRequest) -> Reply:
        self.state = State.DONE
        self.record.outcome, self.record.status = Outcome.BAD_REQUEST, 400
        return error_reply(400, str(error), param=error.param)

    def _route_request(self, chat: ChatRequest) -> Reply:
        route = self._route
        if isinstance(route, RouteSettingsError):
            self.record.outcome = Outcome.INVALID_ROUTE
            return Continue(Phase.REQUEST_BODY)
        cluster = self._pick(route, chat) if route is not None and route.candidates else None
        if cluster is None:
            self.record.outcome = Outcome.DEFAULT
            return Continue(Phase.REQUEST_BODY)
        self.record.outcome, self.record.cluster = Outcome.ROUTED, cluster
        return Continue(Phase.REQUEST_BODY, set_headers=((CLUSTER_HEADER, cluster),),
                        clear_route_cache=True)

    # --- response -----------------------------------------------------------------------

    def _on_response_headers(self, event: ResponseHeaders) -> Reply:
        self.record.status = _status(event.headers)
        self.state = State.DONE if event.end_of_stream else State.AWAIT_RESPONSE_BODY
        extra = ((CLUSTER_HEADER, self.record.cluster),) if self.record.cluster else ()
        return Continue(Phase.RESPONSE_HEADERS, set_headers=extra)

    def _on_response_body(self, event: ResponseBody) -> Reply:
        if event.end_of_stream:
            self.state = State.DONE
        return Continue(Phase.RESPONSE_BODY)

    def _on_passthrough(self, event: Event) -> Reply:
        if isinstance(event, ResponseHeaders):
            self.record.status = _status(event.headers)
        phase = {RequestBody: Phase.REQUEST_BODY, ResponseHeaders: Phase.RESPONSE_HEADERS,
                 ResponseBody: Phase.RESPONSE_BODY}[type(event)]
        return Continue(phase)


def _status(headers) -> int | None:
    try:
        return int(headers.get(":status", ""))
    except ValueError:
        return None
