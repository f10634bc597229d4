"""A processor that changes nothing: the baseline `make bench` compares Sluice against."""
from __future__ import annotations

from sidecar.request.context import RequestContext
from sidecar.extproc.events import Continue, Event, Phase, RequestBody, RequestHeaders, ResponseHeaders

_PHASES = {RequestHeaders: Phase.REQUEST_HEADERS, RequestBody: Phase.REQUEST_BODY,
           ResponseHeaders: Phase.RESPONSE_HEADERS}


class NoopProcessor:
    finished = False       # a plain pass-through: the stream ends when Envoy ends it
    awaits_body = False    # reads every answer, like Sluice's default

    def __init__(self) -> None:
        self.context = RequestContext(route_name="noop")

    def handle(self, event: Event) -> Continue:
        return Continue(_PHASES.get(type(event), Phase.RESPONSE_BODY))
