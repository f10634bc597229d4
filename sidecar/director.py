"""The director decides what happens to a parsed chat request (EPP's Director, STYLE.md §2).

The processor speaks the protocol; the director decides: which cluster, which headers, or an
answer without going upstream. It is async because later stages (cache, embedding, admission)
wait on outside work.
"""
from __future__ import annotations

import random
from typing import Protocol

from sidecar.context import Outcome, RequestContext
from sidecar.events import Plan
from sidecar.picking import pick_by_weight
from sidecar.processor import CLUSTER_HEADER
from sidecar.route_settings import RouteSettings, RouteSettingsError


class Director(Protocol):
    async def decide(self, ctx: RequestContext) -> Plan: ...

    def on_finish(self, ctx: RequestContext) -> None:
        """Called once per request when its stream ends, whatever happened."""


class StaticWeightsDirector:
    """Picks a route's candidate cluster at random in proportion to its static weight."""

    def __init__(self, rng: random.Random | None = None):
        self._rng = rng or random.Random()

    async def decide(self, ctx: RequestContext) -> Plan:
        route = ctx.route
        if isinstance(route, RouteSettingsError):
            ctx.outcome = Outcome.INVALID_ROUTE
            return Plan()
        cluster = (pick_by_weight(route.candidates, self._rng)
                   if isinstance(route, RouteSettings) and route.candidates else None)
        if cluster is None:
            ctx.outcome = Outcome.DEFAULT
            return Plan()
        ctx.outcome, ctx.cluster = Outcome.ROUTED, cluster
        return Plan(cluster=cluster, response_headers=((CLUSTER_HEADER, cluster),))

    def on_finish(self, ctx: RequestContext) -> None:
        pass
