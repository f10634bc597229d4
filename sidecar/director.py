"""The director decides what happens to a parsed chat request (EPP's Director, STYLE.md §2).

The processor speaks the protocol; the director decides: which cluster, which headers, or an
answer without going upstream. Most requests are decided at once (`decide_now`); `decide` is
async because some stages (cache, embedding, admission) wait on outside work. Implementations:
sidecar.routing.RoutingDirector, and sidecar.caching.CachingDirector around it.
"""
from __future__ import annotations

from typing import Protocol

from sidecar.context import RequestContext
from sidecar.events import Plan


class Director(Protocol):
    def decide_now(self, ctx: RequestContext) -> Plan | None:
        """The plan when it needs no waiting, else None: the server then awaits `decide` in a
        task. (Running `decide`'s first step outside a task would let code in it that captures
        the current task, such as asyncio.timeout, cancel the wrong one.)"""

    async def decide(self, ctx: RequestContext) -> Plan: ...

    def reads_response(self, ctx: RequestContext) -> bool:
        """Asked at the request headers, before the body: whether Envoy should send this
        request's response headers (its status, time to first byte). When False, the plan's
        response headers reach the client through dynamic metadata (Plan.response_headers)."""

    def on_response_headers(self, ctx: RequestContext) -> None:
        """The upstream's (or Envoy's) response headers passed: time to first byte."""

    def on_response_body(self, ctx: RequestContext, chunk: bytes, end_of_stream: bool) -> None:
        """A chunk of the response body, when the plan asked for it."""

    def on_finish(self, ctx: RequestContext) -> None:
        """Called once per request when its stream ends, whatever happened."""
