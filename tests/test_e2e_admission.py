"""Admission control through the real Envoy: priority queueing, deadlines, disconnects, limits."""
import json
import threading
import time

import httpx
import pytest

from devtools.envoy_config import chat_route
from devtools.stack import http_get
from tests.e2e import metric, upstream_stats
from tests.redis_server import RedisServer

BODY = {"model": "demo-model", "messages": [{"role": "user", "content": "hello"}]}


def admission_route(name, prefix, admission, max_in_flight=1):
    route = chat_route(name, prefix, [{"cluster": "upstream_a", "max_in_flight": max_in_flight}],
                       rewrite="/")
    route["metadata"]["filter_metadata"]["sluice"]["admission"] = {"enabled": True, **admission}
    return route


def post(stack, prefix, key="k1", timeout=30.0, headers=None):
    url = f"http://127.0.0.1:{stack.ports.http}{prefix}v1/chat/completions"
    return httpx.post(url, json=BODY, timeout=timeout,
                      headers={"authorization": f"Bearer {key}", **(headers or {})})


ROUTES = [
    admission_route("vip", "/vip/", {"default_priority": "vip"}),
    admission_route("metered", "/metered/", {"tokens_per_minute": 1_000_000}, max_in_flight=8),
    admission_route("limited", "/limited/", {"requests_per_minute": 2}, max_in_flight=8),
    admission_route("standard", "/", {"default_priority": "standard"}),
]


@pytest.fixture(scope="module")
def stack(make_module_stack):
    return make_module_stack(routes=ROUTES, upstream_args={
        "a": ["--ttft-ms", "300", "--tokens", "2", "--tokens-per-s", "1000"], "b": []})


def test_vip_overtakes_queued_standard_requests(stack):
    finished = []

    def call(prefix, label):
        response = post(stack, prefix)
        finished.append((label, response.status_code))

    threads = [threading.Thread(target=call, args=("/", f"standard{i}")) for i in range(4)]
    for t in threads:
        t.start()
        time.sleep(0.02)
    time.sleep(0.1)                                   # one running, three queued
    vip = threading.Thread(target=call, args=("/vip/", "vip"))
    vip.start()
    for t in [*threads, vip]:
        t.join(30)
    order = [label for label, status in finished]
    assert all(status == 200 for _, status in finished), finished
    assert order.index("vip") <= 1, order             # right after the request already running


def test_impossible_deadline_is_refused_at_once(stack):
    post(stack, "/")                                  # the cluster's time to first byte is known
    started = time.monotonic()
    response = post(stack, "/", headers={"x-request-deadline-ms": "20"})
    elapsed = time.monotonic() - started
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "overloaded"
    assert int(response.headers["retry-after"]) >= 1
    assert elapsed < 0.1, elapsed


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
