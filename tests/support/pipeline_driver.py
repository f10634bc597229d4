"""Drive sidecar.pipeline without a server: one exchange per request context, as the servicer
keeps one per stream (sidecar/service/server.py), with the processor's part of the response done by
the test itself (ctx.status, ctx.response_headers)."""
from __future__ import annotations

from sidecar.request.context import RequestContext
from sidecar.extproc.events import Continue, Phase, Plan
from sidecar.pipeline import Exchange, Pipeline
from sidecar.pipeline.route_stage import RouteState


class Stages:
    """A pipeline of the given stages, asked per request context."""

    def __init__(self, route, cache=None, guard=None):
        self.pipeline = Pipeline(route, cache, guard)
        self.route, self.cache, self.guard = route, cache, guard
        self._exchanges: dict[int, tuple[RequestContext, Exchange]] = {}

    def exchange(self, ctx: RequestContext) -> Exchange:
        kept = self._exchanges.get(id(ctx))
        if kept is None or kept[0] is not ctx:
            kept = self._exchanges[id(ctx)] = (ctx, self.pipeline.exchange(ctx))
        return kept[1]

    def routed(self, ctx: RequestContext) -> RouteState:
        """The route stage's piece of the request (its decision, admission, feedback)."""
        return self.exchange(ctx).route

    def reads_response(self, ctx: RequestContext) -> bool:
        return self.exchange(ctx).reads_response()

    def decide_now(self, ctx: RequestContext) -> Plan | None:
        return self.exchange(ctx).decide_now()

    async def decide(self, ctx: RequestContext) -> Plan:
        return await self.exchange(ctx).decide()

    def on_response_headers(self, ctx: RequestContext) -> None:
        self.exchange(ctx).on_response_headers()

    def on_response_body(self, ctx: RequestContext, chunk: bytes, end_of_stream: bool) -> Continue:
        return self.exchange(ctx).on_response_body(chunk, end_of_stream, Continue(Phase.RESPONSE_BODY))

    def on_finish(self, ctx: RequestContext) -> None:
        self.exchange(ctx).finish()
