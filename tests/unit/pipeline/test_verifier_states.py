"""The cache stage feeds a verifier that aligns token states: the new prompt's from its own
embedding run, the stored prompt's kept with its entry; without them, a counted miss."""
import asyncio

import pytest
from prometheus_client import REGISTRY

from sidecar.cache.inflight import InFlight
from sidecar.cache.memory_store import MemoryStore
from sidecar.cache.token_states import TokenStates
from sidecar.cache.verifier import load_verifier
from sidecar.embedding import EmbeddingSettings
from sidecar.embedding.service import EmbeddingService
from sidecar.pipeline.cache_stage import CacheRuntime, CacheStage
from sidecar.route_settings import parse_route_settings

STORED, REWORDED = "How do I reset my password?", "How can I reset my password?"


@pytest.fixture(scope="module")
def embedder():
    service = EmbeddingService(EmbeddingSettings(provider="cpu"))
    asyncio.run(service.warm_up())
    return service


def no_states_count() -> float:
    return REGISTRY.get_sample_value("sluice_cache_semantic_checks_total", {"reason": "verifier_no_states"}) or 0


def stage_and_route(embedder, token_states, rate=0.05):
    stage = CacheStage(CacheRuntime(store=MemoryStore(), inflight=InFlight(), embedder=embedder,
                                    secret=b"a test secret of 32 bytes, fixed", token_states=token_states))
    route = parse_route_settings({"name": "chat", "candidates": [{"cluster": "a"}],
                                  "cache": {"max_false_hit_rate": rate}})
    return stage, stage._route_cache_of.get(route, stage._build_route_cache, "chat")


async def store(stage, scope, key, prompt, wants=True):
    vector, states = await stage._embed_states(prompt, wants)
    await stage._rt.store.put(scope, key, prompt, vector, b"answer", 60)
    stage.keep_states(scope, key, states)
    return states


def test_the_verifier_scores_with_both_prompts_states(embedder):
    assert load_verifier().needs_states
    stage, settings = stage_and_route(embedder, TokenStates(1 << 20))

    async def run():
        states = await store(stage, "s", "k1", STORED)
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
        await store(stage, "s", "k1", STORED)
        held.discard("s", "k1")                   # evicted, or stored by another replica
        return await stage.lookup("s", "k2", REWORDED, settings)
    found = asyncio.run(run())
    assert found.tier is None and found.reason == "verifier_no_states" and found.score is None
    assert no_states_count() == before + 1
    # A sidecar without a place for states (or a model without them) misses the same way.
    bare, bare_settings = stage_and_route(embedder, None)

    async def run_bare():
        await store(bare, "s", "k1", STORED, wants=False)
        return await bare.lookup("s", "k2", REWORDED, bare_settings)
    assert asyncio.run(run_bare()).reason == "verifier_no_states"


def test_routes_without_the_verifier_never_ask_for_states(embedder):
    held = TokenStates(1 << 20)
    stage, settings = stage_and_route(embedder, held, rate=0.0)

    async def run():
        vector, states = await stage._embed_states(STORED, stage._wants_states(stage._checks(settings.policy)))
        return vector, states
    vector, states = asyncio.run(run())
    assert vector is not None and states is None
