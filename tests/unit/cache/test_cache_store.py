"""CacheStore behaviour, the same tests for MemoryStore and RedisStore (real redis-server),
then what only the Redis store does: replicas sharing entries, and Redis going away."""
import asyncio
import gc
import hashlib
import logging
import math
import shutil
import signal
import socket
import subprocess
import time
import tracemalloc

import numpy as np
import pytest
from prometheus_client import REGISTRY
from redis.asyncio import Redis as AsyncRedis
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from sidecar.admission import RateLimitRule, RateLimits, RedisTokenLimiter, TokenLimitsConfig, connect
from sidecar.service.app import build
from sidecar.cache.inflight import InFlight, Lead
from sidecar.cache.inflight_redis import RedisInFlight
from sidecar.cache.memory_store import MemoryStore
from sidecar.cache.redis_store import REPUBLISH_BATCH, RedisSettings, RedisStore
from sidecar.cache.store import Entry, StoreLimits, StoreUnavailable
from sidecar.config import SidecarConfig
from tests.support.redis_server import RedisServer, free_port

DIM = 384
REDIS = shutil.which("redis-server")
needs_redis = pytest.mark.skipif(REDIS is None, reason="redis-server is not installed")


def unit(seed: int) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal(DIM).astype(np.float32)
    return v / np.linalg.norm(v)


def towards(v: np.ndarray, cosine: float, seed: int = 99) -> np.ndarray:
    noise = unit(seed)
    noise -= noise.dot(v) * v
    noise /= np.linalg.norm(noise)
    return (cosine * v + math.sqrt(1 - cosine ** 2) * noise).astype(np.float32)


class Clock:
    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


# -- a real redis-server per test module ---------------------------------------------------

def flush(server: RedisServer) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=1) as s:
        s.sendall(b"FLUSHALL\r\n")
        s.recv(16)


def redis_settings(url: str, **kw) -> RedisSettings:
    # Generous per-call deadline: a loaded CI box must not trip it; a dead server is
    # refused at once anyway.
    base = dict(url=url, timeout_s=0.15, connect_timeout_s=0.15, stream_block_ms=200,
                reconnect_min_s=0.05, reconnect_max_s=0.5, start_timeout_s=3.0)
    return RedisSettings(**{**base, **kw})


@pytest.fixture
async def started():
    """started(store) -> the store, started; it is closed when the test ends."""
    stores = []

    async def start(store):
        await store.start()
        stores.append(store)
        return store

    yield start
    for store in stores:
        await store.close()


@pytest.fixture(params=["memory", "redis"])
def make_store(request, started):
    """make_store(limits=..., clock=...) -> a started store of the parametrised kind."""
    server = None
    if request.param == "redis":
        server = request.getfixturevalue("redis_server")
        flush(server)

    def make(limits: StoreLimits | None = None, clock=None):
        if server is None:
            return started(MemoryStore(limits, clock=clock or Clock()))
        return started(RedisStore(redis_settings(server.url), limits))

    return make


# -- the contract, both kinds ------------------------------------------------------------

async def test_put_then_get_exact(make_store):
    store = await make_store()
    await store.put("t1", "k1", "what is 2+2?", unit(1), b"\x00four\xff", ttl_s=60)
    entry = await store.get_exact("t1", "k1")
    assert isinstance(entry, Entry)
    assert (entry.entry_id, entry.scope, entry.prompt, entry.answer) == \
        ("k1", "t1", "what is 2+2?", b"\x00four\xff")
    assert entry.stored_at > 0
    assert await store.get_exact("t1", "other") is None


async def test_put_replaces_the_entry_of_the_same_key(make_store):
    store = await make_store()
    await store.put("t1", "k1", "p", unit(1), b"old", ttl_s=60)
    await store.put("t1", "k1", "p", unit(2), b"new", ttl_s=60)
    assert (await store.get_exact("t1", "k1")).answer == b"new"
    assert await store.nearest("t1", unit(1), 0.9) is None
    assert (await store.nearest("t1", unit(2), 0.9)).entry.answer == b"new"


async def test_nearest_above_and_below_the_threshold(make_store):
    store = await make_store()
    v = unit(1)
    await store.put("t1", "k1", "p1", v, b"a1", ttl_s=60)
    await store.put("t1", "k2", "p2", unit(2), b"a2", ttl_s=60)
    hit = await store.nearest("t1", towards(v, 0.93), 0.90)
    assert hit is not None and hit.entry.entry_id == "k1" and hit.entry.answer == b"a1"
    assert hit.similarity == pytest.approx(0.93, abs=1e-4)
    assert await store.nearest("t1", towards(v, 0.93), 0.95) is None


async def test_entry_without_vector_is_found_only_exactly(make_store):
    store = await make_store()
    await store.put("t1", "k1", "p", None, b"a", ttl_s=60)
    assert (await store.get_exact("t1", "k1")).answer == b"a"
    assert await store.nearest("t1", unit(1), -1.0) is None


async def test_scopes_are_isolated(make_store):
    store = await make_store()
    v = unit(1)
    await store.put("tenant-a", "k", "p", v, b"for a", ttl_s=60)
    await store.put("tenant-b", "k", "p", v, b"for b", ttl_s=60)
    assert (await store.nearest("tenant-a", v, 0.99)).entry.answer == b"for a"
    assert (await store.nearest("tenant-b", v, 0.99)).entry.answer == b"for b"
    assert (await store.get_exact("tenant-b", "k")).answer == b"for b"
    assert await store.nearest("tenant-c", v, 0.0) is None


async def test_per_scope_bound_evicts_only_that_scope(make_store):
    store = await make_store(StoreLimits(max_entries=100, max_entries_per_scope=3))
    await store.put("quiet", "q", "p", unit(100), b"q", ttl_s=60)
    for i in range(5):
        await store.put("noisy", f"k{i}", "p", unit(i), b"a", ttl_s=60)
    assert [await store.get_exact("noisy", f"k{i}") is not None for i in range(5)] == \
        [False, False, True, True, True]
    assert await store.nearest("noisy", unit(0), 0.99) is None
    assert await store.get_exact("quiet", "q") is not None


async def test_per_scope_bound_is_least_recently_used(make_store):
    store = await make_store(StoreLimits(max_entries=100, max_entries_per_scope=2))
    await store.put("s", "old", "p", unit(1), b"a", ttl_s=60)
    await store.put("s", "mid", "p", unit(2), b"a", ttl_s=60)
    await asyncio.sleep(0.002)  # the Redis LRU scores are milliseconds
    assert await store.nearest("s", unit(1), 0.99) is not None  # "old" is used again
    await store.put("s", "new", "p", unit(3), b"a", ttl_s=60)
    assert await store.get_exact("s", "mid") is None
    assert await store.get_exact("s", "old") is not None


async def test_purge_scope_deletes_only_that_scope(make_store):
    store = await make_store()
    for i in range(3):
        await store.put("gone", f"k{i}", "p", unit(i), b"a", ttl_s=60)
    await store.put("kept", "k0", "p", unit(0), b"a", ttl_s=60)
    assert await store.purge_scope("gone") == 3
    assert await store.get_exact("gone", "k1") is None
    assert await store.nearest("gone", unit(1), 0.5) is None
    assert await store.get_exact("kept", "k0") is not None
    assert await store.purge_scope("gone") == 0


async def test_purge_all_deletes_every_scope(make_store):
    store = await make_store()
    for scope in ("a", "b"):
        for i in range(2):
            await store.put(scope, f"k{i}", "p", unit(i), b"x", ttl_s=60)
    assert await store.purge_all() == 4
    assert await store.get_exact("a", "k0") is None
    assert await store.nearest("b", unit(1), 0.5) is None
    await store.put("a", "k0", "p", unit(0), b"y", ttl_s=60)  # and the store still works
    assert (await store.nearest("a", unit(0), 0.99)).entry.answer == b"y"


async def test_an_answer_asked_for_before_a_purge_is_not_stored_after_it(make_store):
    """An upstream answer in flight while an operator purges the scope may be the very answer
    the purge was for: its put is dropped. One asked for after the purge is stored."""
    store = await make_store()
    await store.put("t", "k", "p", unit(1), b"wrong", ttl_s=60)
    asked = store._clock() - 1              # the store's clock (fake for memory)
    assert await store.purge_scope("t") == 1
    # put says whether it stored: the cache stage keeps token states only for what it did.
    assert await store.put("t", "k", "p", unit(1), b"wrong", ttl_s=60, asked_at=asked) is False
    assert await store.get_exact("t", "k") is None and await store.nearest("t", unit(1), 0.9) is None
    assert await store.put("u", "k", "p", unit(1), b"other scope", ttl_s=60, asked_at=asked) is True
    assert (await store.get_exact("u", "k")).answer == b"other scope"
    await store.put("t", "k", "p", unit(1), b"fresh", ttl_s=60, asked_at=store._clock() + 1)
    assert (await store.get_exact("t", "k")).answer == b"fresh"
    await store.purge_all()
    await store.put("u", "k", "p", unit(1), b"wrong", ttl_s=60, asked_at=asked)
    await store.put("fresh", "k", "p", unit(1), b"wrong", ttl_s=60, asked_at=asked)   # nothing there before
    assert await store.get_exact("u", "k") is None and await store.get_exact("fresh", "k") is None


async def test_vector_of_the_wrong_size_is_a_caller_error(make_store):
    store = await make_store()
    with pytest.raises(ValueError, match="384 dimensions"):
        await store.put("t", "k", "p", np.ones(10, np.float32), b"a", ttl_s=60)


# -- MemoryStore: time and the overall bound ----------------------------------------------

async def test_memory_ttl_with_injected_clock():
    clock = Clock()
    store = MemoryStore(clock=clock)
    await store.put("t", "short", "p", unit(1), b"a", ttl_s=10)
    await store.put("t", "long", "p", unit(2), b"a", ttl_s=100)
    clock.now += 9.9
    assert await store.get_exact("t", "short") is not None
    assert (await store.nearest("t", unit(1), 0.99)).entry.entry_id == "short"
    clock.now += 0.1
    assert await store.get_exact("t", "short") is None
    assert await store.nearest("t", unit(1), 0.99) is None
    assert await store.get_exact("t", "long") is not None


async def test_memory_expired_entries_are_dropped_without_being_asked_for():
    clock = Clock()
    store = MemoryStore(clock=clock)
    for i in range(40):
        await store.put(f"s{i}", "k", "p", unit(i), b"a", ttl_s=1)
    clock.now += 2
    for _ in range(3):  # each operation drops a batch of expired entries
        await store.put("live", "k", "p", unit(1), b"a", ttl_s=60)
    assert len(store) == 1 and store.scope_size("s0") == 0


async def test_memory_semantic_hit_that_expired_falls_back_to_the_next_best():
    clock = Clock()
    store = MemoryStore(clock=clock)
    v = unit(1)
    await store.put("t", "best", "p", v, b"a", ttl_s=1)
    await store.put("t", "second", "p", towards(v, 0.95), b"b", ttl_s=60)
    clock.now += 1
    hit = await store.nearest("t", v, 0.9)
    assert hit.entry.entry_id == "second" and hit.similarity == pytest.approx(0.95, abs=1e-4)


async def test_memory_overall_bound_is_least_recently_used_across_scopes():
    store = MemoryStore(StoreLimits(max_entries=3, max_entries_per_scope=3), clock=Clock())
    await store.put("a", "1", "p", unit(1), b"x", ttl_s=60)
    await store.put("b", "2", "p", unit(2), b"x", ttl_s=60)
    await store.put("c", "3", "p", unit(3), b"x", ttl_s=60)
    assert await store.get_exact("a", "1") is not None  # "b"/"2" is now the least recent
    await store.put("d", "4", "p", unit(4), b"x", ttl_s=60)
    assert len(store) == 3
    assert await store.get_exact("b", "2") is None
    assert await store.nearest("b", unit(2), 0.5) is None
    assert all([await store.get_exact(s, k) for s, k in (("a", "1"), ("c", "3"), ("d", "4"))])


async def test_memory_ttl_is_capped_and_zero_ttl_stores_nothing():
    clock = Clock()
    store = MemoryStore(StoreLimits(max_ttl_s=5), clock=clock)
    await store.put("t", "k", "p", unit(1), b"a", ttl_s=3600)
    await store.put("t", "z", "p", unit(2), b"a", ttl_s=0)
    assert await store.get_exact("t", "z") is None
    clock.now += 5
    assert await store.get_exact("t", "k") is None


def test_limits_are_validated():
    with pytest.raises(ValueError, match="max_entries_per_scope"):
        StoreLimits(max_entries=10, max_entries_per_scope=11)
    with pytest.raises(ValueError, match="max_entries:"):
        StoreLimits(max_entries=0)
    with pytest.raises(ValueError, match="max_bytes"):
        StoreLimits(max_bytes=0)


def _flood(store: MemoryStore, n: int, scopes: int, vectors: bool, text: int = 200) -> None:
    """n entries spread over `scopes` scopes, as a caller that varies the system prompt or the
    seed per request opens a scope each time (scopes=n)."""
    for i in range(n):
        scope = hashlib.sha256(b"scope %d" % (i % scopes)).hexdigest()
        key = hashlib.sha256(b"key %d" % i).hexdigest()
        store.put_now(Entry(key, scope, "p" * text + str(i), b"a" * (2 * text) + str(i).encode(), 1.0),
                      unit(i % 64) if vectors else None, 2e9)


@pytest.mark.parametrize("scopes", [1, 50, 4000])
@pytest.mark.parametrize("vectors", [True, False])
def test_memory_byte_account_is_what_the_entries_take(scopes, vectors):
    """The account against max_bytes covers the memory the store's entries really take (Python's
    allocations, traced), whatever the mix of scopes, and not much more: what it adds is the
    allocator's share, which bench/cache_memory.py measures as RSS."""
    store = MemoryStore(StoreLimits(max_bytes=2**40), clock=lambda: 1000.0)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        _flood(store, 4000, scopes, vectors)
        gc.collect()
        taken = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert 0.7 < taken / store.nbytes <= 1.0, (taken, store.nbytes)


def test_memory_a_flood_of_scopes_stays_within_the_byte_budget():
    """One scope per request: the store holds what its bytes allow, the most recent first, and
    forgets the rest entirely (no scope left behind)."""
    budget = 2 * 2**20
    store = MemoryStore(StoreLimits(max_bytes=budget), clock=lambda: 1000.0)
    _flood(store, 5000, 5000, vectors=True)
    assert store.nbytes <= budget
    assert 300 < len(store) < 5000 and store.scope_count == len(store)
    last = hashlib.sha256(b"scope 4999").hexdigest(), hashlib.sha256(b"key 4999").hexdigest()
    first = hashlib.sha256(b"scope 0").hexdigest(), hashlib.sha256(b"key 0").hexdigest()
    assert store.get_exact_now(*last) is not None and store.get_exact_now(*first) is None


async def test_memory_byte_budget_evicts_the_least_recently_used_of_any_scope():
    answer = b"x" * 100_000
    store = MemoryStore(StoreLimits(max_bytes=350_000), clock=Clock())
    for scope in "abc":
        await store.put(scope, "k", "p", unit(ord(scope)), answer, ttl_s=60)
    assert await store.get_exact("a", "k") is not None        # "b" is now the least recent
    await store.put("d", "k", "p", unit(9), answer, ttl_s=60)
    assert await store.get_exact("b", "k") is None
    assert await store.nearest("b", unit(ord("b")), 0.5) is None
    assert all([await store.get_exact(s, "k") for s in "acd"])
    await store.put("e", "k", "p", None, b"y" * 400_000, ttl_s=60)   # larger than the budget: not kept
    assert await store.get_exact("e", "k") is None and len(store) == 3


async def test_memory_byte_account_returns_to_zero():
    clock = Clock()
    store = MemoryStore(StoreLimits(max_entries=50, max_entries_per_scope=20), clock=clock)
    for i in range(200):
        await store.put(f"s{i % 7}", f"k{i % 60}", "p" * i, unit(i) if i % 3 else None, b"a" * i, ttl_s=1 + i % 5)
    await store.purge_scope("s1")
    store.discard("s2", "k2")
    assert store.nbytes > 0
    clock.now += 10
    for _ in range(20):
        store.nearest_now("s0", unit(1), 0.9)                   # each pops a few expired entries
    assert len(store) == 0 and store.nbytes == 0
    await store.put("t", "k", "p", unit(1), b"a", ttl_s=60)
    await store.purge_all()
    assert store.nbytes == 0


# -- RedisStore only ------------------------------------------------------------------------

def _metric(name: str, labels: dict | None = None) -> float:
    return REGISTRY.get_sample_value(name, labels or {}) or 0.0


@pytest.fixture
def redis_stores(redis_server, started):
    """redis_stores(**settings) -> a started RedisStore (a replica) on the module's server."""
    flush(redis_server)
    return lambda **kw: started(RedisStore(redis_settings(redis_server.url, **kw)))


async def eventually(check, timeout=3.0):
    deadline = time.monotonic() + timeout
    while True:
        result = await check()
        if result or time.monotonic() > deadline:
            return result
        await asyncio.sleep(0.02)


@needs_redis
async def test_redis_ttl_expires_in_redis_and_in_the_index(redis_stores):
    a, b = await redis_stores(), await redis_stores()
    v = unit(1)
    await a.put("t", "k", "p", v, b"a", ttl_s=0.2)
    assert await eventually(lambda: b.nearest("t", v, 0.99))
    await asyncio.sleep(0.3)
    assert await a.get_exact("t", "k") is None
    assert await a.nearest("t", v, 0.99) is None
    assert await b.nearest("t", v, 0.99) is None


@needs_redis
async def test_redis_a_put_on_one_replica_is_found_by_another(redis_stores):
    a, b = await redis_stores(), await redis_stores()
    v = unit(7)
    await a.put("t", "k", "prompt", v, b"shared", ttl_s=60)
    hit = await eventually(lambda: b.nearest("t", towards(v, 0.95), 0.9))
    assert hit is not None and hit.entry.answer == b"shared" and hit.entry.prompt == "prompt"
    assert (await b.get_exact("t", "k")).answer == b"shared"


@needs_redis
async def test_redis_a_replica_started_later_loads_what_is_there(redis_stores):
    a = await redis_stores()
    for i in range(300):  # more than one load batch
        await a.put(f"s{i % 3}", f"k{i}", "p", unit(i), b"a", ttl_s=60)
    late = await redis_stores(load_batch=64)
    hit = await late.nearest("s2", unit(299), 0.99)
    assert hit is not None and hit.entry.entry_id == "k299"


@needs_redis
async def test_redis_evictions_and_purges_reach_other_replicas(redis_stores):
    a, b = await redis_stores(), await redis_stores()
    a.limits = b.limits = StoreLimits(max_entries=100, max_entries_per_scope=2)
    for i in range(3):
        await a.put("t", f"k{i}", "p", unit(i), b"a", ttl_s=60)
    assert await eventually(lambda: b.nearest("t", unit(2), 0.99))
    assert await eventually(lambda: _true(b._local.scope_size("t") == 2))
    await b.purge_scope("t")
    assert await eventually(lambda: _true(a._local.scope_size("t") == 0))
    assert await a.get_exact("t", "k2") is None


@needs_redis
async def test_redis_purge_deletes_a_scope_in_batches(redis_stores, monkeypatch):
    from sidecar.cache import redis_store
    monkeypatch.setattr(redis_store, "_PURGE_BATCH_SIZE", 2)
    store = await redis_stores()
    for i in range(5):
        await store.put("t", f"k{i}", "p", unit(i), b"a", ttl_s=60)
    assert await store.purge_scope("t") == 5
    assert [await store.get_exact("t", f"k{i}") for i in range(5)] == [None] * 5


async def _true(value):
    return value


@needs_redis
async def test_redis_going_away_is_a_fast_miss_and_coming_back_resumes(tmp_path, caplog):
    server = RedisServer(tmp_path).start()
    store = RedisStore(redis_settings(server.url))
    caplog.set_level(logging.INFO, logger="sluice.cache")
    try:
        await store.start()
        v = unit(1)
        await store.put("t", "k", "p", v, b"a", ttl_s=60)
        assert store.healthy and _metric("sluice_cache_backend_up") == 1
        errors = _metric("sluice_cache_backend_errors_total", {"op": "get"})

        server.stop()
        # Down: what this replica stored is still served (its local tier), fast; what it was
        # never given is a miss; a put is kept locally.
        for call, answer in ((lambda: store.get_exact("t", "k"), b"a"), (lambda: store.nearest("t", v, 0.9), b"a"),
                             (lambda: store.get_exact("t", "never"), None),
                             (lambda: store.put("t", "k2", "p", unit(2), b"a2", ttl_s=60), True),   # kept locally
                             (lambda: store.get_exact("t", "k2"), b"a2"),
                             (lambda: store.nearest("t", unit(2), 0.9), b"a2")):
            started = time.monotonic()
            found = await call()
            assert (found if found is None or found is True else getattr(found, "entry", found).answer) == answer
            assert time.monotonic() - started < 0.2
        assert not store.healthy and _metric("sluice_cache_backend_up") == 0
        assert _metric("sluice_cache_backend_errors_total", {"op": "get"}) == errors + 1
        with pytest.raises(StoreUnavailable):
            await store.purge_scope("t")
        down_logs = [r for r in caplog.records if "unreachable" in r.getMessage()]
        assert len(down_logs) == 1  # once per transition, not per request

        server = RedisServer(tmp_path, server.port).start()  # same port, empty: the old entries are gone with the old process
        assert await eventually(lambda: _true(store.healthy), timeout=5)
        assert _metric("sluice_cache_backend_up") == 1
        # A new Redis: purges made while this replica was away cannot be ruled out, so the
        # local tier starts over with the rebuilt index.
        assert await store.get_exact("t", "k") is None
        assert await store.nearest("t", v, 0.9) is None
        assert await store.get_exact("t", "k2") is None
        await store.put("t", "k3", "p", v, b"again", ttl_s=60)
        assert (await store.get_exact("t", "k3")).answer == b"again"
        assert (await store.nearest("t", v, 0.9)).entry.answer == b"again"
        assert any("reachable again" in r.getMessage() for r in caplog.records)
    finally:
        await store.close()
        server.stop()


@needs_redis
async def test_redis_short_outage_catches_up_from_the_stream(redis_server, redis_stores, caplog):
    a, b = await redis_stores(), await redis_stores()
    await a.put("t", "before", "p", unit(2), b"a", ttl_s=60)
    assert await eventually(lambda: b.nearest("t", unit(2), 0.99))
    caplog.set_level(logging.INFO, logger="sluice.cache")
    with socket.create_connection(("127.0.0.1", redis_server.port), timeout=1) as s:
        s.sendall(b"CLIENT PAUSE 400 ALL\r\n")  # Redis stops answering, as if overloaded
        s.recv(16)
    started = time.monotonic()
    assert await b.get_exact("t", "k") is None and not b.healthy
    assert time.monotonic() - started < 0.2
    assert await eventually(lambda: _true(b.healthy), timeout=5)
    v = unit(3)
    await a.put("t", "k", "p", v, b"after", ttl_s=60)
    assert (await eventually(lambda: b.nearest("t", v, 0.99))).entry.answer == b"after"
    loads = [r for r in caplog.records if "index loaded" in r.getMessage()]
    assert loads == []  # caught up from the stream, not reloaded whole


@needs_redis
async def test_redis_unreachable_at_start_does_not_fail_start(tmp_path):
    port = free_port()
    store = RedisStore(redis_settings(f"redis://127.0.0.1:{port}/0"))
    started = time.monotonic()
    await store.start()
    try:
        assert time.monotonic() - started < 1 and not store.healthy
        assert await store.get_exact("t", "k") is None
        server = RedisServer(tmp_path, port).start()
        try:
            assert await eventually(lambda: _true(store.healthy), timeout=5)
            await store.put("t", "k", "p", unit(1), b"a", ttl_s=60)
            assert (await store.get_exact("t", "k")).answer == b"a"
        finally:
            server.stop()
    finally:
        await store.close()


@needs_redis
async def test_redis_keys_share_the_scope_hash_tag(redis_server, redis_stores):
    store = await redis_stores()
    await store.put("tenant/model", "abc", "p", unit(1), b"a", ttl_s=60)
    client = AsyncRedis.from_url(redis_server.url)
    try:
        keys = sorted(k.decode() for k in await client.keys("sluice:*"))
        assert keys == ["sluice:events", "sluice:{tenant/model}:e:abc", "sluice:{tenant/model}:ids"]
        assert 0 < await client.pttl("sluice:{tenant/model}:e:abc") <= 60_000
        assert 0 < await client.pttl("sluice:{tenant/model}:ids") <= 60_000
    finally:
        await client.aclose()


@pytest.fixture
def redis_cluster(tmp_path):
    """Three primaries of a real Redis Cluster; the URL of one of them."""
    cli = shutil.which("redis-cli")
    if REDIS is None or cli is None:
        pytest.skip("redis-server and redis-cli are needed for a cluster")
    ports = [_cluster_port() for _ in range(3)]
    procs = []
    try:
        for port in ports:
            (tmp_path / str(port)).mkdir()
            procs.append(subprocess.Popen(
                [REDIS, "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
                 "--cluster-config-file", "nodes.conf", "--save", "", "--appendonly", "no"],
                cwd=tmp_path / str(port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for port in ports:
            _wait_pong(port)
        subprocess.run([cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in ports),
                        "--cluster-replicas", "0", "--cluster-yes"],
                       check=True, capture_output=True, timeout=20)
        deadline = time.monotonic() + 10
        while not all(_cluster_ok(p) for p in ports):
            assert time.monotonic() < deadline, "cluster did not become ok"
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{ports[0]}/0"
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def _cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is valid and free too."""
    while True:
        port = free_port()
        if port + 10000 < 65536:
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port + 10000))
                    return port
                except OSError:
                    pass


def _ask(port: int, command: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
        s.sendall(command)
        return s.recv(4096)


def _wait_pong(port: int) -> None:
    deadline = time.monotonic() + 10
    while True:
        try:
            if _ask(port, b"PING\r\n").startswith(b"+PONG"):
                return
        except OSError:
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.02)


def _cluster_ok(port: int) -> bool:
    return b"cluster_state:ok" in _ask(port, b"CLUSTER INFO\r\n")


@needs_redis
async def test_redis_cluster_every_operation_stays_in_its_scope_slot(redis_cluster, started):
    """Scopes spread over three primaries: puts, scripts, the stream and SCAN all work."""
    make = lambda: started(RedisStore(redis_settings(redis_cluster, cluster=True)))  # noqa: E731
    a = await make()
    for i in range(12):
        await a.put(f"scope{i % 4}", f"k{i}", "p", unit(i), f"a{i}".encode(), ttl_s=60)
    b = await make()  # loads by SCAN across every primary
    assert (await b.nearest("scope1", unit(5), 0.99)).entry.answer == b"a5"
    await a.put("late", "k", "p", unit(50), b"late", ttl_s=60)  # reaches b by the stream
    assert (await eventually(lambda: b.nearest("late", unit(50), 0.99))).entry.answer == b"late"
    assert await b.purge_scope("scope2") == 3
    assert await a.get_exact("scope2", "k6") is None
    assert await a.purge_all() == 10


# -- data this version cannot read: another version's, or corrupt; never a failed request --

async def _raw_redis(server: RedisServer, *command: bytes | str) -> None:
    """One command to the module's redis-server, past the store."""
    async with AsyncRedis(port=server.port) as client:
        await client.execute_command(*command)


def _before_each_pipeline(store, hook) -> None:
    """hook(pipe) runs before each of the store's pipelines is sent; it may raise as Redis would."""
    real = store._client.pipeline

    def pipeline(*args, **kw):
        pipe = real(*args, **kw)
        execute = pipe.execute

        async def hooked(*more, **kws):
            hook(pipe)
            return await execute(*more, **kws)
        pipe.execute = hooked
        return pipe
    store._client.pipeline = pipeline


@needs_redis
async def test_redis_an_entry_with_a_junk_time_is_a_miss(redis_server, redis_stores):
    store = await redis_stores()
    await store.put("t", "k", "p", None, b"answer", ttl_s=60)
    await _raw_redis(redis_server, "HSET", "sluice:{t}:e:k", "t", "not-a-time")
    assert await store.get_exact("t", "k") is None


@needs_redis
async def test_redis_a_malformed_vector_or_event_is_skipped_not_a_stuck_index(redis_server, redis_stores):
    writer = await redis_stores()
    await writer.put("s0", "first", "p", unit(0), b"a", ttl_s=60)     # the stream is not empty
    expires = str(int(time.time() * 1000) + 60_000)
    await _raw_redis(redis_server, "HSET", "sluice:{s2}:e:bad", "p", "p", "a", "a", "t", "1", "x", expires,
               "v", np.zeros(DIM, np.float32).tobytes())                 # a zero vector
    await _raw_redis(redis_server, "ZADD", "sluice:{s2}:ids", "1", "bad")
    before = _metric("sluice_cache_unreadable_total")
    late = await redis_stores()                                         # loads past the bad vector
    assert await late.nearest("s0", unit(0), 0.99) is not None
    await _raw_redis(redis_server, "XADD", "sluice:events", "*", "op", "put", "s", "s3", "k", "odd", "v", "abc")
    await writer.put("s1", "after", "p", unit(1), b"a", ttl_s=60)       # follows past the bad event
    hit = await eventually(lambda: late.nearest("s1", unit(1), 0.99))
    assert hit is not None and hit.entry.entry_id == "after"
    assert _metric("sluice_cache_unreadable_total") >= before + 2


@needs_redis
async def test_redis_a_purge_on_one_replica_drops_anothers_put_asked_for_before_it(redis_stores):
    a, b = await redis_stores(), await redis_stores()
    asked = time.time() - 1
    await a.purge_scope("t")
    assert await b.put("t", "k", "p", unit(1), b"wrong", ttl_s=60, asked_at=asked) is False
    assert await a.get_exact("t", "k") is None and await b.get_exact("t", "k") is None
    assert b._local.scope_size("t") == 0                  # not in its semantic index either
    assert await b.put("t", "k", "p", unit(1), b"fresh", ttl_s=60, asked_at=time.time()) is True
    assert (await a.get_exact("t", "k")).answer == b"fresh"


@needs_redis
async def test_redis_purge_all_is_heard_by_every_replica_and_scans_the_keyspace_once(redis_server, redis_stores):
    """A replica that did not purge drops puts asked for before the purge_all too; and the
    purge finds stray entries with one SCAN of the keyspace, not one per scope."""
    a, b = await redis_stores(), await redis_stores()
    for i in range(50):
        await a.put(f"scope{i}", "k", "p", None, b"x", ttl_s=60)
    asked = time.time() - 1
    async with AsyncRedis(port=redis_server.port) as admin:
        await admin.config_resetstat()
        assert await a.purge_all() == 50
        scans = (await admin.info("commandstats")).get("cmdstat_scan", {}).get("calls", 0)
    assert scans <= 5, f"{scans} SCAN calls for one purge_all of 50 scopes"

    assert await eventually(lambda: _true(b._purged_all_at > asked))     # heard from the stream
    await b.put("new", "k", "p", unit(1), b"wrong", ttl_s=60, asked_at=asked)
    assert await b.get_exact("new", "k") is None
    late = await redis_stores()                          # started after: reads the time from Redis
    await late.put("newer", "k", "p", unit(1), b"wrong", ttl_s=60, asked_at=asked)
    assert await late.get_exact("newer", "k") is None


@needs_redis
async def test_redis_a_purge_also_forgets_the_answers_kept_for_late_twins(redis_server, redis_stores):
    store = await redis_stores()
    async with AsyncRedis(port=redis_server.port) as client:
        inflight = RedisInFlight(client, InFlight(), done_ms=60_000, op_timeout_s=0.5)
        try:
            scope = "ab" * 32
            lead = await inflight.join(scope, "k")
            lead.complete(b"an answer the admin is about to purge")
            await asyncio.wait(set(inflight._tasks))
            await store.put(scope, "k", "p", None, b"an answer the admin is about to purge", ttl_s=60)
            await store.purge_scope(scope)
            again = await inflight.join(scope, "k")
            assert isinstance(again, Lead)           # not Answered with the purged payload
            again.abandon()
        finally:
            await inflight.aclose()


@needs_redis
async def test_redis_a_put_whose_stream_event_failed_reaches_the_replicas_later(redis_stores):
    a, b = await redis_stores(), await redis_stores()
    await a.put("t", "earlier", "p", unit(9), b"x", ttl_s=60)       # the stream is not empty
    assert await eventually(lambda: b.nearest("t", unit(9), 0.99))
    failed = []

    def fail_once(pipe):                                            # the event's round trip fails once
        if not failed:
            failed.append(True)
            raise RedisTimeoutError("as if the deadline hit between the entry and its event")
    _before_each_pipeline(a, fail_once)
    await a.put("t", "k", "p", unit(1), b"answer", ttl_s=60)
    assert failed and (await b.get_exact("t", "k")).answer == b"answer"
    hit = await eventually(lambda: b.nearest("t", unit(1), 0.99), timeout=5)
    assert hit is not None and hit.entry.entry_id == "k"            # b's semantic index has it


@needs_redis
async def test_redis_events_waiting_for_a_retry_go_a_few_at_a_time(redis_stores):
    a, b = await redis_stores(), await redis_stores()
    refusing, sizes = [True], []

    def maybe_refuse(pipe):                      # Redis out of memory: XADD refused, still up
        sizes.append(len(pipe.command_stack))
        if refusing[0]:
            raise ResponseError("OOM command not allowed when used memory > 'maxmemory'")
    _before_each_pipeline(a, maybe_refuse)
    for i in range(100):
        await a.put("t", f"k{i}", "p", unit(i), b"a", ttl_s=60)
    assert a.healthy and max(sizes) <= REPUBLISH_BATCH + 1          # never the whole backlog at once
    refusing[0] = False
    for i in range(100, 103):                                        # the next puts drain it
        await a.put("t", f"k{i}", "p", unit(i), b"a", ttl_s=60)
    assert await eventually(lambda: b.nearest("t", unit(102), 0.99))      # the stream is in order
    assert all([await b.nearest("t", unit(i), 0.99) for i in range(103)])


# -- Redis as production runs it: full, evicting, stalling, closing idle connections ------------

@needs_redis
async def test_redis_full_under_noeviction_still_serves_what_it_has(tmp_path):
    """Full, Redis refuses writes: the lookup's LRU mark among them. The answer is still there to
    read, so it is a hit, not a miss for every request until memory frees up."""
    server = RedisServer(tmp_path, args=("--maxmemory-policy", "noeviction")).start()
    store = RedisStore(redis_settings(server.url))
    try:
        await store.start()
        await store.put("t", "k", "p", unit(1), b"answer", ttl_s=60)
        async with AsyncRedis(port=server.port) as raw:
            for i in range(20):
                await raw.set(f"ballast:{i}", b"x" * 100_000)
            await raw.config_set("maxmemory", "1mb")
            with pytest.raises(ResponseError, match="maxmemory"):
                await raw.set("probe", b"x")
        assert (await store.get_exact("t", "k")).answer == b"answer"
        assert (await store.nearest("t", unit(1), 0.9)).entry.answer == b"answer"
        assert store.healthy
    finally:
        await store.close()
        server.stop()


@needs_redis
async def test_redis_purges_find_answers_whose_id_set_redis_evicted(redis_server, redis_stores):
    """Under allkeys-lru (or volatile-lru: every key has a TTL) a full Redis may evict a scope's
    id set and keep some of its answers: a purge must delete those too, or they stay served."""
    store, other = await redis_stores(), await redis_stores()
    for scope in ("t", "u"):
        for i in range(5):
            await store.put(scope, f"k{i}", "p", unit(i), b"a", ttl_s=60)
    await _raw_redis(redis_server, "DEL", "sluice:{t}:ids", "sluice:{u}:ids")     # as LRU would
    assert await store.purge_scope("t") == 5
    assert await store.get_exact("t", "k0") is None
    assert await eventually(lambda: _true(other._local.scope_size("t") == 0))
    assert await store.purge_all() == 5                                  # "u": no id set either
    assert await store.get_exact("u", "k0") is None


@needs_redis
async def test_redis_a_failed_lookup_wakes_the_reconnect_without_waiting_for_the_stream_read(
        redis_server, redis_stores):
    """A stall marks Redis down at the first slow lookup; only the local tier answers until the
    store reconnects. That must not wait for the stream reader's blocking XREAD to return."""
    store = await redis_stores(stream_block_ms=5000)
    await store.put("t", "k", "p", unit(1), b"a", ttl_s=60)
    await asyncio.sleep(0.2)                                # the reader is in its 5 s XREAD
    await _raw_redis(redis_server, "CLIENT", "PAUSE", "300")
    assert await store.get_exact("t", "elsewhere") is None and not store.healthy    # timed out: down
    paused_at = time.monotonic()
    assert await eventually(lambda: _true(store.healthy), timeout=5)
    assert time.monotonic() - paused_at < 2.5               # the pause, a reconnect: not the 5 s read
    assert (await store.get_exact("t", "k")).answer == b"a"


@needs_redis
async def test_redis_closing_idle_connections_is_no_outage(tmp_path, caplog):
    """Redis `timeout` (managed Redis and NATs alike) closes idle connections: the next command
    on one fails, and is tried again on a fresh connection instead of setting Redis aside."""
    server = RedisServer(tmp_path, args=("--timeout", "1")).start()
    store = RedisStore(redis_settings(server.url))
    dedup = RedisInFlight(connect(server.url, timeout_s=0.5), InFlight())
    every_tenant = RateLimitRule(RateLimits(requests_per_minute=1000))
    limiter = RedisTokenLimiter(connect(server.url, timeout_s=0.5), TokenLimitsConfig(rules=(every_tenant,)))
    caplog.set_level(logging.INFO)
    try:
        await store.start()
        await store.put("t", "k", "p", unit(1), b"answer", ttl_s=60)
        (await dedup.join("s", "k0")).complete(b"x")
        assert (await limiter.check("tenant", "chat", 10)).allowed
        await asyncio.sleep(2.2)                            # every pooled connection idle past 1 s
        assert (await store.get_exact("t", "k")).answer == b"answer"
        lead = await dedup.join("s", "k1")
        lead.abandon()
        assert (await limiter.check("tenant", "chat", 10)).allowed
        assert store.healthy and dedup.available and limiter.shared
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    finally:
        await store.close()
        await dedup.aclose()
        server.stop()


@needs_redis
async def test_redis_cluster_from_the_sidecars_config(redis_cluster):
    """SLUICE_REDIS_CLUSTER: the store, cross-replica dedup and the token limiter all use
    cluster clients, so scopes and tenants on every primary work (plain clients got MOVED)."""
    # A generous round trip: on a loaded 2-core box 50 ms trips, and the parts go local.
    config = SidecarConfig(redis_url=redis_cluster, redis_cluster=True, redis_timeout_s=0.5,
                           cache_secret="s" * 16, semantic=False)
    apps = [build(config), build(config)]
    for app in apps:
        await app.start()
    try:
        (store, dedup), (_, other_dedup) = [(a.store, a.pipeline.cache._rt.inflight) for a in apps]
        limiter = apps[0].pipeline.route.admission._tokens
        limiter.config = TokenLimitsConfig(rules=(RateLimitRule(RateLimits(requests_per_minute=1)),))
        for i in range(8):                                  # over all three primaries
            scope = f"scope{i}"
            await store.put(scope, "k", "p", unit(i), b"answer", ttl_s=60)
            assert (await store.get_exact(scope, "k")).answer == b"answer"
            lead = await dedup.join(scope, "k")
            follow = await other_dedup.join(scope, "k")
            lead.complete(b"twin")
            assert (await follow.wait(5)).payload == b"twin"
            assert [(await limiter.check(f"tenant{i}", "chat", 1)).allowed for _ in range(2)] == [True, False]
        assert store.healthy and dedup.available and other_dedup.available and limiter.shared
    finally:
        for app in apps:
            await app.close()


@needs_redis
async def test_a_cluster_node_used_as_one_server_is_named_in_the_log(redis_cluster, started, caplog):
    caplog.set_level(logging.ERROR, logger="sluice.cache")
    await started(RedisStore(redis_settings(redis_cluster)))
    assert any("SLUICE_REDIS_CLUSTER is off" in r.getMessage() for r in caplog.records)


@needs_redis
async def test_a_redis_older_than_7_is_named_in_the_log(redis_stores, caplog):
    """Storing needs PEXPIRE NX/GT (7.0): on 6.x every put would fail, with the backend up."""
    store = await redis_stores()
    real_info = store._client.info

    async def info(section=None):
        return {**await real_info(section), "redis_version": "6.2.14"}
    store._client.info, store._said_misfit = info, False
    caplog.set_level(logging.ERROR, logger="sluice.cache")
    await store._server_id()
    assert any("runs Redis 6.2.14" in r.getMessage() for r in caplog.records)


# -- the local tier: what a replica answers while Redis is down -----------------------------


@pytest.fixture
async def own_redis(tmp_path, started):
    """A redis-server of this test's own (to kill or freeze) and started_replica() on it."""
    server = RedisServer(tmp_path).start()

    async def replica(**kw):
        return await started(RedisStore(redis_settings(server.url, **kw)))

    yield server, replica
    if server.proc is not None and server.proc.poll() is None:
        server.proc.send_signal(signal.SIGCONT)
    server.stop()


async def _until_down(store: RedisStore) -> None:
    """The first lookup after the fault marks Redis down (one deadline); later ones are local."""
    await store.get_exact("none", "none")
    assert not store.healthy


@needs_redis
@pytest.mark.parametrize("fault", ["SIGKILL", "SIGSTOP"])
async def test_redis_down_the_local_tier_answers_what_this_replica_stored_or_fetched(own_redis, fault):
    server, replica = own_redis
    a, b = await replica(), await replica()
    await a.put("t", "mine", "p", unit(1), b"a-mine", ttl_s=60)
    await b.put("t", "theirs", "p", unit(2), b"b-theirs", ttl_s=60)
    await b.put("t", "unread", "p", unit(3), b"b-unread", ttl_s=60)
    assert (await a.get_exact("t", "theirs")).answer == b"b-theirs"   # fetched: kept locally
    hits = _metric("sluice_cache_local_tier_hits_total", {"tier": "exact"})

    server.proc.send_signal(getattr(signal, fault))
    await _until_down(a)
    started = time.monotonic()
    assert (await a.get_exact("t", "mine")).answer == b"a-mine"
    assert (await a.get_exact("t", "theirs")).answer == b"b-theirs"
    assert (await a.nearest("t", towards(unit(1), 0.95), 0.9)).entry.answer == b"a-mine"
    assert await a.get_exact("t", "unread") is None               # never had it: a miss
    assert await a.nearest("t", unit(3), 0.9) is None             # its vector alone serves nothing
    await a.put("t", "during", "p", unit(4), b"a-during", ttl_s=60)
    assert (await a.get_exact("t", "during")).answer == b"a-during"
    assert time.monotonic() - started < 0.1                       # no call waits on Redis
    assert _metric("sluice_cache_local_tier_hits_total", {"tier": "exact"}) == hits + 3
    assert _metric("sluice_cache_local_tier_hits_total", {"tier": "nearest"}) >= 1
    if fault == "SIGSTOP":
        server.proc.send_signal(signal.SIGCONT)                   # the same process: caught up, kept
        assert await eventually(lambda: _true(a.healthy), timeout=5)
        assert (await a.get_exact("t", "mine")).answer == b"a-mine"
        assert (await b.get_exact("t", "mine")).answer == b"a-mine"


@needs_redis
async def test_redis_the_local_tier_honours_purges_and_other_replicas_puts(own_redis):
    server, replica = own_redis
    a, b = await replica(), await replica()
    for key in ("purged", "replaced", "deleted", "kept"):
        await b.put("t", key, "p", None, b"old " + key.encode(), ttl_s=60)
    await b.put("other", "purged", "p", None, b"elsewhere", ttl_s=60)
    asked_at = time.time()
    await a.purge_scope("t")                                      # heard by b from the stream
    assert await eventually(lambda: _true(b._local.peek("t", "purged") is None))
    for key in ("replaced", "kept", "deleted"):
        await b.put("t", key, "p", None, b"new " + key.encode(), ttl_s=60)
    await a.put("t", "replaced", "p", None, b"a's answer", ttl_s=60)
    assert await eventually(lambda: _true(b._local.peek("t", "replaced") is None))
    async with AsyncRedis(port=server.port) as raw:              # gone from Redis, as Redis evicts
        await raw.delete(b._keys.entry("t", "deleted"))
    assert await b.get_exact("t", "deleted") is None

    server.proc.send_signal(signal.SIGKILL)
    await _until_down(b)
    await b.put("t", "late", "p", None, b"asked before the purge", ttl_s=60, asked_at=asked_at)
    assert await b.get_exact("t", "purged") is None
    assert await b.get_exact("t", "late") is None
    assert await b.get_exact("t", "replaced") is None             # not b's stale answer
    assert await b.get_exact("t", "deleted") is None
    assert (await b.get_exact("t", "kept")).answer == b"new kept"
    assert (await b.get_exact("other", "purged")).answer == b"elsewhere"


@needs_redis
async def test_redis_the_local_tier_honours_purge_all_and_its_ttl(own_redis):
    server, replica = own_redis
    a, b = await replica(), await replica()
    await b.put("t", "k", "p", None, b"a", ttl_s=60)
    await a.purge_all()
    assert await eventually(lambda: _true(len(b._local) == 0))
    await b.put("t", "k2", "p", None, b"kept", ttl_s=60)
    await b.put("t", "short", "p", None, b"brief", ttl_s=0.3)
    server.proc.send_signal(signal.SIGKILL)
    await _until_down(b)
    assert (await b.get_exact("t", "k2")).answer == b"kept"
    assert (await b.get_exact("t", "short")).answer == b"brief"
    await asyncio.sleep(0.35)
    assert await b.get_exact("t", "short") is None


async def test_the_sidecar_exports_what_its_cache_holds_against_each_share_of_the_budget():
    from sidecar.cache.budget import CacheBudget
    app = build(SidecarConfig(semantic=False, cache_max_mib=64))
    budget = CacheBudget(64 * 2**20)
    for part, share in (("store", budget.store), ("profiles", budget.profiles), ("memos", budget.memos),
                        ("token_states", budget.token_states)):
        assert _metric("sluice_cache_memory_budget_bytes", {"part": part}) == share
    held = _metric("sluice_cache_memory_bytes", {"part": "store"})
    await app.store.put("t", "k", "p", unit(1), b"a" * 10_000, ttl_s=60)
    assert _metric("sluice_cache_memory_bytes", {"part": "store"}) > held + 10_000


# -- token states beside the entries (a verifier's, sidecar/cache/token_states.py) ----------

STATES = b"states of the prompt" * 10


async def test_the_memory_store_keeps_no_states(make_store):
    store = await make_store()
    assert await store.put("t", "k", "p", unit(1), b"a", 60, states=STATES)
    expected = [STATES] if isinstance(store, RedisStore) else [None]
    assert await store.get_states("t", ["k"], 1 << 20) == expected


@needs_redis
async def test_redis_states_put_by_one_replica_are_read_by_another(redis_stores):
    a, b = await redis_stores(), await redis_stores()
    await a.put("t", "k1", "p1", unit(1), b"a1", 60, states=STATES)
    await a.put("t", "k2", "p2", unit(2), b"a2", 60)                       # none kept
    assert await b.get_states("t", ["k1", "k2", "gone"], 1 << 20) == [STATES, None, None]
    assert await b.get_states("other-tenant", ["k1"], 1 << 20) == [None]    # scoped
    assert await b.get_states("t", [], 1 << 20) == []
    # A value over the bound is never read whole: a miss, and Redis sends its length, not it.
    assert await b.get_states("t", ["k1"], len(STATES) - 1) == [None]
    keys = [b._keys.entry("t", "k1")]
    assert await b._states_script(keys=keys, args=[len(STATES) - 1]) == [len(STATES)]
    assert await b._states_script(keys=keys, args=[len(STATES)]) == [STATES]
    # An exact lookup does not carry the states (they are read only when the verifier needs them).
    assert (await b.get_exact("t", "k1")).answer == b"a1"


@needs_redis
async def test_redis_states_go_with_their_entry(redis_stores, redis_server):
    store = await redis_stores()
    store.limits = StoreLimits(max_entries=100, max_entries_per_scope=1)
    await store.put("t", "k1", "p", unit(1), b"a", 60, states=STATES)
    await store.put("t", "k2", "p", unit(2), b"a", 60, states=STATES)      # evicts k1
    assert await store.get_states("t", ["k1", "k2"], 1 << 20) == [None, STATES]
    await store.put("t", "k2", "p", unit(2), b"a", 60)                       # replaced without
    assert await store.get_states("t", ["k2"], 1 << 20) == [None]
    await store.put("t", "k3", "p", unit(3), b"a", 60, states=STATES)
    await store.put("u", "k3", "p", unit(3), b"a", 60, states=STATES)
    await store.purge_scope("t")
    assert await store.get_states("t", ["k3"], 1 << 20) == [None]
    assert await store.get_states("u", ["k3"], 1 << 20) == [STATES]
    client = AsyncRedis.from_url(redis_server.url)
    try:
        ttl = await client.pttl(store._keys.entry("u", "k3"))
        assert 0 < ttl <= 60_000                                            # the entry's TTL
    finally:
        await client.aclose()


@needs_redis
async def test_redis_states_of_a_broken_entry_or_a_down_backend_are_none(redis_stores, redis_server):
    store = await redis_stores()
    client = AsyncRedis.from_url(redis_server.url)
    try:
        await client.set(store._keys.entry("t", "not-a-hash"), b"x")       # not this code's
    finally:
        await client.aclose()
    assert await store.get_states("t", ["not-a-hash"], 1 << 20) == [None]
    await store.put("t", "k", "p", unit(1), b"a", 60, states=STATES)
    store._mark_down("test", ConnectionError("down"))
    assert await store.get_states("t", ["k"], 1 << 20) == [None]
