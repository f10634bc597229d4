"""Admission control through the real Envoy: priority queueing, deadlines, disconnects, limits."""
import json
import threading
import time
from collections import Counter

import httpx
import pytest

from devtools.envoy_config import chat_route
from devtools.stack import http_get
from tests.support.e2e import ask, metric, upstream_stats
from tests.support.e2e import client as e2e_client
from tests.support.redis_server import RedisServer

BODY = {"model": "demo-model", "messages": [{"role": "user", "content": "hello"}]}


def admission_route(name, prefix, admission, max_in_flight=1, candidates=None, cache=None):
    route = chat_route(name, prefix, candidates or [{"cluster": "upstream_a", "max_in_flight": max_in_flight}],
                       rewrite="/")
    route["metadata"]["filter_metadata"]["sluice"]["admission"] = {"enabled": True, **admission}
    if cache is not None:
        route["metadata"]["filter_metadata"]["sluice"]["cache"] = cache
    return route


VLLM_B = {"cluster": "upstream_b", "engine_priority": {"kind": "vllm"}}
DYNAMO_B = {"cluster": "upstream_b",
            "engine_priority": {"kind": "field", "field": "nvext.agent_hints.priority", "higher_first": True}}
PRIMARY_A = {"cluster": "upstream_a", "max_in_flight": 1}
FALLBACK_B = {"cluster": "upstream_b", "role": "fallback"}


def post(stack, prefix, key="k1", timeout=30.0, headers=None):
    url = f"http://127.0.0.1:{stack.ports.http}{prefix}v1/chat/completions"
    return httpx.post(url, json=BODY, timeout=timeout,
                      headers={"authorization": f"Bearer {key}", **(headers or {})})


ROUTES = [
    admission_route("engine_vip", "/engine-vip/", {"default_priority": "vip"}, candidates=[VLLM_B]),
    admission_route("engine_batch", "/engine-batch/", {"default_priority": "batch", "engine_ranks": {"batch": 7}},
                    candidates=[VLLM_B]),
    admission_route("dynamo", "/dynamo/", {"default_priority": "vip"}, candidates=[DYNAMO_B]),
    # The client's priority goes nowhere: b (never picked, weight 0) reads it, a does not.
    admission_route("strip", "/strip/", {}, candidates=[{"cluster": "upstream_a"}, {**VLLM_B, "weight": 0}]),
    admission_route("degrade", "/degrade/", {"degrade_after_s": 0.05}, candidates=[PRIMARY_A, FALLBACK_B]),
    admission_route("degrade_deadline", "/degrade-deadline/", {}, candidates=[PRIMARY_A, FALLBACK_B]),
    admission_route("fair", "/fair/", {"tenant_weights": {"gold": 3}}, cache={"tenant_header": "x-tenant"}),
    admission_route("vip", "/vip/", {"default_priority": "vip"}),
    admission_route("metered", "/metered/", {"tokens_per_minute": 1_000_000}, max_in_flight=8),
    admission_route("limited", "/limited/", {"requests_per_minute": 2}, max_in_flight=8),
    admission_route("standard", "/", {"default_priority": "standard"}),
]


@pytest.fixture(scope="module")
def stack(make_module_stack):
    return make_module_stack(routes=ROUTES, upstream_args={
        "a": ["--ttft-ms", "300", "--tokens", "2", "--tokens-per-s", "1000"],
        "b": ["--scheduling-policy", "priority", "--ttft-ms", "0", "--tokens", "2"]})


def last_upstream_body(stack, name):
    port = getattr(stack.ports, f"upstream_{name}")
    return httpx.get(f"http://127.0.0.1:{port}/admin/last").json()["body"]


def post_body(stack, prefix, body, headers=None):
    return httpx.post(f"http://127.0.0.1:{stack.ports.http}{prefix}v1/chat/completions", json=body, timeout=30,
                      headers={"authorization": "Bearer k1", **(headers or {})})


@pytest.mark.parametrize("prefix, expected", [("/engine-vip/", 0), ("/engine-batch/", 7)])
def test_the_engine_gets_the_requests_class_not_the_clients_priority(stack, prefix, expected):
    response = post_body(stack, prefix, {**BODY, "priority": -1000})
    assert response.status_code == 200, response.text
    body = last_upstream_body(stack, "b")
    assert body["priority"] == expected and body["messages"] == BODY["messages"]


def test_a_named_field_with_higher_first_gets_the_top_rank_for_vip(stack):
    sent = {**BODY, "nvext": {"agent_hints": {"priority": 0, "latency_sensitivity": 1}}}
    assert post_body(stack, "/dynamo/", sent).status_code == 200
    # vip is rank 0 of 0..2: the highest value for an engine that runs higher first
    assert last_upstream_body(stack, "b")["nvext"] == {"agent_hints": {"priority": 2, "latency_sensitivity": 1}}


def test_a_clients_priority_is_stripped_on_a_cluster_that_takes_none(stack):
    response = post_body(stack, "/strip/", {**BODY, "priority": 5})
    # upstream a schedules first come first served: like vLLM, it refuses a priority it cannot honour
    assert response.status_code == 200, response.text
    assert response.headers["x-upstream-name"] == "a"
    assert "priority" not in last_upstream_body(stack, "a")


def configure(stack, name, **changes):
    port = getattr(stack.ports, f"upstream_{name}")
    assert httpx.post(f"http://127.0.0.1:{port}/admin/config", json=changes).status_code == 200


def hold_the_primary(stack):
    """Warm the primary (its slot hold time becomes known), then keep its one slot busy for
    about 1.5 s (that one request is slow; the cluster's measured times stay as they were)."""
    assert post(stack, "/degrade/").headers["x-upstream-name"] == "a"
    configure(stack, "a", ttft_ms=1500)
    holder = threading.Thread(target=post, args=(stack, "/degrade/"))
    holder.start()
    wait_until_running(stack)
    configure(stack, "a", ttft_ms=300)
    return holder


def wait_until_running(stack):
    deadline = time.monotonic() + 15
    while upstream_stats(stack, "a")["running"] < 1:
        assert time.monotonic() < deadline, "the holder never reached the upstream"
        time.sleep(0.01)


def test_an_expected_wait_over_degrade_after_s_goes_to_the_fallback(stack):
    holder = hold_the_primary(stack)
    response = post(stack, "/degrade/", key="other")
    primary_still_busy = holder.is_alive()
    holder.join(10)
    assert response.status_code == 200
    assert response.headers["x-upstream-name"] == "b" and response.headers["x-sluice-degraded"] == "1"
    assert primary_still_busy                          # it did not wait for the primary's slot


def test_a_request_the_deadline_would_refuse_goes_to_the_fallback_instead(stack):
    holder = hold_the_primary(stack)
    deadline = {"x-request-deadline-ms": "400"}        # wait ~0.3 s + first token ~0.3 s > 0.4 s
    answers = {}
    # At once, while the primary's slot is held; "/" is a route without a fallback.
    calls = [threading.Thread(target=lambda p=p: answers.setdefault(p, post(stack, p, key="other", headers=deadline)))
             for p in ("/degrade-deadline/", "/")]
    for t in calls:
        t.start()
    for t in [*calls, holder]:
        t.join(10)
    degraded, refused = answers["/degrade-deadline/"], answers["/"]
    assert degraded.status_code == 200, degraded.text
    assert degraded.headers["x-upstream-name"] == "b" and degraded.headers["x-sluice-degraded"] == "1"
    assert refused.status_code == 503


def test_tenants_share_their_class_by_weight(stack):
    served = []
    lock = threading.Lock()
    client = httpx.Client(timeout=30, limits=httpx.Limits(max_connections=32))
    url = f"http://127.0.0.1:{stack.ports.http}/fair/v1/chat/completions"

    def call(tenant):
        response = client.post(url, json=BODY, headers={"authorization": f"Bearer key-{tenant}", "x-tenant": tenant})
        with lock:
            served.append((tenant, response.status_code))

    # One slow request holds the slot until everyone below is queued, in this order: the burst first.
    configure(stack, "a", ttft_ms=4000)
    holder = threading.Thread(target=call, args=("holder",))
    holder.start()
    wait_until_running(stack)
    configure(stack, "a", ttft_ms=300)
    queued = metric(stack, "sluice_admission_queue_depth", **{"class": "standard"})
    threads = [threading.Thread(target=call, args=(t,)) for t in ["burst"] * 8 + ["gold"] * 6 + ["light"] * 3]
    for t in threads:
        t.start()
    deadline, depths = time.monotonic() + 10, []
    while (depth := metric(stack, "sluice_admission_queue_depth", **{"class": "standard"})) < queued + 17:
        depths.append(depth)
        assert time.monotonic() < deadline and holder.is_alive(), ("not all queued behind the holder", queued, depths[::10], served)
        time.sleep(0.02)
    for t in [holder, *threads]:
        t.join(30)
    client.close()
    assert all(status == 200 for _, status in served), served
    # Served by weight (gold 3, the others 1) while all three wait: 3 gold, 1 burst, 1 light in
    # every 5, not the burst's 8 first.
    first = Counter(t for t, _ in served[1:11])
    assert first == {"gold": 6, "burst": 2, "light": 2}, served


def _vip_behind_three_queued(stack):
    """One standard request running, three queued, then a VIP: the finishing order, and whether
    the VIP was seen queued while all three standards still were (so no standard could have been
    dispatched before it arrived: on a loaded machine the running one may end first)."""
    finished = []

    def call(prefix, label):
        response = post(stack, prefix)
        finished.append((label, response.status_code))

    threads = [threading.Thread(target=call, args=("/", f"standard{i}")) for i in range(4)]
    for t in threads:
        t.start()
        time.sleep(0.02)
    deadline = time.monotonic() + 10                  # one running, three queued
    while metric(stack, "sluice_admission_queue_depth", **{"class": "standard"}) < 3:
        assert time.monotonic() < deadline and not finished, finished
        time.sleep(0.01)
    vip = threading.Thread(target=call, args=("/vip/", "vip"))
    vip.start()
    ahead_of_all = False
    while vip.is_alive() and not ahead_of_all:
        # Four queued in all: the VIP and the three standards (no more arrive, so that is when
        # it queued too).
        ahead_of_all = metric(stack, "sluice_admission_queue_depth") >= 4
        time.sleep(0.005)
    for t in [*threads, vip]:
        t.join(30)
    assert all(status == 200 for _, status in finished), finished
    return [label for label, _ in finished], ahead_of_all


def test_vip_overtakes_queued_standard_requests(stack):
    for _ in range(5):
        order, ahead_of_all = _vip_behind_three_queued(stack)
        if ahead_of_all:
            break
    assert ahead_of_all, "the VIP never reached the gate while three standard requests were queued"
    assert order.index("vip") <= 1, order             # right after the request already running


def test_impossible_deadline_is_refused_at_once(stack):
    post(stack, "/")                                  # the cluster's time to first byte is known
    httpx.post(f"http://127.0.0.1:{stack.ports.upstream_a}/admin/reset-stats")
    started = time.monotonic()
    response = post(stack, "/", headers={"x-request-deadline-ms": "20"})
    elapsed = time.monotonic() - started
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "overloaded"
    assert int(response.headers["retry-after"]) >= 1
    # At once: never sent upstream, and answered well before the upstream's 300 ms to a first
    # byte (a wall-clock bound tighter than that measures the machine's load, not the gate).
    assert upstream_stats(stack, "a")["requests"] == 0
    assert elapsed < 0.25, elapsed


def test_client_that_gives_up_while_queued_never_reaches_upstream(stack):
    httpx.post(f"http://127.0.0.1:{stack.ports.upstream_a}/admin/reset-stats")
    results = []
    running = threading.Thread(target=lambda: results.append(post(stack, "/").status_code))
    running.start()
    time.sleep(0.1)
    with pytest.raises(httpx.TimeoutException):       # queued behind it, then gives up
        post(stack, "/", timeout=0.15)
    running.join(10)
    time.sleep(0.5)                                   # the slot is free again: nothing else comes
    assert results == [200]
    assert upstream_stats(stack, "a")["requests"] == 1


def test_tenant_request_limit_gives_429_with_retry_after(stack):
    statuses = [post(stack, "/limited/", key="tenant-x").status_code for _ in range(2)]
    refused = post(stack, "/limited/", key="tenant-x")
    assert statuses == [200, 200] and refused.status_code == 429
    error = refused.json()["error"]
    assert error["type"] == "rate_limit_error"
    assert "admission control" in error["message"]              # the sidecar's own words, not Envoy's mapper's
    assert 20 <= int(refused.headers["retry-after"]) <= 31      # 2 per minute: one every 30 s
    assert post(stack, "/limited/", key="tenant-y").status_code == 200   # another tenant


@pytest.mark.parametrize("stream", [False, True])
def test_real_usage_corrects_the_budget_and_reaches_envoy(stack, stream):
    before = metric(stack, "sluice_admission_tokens_total", kind="added")
    log_lines = len((stack.workdir / "envoy.log").read_text().splitlines())
    body = {"model": "demo-model", "stream": stream,
            "messages": [{"role": "user", "content": f"count my tokens {stream}"}]}
    url = f"http://127.0.0.1:{stack.ports.http}/metered/v1/chat/completions"
    response = httpx.post(url, json=body, headers={"authorization": "Bearer metered"}, timeout=30)
    assert response.status_code == 200 and response.text
    # The admission estimate covered the prompt only: the answer's completion tokens are added.
    deadline = time.monotonic() + 5
    while metric(stack, "sluice_admission_tokens_total", kind="added") <= before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(stack, "sluice_admission_tokens_total", kind="added") > before

    def logged_tokens():                              # this request's access-log line (Envoy's)
        lines = (stack.workdir / "envoy.log").read_text().splitlines()[log_lines:]
        entries = [json.loads(line) for line in lines if line.startswith("{")]
        return [e["tokens"] for e in entries if e.get("tokens") not in (None, "-")]
    deadline = time.monotonic() + 15
    while not logged_tokens() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert logged_tokens() and int(logged_tokens()[-1]) >= 3   # read from the dynamic metadata


def test_two_sidecars_share_one_tenant_budget_through_redis(make_stack, tmp_path):
    redis = RedisServer(tmp_path / "redis").start()
    try:
        stack = make_stack(sidecars=2, routes=ROUTES, upstream_args={"a": ["--ttft-ms", "10"], "b": []},
                           sidecar_env={"SLUICE_CACHE": "false", "SLUICE_REDIS_URL": redis.url,
                                        "SLUICE_CACHE_SECRET": "shared-secret-for-tests"})
        statuses = [post(stack, "/limited/", key="tenant-z").status_code for _ in range(6)]
        assert statuses.count(200) == 2 and statuses.count(429) == 4, statuses
        for name in stack.sidecar_names():              # both replicas took part
            metrics = http_get(f"http://127.0.0.1:{stack.sidecar_ports(name)[1]}/metrics")[1]
            assert 'sluice_requests_total{' in metrics, name
    finally:
        redis.stop()


# -- cost-aware admission ----------------------------------------------------------------------
# Both engines hold 56 tokens at once (kv_tokens) and decode 20 tokens/s; the gate lets 4
# requests through to each. A "typical" request is 14 tokens (prompt 1 + 13 of answer: 4 of
# them fill the engine), a large one 42 (2 s), a small one 12 (0.55 s). The engine fits a large
# and one small, not two larges.
COST_ENGINE = ["--ttft-ms", "0", "--tokens", "100", "--tokens-per-s", "20", "--kv-tokens", "56"]
COST_ROUTES = [admission_route(f"cost_{arm}", f"/cost-{arm}/", {"count_tokens": arm == "on"}, max_in_flight=4,
                               candidates=[{"cluster": cluster, "max_in_flight": 4}])
               for arm, cluster in (("on", "upstream_a"), ("off", "upstream_b"))]


@pytest.fixture(scope="module")
def cost_stack(make_module_stack):
    return make_module_stack(routes=COST_ROUTES, upstream_args={"a": COST_ENGINE, "b": COST_ENGINE})


def large_then_small(stack, arm):
    """A typical request first (the cluster's mean cost), then two large requests and three
    small ones, in this order, 50-100 ms apart. Returns each one's latency and the most seen
    at once: queued in the sidecar, running and waiting in the engine."""
    sdk = e2e_client(stack, f"/cost-{arm}/v1")
    ask(sdk, "hi", max_tokens=13)
    name = "a" if arm == "on" else "b"
    plan = [("large1", 41, 0.0), ("large2", 41, 0.1), ("small1", 11, 0.2), ("small2", 11, 0.25), ("small3", 11, 0.3)]
    latencies = {}
    start = time.monotonic()

    def call(label, max_tokens, at):
        time.sleep(max(0.0, start + at - time.monotonic()))
        sent = time.monotonic()
        completion, _ = ask(sdk, "hi", max_tokens=max_tokens)
        assert completion.usage.completion_tokens == max_tokens
        latencies[label] = time.monotonic() - sent

    threads = [threading.Thread(target=call, args=step) for step in plan]
    for t in threads:
        t.start()
    seen = {"queued": 0, "running": 0, "waiting": 0}
    while any(t.is_alive() for t in threads):
        stats = upstream_stats(stack, name)
        queued = metric(stack, "sluice_admission_queue_depth", **{"class": "standard"})
        seen = {"queued": max(seen["queued"], queued), "running": max(seen["running"], stats["running"]),
                "waiting": max(seen["waiting"], stats["waiting"])}
        time.sleep(0.02)
    for t in threads:
        t.join()
    assert len(latencies) == len(plan), latencies
    return latencies, seen


def test_counting_tokens_a_large_request_takes_the_slots_of_several_small_ones(cost_stack):
    latencies, seen = large_then_small(cost_stack, "on")
    # The first large request counts for 3 of the 4 slots: one small one runs beside it, the
    # second large one and two small ones wait in the sidecar, and the engine never queues.
    assert seen["queued"] >= 3 and seen["running"] <= 2 and seen["waiting"] == 0, seen
    # So a small request is answered while the first large one still runs, not behind the second.
    assert latencies["small1"] < 1.5 and latencies["small1"] < latencies["large1"], latencies


def test_counting_requests_a_large_request_holds_small_ones_up_in_the_engine(cost_stack):
    latencies, seen = large_then_small(cost_stack, "off")
    # Four requests of one slot each: the second large one does not fit the engine beside the
    # first, and the small ones wait behind it there, past the first large one's end.
    assert seen["waiting"] >= 1, seen
    assert latencies["small1"] > latencies["large1"], latencies
