"""The shared cache tier: two sidecar replicas behind the real Envoy, sharing a real redis-server.

Envoy spreads ext_proc streams over the replicas; which one served a request is read from the
replicas' own metrics (the sidecar counts every cached-route request in
sluice_cache_requests_total before it answers).
"""
import asyncio
import re
import signal
import time
from collections import Counter

import httpx
import openai
import pytest

from devtools.stack import Stack, http_get
from tests.support.e2e import chat_route
from tests.support.redis_server import RedisServer

SECRET = "a-secret-of-at-least-16-bytes"
REPLICAS = ("sidecar", "sidecar2")
VERIFIED = chat_route("verified", "/verified/", [{"cluster": "upstream_a"}], rewrite="/")
VERIFIED["metadata"]["filter_metadata"]["sluice"]["cache"] = {"max_false_hit_rate": 0.02}
# The lexical decision (τ and the checks): vectors mirrored by every replica, no token states.
LEXICAL = chat_route("lexical", "/lexical/", [{"cluster": "upstream_a"}], rewrite="/")
LEXICAL["metadata"]["filter_metadata"]["sluice"]["cache"] = {"max_false_hit_rate": 0}
ROUTES = [VERIFIED, LEXICAL, chat_route("chat", "/", [{"cluster": "upstream_a"}])]
FAST = {"ttft_ms": 20, "tokens": 8, "tokens_per_s": 1000, "error_rate": 0.0}


@pytest.fixture(scope="module")
def redis(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def stack(redis, tmp_path_factory):
    stack = Stack(tmp_path_factory.mktemp("stack"), routes=ROUTES, sidecars=2,
                  sidecar_env={"SLUICE_CACHE": "true", "SLUICE_REDIS_URL": redis.url, "SLUICE_CACHE_SECRET": SECRET},
                  upstream_args={"a": ["--ttft-ms", "20", "--tokens", "8", "--tokens-per-s", "1000"]})
    try:
        stack.start()
    except Exception as exc:        # show why a replica did not come up, not only Envoy's view
        logs = {r: (stack.workdir / f"{r}.log").read_text()[-400:] for r in REPLICAS
                if (stack.workdir / f"{r}.log").exists()}
        pytest.fail(f"stack did not start ({exc}); replica logs: {logs}", pytrace=False)
    yield stack
    stack.stop()


@pytest.fixture(autouse=True)
def running_redis_and_fast_upstream(stack, redis):
    if redis.proc is None:          # a test above left it stopped
        redis.start()
    yield
    httpx.post(f"http://127.0.0.1:{stack.ports.upstream_a}/admin/config", json=FAST).raise_for_status()


# --- helpers ------------------------------------------------------------------------------

def replica_metric(stack, replica, name, **labels) -> float:
    _, text = http_get(f"http://127.0.0.1:{stack.sidecar_ports(replica)[1]}/metrics")
    total = 0.0
    for line in text.splitlines():
        match = re.match(rf"^{re.escape(name)}(\{{.*\}})? (\S+)$", line)
        if match:
            found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1) or ""))
            if all(found.get(k) == v for k, v in labels.items()):
                total += float(match.group(2))
    return total


def lookups(stack) -> dict:
    return {r: replica_metric(stack, r, "sluice_cache_requests_total") for r in REPLICAS}


def upstream_requests(stack) -> int:
    return httpx.get(f"http://127.0.0.1:{stack.ports.upstream_a}/admin/stats").json()["requests"]


def sdk(stack, key, path=None) -> openai.OpenAI:
    base_url = stack.base_url if path is None else f"http://127.0.0.1:{stack.ports.http}{path}"
    return openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=30)


def ask(stack, c, prompt):
    """(content, x-sluice-cache, replica that served it, seconds)."""
    before = lookups(stack)
    started = time.monotonic()
    raw = c.chat.completions.with_raw_response.create(
        model="demo-model", messages=[{"role": "user", "content": prompt}])
    elapsed = time.monotonic() - started
    content = raw.parse().choices[0].message.content
    after = lookups(stack)
    served = [r for r in REPLICAS if after[r] > before[r]]
    assert len(served) == 1, (before, after)
    return content, raw.headers.get("x-sluice-cache"), served[0], elapsed


def wait_stored(stack, replica, count, timeout=5.0) -> None:
    deadline = time.monotonic() + timeout
    while replica_metric(stack, replica, "sluice_cache_stored_total") < count and time.monotonic() < deadline:
        time.sleep(0.05)


def wait_backend_up(stack, timeout=5.0) -> None:
    for replica in REPLICAS:
        deadline = time.monotonic() + timeout
        while replica_metric(stack, replica, "sluice_cache_backend_up") != 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert replica_metric(stack, replica, "sluice_cache_backend_up") == 1, replica


def ask_on_other_replica(stack, c, prompt, first, tries=30):
    """Ask until a replica other than `first` serves the request: its (content, status)."""
    for _ in range(tries):
        content, status, replica, _ = ask(stack, c, prompt)
        if replica != first:
            return content, status
    pytest.fail(f"Envoy sent {tries} requests in a row to {first}")


def semantic_on_other_replica(stack, c, prompt, first):
    """Ask on a replica other than `first` until it serves a semantic hit (it learns the stored
    vector from the Redis stream: within a few seconds): the last (content, status)."""
    deadline, status = time.monotonic() + 5, None
    while status != "semantic" and time.monotonic() < deadline:
        content, status = ask_on_other_replica(stack, c, prompt, first)
        if status != "semantic":
            time.sleep(0.2)
    return content, status


def store_via_one_replica(stack, c, prompt):
    """Ask once (a miss), wait until the serving replica stored it: (content, replica)."""
    stored = {r: replica_metric(stack, r, "sluice_cache_stored_total") for r in REPLICAS}
    content, status, replica, _ = ask(stack, c, prompt)
    assert status == "miss"
    wait_stored(stack, replica, stored[replica] + 1)
    time.sleep(0.1)         # counted when captured; the write to Redis follows in the background
    return content, replica


# --- tests --------------------------------------------------------------------------------

def test_both_replicas_use_redis(stack):
    for replica in REPLICAS:
        assert stack.procs[replica].poll() is None, (stack.workdir / f"{replica}.log").read_text()[-3000:]
        assert replica_metric(stack, replica, "sluice_cache_backend_up") == 1


def test_answer_stored_via_one_replica_is_an_exact_hit_via_the_other(stack):
    c = sdk(stack, "key-shared-exact")
    before = upstream_requests(stack)
    original, first = store_via_one_replica(stack, c, "What is the tallest mountain in Africa?")
    content, status = ask_on_other_replica(stack, c, "What is the tallest mountain in Africa?", first)
    assert status == "exact" and content == original
    assert upstream_requests(stack) - before == 1


def test_semantic_hit_across_replicas(stack):
    c = sdk(stack, "key-shared-semantic", "/lexical/v1")
    original, first = store_via_one_replica(stack, c, "How do I reset my router?")
    content, status = semantic_on_other_replica(stack, c, "how can I reset my router?", first)
    assert status == "semantic" and content == original


def test_a_verifier_route_serves_across_replicas_with_the_states_stored_beside_the_entry(stack):
    """The verifier reads the stored prompt's token states: a replica that did not store the
    entry reads them from Redis, where the storing replica put them with it."""
    c = sdk(stack, "key-shared-verified", "/verified/v1")
    checks = "sluice_cache_semantic_checks_total"
    missing = {r: replica_metric(stack, r, checks, reason="verifier_no_states") for r in REPLICAS}
    original, first = store_via_one_replica(stack, c, "Can you explain how a star becomes a black hole?")
    other = next(r for r in REPLICAS if r != first)
    content, status = semantic_on_other_replica(stack, c, "Explain how a star becomes a black hole.", first)
    assert status == "semantic" and content == original
    assert replica_metric(stack, other, checks, reason="verifier_no_states") == missing[other]


def test_tenants_stay_apart_across_replicas(stack):
    before = upstream_requests(stack)
    _, first = store_via_one_replica(stack, sdk(stack, "key-shared-tenant-1"), "Who painted the Mona Lisa?")
    other = sdk(stack, "key-shared-tenant-2")
    statuses = [ask(stack, other, "Who painted the Mona Lisa?")[1] for _ in range(4)]
    assert statuses[0] == "miss" and set(statuses) <= {"miss", "exact"}, statuses
    assert upstream_requests(stack) - before == 1 + statuses.count("miss")


# Past its 50 ms deadline a Redis call leaves the replica deduplicating alone for a second (by
# design, logged): on a loaded machine a burst can meet that, and then goes upstream once per
# replica. Such a burst is not judged; a fresh prompt is tried, and every burst doing so fails.
FALLBACK = "in-flight dedup within this replica"
BURST_PROMPTS = ("Explain the offside rule in football.", "How does a bicycle derailleur shift gears?",
                 "Why do onions make people cry when cut?")


def fallbacks(stack) -> int:
    return sum((stack.workdir / f"{r}.log").read_text(errors="replace").count(FALLBACK) for r in REPLICAS)


def test_concurrent_identical_requests_across_replicas_go_upstream_once(stack):
    httpx.post(f"http://127.0.0.1:{stack.ports.upstream_a}/admin/config",
               json={"ttft_ms": 1000}).raise_for_status()

    async def burst(n, prompt):
        c = openai.AsyncOpenAI(base_url=stack.base_url, api_key="key-shared-dedup", max_retries=0, timeout=30)

        async def one():
            raw = await c.chat.completions.with_raw_response.create(
                model="demo-model", messages=[{"role": "user", "content": prompt}])
            return raw.parse().choices[0].message.content, raw.headers.get("x-sluice-cache")
        try:
            return await asyncio.gather(*(one() for _ in range(n)), return_exceptions=True)
        finally:
            await c.close()

    for prompt in BURST_PROMPTS:
        before_upstream, before_fallbacks = upstream_requests(stack), fallbacks(stack)
        before = {r: replica_metric(stack, r, "sluice_cache_requests_total", result="coalesced") for r in REPLICAS}
        results = asyncio.run(burst(20, prompt))
        if fallbacks(stack) == before_fallbacks:
            break
        time.sleep(1.2)             # the replica tries Redis again after a second
    assert fallbacks(stack) == before_fallbacks, "every burst met a Redis call past its deadline"
    assert not [r for r in results if isinstance(r, BaseException)], results
    statuses = Counter(s for _, s in results)
    assert statuses["miss"] == 1, statuses
    # Late ones may find the stored answer (semantic: stored between their two lookups).
    assert set(statuses) <= {"miss", "coalesced", "exact", "semantic"}, statuses
    assert len({content for content, _ in results}) == 1
    coalesced = {r: replica_metric(stack, r, "sluice_cache_requests_total", result="coalesced") - before[r]
                 for r in REPLICAS}
    assert all(n > 0 for n in coalesced.values()), coalesced       # followers on both replicas
    assert upstream_requests(stack) - before_upstream == 1


def test_requests_keep_succeeding_while_redis_is_down(stack, redis):
    """Redis down costs sharing, not caching: a replica answers its own repeats from its local
    tier (a prompt goes upstream at most once per replica), fast, and nothing fails."""
    redis.stop()
    c = sdk(stack, "key-redis-down")
    before = upstream_requests(stack)
    seen, slowest, first_answer, statuses = set(), 0.0, {}, Counter()
    for i in range(12):
        prompt = f"Name a river in country number {i % 3}."     # each asked 4 times
        content, status, replica, elapsed = ask(stack, c, prompt)
        if (prompt, replica) in first_answer:               # this replica has it: a local hit
            assert (content, status) == (first_answer[prompt, replica], "exact"), i
        else:
            assert content and status == "miss", (i, status)
            first_answer[prompt, replica] = content
        statuses[status] += 1
        seen.add(replica)
        slowest = max(slowest, elapsed)
    assert slowest < 2.0, slowest
    assert seen == set(REPLICAS)
    assert statuses["exact"] >= 6 and statuses["miss"] == len(first_answer), statuses
    assert upstream_requests(stack) - before == statuses["miss"]
    for replica in REPLICAS:
        assert stack.procs[replica].poll() is None
        assert replica_metric(stack, replica, "sluice_cache_backend_up") == 0


@pytest.mark.parametrize("fault", [signal.SIGSTOP, signal.SIGKILL], ids=["frozen", "killed"])
def test_exact_hits_stored_before_redis_fails_continue_on_every_replica(stack, redis, fault):
    """An answer stored via one replica and fetched via the other is served by both from their
    local tiers once Redis is frozen or killed: no request goes upstream for it."""
    wait_backend_up(stack)
    c = sdk(stack, f"key-local-tier-{fault.name}")
    prompt = f"Which sea is the saltiest ({fault.name})?"
    original, first = store_via_one_replica(stack, c, prompt)
    assert ask_on_other_replica(stack, c, prompt, first) == (original, "exact")
    before = upstream_requests(stack)
    redis.proc.send_signal(fault)
    try:
        served = Counter()
        for _ in range(10):
            content, status, replica, elapsed = ask(stack, c, prompt)
            assert (content, status) == (original, "exact")
            assert elapsed < 1.0, elapsed
            served[replica] += 1
        assert upstream_requests(stack) - before == 0
        assert set(served) == set(REPLICAS), served
        assert sum(replica_metric(stack, r, "sluice_cache_local_tier_hits_total") for r in REPLICAS) >= 10
    finally:
        if fault == signal.SIGSTOP:
            redis.proc.send_signal(signal.SIGCONT)
        else:
            redis.stop()            # reaped; the next test's fixture starts it again


def test_shared_tier_resumes_after_redis_restart(stack, redis):
    redis.stop()
    c = sdk(stack, "key-redis-back")
    ask(stack, c, "Is this request served without Redis?")       # both replicas notice soon enough
    redis.start()                                                # same port, empty
    deadline, i, status = time.monotonic() + 20, 0, None
    while status != "exact" and time.monotonic() < deadline:
        prompt = f"What is the capital of country number {i}?"
        i += 1
        original, first = store_via_one_replica(stack, c, prompt)
        content, status = ask_on_other_replica(stack, c, prompt, first)
        if status != "exact":
            time.sleep(0.25)
    assert status == "exact" and content == original
    wait_backend_up(stack)


def test_zz_replicas_alive_and_streams_closed(stack):
    for replica in REPLICAS:
        assert stack.procs[replica].poll() is None
        deadline = time.monotonic() + 10
        while replica_metric(stack, replica, "sluice_open_streams") != 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert replica_metric(stack, replica, "sluice_open_streams") == 0
        assert "Traceback" not in (stack.workdir / f"{replica}.log").read_text()
