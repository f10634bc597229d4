"""The cache stage feeds a verifier that aligns token states: the new prompt's from its own
embedding run, the stored prompt's kept with its entry; without them, a counted miss."""
import asyncio
import json
import random

import numpy as np
import pytest
from prometheus_client import REGISTRY
from redis.asyncio import Redis

from sidecar.cache.inflight import InFlight
from sidecar.cache.memory_store import MemoryStore
from sidecar.cache.redis_store import RedisSettings, RedisStore
from sidecar.cache.token_states import TokenStates
from sidecar.cache.verifier import load_verifier
from sidecar.embedding import EmbeddingSettings
from sidecar.embedding.service import EmbeddingService
from sidecar.openai.chat import parse_chat_request
from sidecar.pipeline.cache_stage import CacheRuntime, CacheStage
from sidecar.pipeline.route_stage import RouteStage
from sidecar.request.context import RequestContext
from sidecar.route_settings import parse_route_settings
from sidecar.scheduling import Scheduler
from tests.support.pipeline_driver import Stages

STORED, REWORDED = "How do I reset my password?", "How can I reset my password?"
# A rewording the verifier serves by a wide margin (P ~0.99 against a threshold of ~0.93).
SERVED = ("What is the capital of France?", "What's the capital of France?")


@pytest.fixture(scope="module")
def embedder():
    service = EmbeddingService(EmbeddingSettings(provider="cpu"))
    asyncio.run(service.warm_up())
    return service


def no_states_count() -> float:
    return REGISTRY.get_sample_value("sluice_cache_semantic_checks_total", {"reason": "verifier_no_states"}) or 0


def stage_and_route(embedder, token_states, rate=0.05, store=None):
    stage = CacheStage(CacheRuntime(store=store or MemoryStore(), inflight=InFlight(), embedder=embedder,
                                    secret=b"a test secret of 32 bytes, fixed", token_states=token_states))
    route = parse_route_settings({"name": "chat", "candidates": [{"cluster": "a"}],
                                  "cache": {"max_false_hit_rate": rate}})
    return stage, stage._route_cache_of.get(route, stage._build_route_cache, "chat")


async def store(stage, scope, key, prompt, settings, **put):
    vector, states = await stage.embed_prompt(prompt, settings.policy)
    await stage.store(scope, key, prompt, vector, states, b"answer", 60, **put)
    return states


def test_the_verifier_scores_with_both_prompts_states(embedder):
    assert load_verifier().needs_states
    stage, settings = stage_and_route(embedder, TokenStates(1 << 20))

    async def run():
        states = await store(stage, "s", "k1", STORED, settings)
        assert states is not None and states.shape[1] == 384
        return await stage.lookup("s", "k2", REWORDED, settings)
    found = asyncio.run(run())
    assert found.score is not None and found.reason in ("ok", "verifier_rejected")
    assert found.states is not None            # kept for this prompt's own entry, if it is stored


def test_a_candidate_without_states_is_a_counted_miss_never_a_guess(embedder):
    held = TokenStates(1 << 20)
    stage, settings = stage_and_route(embedder, held)
    before = no_states_count()

    async def run():
        await store(stage, "s", "k1", STORED, settings)
        held.discard("s", "k1")                   # evicted, or stored by another replica
        return await stage.lookup("s", "k2", REWORDED, settings)
    found = asyncio.run(run())
    assert found.tier is None and found.reason == "verifier_no_states" and found.score is None
    assert no_states_count() == before + 1
    # A sidecar without a place for states (or a model without them) misses the same way.
    bare, bare_settings = stage_and_route(embedder, None)

    async def run_bare():
        await store(bare, "s", "k1", STORED, bare_settings)
        return await bare.lookup("s", "k2", REWORDED, bare_settings)
    assert asyncio.run(run_bare()).reason == "verifier_no_states"


def test_routes_without_the_verifier_never_ask_for_states(embedder):
    held = TokenStates(1 << 20)
    stage, settings = stage_and_route(embedder, held, rate=0.0)

    async def run():
        return await stage.embed_prompt(STORED, settings.policy)
    vector, states = asyncio.run(run())
    assert vector is not None and states is None


def test_states_are_kept_only_for_an_entry_the_store_kept(embedder):
    held = TokenStates(1 << 20)
    stage, settings = stage_and_route(embedder, held)

    async def run():
        await store(stage, "s", "k1", STORED, settings)
        assert held.get("s", "k1") is not None
        asked_at = stage._clock() - 1.0
        await stage.purge_scope("s")
        # An answer asked for before the purge: the store drops it, and keeps no states for it.
        await store(stage, "s", "k2", REWORDED, settings, asked_at=asked_at)
        assert await stage._rt.store.get_exact("s", "k2") is None
        assert held.get("s", "k2") is None
        # A replacement that comes without states leaves none of its predecessor's.
        await store(stage, "s", "k3", STORED, settings)
        await stage.store("s", "k3", STORED, None, None, b"answer", 60)
        assert held.get("s", "k3") is None
    asyncio.run(run())
    assert len(held) == 0


def test_an_admin_purge_forgets_the_scopes_states(embedder):
    held = TokenStates(1 << 20)
    stage, settings = stage_and_route(embedder, held)

    async def run():
        for scope, key in (("s", "k1"), ("s", "k2"), ("other", "k1")):
            await store(stage, scope, key, STORED, settings)
        assert await stage.purge_scope("s") == 2
        assert held.get("s", "k1") is None and held.get("s", "k2") is None
        assert held.get("other", "k1") is not None           # another tenant's stay
        assert await stage.purge_all() == 1
    asyncio.run(run())
    assert len(held) == 0 and held.nbytes == 0


def stage_with(has_states, embedder=None):
    """has_states: the model's answer, or a callable giving it (None: not loaded yet)."""
    return CacheStage(CacheRuntime(store=MemoryStore(), inflight=InFlight(), token_states=TokenStates(1 << 20),
                                   embedder=embedder, secret=b"a test secret of 32 bytes, fixed",
                                   model_has_states=has_states if callable(has_states) else lambda: has_states))


def build(stage, name, rate):
    route = parse_route_settings({"name": name, "candidates": [{"cluster": "a"}],
                                  "cache": {"max_false_hit_rate": rate}})
    return stage._route_cache_of.get(route, stage._build_route_cache, name)


@pytest.fixture
def warnings(caplog):
    caplog.set_level("WARNING", logger="sluice.cache")
    return lambda: [r for r in caplog.records if r.levelname == "WARNING" and "token_states" in r.getMessage()]


def test_a_model_without_states_is_logged_once_for_a_verifier_route(caplog, warnings):
    """A stale build/models loads the packaged model, which has no token_states output."""
    stage = stage_with(False)
    build(stage, "plain", 0.0)
    assert warnings() == []                              # no verifier on that route
    build(stage, "chat", 0.05)
    build(stage, "other", 0.02)
    assert len(warnings()) == 1 and "route chat" in warnings()[0].getMessage()
    caplog.clear()
    build(stage_with(True), "chat", 0.05)
    assert warnings() == []


# -- replicas sharing Redis: the states travel beside the entry ----------------------------

def replica(embedder, server, held):
    store = RedisStore(RedisSettings(url=server.url, timeout_s=0.5, connect_timeout_s=0.5, stream_block_ms=200))
    return stage_and_route(embedder, held, store=store)


def unreadable_count() -> float:
    return REGISTRY.get_sample_value("sluice_cache_unreadable_total") or 0


def test_an_entry_stored_by_one_replica_is_verified_by_another(embedder, redis_server):
    held_a, held_b = TokenStates(1 << 20), TokenStates(1 << 20)
    (a, settings), (b, _) = replica(embedder, redis_server, held_a), replica(embedder, redis_server, held_b)

    async def run():
        await a._rt.store.start()
        await b._rt.store.start()
        try:
            stored = await store(a, "s", "k1", SERVED[0], settings)
            vector = (await b.embed_prompt(SERVED[0], settings.policy))[0]
            for _ in range(100):                           # b's index hears of the put
                if b._rt.store._local.nearest_now("s", vector, 0.99):
                    break
                await asyncio.sleep(0.02)
            found = await b.lookup("s", "k2", SERVED[1], settings)
            other_tenant = await b.lookup("t", "k2", SERVED[1], settings)
            return stored, found, other_tenant
        finally:
            await a._rt.store.close()
            await b._rt.store.close()
    stored, found, other_tenant = asyncio.run(run())
    assert found.entry is not None and found.entry.entry_id == "k1"
    assert found.reason != "verifier_no_states" and found.score is not None
    assert found.tier == "semantic"                              # the same question, reworded
    kept = held_b.get("s", "k1")                                 # now in b's own share
    assert kept is not None and np.array_equal(kept, stored.astype(np.float16))
    assert other_tenant.entry is None and held_b.get("t", "k1") is None


@pytest.mark.parametrize("value", [b"junk", None], ids=["corrupt", "missing"])
def test_states_in_redis_that_are_not_states_are_a_counted_miss(embedder, redis_server, value):
    held_a, held_b = TokenStates(1 << 20), TokenStates(1 << 20)
    (a, settings), (b, _) = replica(embedder, redis_server, held_a), replica(embedder, redis_server, held_b)
    before, unreadable = no_states_count(), unreadable_count()

    async def run():
        await a._rt.store.start()
        await b._rt.store.start()
        try:
            await store(a, "s", "k1", STORED, settings)
            client = Redis.from_url(redis_server.url)
            key = a._rt.store._keys.entry("s", "k1")
            await (client.hset(key, "s", value) if value is not None else client.hdel(key, "s"))
            await client.aclose()
            for _ in range(100):
                found = await b.lookup("s", "k2", REWORDED, settings)
                if found.entry is not None:
                    return found
                await asyncio.sleep(0.02)
        finally:
            await a._rt.store.close()
            await b._rt.store.close()
    found = asyncio.run(run())
    assert found.tier is None and found.reason == "verifier_no_states" and found.score is None
    assert no_states_count() == before + 1 and held_b.get("s", "k1") is None
    assert unreadable_count() == unreadable + (value is not None)


class LoadingModel:
    """An embedder whose model loads later; until then has_states is not known."""
    def __init__(self, has_states: bool):
        self.loaded, self._has_states = False, has_states

    def has_states(self) -> bool | None:
        return self._has_states if self.loaded else None

    async def embed(self, text, with_states=False):
        vector = np.ones(384, np.float32) / np.sqrt(384)
        if with_states and self._has_states:
            return type("WithStates", (), {"vector": vector, "states": np.ones((5, 384), np.float16)})()
        return vector


@pytest.mark.parametrize("has_states", [True, False])
def test_a_route_built_before_the_model_loads_is_checked_once_it_has(warnings, has_states):
    model = LoadingModel(has_states)
    stage = stage_with(model.has_states, embedder=model)
    settings = build(stage, "chat", 0.05)
    assert warnings() == []                          # not known yet: no warning, true or false
    model.loaded = True
    for key in ("k1", "k2"):
        asyncio.run(stage.lookup("s", key, STORED, settings))
    assert len(warnings()) == (0 if has_states else 1)
    if not has_states:
        assert "route chat" in warnings()[0].getMessage()


def test_the_sidecar_tells_its_cache_whether_the_model_has_states_only_once_it_has_loaded():
    """While the model loads, "no states" would be a false warning: not known yet (None)."""
    from sidecar.config import SidecarConfig
    from sidecar.service.app import build
    app = build(SidecarConfig())
    has_states = app.pipeline.cache._rt.model_has_states
    assert has_states() is None

    async def run():
        await app.embedder.warm_up()
        try:
            return has_states()
        finally:
            await app.embedder.close()
    assert asyncio.run(run()) is True
    assert has_states() is None                          # closed: no model to ask


# -- near twins in flight: a follower is coalesced as the verifier would serve it -----------

ANSWER = json.dumps({"id": "x", "object": "chat.completion", "created": 1, "model": "m", "choices": [
    {"index": 0, "message": {"role": "assistant", "content": "Paris."}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}}).encode()
DEFAULT_ROUTE = parse_route_settings({"name": "chat", "candidates": [{"cluster": "a"}]})   # the verifier at 0.05
# Cosine 0.99 both; the verifier scores the first 0.99 and the second 0.10 (an exchange).
REWORDING = SERVED
EXCHANGE = ("Is every square a rectangle?", "Is every rectangle a square?")


def chat(prompt):
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": prompt}]}).encode()
    ctx = RequestContext(headers={"authorization": "Bearer k1"}, route=DEFAULT_ROUTE, route_name="chat")
    ctx.body, ctx.chat = body, parse_chat_request(body)
    return ctx


async def twins(embedder, pair, token_states, inflight=None):
    """The first prompt goes upstream; the second comes while it is in flight. The second's
    x-sluice-cache, once the first's answer came."""
    cache = CacheStage(CacheRuntime(store=MemoryStore(), inflight=inflight or InFlight(), embedder=embedder,
                                    secret=b"a test secret of 32 bytes, fixed", token_states=token_states))
    d = Stages(RouteStage(Scheduler(rng=random.Random(0)), scrape_interval_s=None), cache)
    leader, follower = chat(pair[0]), chat(pair[1])
    assert (await d.decide(leader)).reply is None and leader.cache_status == "miss"
    waiting = asyncio.ensure_future(d.decide(follower))
    for _ in range(500):                   # until it follows the leader, or went its own way
        if waiting.done() or cache._rt.inflight.stats()["followers"]:
            break
        await asyncio.sleep(0.01)
    leader.response_headers = {":status": "200", "content-type": "application/json"}
    d.on_response_headers(leader)
    d.on_response_body(leader, ANSWER, True)
    d.on_finish(leader)
    plan = await waiting
    if plan.reply is None:
        d.exchange(follower).cache.upstream.abandon()
        return follower.cache_status
    assert json.loads(plan.reply.body)["choices"][0]["message"]["content"] == "Paris."
    return dict(plan.reply.headers)["x-sluice-cache"]


def test_a_near_twin_in_flight_is_coalesced_when_the_verifier_says_same(embedder):
    assert asyncio.run(twins(embedder, REWORDING, TokenStates(1 << 20))) == "coalesced"


def test_a_near_twin_the_verifier_tells_apart_goes_upstream(embedder):
    assert asyncio.run(twins(embedder, EXCHANGE, TokenStates(1 << 20))) == "miss"


def test_without_token_states_a_near_twin_is_not_coalesced(embedder):
    # A sidecar without a place for states (so its embeddings bring none) ...
    assert asyncio.run(twins(embedder, REWORDING, None)) == "miss"
    # ... or a leader whose states were past the flights' byte bound.
    assert asyncio.run(twins(embedder, REWORDING, TokenStates(1 << 20), InFlight(max_states_bytes=0))) == "miss"
