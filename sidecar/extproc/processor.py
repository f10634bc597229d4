"""Sans-IO processor for one request: Envoy's ext_proc events in, replies out.

No gRPC or asyncio here (see ../shared/STYLE.md, h11): the server feeds events decoded by the
codec and sends back the replies. Legal moves live in one table, TRANSITIONS; any other event
raises ProtocolError. When a chat request is parsed, the processor returns `Decide` (outside
work); the servicer asks the pipeline (sidecar/pipeline/exchange.py) and hands the Plan back through
`apply()`. Answers to outside questions are events too: `SkipResponse` after a chat request's
headers, when the pipeline needs none of its answer.
"""
from __future__ import annotations

import enum
import re
from urllib.parse import unquote

from sidecar.openai.chat import BadRequest, parse_chat_request
from sidecar.request.context import Outcome, RequestContext
from sidecar.memo import may_keep
from sidecar.extproc.events import (BodyMode, Continue, Decide, Event, ModeOverride, Phase, Plan,
                            ProtocolError, Reply, RequestBody, RequestHeaders, ResponseBody,
                            ResponseHeaders, SkipResponse)
from sidecar.extproc.errors import error_reply
from sidecar.route_settings import RouteSettings

CLUSTER_HEADER = "x-sluice-cluster"
CHAT_PATH_SUFFIX = "/chat/completions"


class State(enum.Enum):
    START = "start"
    AWAIT_REQUEST_BODY = "await_request_body"
    AWAIT_PLAN = "await_plan"
    AWAIT_RESPONSE_HEADERS = "await_response_headers"
    AWAIT_RESPONSE_BODY = "await_response_body"
    PASSTHROUGH = "passthrough"   # not ours: continue whatever Envoy still sends
    DONE = "done"


# (state, event type) -> handler name. Everything else is a protocol error.
TRANSITIONS: dict[tuple[State, type], str] = {
    (State.START, RequestHeaders): "_on_request_headers",
    (State.AWAIT_REQUEST_BODY, SkipResponse): "_on_skip_response",
    (State.AWAIT_REQUEST_BODY, RequestBody): "_on_request_body",
    # Envoy's own local replies pass through ext_proc's response path even when the request
    # never reached (or got past) it: a 429 from the rate limit before it, a 413 while buffering.
    (State.START, ResponseHeaders): "_on_envoy_reply",
    (State.AWAIT_REQUEST_BODY, ResponseHeaders): "_on_envoy_reply",
    (State.AWAIT_PLAN, Plan): "_on_plan",
    (State.AWAIT_RESPONSE_HEADERS, ResponseHeaders): "_on_response_headers",
    (State.AWAIT_RESPONSE_BODY, ResponseBody): "_on_response_body",
    **{(State.PASSTHROUGH, kind): "_on_passthrough"
       for kind in (RequestBody, ResponseHeaders, ResponseBody)},
}


_PHASES = {RequestHeaders: Phase.REQUEST_HEADERS, RequestBody: Phase.REQUEST_BODY,
           ResponseHeaders: Phase.RESPONSE_HEADERS, ResponseBody: Phase.RESPONSE_BODY}
# Envoy sends no response headers for this request (the rest as configured).
_SKIP_RESPONSE = ModeOverride(response_headers=False)


class RequestProcessor:
    def __init__(self, now=None) -> None:
        self.state = State.START
        self.context = RequestContext() if now is None else RequestContext(started=now)
        self._plan = Plan()

    @property
    def awaits_body(self) -> bool:
        """A chat request's headers passed: its body comes next."""
        return self.state is State.AWAIT_REQUEST_BODY

    @property
    def finished(self) -> bool:
        """Envoy will send nothing more for this request."""
        return self.state is State.DONE

    def handle(self, event: Event) -> Reply | Decide:
        handler = TRANSITIONS.get((self.state, type(event)))
        if handler is None:
            raise ProtocolError(f"{type(event).__name__} not allowed in state {self.state.value}")
        return getattr(self, handler)(event)

    def apply(self, answer: Plan | SkipResponse) -> Reply:
        """The pipeline's answer: a Plan to the last `Decide`; SkipResponse, instead of the
        request headers' reply, while the body is awaited."""
        return self.handle(answer)

    def fail(self, event: Event, refuse: bool) -> Reply:
        """The reply to an event whose handling raised (a bug, never a client's mistake: those
        are 400s). A request not yet decided is refused with an OpenAI-shaped 500 when `refuse`
        (sidecar.config on_internal_error), else let go undecided; so a body that trips a bug
        never slips past admission and the tenant limits unless the operator chose so. Once
        decided, the answer passes through untouched: it is the client's, admitted and paid."""
        ctx = self.context
        if isinstance(event, (RequestHeaders, RequestBody)):
            ctx.outcome = Outcome.FAILED
            if refuse:
                self.state = State.DONE
                ctx.status = 500
                return error_reply(500, "the request could not be processed; it was not sent upstream",
                                   type_="server_error", code="sidecar_error")
        if isinstance(event, (ResponseHeaders, ResponseBody)) and event.end_of_stream:
            self.state = State.DONE                 # Envoy sends nothing more
        elif self.state is not State.DONE:
            self.state = State.PASSTHROUGH
        if isinstance(event, RequestHeaders):
            return Continue(Phase.REQUEST_HEADERS, mode=ModeOverride(
                request_body=BodyMode.NONE, response_headers=False))
        return Continue(_PHASES[type(event)])

    # --- request ------------------------------------------------------------------------

    def _on_request_headers(self, event: RequestHeaders) -> Reply:
        ctx = self.context
        ctx.headers, ctx.route = event.headers, event.route
        settings_name = event.route.name if isinstance(event.route, RouteSettings) else ""
        ctx.route_name = settings_name or event.route_name or "default"
        path = event.headers.get(":path", "").split("?", 1)[0]
        if "%" in path or "//" in path:
            # Envoy normalises paths (envoy/envoy.yaml.tmpl); behind one that does not, the
            # upstream would still decode "/v1/chat/%63ompletions" to the chat endpoint.
            path = re.sub("/{2,}", "/", unquote(path))
        is_chat = event.headers.get(":method") == "POST" and path.endswith(CHAT_PATH_SUFFIX)
        if is_chat and event.end_of_stream:
            return self._reject(BadRequest("request body is empty; expected a JSON chat completion request"))
        if not is_chat:
            # Ask Envoy for nothing more about this request: no body, no response headers.
            self.state = State.PASSTHROUGH
            ctx.outcome = Outcome.PASSTHROUGH
            return Continue(Phase.REQUEST_HEADERS, mode=ModeOverride(
                request_body=BodyMode.NONE, response_headers=False))
        self.state = State.AWAIT_REQUEST_BODY
        return Continue(Phase.REQUEST_HEADERS)

    def _on_skip_response(self, _: SkipResponse) -> Reply:
        # Said in the headers' reply: Envoy 1.40 ignored a mode override in the body's (measured).
        self.context.response_read = False
        return Continue(Phase.REQUEST_HEADERS, mode=_SKIP_RESPONSE)

    def _on_request_body(self, event: RequestBody) -> Reply | Decide:
        # BUFFERED, the request body mode Sluice asks for: Envoy sends the whole body in one
        # message, with end_of_stream False when request trailers follow (the filter skips
        # them). Waiting for more would let a request with trailers go on undecided: no
        # routing, admission, limits or cache.
        self.context.body = event.body
        try:
            self.context.chat = parse_chat_request(self.context.body, remember=may_keep(self.context.headers))
        except BadRequest as exc:
            return self._reject(exc)
        self.state = State.AWAIT_PLAN
        return Decide(self.context)

    def _on_envoy_reply(self, event: ResponseHeaders) -> Reply:
        ctx = self.context
        self.state = State.DONE
        ctx.outcome, ctx.response_headers = Outcome.ENVOY_REPLY, event.headers
        ctx.status = _status(event.headers)
        return Continue(Phase.RESPONSE_HEADERS)

    def _reject(self, error: BadRequest) -> Reply:
        self.state = State.DONE
        self.context.outcome, self.context.status = Outcome.BAD_REQUEST, 400
        return error_reply(400, str(error), param=error.param)

    def _on_plan(self, plan: Plan) -> Reply:
        self._plan = plan
        if plan.reply is not None:
            self.state = State.DONE
            self.context.status = plan.reply.status
            return plan.reply
        self.state = State.AWAIT_RESPONSE_HEADERS
        headers = plan.request_headers
        # Envoy's edge set the header to the default cluster and matched the route with it: the
        # route is re-resolved (a cost on every request) only when the sidecar chose another.
        steer = plan.cluster is not None and plan.cluster != self.context.headers.get(CLUSTER_HEADER)
        if steer:
            headers = ((CLUSTER_HEADER, plan.cluster), *headers)
        # Unread answers get the plan's headers from Envoy, out of this metadata (Plan docs).
        # Only when this is the request's last reply: metadata on an earlier one often kept
        # Envoy 1.40's ext_proc stream open for seconds after the request ended (measured).
        metadata = () if self.context.response_read else plan.response_headers
        return Continue(Phase.REQUEST_BODY, set_headers=headers, body=plan.body, clear_route_cache=steer,
                        dynamic_metadata=metadata)

    # --- response -----------------------------------------------------------------------

    def _on_response_headers(self, event: ResponseHeaders) -> Reply:
        ctx = self.context
        ctx.status, ctx.response_headers = _status(event.headers), event.headers
        self.state = State.DONE if event.end_of_stream else State.AWAIT_RESPONSE_BODY
        ctx.response_complete = event.end_of_stream
        mode = None
        # Only a complete 200 answer is worth reading (e.g. for the cache).
        if self._plan.response_body is not None and ctx.status == 200 and not event.end_of_stream:
            mode = ModeOverride(response_body=self._plan.response_body)
            ctx.response_body_read = True
        return Continue(Phase.RESPONSE_HEADERS, set_headers=self._plan.response_headers, mode=mode)

    def _on_response_body(self, event: ResponseBody) -> Reply:
        if not event.end_of_stream:
            if self._plan.response_body is BodyMode.BUFFERED:
                # Outgrew Envoy's buffer (BUFFERED_PARTIAL): the rest flows on unseen, so
                # whether the answer reached its end is not known here.
                self.context.response_body_read = False
            return Continue(Phase.RESPONSE_BODY)
        self.state = State.DONE
        self.context.response_complete = True
        return Continue(Phase.RESPONSE_BODY)

    def _on_passthrough(self, event: Event) -> Reply:
        if isinstance(event, ResponseHeaders):
            self.context.status = _status(event.headers)
        return Continue(_PHASES[type(event)])


def _status(headers) -> int | None:
    try:
        return int(headers.get(":status", ""))
    except ValueError:
        return None
