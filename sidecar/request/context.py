"""Per-request lifecycle state, kept apart from the processor's protocol state.

The processor fills it from Envoy's events; the pipeline's stages read it to decide and write
what they decided; metrics and the request log read it when the stream ends.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Mapping

from sidecar import deadlines
from sidecar.openai.chat import ChatRequest
from sidecar.request.decision_record import Why
from sidecar.route_settings import RouteSettings, RouteSettingsError


# The model name is the client's own text, logged and traced: its length must not be.
MAX_LOGGED_MODEL_CHARS = 200


class Outcome(enum.Enum):
    ROUTED = "routed"                  # the sidecar chose the cluster
    DEFAULT = "default"                # no steering configured: the route's default cluster
    INVALID_ROUTE = "invalid_route"    # bad route settings: the route's default cluster
    PASSTHROUGH = "passthrough"        # not a chat completion: untouched
    BAD_REQUEST = "bad_request"        # answered 400 by the sidecar
    ANSWERED = "answered"              # answered by the sidecar (e.g. from cache)
    REFUSED = "refused"                # refused by the sidecar (overload, limits)
    ENVOY_REPLY = "envoy_reply"        # Envoy answered itself before the sidecar decided (413, 429)
    FAILED = "failed"                  # the sidecar failed on it (a bug): refused, or passed on undecided


@dataclass
class RequestContext:
    headers: Mapping[str, str] = field(default_factory=dict)
    route: RouteSettings | RouteSettingsError | None = None   # the matched route's settings
    route_name: str = "default"
    chat: ChatRequest | None = None
    body: bytes = b""                  # the raw request body, as the client sent it
    started: float = field(default_factory=time.monotonic)
    # The request's record, filled by the pipeline's stages and by the response: what the
    # request log, the metrics and the span read. Each stage's own working state lives in the
    # exchange (sidecar/pipeline/exchange.py), not here.
    outcome: Outcome | None = None
    cluster: str | None = None
    usage: tuple[int, int] | None = None  # (prompt, completion) tokens of the answer, once read
    status: int | None = None
    response_headers: Mapping[str, str] = field(default_factory=dict)
    response_headers_at: float | None = None
    cache_status: str | None = None    # exact|semantic|coalesced|miss|bypass
    cache_scope: str | None = None     # the cache scope key (a hash; for admin purges)
    response_complete: bool = False
    response_body_read: bool = False   # Envoy sends the answer's body (or its end) to the sidecar
    response_read: bool = True         # False: Envoy sends no response headers (feedback sampling)
    why: Why = field(default_factory=Why)  # each stage's reasons (sidecar/request/decision_record.py)

    @property
    def request_id(self) -> str:
        return self.headers.get("x-request-id", "")

    @property
    def logged_model(self) -> str | None:
        """The model the client asked for, cut to MAX_LOGGED_MODEL_CHARS for logs and spans."""
        if self.chat is None:
            return None
        model = self.chat.model
        return model if len(model) <= MAX_LOGGED_MODEL_CHARS else model[:MAX_LOGGED_MODEL_CHARS] + "…"

    @property
    def client_deadline(self) -> float | None:
        """When the client's budget runs out (sidecar/deadlines.py); None when it set none."""
        return deadlines.client_deadline(self.headers, self.started)
