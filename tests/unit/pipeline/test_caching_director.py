"""The cache stage in the pipeline, without a server: which requests it answers at once (decide_now)."""
import asyncio
import gzip
import json
import random
import time

import numpy as np
import pytest

from sidecar.cache.capture import capture_json
from sidecar.cache.inflight import InFlight
from sidecar.cache.memory_store import MemoryStore
from sidecar import deadlines
from sidecar.pipeline.cache_stage import CacheRuntime, CacheStage
from sidecar.openai.chat import parse_chat_request
from sidecar.request.context import Outcome, RequestContext
from sidecar.deadlines import EXTEND_AFTER_S, EXTENDED_MESSAGE_TIMEOUT_S, HOLD_LIMIT_S
from sidecar.route_settings import parse_route_settings
from sidecar.pipeline.route_stage import RouteStage
from sidecar.scheduling import Scheduler
from sidecar.token_estimate import estimate_tokens
from sidecar.pipeline.admission_stage import AdmissionState
from tests.support.pipeline_driver import Stages
from tests.unit.admission.test_admission_metrics import value
from tests.unit.cache.test_cache_capture import chunk, sse

ROUTE = parse_route_settings({"name": "chat", "candidates": [{"cluster": "a"}],
                              "cache": {"semantic": False}})
ANSWER = json.dumps({"id": "x", "object": "chat.completion", "created": 1, "model": "m", "choices": [
    {"index": 0, "message": {"role": "assistant", "content": "Use the link."}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}}).encode()


class AwaitOnlyStore(MemoryStore):
    """A store like Redis: entries only through an await."""
    get_exact_now = None

    async def get_exact(self, scope, exact_key):
        return MemoryStore.get_exact_now(self, scope, exact_key)


def director(store=None):
    routing = RouteStage(Scheduler(rng=random.Random(0)), scrape_interval_s=None)
    return Stages(routing, CacheStage(CacheRuntime(store=MemoryStore() if store is None else store, inflight=InFlight(), secret=b"a test secret of 32 bytes, fixed")))


def request(prompt="How do I reset my password?", **headers):
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": prompt}]}).encode()
    ctx = RequestContext(headers={"authorization": "Bearer k1", **headers}, route=ROUTE, route_name="chat")
    ctx.body, ctx.chat = body, parse_chat_request(body)
    return ctx


def store_answer(d, prompt="How do I reset my password?"):
    ctx = request(prompt)
    worked_out = d.cache._cache_request(ctx, d.exchange(ctx).cache, d.cache._route_cache(ctx))
    answer = capture_json(ANSWER, time.time(), prompt_text=worked_out.prompt).to_bytes()
    asyncio.run(d.cache._rt.store.put(worked_out.scope.key, worked_out.key, worked_out.prompt, None, answer, 60))


def test_an_exact_hit_from_an_in_process_store_is_answered_at_once():
    d = director()
    store_answer(d)
    ctx = request()
    plan = d.decide_now(ctx)
    assert plan is not None and plan.reply is not None and plan.reply.status == 200
    assert json.loads(plan.reply.body)["choices"][0]["message"]["content"] == "Use the link."
    assert (ctx.outcome, ctx.cache_status) == (Outcome.ANSWERED, "exact")
    assert ctx.cache_scope == d.exchange(ctx).cache.request.scope.key


def test_a_miss_waits_for_decide_which_reuses_the_work_done():
    d = director()
    ctx = request()
    assert d.decide_now(ctx) is None
    worked_out = d.exchange(ctx).cache.request
    plan = asyncio.run(d.decide(ctx))
    assert d.exchange(ctx).cache.request is worked_out and ctx.cache_status == "miss" and plan.cluster == "a"


def test_bypassed_requests_and_await_only_stores_are_not_answered_at_once():
    d = director()
    store_answer(d)
    assert d.decide_now(request(**{"cache-control": "no-cache"})) is None     # may store, never serve
    slow = director(AwaitOnlyStore())
    store_answer(slow)
    ctx = request()
    assert slow.decide_now(ctx) is None
    assert asyncio.run(slow.decide(ctx)).reply is not None and ctx.cache_status == "exact"


def test_a_repeat_reuses_the_verdict_and_another_caller_gets_its_own_scope():
    d = director()
    first, again = request(), request()
    d.decide_now(first)
    d.decide_now(again)
    assert d.exchange(again).cache.request is d.exchange(first).cache.request
    other = request(authorization="Bearer k2")
    d.decide_now(other)
    assert d.exchange(other).cache.request.scope.key != d.exchange(first).cache.request.scope.key
    elsewhere = request()
    elsewhere.route_name = "chat-eu"                     # the same settings on another route: its own memo
    d.decide_now(elsewhere)
    assert d.exchange(elsewhere).cache.request.scope.key != d.exchange(first).cache.request.scope.key
    no_cache = request(**{"cache-control": "no-cache"})
    d.decide_now(no_cache)
    assert d.exchange(no_cache).cache.request.bypass is not None and d.exchange(first).cache.request.bypass is None


def test_a_prompt_without_user_text_is_bypassed_not_an_error():
    d = director()
    ctx = request()
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]}]}).encode()
    ctx.body, ctx.chat = body, parse_chat_request(body)
    plan = d.decide_now(ctx)
    assert ctx.cache_status == "bypass" and d.exchange(ctx).cache.request.bypass.reason == "not_text" and plan.cluster == "a"


def test_what_the_cache_may_neither_serve_nor_store_is_routed_at_once_like_decide_routes_it():
    """No task for them: decide_now gives routing's plan, with the same headers and count."""
    for store in (UnaskedStore(), UnaskedAwaitOnlyStore()):
        d = director(store)
        now, later = request(**{"cache-control": "no-store"}), request(**{"cache-control": "no-store"})
        before = value("sluice_cache_requests_total", route="chat", result="bypass")
        plan = d.decide_now(now)
        assert plan is not None and plan.reply is None and plan.cluster == "a"
        assert value("sluice_cache_requests_total", route="chat", result="bypass") == before + 1
        awaited = asyncio.run(d.decide(later))
        assert value("sluice_cache_requests_total", route="chat", result="bypass") == before + 2
        assert plan.response_headers == awaited.response_headers and ("x-sluice-cache", "bypass") in plan.response_headers
        assert (now.cache_status, d.exchange(now).cache.upstream.capture, now.cache_scope) == (later.cache_status, d.exchange(later).cache.upstream.capture,
                                                                    later.cache_scope) == ("bypass", None, None)


class UnaskedStore(MemoryStore):
    """Fails the test if a lookup reaches it."""
    def get_exact_now(self, scope, exact_key):
        raise AssertionError("the store was asked")

    async def get_exact(self, scope, exact_key):
        raise AssertionError("the store was asked")

    async def nearest(self, scope, vector, min_similarity):
        raise AssertionError("the store was asked")


class UnaskedAwaitOnlyStore(UnaskedStore):
    get_exact_now = None


def test_the_memo_of_a_tenant_header_route_keys_on_that_header():
    """Two tenants behind one API key (an Envoy-verified tenant header) never share a verdict."""
    route = parse_route_settings({"name": "chat", "candidates": [{"cluster": "a"}],
                                  "cache": {"semantic": False, "tenant_header": "X-Tenant"}})
    d = director()

    def tenant_request(tenant):
        ctx = request(**{"x-tenant": tenant})
        ctx.route = route
        d.decide_now(ctx)
        return d.exchange(ctx).cache.request

    a, b, a_again = tenant_request("a"), tenant_request("b"), tenant_request("a")
    assert a.scope.key != b.scope.key
    assert a_again is a                                  # the memo keyed on the tenant header


def test_a_bypass_waits_for_decide_when_routing_cannot_decide_at_once():
    d = director()

    class Queue:                                         # e.g. an admission queue to wait in
        def settings(self, ctx):
            return "admits"

        async def admit(self, ctx, state, scheduled, settings):
            return scheduled
    d.route.admit = Queue()
    before = value("sluice_cache_requests_total", route="chat", result="bypass")
    ctx = request(**{"cache-control": "no-store"})
    assert d.decide_now(ctx) is None
    assert value("sluice_cache_requests_total", route="chat", result="bypass") == before                    # counted once, in decide
    assert asyncio.run(d.decide(ctx)).cluster == "a" and ctx.cache_status == "bypass"


# Another version's stored format (replicas sharing Redis during a rolling upgrade) and junk.
UNREADABLE = [json.dumps({"v": 999, "content": "a newer format"}).encode(), b"\x00not json"]


def store_raw(d, data: bytes, prompt="How do I reset my password?"):
    ctx = request(prompt)
    worked_out = d.cache._cache_request(ctx, d.exchange(ctx).cache, d.cache._route_cache(ctx))
    asyncio.run(d.cache._rt.store.put(worked_out.scope.key, worked_out.key, worked_out.prompt, None, data, 60))


def test_a_stored_answer_this_version_cannot_read_is_a_miss_and_is_replaced():
    for data in UNREADABLE:
        for store in (MemoryStore(), AwaitOnlyStore()):
            d = director(store)
            store_raw(d, data)
            before = value("sluice_cache_unreadable_total")
            ctx = request()
            assert d.decide_now(ctx) is None
            plan = asyncio.run(d.decide(ctx))
            assert plan.reply is None and plan.cluster == "a" and ctx.cache_status == "miss"
            assert d.exchange(ctx).cache.upstream.capture is not None and value("sluice_cache_unreadable_total") > before
            d.exchange(ctx).cache.upstream.capture.abandon()


def test_a_follower_relayed_an_unreadable_answer_goes_upstream_itself():
    async def scenario():
        d = director()
        leader = request()
        await d.decide(leader)
        follower = request()
        waiting = asyncio.ensure_future(d.decide(follower))
        await asyncio.sleep(0.01)
        d.exchange(leader).cache.upstream.capture.lead.complete(UNREADABLE[0])      # as a newer replica would publish it
        plan = await waiting
        assert plan.reply is None and plan.cluster == "a" and follower.cache_status == "miss"
        d.exchange(follower).cache.upstream.capture.abandon()
    asyncio.run(scenario())


def test_a_follower_waits_no_longer_than_its_clients_deadline_allows():
    async def scenario():
        d = director()
        leader = request()
        await d.decide(leader)                                  # never answers in this test
        follower = request(**{"x-request-deadline-ms": "150"})
        started = time.monotonic()
        plan = await asyncio.wait_for(d.decide(follower), timeout=5)   # the route allows 30 s
        waited = time.monotonic() - started
        assert plan.reply is None and plan.cluster == "a" and follower.cache_status == "miss"
        assert 0.1 <= waited < 2.0                              # its own budget, not the route's 30 s
        d.exchange(follower).cache.upstream.capture.abandon()
        d.exchange(leader).cache.upstream.capture.abandon()
    asyncio.run(scenario())


NO_CACHE = parse_route_settings({"name": "chat", "candidates": [{"cluster": "a"}], "cache": {"enabled": False}})


async def metered(route, answer: bytes, end: bool = True, response_headers: dict | None = None):
    """A request on a token-budget route answered with `answer`: (its plan, its usage)."""
    d = director()
    ctx = request(**{"accept-encoding": "gzip, deflate"})           # as the openai SDK sends
    ctx.route = route
    d.routed(ctx).admission = AdmissionState(token_estimate=7)      # admission charged an estimate
    plan = await d.decide(ctx)
    ctx.response_headers = {":status": "200", "content-type": "application/json", **(response_headers or {})}
    d.on_response_headers(ctx)
    d.on_response_body(ctx, answer, end)
    d.on_finish(ctx)
    return plan, ctx.usage


def test_the_answers_usage_is_read_for_token_budgets_whatever_the_cache_does_with_it():
    """The route stage's usage meter is fed through the pipeline, with the cache stage: on a route
    without the cache, and for an answer the cache refuses to store (n > 1)."""
    two_choices = json.dumps({"object": "chat.completion", "model": "m", "choices": [
        {"index": i, "message": {"role": "assistant", "content": "x"}, "finish_reason": "stop"} for i in range(2)],
        "usage": {"prompt_tokens": 11, "completion_tokens": 500, "total_tokens": 511}}).encode()
    assert asyncio.run(metered(NO_CACHE, ANSWER))[1] == (5, 3)
    assert asyncio.run(metered(ROUTE, two_choices))[1] == (11, 500)
    # Only its first part ever came (past Envoy's buffer): charged for that much at least.
    _, cut = asyncio.run(metered(NO_CACHE, b'{"choices": [{"message": {"content": "' + b"x" * 40_000, end=False))
    assert cut is not None and cut[1] >= 10_000


def test_an_answer_read_for_its_usage_is_asked_for_uncompressed_and_skipped_if_not():
    """Clients such as the openai SDK accept gzip: a compressed answer would give the token
    budget nothing to read, so the meter asks for identity encoding (once, with the capture)."""
    for route in (NO_CACHE, ROUTE):
        plan, usage = asyncio.run(metered(route, ANSWER))
        assert [h for h in plan.request_headers if h[0] == "accept-encoding"] == [("accept-encoding", "identity")]
        assert usage == (5, 3)
        gzipped = asyncio.run(metered(route, gzip.compress(ANSWER), response_headers={"content-encoding": "gzip"}))
        assert gzipped[1] is None                                    # ignored: no guess


def test_a_fallback_models_answer_is_neither_stored_nor_relayed_to_twins():
    """Degraded to the fallback (a weight-0 primary stands in for open breakers), the answer
    is another model's: a later request for the model asked for must not be served it."""
    route = parse_route_settings({"name": "chat", "cache": {"semantic": False}, "candidates": [
        {"cluster": "big", "model": "m", "weight": 0}, {"cluster": "small", "role": "fallback", "model": "tiny"}]})

    async def scenario():
        d = director()
        leader, twin = request(), request()
        leader.route = twin.route = route
        plan = await d.decide(leader)
        assert plan.cluster == "small" and ("x-sluice-degraded", "1") in plan.response_headers
        assert (await asyncio.wait_for(d.decide(twin), timeout=5)).cluster == "small"   # not held for it
        for ctx in (leader, twin):
            ctx.response_headers = {":status": "200", "content-type": "application/json"}
            d.on_response_headers(ctx)
            d.on_response_body(ctx, ANSWER, True)
            d.on_finish(ctx)
        await asyncio.sleep(0.01)
        later = request()
        later.route = route
        return d.decide_now(later)
    later_plan = asyncio.run(scenario())
    assert later_plan is None or later_plan.reply is None                # a miss, not the fallback's answer


@pytest.mark.parametrize("route_cache, cache_control, stored", [
    ({"semantic": False}, "no-store", False),
    ({"semantic": False}, "private", False),     # one user's, and one key may be a whole organisation's
    ({"semantic": False, "shared": True}, "private", False),
    ({"semantic": False, "tenant_header": "x-sluice-tenant"}, "private", False),
    ({"semantic": False, "shared": True}, "public, max-age=600", True),
    ({"semantic": False}, "no-cache", True),
])
def test_the_upstreams_cache_control_decides_whether_its_answer_is_stored(route_cache, cache_control, stored):
    route = parse_route_settings({"name": "chat", "candidates": [{"cluster": "a"}], "cache": route_cache})

    async def scenario():
        d = director()
        first = request(**{"x-sluice-tenant": "acme"})
        first.route = route
        await d.decide(first)
        first.response_headers = {":status": "200", "content-type": "application/json", "cache-control": cache_control}
        d.on_response_headers(first)
        d.on_response_body(first, ANSWER, True)
        d.on_finish(first)
        await asyncio.sleep(0.01)
        another_user = route_cache.get("shared") or route_cache.get("tenant_header")     # in the same scope
        again = request(authorization="Bearer another caller" if another_user else "Bearer k1",
                        **{"x-sluice-tenant": "acme"})
        again.route = route
        return d.decide_now(again)
    plan = asyncio.run(scenario())
    assert (plan is not None and plan.reply is not None) == stored


def test_without_usage_from_the_upstream_the_whole_chat_counts_as_prompt():
    """A stream without include_usage: prompt tokens are estimated from every message (a long
    system prompt included), not from the last user turn the cache keys on."""
    system = "You are a support bot for ACME. " * 100
    body = json.dumps({"model": "m", "stream": True, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": "Hi?"}]}).encode()
    answer = sse(chunk("Hello!"), chunk(finish_reason="stop"))

    async def miss_then_hit():
        d = director()
        ctx = request()
        ctx.body, ctx.chat = body, parse_chat_request(body)
        await d.decide(ctx)
        ctx.response_headers = {":status": "200", "content-type": "text/event-stream"}
        d.on_response_headers(ctx)
        d.on_response_body(ctx, answer, True)
        await asyncio.sleep(0)
        hit = request()
        hit.body = body.replace(b'"stream": true', b'"stream": false')
        hit.chat = parse_chat_request(hit.body)
        return ctx, json.loads(d.decide_now(hit).reply.body)["usage"]
    ctx, served = asyncio.run(miss_then_hit())
    assert ctx.usage[0] == served["prompt_tokens"] == estimate_tokens(ctx.chat.text) > 800


def test_twins_are_released_as_soon_as_the_leaders_stream_cannot_be_stored():
    """A tool call on a route that allows tools: known at the first chunk, not at [DONE]
    (a generation can take the twins' whole max_dedup_wait_s)."""
    route = parse_route_settings({"name": "chat", "candidates": [{"cluster": "a"}],
                                  "cache": {"semantic": False, "allow_tools": True}})
    body = json.dumps({"model": "m", "stream": True, "messages": [{"role": "user", "content": "Book a table"}],
                       "tools": [{"type": "function", "function": {"name": "book"}}]}).encode()

    def streamed():
        ctx = request()
        ctx.route, ctx.body, ctx.chat = route, body, parse_chat_request(body)
        return ctx

    tool_call = sse(chunk(tool_calls=[{"index": 0, "id": "t"}]), done=False)
    asyncio.run(twin_goes_upstream_once_the_leader_sends(streamed, "text/event-stream", tool_call))


def test_twins_are_released_when_a_json_answer_comes_only_in_part():
    """Past Envoy's buffer, BUFFERED_PARTIAL sends the first part without end_of_stream and
    nothing more: the answer cannot be stored, so twins need not wait for the download."""
    asyncio.run(twin_goes_upstream_once_the_leader_sends(request, "application/json", ANSWER[:40]))


async def twin_goes_upstream_once_the_leader_sends(new_request, content_type: str, first_chunk: bytes):
    """A twin follows its leader until the leader's answer shows it cannot be stored."""
    d = director()
    leader = new_request()
    await d.decide(leader)
    twin = asyncio.create_task(d.decide(new_request()))
    await asyncio.sleep(0.01)
    assert not twin.done()                                          # it follows the leader
    leader.response_headers = {":status": "200", "content-type": content_type}
    d.on_response_headers(leader)
    d.on_response_body(leader, first_chunk, False)
    plan = await asyncio.wait_for(twin, timeout=2)
    assert plan.reply is None and plan.cluster == "a"                # upstream on its own
    d.on_finish(leader)


@pytest.mark.parametrize("status, cache_control, all_at_once", [
    ("400", None, True),                   # whole answers that may not be shared: no one waits
    ("200", "private", True),
    ("503", None, False),                  # a failure another try may not repeat: one at a time
    ("429", None, False),
])
def test_twins_of_an_answer_that_may_not_be_shared_go_upstream_at_once(status, cache_control, all_at_once):
    async def scenario():
        d = director()
        leader = request()
        await d.decide(leader)
        twins = [asyncio.create_task(d.decide(request())) for _ in range(3)]
        await asyncio.sleep(0.01)
        assert not any(t.done() for t in twins)                  # they follow the leader
        leader.status = int(status)
        leader.response_headers = {":status": status, "content-type": "application/json",
                                   **({"cache-control": cache_control} if cache_control else {})}
        d.on_response_headers(leader)
        await asyncio.sleep(0.01)
        gone = [t for t in twins if t.done()]
        for t in twins:
            t.cancel()
        return len(gone)
    assert asyncio.run(scenario()) == (3 if all_at_once else 1)


def test_a_tenant_header_envoy_does_not_strip_is_warned_about(caplog):
    d = director()
    for header, warned in (("x-sluice-tenant", False), ("x-tenant-id", True)):
        ctx = request()
        ctx.route = parse_route_settings({"name": "chat", "candidates": [{"cluster": "a"}],
                                          "cache": {"semantic": False, "tenant_header": header}})
        caplog.clear()
        d.decide_now(ctx)
        assert any("can choose its tenant" in r.getMessage() for r in caplog.records) is warned, header


@pytest.mark.parametrize("cache, warned", [
    ({"semantic_threshold": 0.97}, True),                             # the verifier decides: unread
    ({"semantic_threshold": 0.97, "max_false_hit_rate": 0.02}, True),
    ({"semantic_threshold": 0.97, "max_false_hit_rate": 0}, False),   # the lexical decision reads it
    ({"semantic_threshold": 0.97, "semantic": False}, False),          # no semantic tier at all
    ({}, False),
])
def test_a_semantic_threshold_the_route_does_not_read_is_warned_about(caplog, cache, warned):
    d = director()
    ctx = request()
    ctx.route = parse_route_settings({"name": "chat", "candidates": [{"cluster": "a"}], "cache": cache})
    caplog.clear()
    d.decide_now(ctx)
    assert any("semantic_threshold" in r.getMessage() for r in caplog.records) is warned, cache


def test_no_deadline_holds_a_request_past_envoys_one_message_timeout_extension():
    assert HOLD_LIMIT_S < EXTEND_AFTER_S + EXTENDED_MESSAGE_TIMEOUT_S - 2       # room to spare
    ctx = request(**{"x-request-deadline-ms": "600000"})                      # ten minutes
    assert deadlines.follow_for(time.monotonic(), ctx.started, ctx.client_deadline, 300.0) <= HOLD_LIMIT_S            # the queue: test_admission_gate


def test_a_same_question_check_that_fails_is_a_miss_not_a_failed_request(monkeypatch, caplog):
    import sidecar.pipeline.cache_stage as caching

    def broken(*args):
        raise ValueError("Exceeds the limit (4300 digits)")
    monkeypatch.setattr(caching, "same_question", broken)
    verdict = caching.checked_same_question("a", "b", 0.99, caching.EquivalenceSettings())
    assert verdict == caching.Verdict(False, "check_failed")
    assert any("same-question check failed" in r.getMessage() for r in caplog.records)


def test_a_prompt_past_max_prompt_chars_is_not_embedded():
    """Every same-question check refuses it, so its embedding would be model time for nothing."""
    class CountingEmbedder:
        texts: list = []

        async def embed(self, text):
            self.texts.append(text)
            return np.ones(384, np.float32) / np.sqrt(384)
    embedder = CountingEmbedder()
    d = CacheStage(CacheRuntime(store=MemoryStore(), inflight=InFlight(), embedder=embedder,
                                secret=b"a test secret of 32 bytes, fixed"))
    route = parse_route_settings({"name": "chat", "candidates": [{"cluster": "a"}]})
    settings = d._route_cache_of.get(route, d._build_route_cache, "chat")
    limit = d._rt.equivalence.max_prompt_chars
    short = asyncio.run(d.lookup("scope", "k1", "x" * limit, settings))
    long = asyncio.run(d.lookup("scope", "k2", "x" * (limit + 1), settings))
    assert (short.reason, long.reason) == ("below_threshold", "too_long")
    assert [len(t) for t in embedder.texts] == [limit]


def test_a_stored_entry_that_cannot_be_replayed_is_dropped_and_the_request_goes_upstream():
    """A 401-digit token count stored by an older version failed every hit on the entry."""
    d = director()
    ctx = request()
    worked_out = d.cache._cache_request(ctx, d.exchange(ctx).cache, d.cache._route_cache(ctx))
    stored = json.loads(capture_json(ANSWER, time.time()).to_bytes())
    stored["prompt_tokens"] = 10 ** 400
    asyncio.run(d.cache._rt.store.put(worked_out.scope.key, worked_out.key, worked_out.prompt, None,
                                json.dumps(stored).encode(), 60))
    assert d.decide_now(ctx) is None                     # a miss, not an exception
    assert d.cache._rt.store.get_exact_now(worked_out.scope.key, worked_out.key) is None   # dropped
    plan = asyncio.run(d.decide(ctx))
    assert plan.reply is None and plan.cluster == "a" and ctx.cache_status == "miss"
