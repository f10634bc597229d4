"""Load- and latency-aware routing, breakers, fallback and timeouts through the real Envoy."""
import json
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from devtools.envoy_config import chat_route
from devtools.stack import http_get
from tests.support.e2e import ask, client, metric, wait_for_access_lines, wait_for_metric

FAST_BREAKER = {"window_s": 5, "min_requests": 4, "max_error_ratio": 0.5, "cooldown_s": 1,
                "close_after_successes": 2}


def configure(stack, name, **options):
    port = getattr(stack.ports, f"upstream_{name}")
    httpx.post(f"http://127.0.0.1:{port}/admin/config", json=options).raise_for_status()


def last_forwarded(stack, name):
    return json.loads(http_get(f"http://127.0.0.1:{getattr(stack.ports, f'upstream_{name}')}/admin/last")[1])


def try_ask(c):
    try:
        return ask(c)[1]
    except openai.APIStatusError as exc:
        return exc.response.headers


@pytest.fixture
def stack(make_stack):
    """A fresh stack per test: breakers and signals are per cluster and would carry over."""
    metrics_a = "http://127.0.0.1:{}/metrics"
    routes = [
        chat_route("spread", "/spread/", [{"cluster": "upstream_a"}, {"cluster": "upstream_b"}], rewrite="/"),
        chat_route("fallback", "/fallback/", [
            {"cluster": "upstream_a", "role": "primary"},
            {"cluster": "upstream_b", "role": "fallback", "model": "small-model"}], rewrite="/"),
        chat_route("timeout", "/timeout/", [{"cluster": "upstream_a"}], rewrite="/"),
        chat_route("unread", "/unread/", [{"cluster": "upstream_a"}, {"cluster": "upstream_b"}], rewrite="/"),
        chat_route("chat", "/", [{"cluster": "upstream_a"}, {"cluster": "upstream_b"}]),
    ]
    stack = make_stack(routes=routes, upstream_args={
        "a": ["--ttft-ms", "10", "--tokens", "4", "--tokens-per-s", "1000"],
        "b": ["--ttft-ms", "10", "--tokens", "4", "--tokens-per-s", "1000"]})
    # Settings that need the ports: scraping, breakers, timeouts and debug headers.
    for route in routes:
        sluice = route["metadata"]["filter_metadata"]["sluice"]
        sluice["scheduling"] = {"breaker": FAST_BREAKER, "debug_header": True}
        if sluice["name"] == "spread":
            sluice["candidates"][0]["metrics_url"] = metrics_a.format(stack.ports.upstream_a)
        if sluice["name"] == "timeout":
            sluice["scheduling"]["timeout"] = {"min_ms": 300, "max_ms": 300}
        if sluice["name"] == "unread":     # answers never read (sampled out), no debug header
            sluice["scheduling"] = {"feedback": {"read_all_per_s": 0, "then_one_in": 1000000}}
    stack.routes = routes
    stack.stop_process("envoy")
    stack.start_envoy()
    return stack


@pytest.fixture(autouse=True)
def healthy_upstreams(stack):
    yield
    for name in ("a", "b"):
        configure(stack, name, ttft_ms=10, error_rate=0)


def latency_scores(debug):
    """Cluster name -> its latency score in an x-sluice-debug header (None: not known yet)."""
    scores = {}
    for item in debug.split("; ")[1:]:
        cluster, _, rest = item.partition("=")
        part = next((p for p in rest.split(" ", 1)[-1].split(",") if p.startswith("latency:")), None)
        if part is not None:
            value = part.split(":")[1]
            scores[cluster.removeprefix("upstream_")] = None if value == "-" else float(value)
    return scores


def test_traffic_shifts_toward_the_fast_cluster(stack):
    """Once the picker has a's time to first byte (its first answer), most traffic goes to b.
    Judged on the picks after that: with a 600 ms against b's ~10 ms, b's time to first byte as
    the sidecar measures it on a loaded machine (up to ~100 ms) still leaves a a small share."""
    configure(stack, "a", ttft_ms=600)
    c = client(stack, "/spread/v1")

    def pick(_):
        headers = ask(c)[1]
        return headers["x-upstream-name"], latency_scores(headers["x-sluice-debug"])

    with ThreadPoolExecutor(4) as pool:       # some concurrency, like real traffic
        for _ in range(20):                   # until both latencies are known (a few batches)
            _, seen = list(pool.map(pick, range(4)))[-1]
            if None not in seen.values():
                break
        assert None not in seen.values(), seen
        picks = list(pool.map(pick, range(80)))
    assert all(scores["a"] < scores["b"] for _, scores in picks), picks   # the picker saw a slower
    names = Counter(name for name, _ in picks)
    assert names["b"] > 2 * names["a"], names


def test_debug_header_shows_scores_and_scraped_queue(stack):
    ask(client(stack, "/spread/v1"))          # the route's first request starts the scraper
    time.sleep(2.5)                           # one scrape of upstream a's /metrics
    headers = ask(client(stack, "/spread/v1"))[1]
    debug = headers["x-sluice-debug"]
    assert "upstream_a=" in debug and "upstream_b=" in debug
    assert "queue:-" not in debug.split("upstream_a=")[1].split(";")[0]   # a has a queue figure


def test_failing_cluster_is_cut_off_then_taken_back(stack):
    configure(stack, "a", error_rate=1.0)
    c = client(stack, "/spread/v1")
    names = [try_ask(c).get("x-upstream-name") for _ in range(30)]
    # Once open, a sees only half-open probes: one per cool-down (1 s) at most.
    assert Counter(names[-20:])["a"] <= 3, names
    configure(stack, "a", error_rate=0.0)
    deadline, seen_a = time.monotonic() + 15, 0
    while time.monotonic() < deadline and seen_a < 3:
        seen_a += try_ask(c).get("x-upstream-name") == "a"
        time.sleep(0.05)
    assert seen_a >= 3


def test_fallback_gets_traffic_with_model_rewritten_when_primaries_fail(stack):
    configure(stack, "a", error_rate=1.0)
    c = client(stack, "/fallback/v1")
    for _ in range(8):
        try_ask(c)
    completion, headers = ask(c)
    assert headers["x-upstream-name"] == "b" and headers["x-sluice-degraded"] == "1"
    forwarded = last_forwarded(stack, "b")["body"]
    assert forwarded["model"] == "small-model"
    assert forwarded["messages"] == [{"role": "user", "content": "hello"}]


def test_nothing_healthy_gives_fast_503_with_retry_after(stack):
    configure(stack, "a", error_rate=1.0)
    configure(stack, "b", error_rate=1.0)
    c = client(stack, "/fallback/v1")
    refusals = []
    for _ in range(40):                       # both breakers open (between half-open probes)
        started = time.monotonic()
        try:
            ask(c)
        except openai.APIStatusError as exc:
            if exc.status_code == 503:
                refusals.append((time.monotonic() - started, exc.response))
    assert len(refusals) >= 10
    elapsed, response = refusals[-1]
    assert elapsed < 0.5
    assert int(response.headers["retry-after"]) >= 1
    assert response.json()["error"]["code"] == "upstream_unavailable"


def test_per_request_timeout_is_enforced_by_envoy(stack):
    configure(stack, "a", ttft_ms=2000)
    started = time.monotonic()
    with pytest.raises(openai.APIStatusError) as err:
        ask(client(stack, "/timeout/v1"))
    assert err.value.status_code == 504
    assert err.value.response.json()["error"]["code"] == "upstream_timeout"
    assert time.monotonic() - started < 1.5


def test_unread_answers_still_carry_the_sidecars_headers_and_end_in_flight(stack):
    """Sampled out: Envoy sends no response headers to the sidecar; it adds x-sluice-cluster from
    the sidecar's dynamic metadata, and the stream still ends with the request."""
    read_before = metric(stack, "sluice_ext_proc_message_seconds_count", phase="ResponseHeaders")
    c = client(stack, "/unread/v1")
    for _ in range(6):
        completion, headers = ask(c)
        assert completion.choices[0].message.content
        assert headers["x-sluice-cluster"] == "upstream_" + headers["x-upstream-name"]
    raw = c.chat.completions.with_raw_response.create(
        model="demo-model", messages=[{"role": "user", "content": "hi"}], stream=True)
    chunks = list(raw.parse())
    assert raw.headers["x-sluice-cluster"] == "upstream_" + raw.headers["x-upstream-name"]
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert wait_for_metric(stack, "sluice_open_streams", 0) == 0
    lines = wait_for_access_lines(stack, lambda entry: entry["route"] == "unread", 7)
    assert len(lines) == 7 and all(e["status"] is None and e["response_read"] is False for e in lines)
    for cluster in ("upstream_a", "upstream_b"):
        assert wait_for_metric(stack, "sluice_scheduler_in_flight", 0, cluster=cluster) == 0
    assert metric(stack, "sluice_ext_proc_message_seconds_count", phase="ResponseHeaders") == read_before
    assert metric(stack, "sluice_requests_total", route="unread", status_class="unread") == 7
    ask(client(stack, "/spread/v1"))          # a route with the debug header reads its answers
    assert metric(stack, "sluice_ext_proc_message_seconds_count", phase="ResponseHeaders") == read_before + 1


def test_an_unread_answer_counts_in_flight_until_it_ends(stack):
    """The ext_proc stream of a request whose response headers are skipped stays open until the
    request ends (Envoy 1.40 with a BUFFERED body): the cluster's in-flight count covers the answer."""
    for name in ("a", "b"):
        configure(stack, name, tokens=20, tokens_per_s=20)          # ~1 s of streaming
    stream = client(stack, "/unread/v1").chat.completions.create(
        model="demo-model", messages=[{"role": "user", "content": "tell me more"}], stream=True)
    chunks = iter(stream)
    next(chunks)                                                    # the answer has started
    assert metric(stack, "sluice_scheduler_in_flight") == 1
    assert sum(1 for _ in chunks) > 5
    assert wait_for_metric(stack, "sluice_scheduler_in_flight", 0) == 0
