"""Reported false hits: remembered per scope, bounded, shared over Redis, honoured by lookups."""
import asyncio
import json
import random
import time
import zlib

import numpy as np
import pytest

from sidecar.admission import connect
from sidecar.cache.capture import capture_json
from sidecar.cache.false_hits import FEEDBACK_HEADER, PAIR_BYTES, MemoryFalseHits, RedisFalseHits, pair_id
from sidecar.cache.inflight import InFlight
from sidecar.cache.memory_store import MemoryStore
from sidecar.cache.token_states import TokenStates
from sidecar.embedding import EmbeddingSettings
from sidecar.embedding.service import EmbeddingService
from sidecar.pipeline.cache_stage import CacheRuntime, CacheStage
from sidecar.openai.chat import parse_chat_request
from sidecar.request.context import RequestContext
from sidecar.route_settings import parse_route_settings
from sidecar.pipeline.route_stage import RouteStage
from sidecar.scheduling import Scheduler
from tests.support.redis_server import RedisServer
from tests.support.pipeline_driver import Stages
from tests.unit.admission.test_admission_metrics import value
from tests.unit.service.test_admin import Aborted, Context, service
from tests.unit.pipeline.test_caching_director import ANSWER

# The lexical decision: the fake embedder below gives vectors, no token states for the verifier.
ROUTE = parse_route_settings({"name": "chat", "candidates": [{"cluster": "a"}], "cache": {"max_false_hit_rate": 0}})
# The default settings (the verifier), which an admin report decides with: the real model.
DEFAULT_ROUTE = parse_route_settings({"name": "chat", "candidates": [{"cluster": "a"}]})
STORED = "How do I reset my password?"
REWORDED = "how can I reset my password?"
OTHER_REWORDING = "How can I reset my password"
VERIFIED = "What are the steps to reset my password?"    # served from STORED at the default rate


class Embedder:
    """Nearly the same vector for the three password prompts, another for anything else."""

    async def embed(self, text):
        base = np.zeros(384, np.float32)
        base[0 if "password" in text else 1] = 1.0
        base[2] = 0.01 * (zlib.crc32(text.encode()) % 11)   # not hash(): it is salted per process
        return base / np.linalg.norm(base)


@pytest.fixture(scope="module")
def model():
    service = EmbeddingService(EmbeddingSettings(provider="cpu"))
    asyncio.run(service.warm_up())
    return service


def director(false_hits=None, store=None, embedder=None, token_states=None):
    rt = CacheRuntime(store=store or MemoryStore(), inflight=InFlight(), embedder=embedder or Embedder(),
                      secret=b"a test secret of 32 bytes, fixed", token_states=token_states)
    if false_hits is not None:
        rt.false_hits = false_hits
    return Stages(RouteStage(Scheduler(rng=random.Random(0)), scrape_interval_s=None), CacheStage(rt))


def request(prompt, key="k1", route=ROUTE, **headers):
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": prompt}]}).encode()
    ctx = RequestContext(headers={"authorization": f"Bearer {key}", **headers}, route=route, route_name="chat")
    ctx.body, ctx.chat = body, parse_chat_request(body)
    return ctx


async def store_answer(d, prompt, key="k1", route=ROUTE):
    ctx = request(prompt, key, route)
    settings = d.cache._route_cache(ctx)
    worked_out = d.cache._cache_request(ctx, d.exchange(ctx).cache, settings)
    answer = capture_json(ANSWER, time.time(), prompt_text=worked_out.prompt).to_bytes()
    vector, states = await d.cache.embed_prompt(worked_out.prompt, settings.policy)
    await d.cache.store(worked_out.scope.key, worked_out.key, worked_out.prompt, vector, states, answer, 60)
    return worked_out


def reports(tier, source="client", route="chat"):
    return value("sluice_cache_false_hit_reports_total", route=route, tier=tier, source=source)


async def test_a_reported_semantic_hit_stops_serving_that_prompt_and_only_that_one():
    d = director()
    await store_answer(d, STORED)
    ctx = request(REWORDED)
    await d.decide(ctx)
    assert ctx.cache_status == "semantic"
    before = reports("semantic")

    report = request(REWORDED, **{FEEDBACK_HEADER: "1"})
    plan = await d.decide(report)
    assert report.cache_status == "miss" and plan.reply is None and plan.cluster == "a"   # goes upstream
    assert reports("semantic") - before == 1

    again = request(REWORDED)
    await d.decide(again)
    assert again.cache_status == "miss"
    other = request(OTHER_REWORDING)               # another rewording is still served
    await d.decide(other)
    assert other.cache_status == "semantic"
    elsewhere = request(REWORDED, key="k2")        # another tenant's scope: nothing of it changed
    await store_answer(d, STORED, key="k2")
    await d.decide(elsewhere)
    assert elsewhere.cache_status == "semantic"


async def test_a_reported_hit_goes_upstream_even_with_a_near_twin_in_flight():
    """The repeat is never served another prompt's answer by the decision just reported wrong:
    it does not follow a near twin's flight (nor any flight), it goes upstream."""
    d = director()
    twin = request(OTHER_REWORDING)
    assert (await d.decide(twin)).reply is None and twin.cache_status == "miss"     # in flight, leading
    await store_answer(d, STORED)
    report = request(REWORDED, **{FEEDBACK_HEADER: "1"})
    plan = await asyncio.wait_for(d.decide(report), 2)
    assert plan.reply is None and report.cache_status == "miss" and plan.cluster == "a"
    assert d.cache._rt.inflight.stats()["followers"] == 0
    d.exchange(twin).cache.upstream.abandon()


async def test_a_reported_exact_hit_is_replaced_by_the_fresh_answer():
    d = director()
    stored = await store_answer(d, STORED)
    first = request(STORED)
    assert d.decide_now(first).reply is not None and first.cache_status == "exact"
    report = request(STORED, **{FEEDBACK_HEADER: "1"})
    assert d.decide_now(report) is None                    # never answered from cache at once
    plan = await d.decide(report)
    assert plan.reply is None and report.cache_status == "miss" and d.exchange(report).cache.upstream.capture is not None
    assert d.decide_now(request(STORED)) is None           # the wrong entry no longer serves
    again = request(STORED)
    await d.decide(again)
    assert again.cache_status == "miss"
    await asyncio.sleep(0.002)                              # a later store, to the millisecond
    await store_answer(d, STORED)                           # the repeat's fresh answer
    fresh = request(STORED)
    assert d.decide_now(fresh).reply is not None and fresh.cache_status == "exact"
    assert stored.key == d.exchange(fresh).cache.request.key


async def test_a_report_without_a_hit_reports_nothing():
    d = director()
    before = reports("semantic") + reports("exact")
    ctx = request("What is the capital of France?", **{FEEDBACK_HEADER: "1"})
    await d.decide(ctx)
    assert ctx.cache_status == "miss" and reports("semantic") + reports("exact") == before


async def test_memory_is_bounded_in_bytes_and_pairs_expire():
    now = [1000.0]
    log = MemoryFalseHits(max_bytes=10 * PAIR_BYTES, clock=lambda: now[0])
    for i in range(25):
        await log.report("s", pair_id(f"e{i}", 1.0, "p"), ttl_s=60)
    assert len(log) == 10
    assert not log.known_now("s", pair_id("e0", 1.0, "p")) and log.known_now("s", pair_id("e24", 1.0, "p"))
    assert not log.known_now("other scope", pair_id("e24", 1.0, "p"))
    now[0] += 61
    assert not log.known_now("s", pair_id("e24", 1.0, "p"))
    with pytest.raises(ValueError):
        MemoryFalseHits(max_bytes=1)


async def test_replicas_sharing_redis_hear_each_others_reports(redis_server):
    one = RedisFalseHits(connect(redis_server.url, 0.5), max_per_scope=3)
    two = RedisFalseHits(connect(redis_server.url, 0.5), max_per_scope=3)
    await one.report("scope-a", "pair-1", ttl_s=60)
    assert one.known_now("scope-a", "pair-1") and not two.known_now("scope-a", "pair-1")
    assert await two.known("scope-a", "pair-1") and not await two.known("scope-b", "pair-1")
    for i in range(2, 10):
        await two.report("scope-a", f"pair-{i}", ttl_s=60)
    client = connect(redis_server.url, 0.5)
    assert await client.scard("sluice:{scope-a}:false-hits") == 3       # bounded per scope
    assert 0 < await client.pttl("sluice:{scope-a}:false-hits") <= 7 * 24 * 3600 * 1000


async def test_redis_away_keeps_this_replicas_reports_and_never_raises(tmp_path):
    server = RedisServer(tmp_path / "r").start()
    log = RedisFalseHits(connect(server.url, 0.2))
    server.stop()
    await log.report("s", "pair", ttl_s=60)          # no exception: kept locally
    assert await log.known("s", "pair") and not await log.known("s", "another")


async def test_admin_report_false_hit(model):
    d = director(embedder=model, token_states=TokenStates(1 << 20))
    stored = await store_answer(d, STORED, route=DEFAULT_ROUTE)
    admin, _ = service(report_false_hit=d.pipeline.report_false_hit)
    served = request(VERIFIED, route=DEFAULT_ROUTE)
    await d.decide(served)
    assert served.cache_status == "semantic"
    before = reports("semantic", source="admin", route="admin")
    from sidecar.protos import admin_pb2
    response = await admin.ReportFalseHit(admin_pb2.ReportFalseHitRequest(scope=stored.scope.key, prompt=VERIFIED),
                                          Context())
    assert response.reported and response.tier == "semantic" and response.stored_prompt == STORED
    assert 0.9 < response.similarity < 1.0
    assert reports("semantic", source="admin", route="admin") - before == 1
    ctx = request(VERIFIED, route=DEFAULT_ROUTE)
    await d.decide(ctx)
    assert ctx.cache_status == "miss"
    nothing = await admin.ReportFalseHit(admin_pb2.ReportFalseHitRequest(scope=stored.scope.key,
                                                                         prompt="Unrelated question?"), Context())
    assert not nothing.reported
    for bad in (admin_pb2.ReportFalseHitRequest(scope=stored.scope.key), admin_pb2.ReportFalseHitRequest()):
        context = Context()
        with pytest.raises(Aborted):
            await admin.ReportFalseHit(bad, context)
    off, _ = service()
    with pytest.raises(Aborted):
        await off.ReportFalseHit(admin_pb2.ReportFalseHitRequest(scope="s", prompt="p"), Context())
