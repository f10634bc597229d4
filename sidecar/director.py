"""The director decides what happens to a parsed chat request (EPP's Director, STYLE.md §2).

The processor speaks the protocol; the director decides: which cluster, which headers, or an
answer without going upstream. It is async because some stages (cache, embedding, admission)
wait on outside work. Implementations: sidecar.routing.RoutingDirector.
"""
from __future__ import annotations

from typing import Protocol

from sidecar.context import RequestContext
from sidecar.events import Plan


class Director(Protocol):
    async def decide(self, ctx: RequestContext) -> Plan: ...

    def on_response_headers(self, ctx: RequestContext) -> None:
        """The upstream's (or Envoy's) response headers passed: time to first byte."""

    def on_response_body(self, ctx: RequestContext, chunk: bytes, end_of_stream: bool) -> None:
        """A chunk of the response body, when the plan asked for it."""

    def on_finish(self, ctx: RequestContext) -> None:
        """Called once per request when its stream ends, whatever happened."""
