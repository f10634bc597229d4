"""The pipeline's order of stages and the exchange's part of a request, without a server."""
import asyncio
import json

import pytest

from sidecar.cache.inflight import InFlight
from sidecar.cache.memory_store import MemoryStore
from sidecar.pipeline.cache_stage import CacheRuntime, CacheStage
from sidecar.openai.chat import parse_chat_request
from sidecar.request.context import RequestContext
from sidecar.extproc.events import Continue, Phase
from sidecar.pipeline.guard_stage import GuardStage
from sidecar.pipeline import Pipeline
from sidecar.route_settings import parse_route_settings
from tests.support.ext_proc_stream import FakeRoute

ANSWER = json.dumps({"object": "chat.completion", "model": "m", "choices": [
    {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}}).encode()


class CountingRoute(FakeRoute):
    def __init__(self):
        super().__init__(cluster="a")
        self.asked = 0

    def target(self, ctx):
        self.asked += 1
        return super().target(ctx)


def request(route: dict, prompt: str = "How do I reset my password?") -> RequestContext:
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": prompt}]}).encode()
    return RequestContext(headers={"authorization": "Bearer k1"}, route=parse_route_settings(route),
                          route_name="chat", body=body, chat=parse_chat_request(body))


def pipeline(route) -> Pipeline:
    cache = CacheStage(CacheRuntime(store=MemoryStore(), inflight=InFlight(), secret=b"a test secret of 32 bytes, fixed"))
    return Pipeline(route, cache, GuardStage())


GUARDED = {"guard": {"words": [{"name": "w", "words": ["forbidden"]}]}, "cache": {"semantic": False}}


def test_a_blocked_request_reaches_neither_the_cache_nor_the_route_stage():
    route = CountingRoute()
    exchange = pipeline(route).exchange(request(GUARDED, "a forbidden question"))
    plan = exchange.decide_now()
    assert plan.reply.status == 400 and route.asked == 0 and exchange.cache.request is exchange.cache.upstream is None


def test_an_answer_from_the_cache_never_asks_the_route_stage():
    route = CountingRoute()
    p = pipeline(route)
    first = p.exchange(request(GUARDED))
    asyncio.run(first.decide())
    assert route.asked == 1 and first.cache.upstream.status == "miss"
    first.ctx.status, first.ctx.response_headers = 200, {":status": "200", "content-type": "application/json"}

    async def answer():
        first.on_response_headers()
        first.on_response_body(ANSWER, True, Continue(Phase.RESPONSE_BODY))
        await asyncio.sleep(0.01)                                    # the store's put, in the background
    asyncio.run(answer())
    again = p.exchange(request(GUARDED))
    plan = again.decide_now()
    assert plan.reply.status == 200 and route.asked == 1


def test_each_stage_decides_once_when_the_route_stage_must_wait():
    """A verdict found without waiting is kept for `decide`: a bypass is counted once."""
    route = CountingRoute()
    exchange = pipeline(route).exchange(request({"cache": {"enabled": False}}))
    assert exchange.decide_now() is None and route.asked == 1
    verdict = exchange.cache.upstream
    plan = asyncio.run(exchange.decide())
    assert exchange.cache.upstream is verdict and plan.cluster == "a"
    assert ("x-sluice-cache", "bypass") in plan.response_headers


def test_the_answers_usage_goes_to_envoy_with_its_last_chunk_only():
    class Metering(FakeRoute):
        def on_response_body(self, ctx, state, chunk, end_of_stream):
            if end_of_stream:
                ctx.usage = (5, 3)

    exchange = Pipeline(Metering()).exchange(request({}))
    asyncio.run(exchange.decide())
    exchange.ctx.status = 200
    middle = exchange.on_response_body(b"{", False, Continue(Phase.RESPONSE_BODY))
    assert middle.dynamic_metadata == ()
    exchange.ctx.response_complete = True                 # the processor read it to its end
    last = exchange.on_response_body(b"}", True, Continue(Phase.RESPONSE_BODY))
    assert dict(last.dynamic_metadata) == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}


def test_a_route_stage_failure_abandons_the_capture():
    class Failing(FakeRoute):
        async def admitted(self, ctx):
            raise RuntimeError("planted")

    exchange = pipeline(Failing()).exchange(request({"cache": {"semantic": False}}))
    with pytest.raises(RuntimeError):
        asyncio.run(exchange.decide())
    assert exchange.cache.upstream.status == "miss" and exchange.cache.upstream.capture is None


def test_the_stages_count_through_the_metrics_they_are_given():
    class Counted:
        def __init__(self):
            self.lookups = []

        def __getattr__(self, name):
            return lambda *args: None

        def lookup(self, route, result):
            self.lookups.append((route, result))

    counted = Counted()
    cache = CacheStage(CacheRuntime(store=MemoryStore(), inflight=InFlight(), secret=b"a test secret of 32 bytes, fixed"),
                       metrics=counted)
    exchange = Pipeline(FakeRoute(), cache).exchange(request({"cache": {"semantic": False}}))
    asyncio.run(exchange.decide())
    assert counted.lookups == [("chat", "miss")]
    exchange.cache.upstream.abandon()
