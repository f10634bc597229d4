"""Demo upstream (devtools.demo_upstream): a real subprocess driven by the openai SDK."""

from __future__ import annotations

import http.client
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
from devtools.stack import free_port

ROOT = Path(__file__).resolve().parents[3]
NAME = "up-a"
# Fast defaults so each test only waits for what it configures itself.
BASELINE = {
    "model": "demo-model",
    "ttft_ms": 0,
    "tokens_per_s": 1000,
    "tokens": 8,
    "error_rate": 0,
    "error_mode": "500",
    "capacity": 0,
    "kv_tokens": 0,
    "slowdown_per_running": 0,
    "seed": None,
    "scheduling_policy": "fcfs",
}
HELLO = [{"role": "user", "content": "hello there"}]
# What a dropped or truncated connection surfaces as in http.client.
CUT = (OSError, http.client.HTTPException)


@dataclass
class Reply:
    status: int
    headers: http.client.HTTPMessage
    body: bytes

    def json(self):
        return json.loads(self.body)


def request(port: int, method: str, path: str, body=None, headers: dict | None = None) -> Reply:
    """One plain HTTP exchange on a fresh connection; a dict body is sent as JSON."""
    headers = dict(headers or {})
    if isinstance(body, dict):
        body = json.dumps(body)
        headers["Content-Type"] = "application/json"
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(method, path, body=body, headers=headers)
        response = conn.getresponse()
        return Reply(response.status, response.headers, response.read())
    finally:
        conn.close()


def stream_events(port: int, body: dict, events: list[str]) -> str:
    """POST a streaming chat, appending each SSE line to `events` as it arrives
    (so a test still sees them when the stream is cut); returns the content type."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200
        for line in iter(response.readline, b""):
            if line.strip():
                events.append(line.decode().strip())
        return response.headers["Content-Type"]
    finally:
        conn.close()




def start_upstream(name: str, *args: str) -> tuple[subprocess.Popen, int]:
    port = free_port()
    cmd = [sys.executable, "-m", "devtools.demo_upstream", "--port", str(port), "--name", name, *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"demo upstream exited with {proc.returncode}"
        try:
            health = request(port, "GET", "/health")
            assert health.headers["x-upstream-name"] == name
            if health.status == 200:
                return proc, port
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise AssertionError("demo upstream never became healthy")


def stop(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()


class Upstream:
    def __init__(self, proc: subprocess.Popen, port: int) -> None:
        self.proc = proc
        self.port = port
        self.sdk = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=10)

    def get(self, path: str, headers: dict | None = None) -> Reply:
        return request(self.port, "GET", path, headers=headers)

    def post(self, path: str, body=None) -> Reply:
        return request(self.port, "POST", path, body)

    def configure(self, **changes) -> dict:
        response = self.post("/admin/config", changes)
        assert response.status == 200, response.body
        return response.json()

    def stats(self) -> dict:
        return self.get("/admin/stats").json()

    def wait_stats(self, timeout: float = 3, **expected) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            stats = self.stats()
            if all(stats[k] == v for k, v in expected.items()) or time.monotonic() > deadline:
                assert {k: stats[k] for k in expected} == expected
                return stats
            time.sleep(0.01)

    def metric(self, name: str) -> float:
        text = self.get("/metrics").body.decode()
        match = re.search(rf'^{re.escape(name)}{{model_name="[^"]*"}} (\S+)$', text, re.M)
        assert match, f"{name} missing from /metrics"
        return float(match.group(1))

    def chat(self, content: str = "hello there", **kwargs):
        return self.sdk.chat.completions.create(
            model=kwargs.pop("model", "demo-model"), messages=[{"role": "user", "content": content}], **kwargs
        )

    def raw_chat(self, body: dict) -> socket.socket:
        """Send a chat request on a bare socket, so the test controls the disconnect."""
        payload = json.dumps(body).encode()
        sock = socket.create_connection(("127.0.0.1", self.port))
        head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
        sock.sendall(head.encode() + payload)
        return sock


@pytest.fixture(scope="module")
def upstream():
    proc, port = start_upstream(NAME)
    # The readiness line parents wait for.
    assert proc.stdout.readline().strip() == f"demo-upstream {NAME} listening on 127.0.0.1:{port}"
    up = Upstream(proc, port)
    yield up
    assert stop(proc) == 0


@pytest.fixture
def up(upstream):
    upstream.configure(**BASELINE)
    assert upstream.post("/admin/reset-stats").status == 200
    return upstream


def run_concurrently(calls) -> tuple[list[threading.Thread], list]:
    """Start callables in threads released together; results fill in as threads end."""
    results: list = [None] * len(calls)
    barrier = threading.Barrier(len(calls))

    def worker(i, call):
        barrier.wait()
        results[i] = call()

    threads = [threading.Thread(target=worker, args=(i, c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    return threads, results


def timed(call):
    def run():
        start = time.monotonic()
        call()
        return time.monotonic() - start

    return run


def test_non_stream_completion_via_sdk(up):
    raw = up.sdk.chat.completions.with_raw_response.create(model="m-requested", messages=HELLO)
    assert raw.headers["x-upstream-name"] == NAME
    completion = raw.parse()
    assert completion.object == "chat.completion"
    assert completion.id.startswith("chatcmpl-")
    assert completion.model == "m-requested"
    choice = completion.choices[0]
    assert choice.message.role == "assistant"
    assert choice.finish_reason == "stop"
    assert len(choice.message.content.split()) == 8
    assert completion.usage.completion_tokens == 8
    assert completion.usage.prompt_tokens == len("hello there") // 4
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + 8
    up.wait_stats(requests=1, completed=1, errors=0)


def test_answers_are_deterministic_per_prompt_and_seed(up):
    first = up.chat("what is a sluice?").choices[0].message.content
    assert up.chat("what is a sluice?").choices[0].message.content == first
    assert up.chat("what is a weir?").choices[0].message.content != first
    up.configure(seed=7)
    seeded = up.chat("what is a sluice?").choices[0].message.content
    assert seeded != first
    assert up.chat("what is a sluice?").choices[0].message.content == seeded


def test_a_lone_surrogate_in_the_prompt_is_answered(up):
    """Legal JSON; a 500 here could open a breaker in tests and demos."""
    reply = up.post("/v1/chat/completions", {"model": "demo-model", "messages": [{"role": "user", "content": "\ud800"}]})
    assert reply.status == 200 and reply.json()["choices"][0]["message"]["content"]


def test_non_stream_waits_ttft_plus_generation(up):
    up.configure(ttft_ms=100, tokens=10, tokens_per_s=100)
    start = time.monotonic()
    up.chat()
    elapsed = time.monotonic() - start
    assert 0.2 <= elapsed < 0.5


def test_stream_chunks_arrive_incrementally(up):
    up.configure(ttft_ms=50, tokens=20, tokens_per_s=40)  # ~0.55 s in all
    start = time.monotonic()
    stream = up.chat("stream me", stream=True)
    arrivals, chunks = [], []
    for chunk in stream:
        arrivals.append(time.monotonic() - start)
        chunks.append(chunk)
    total = time.monotonic() - start

    assert chunks[0].choices[0].delta.role == "assistant"
    content = [(t, c.choices[0].delta.content) for t, c in zip(arrivals, chunks) if c.choices and c.choices[0].delta.content]
    assert len(content) == 20
    assert total >= 0.5
    assert content[0][0] < 0.25  # first token long before the end: not buffered
    assert content[10][0] - content[0][0] >= 0.2  # paced at ~25 ms per token
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert all(c.usage is None for c in chunks)  # no usage chunk unless asked
    # Same words as the non-streamed answer to the same prompt.
    up.configure(ttft_ms=0, tokens_per_s=1000)
    assert "".join(text for _, text in content) == up.chat("stream me").choices[0].message.content
    up.wait_stats(completed=2)


def test_stream_include_usage_and_max_tokens(up):
    chunks = list(up.chat(stream=True, max_tokens=3, stream_options={"include_usage": True}))
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) == 3
    last = chunks[-1]
    assert last.choices == []
    assert (last.usage.completion_tokens, last.usage.total_tokens) == (3, last.usage.prompt_tokens + 3)


def test_stream_ends_with_done_marker(up):
    events: list[str] = []
    assert stream_events(up.port, {"messages": HELLO, "stream": True}, events).startswith("text/event-stream")
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "stop"


def test_max_tokens_caps_and_reports_length(up):
    capped = up.chat(max_tokens=5)
    assert capped.choices[0].finish_reason == "length"
    assert capped.usage.completion_tokens == 5
    assert len(capped.choices[0].message.content.split()) == 5
    roomy = up.chat(max_tokens=100)
    assert roomy.choices[0].finish_reason == "stop"
    assert roomy.usage.completion_tokens == 8


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"{not json", None),
        (b'{"model": "m"}', "messages"),
        (b'{"messages": []}', "messages"),
        (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}', "max_tokens"),
    ],
)
def test_bad_requests_get_openai_400(up, body, param):
    response = request(up.port, "POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    assert response.status == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert error["message"] and "code" in error
    up.wait_stats(requests=1, errors=1, completed=0)


def test_error_rate_one_gives_openai_500(up):
    up.configure(error_rate=1)
    with pytest.raises(openai.InternalServerError) as caught:
        up.chat()
    assert caught.value.status_code == 500
    assert caught.value.response.headers["x-upstream-name"] == NAME
    error = caught.value.response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    up.wait_stats(requests=1, errors=1, completed=0)


def test_error_mode_reset_drops_connection(up):
    up.configure(error_rate=1, error_mode="reset")
    with pytest.raises(CUT):
        up.post("/v1/chat/completions", {"messages": HELLO})
    up.wait_stats(errors=1, completed=0, disconnected=0)
    assert up.get("/health").status == 200  # the server itself lives on


def test_error_mode_midstream_cuts_stream_before_done(up):
    up.configure(error_rate=1, error_mode="midstream")
    events: list[str] = []
    with pytest.raises(CUT):
        stream_events(up.port, {"messages": HELLO, "stream": True}, events)
    contents = [json.loads(e[6:])["choices"][0]["delta"].get("content") for e in events]
    assert 1 <= sum(1 for c in contents if c) < 8  # a partial answer...
    assert "data: [DONE]" not in events  # ...that never says it is complete
    # A non-streamed answer is cut short inside its promised body.
    with pytest.raises(CUT):
        up.post("/v1/chat/completions", {"messages": HELLO})
    up.wait_stats(requests=2, errors=2, completed=0, disconnected=0)


def test_error_mode_hang_sends_nothing_until_the_client_leaves(up):
    up.configure(error_rate=1, error_mode="hang")
    with socket.create_connection(("127.0.0.1", up.port)) as sock:
        body = json.dumps({"messages": HELLO}).encode()
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        sock.settimeout(1.0)
        with pytest.raises(socket.timeout):
            sock.recv(1)                     # no status line, however long one waits
    up.wait_stats(requests=1, errors=1, completed=0, disconnected=1)
    assert up.get("/health").status == 200


def test_capacity_queues_requests_fifo(up):
    up.configure(capacity=1, tokens=5, tokens_per_s=25)  # 0.2 s each
    threads, latencies = run_concurrently([timed(up.chat)] * 3)
    waiting_seen, running_seen, usage_seen = [], [], []
    while any(t.is_alive() for t in threads):
        waiting_seen.append(up.metric("vllm:num_requests_waiting"))
        running_seen.append(up.metric("vllm:num_requests_running"))
        usage_seen.append(up.metric("vllm:kv_cache_usage_perc"))
        time.sleep(0.02)
    for t in threads:
        t.join()
    assert max(waiting_seen) >= 1
    assert max(running_seen) == 1
    assert max(usage_seen) == 1.0
    latencies.sort()
    assert latencies[0] < 0.35
    assert latencies[2] >= 0.55  # the last one waited for the other two
    up.wait_stats(completed=3, running=0, waiting=0)
    assert up.metric("vllm:request_success_total") == 3


def test_kv_tokens_queue_a_request_that_does_not_fit_and_those_behind_it(up):
    # 0.2 s prefill + 100 tokens at 500/s: 0.4 s; a long request holds 101 of the 150 tokens.
    up.configure(kv_tokens=150, ttft_ms=200, tokens=100, tokens_per_s=500)

    def call(delay, max_tokens):
        def run():
            time.sleep(delay)
            return timed(lambda: up.chat("long", max_tokens=max_tokens))()
        return run

    threads, latencies = run_concurrently([call(0, 100), call(0.05, 100), call(0.1, 5)])
    for t in threads:
        t.join()
    first, second, short = latencies
    assert first < 0.55
    assert second >= 0.7                  # 101 + 101 > 150: after the first
    assert short >= 0.5                   # 6 tokens would fit, but it is behind the second
    up.configure(kv_tokens=10)
    assert up.chat(max_tokens=100).choices[0].message.content   # alone it runs, however long


def test_priority_policy_orders_the_waiting_queue(up):
    up.configure(capacity=1, tokens=5, tokens_per_s=25, scheduling_policy="priority")  # 0.2 s each
    finished = []

    def call(label, priority, delay):
        def run():
            time.sleep(delay)
            up.chat(label, extra_body={"priority": priority})
            finished.append(label)
        return run

    # "first" runs (priority 0: nothing preempts it); "late-3" and "late-1" wait, best first.
    threads, _ = run_concurrently([call("first", 0, 0), call("late-3", 3, 0.05), call("late-1", 1, 0.1)])
    for t in threads:
        t.join()
    assert finished == ["first", "late-1", "late-3"]
    assert up.stats()["preempted"] == 0


def test_priority_policy_preempts_the_worst_running_request(up):
    # 0.1 s prefill + 10 tokens at 50/s: 0.3 s alone.
    up.configure(capacity=1, ttft_ms=100, tokens=10, tokens_per_s=50, scheduling_policy="priority")
    done = {}

    def call(label, priority, delay, stream=False):
        def run():
            time.sleep(delay)
            start = time.monotonic()
            if stream:
                text = "".join(c.choices[0].delta.content or "" for c in up.chat(label, stream=True, extra_body={"priority": priority}) if c.choices)
            else:
                text = up.chat(label, extra_body={"priority": priority}).choices[0].message.content
            done[label] = (time.monotonic(), time.monotonic() - start, text)
        return run

    threads, _ = run_concurrently([call("low", 5, 0, stream=True), call("high", 0, 0.2)])
    for t in threads:
        t.join()
    assert done["high"][0] < done["low"][0]               # it did not wait for the running one
    assert done["high"][1] < 0.45
    # The low one lost its slot for the high one's 0.3 s, then paid a prefill again (0.1 s).
    assert done["low"][1] >= 0.3 + 0.3 + 0.1 - 0.02, done["low"]
    up.configure(scheduling_policy="fcfs")
    assert done["low"][2] == up.chat("low").choices[0].message.content  # whole, in order
    assert up.stats()["preempted"] == 1
    assert up.metric("vllm:num_preemptions_total") == 1


def test_a_priority_without_priority_scheduling_is_refused_as_vllm_does(up):
    with pytest.raises(openai.BadRequestError, match="Priority scheduling is not enabled"):
        up.chat(extra_body={"priority": 1})
    assert up.chat(extra_body={"priority": 0}).choices[0].message.content


def test_slowdown_per_running_stretches_tokens(up):
    up.configure(capacity=2, slowdown_per_running=1.0, tokens=10, tokens_per_s=50)  # 0.2 s alone

    def stream():
        return list(up.chat(stream=True))

    alone = timed(stream)()
    threads, together = run_concurrently([timed(stream)] * 2)
    for t in threads:
        t.join()
    assert alone < 0.3
    assert min(together) >= 0.3  # two running > capacity/2: each token ~2x slower


def test_metrics_exposition(up):
    up.chat()
    text = up.get("/metrics").body.decode()
    for name, kind in [
        ("vllm:num_requests_running", "gauge"),
        ("vllm:num_requests_waiting", "gauge"),
        ("vllm:kv_cache_usage_perc", "gauge"),
        ("vllm:request_success_total", "counter"),
    ]:
        assert f"# TYPE {name} {kind}\n" in text
        assert f'{name}{{model_name="demo-model"}} ' in text
    assert up.metric("vllm:request_success_total") == 1
    assert up.metric("vllm:num_requests_running") == 0


def test_models_endpoint(up):
    assert [m.id for m in up.sdk.models.list()] == ["demo-model"]


def test_admin_config_validates_and_applies(up):
    for bad in ({"tokens": 0}, {"error_rate": 1.5}, {"error_mode": "explode"}, {"capacity": "x"}, {"nope": 1}):
        response = up.post("/admin/config", bad)
        assert response.status == 400, bad
        assert response.json()["error"]["param"] == next(iter(bad))
    assert up.configure(tokens=3, model="other")["tokens"] == 3
    assert up.get("/admin/config").json()["model"] == "other"
    assert up.chat().usage.completion_tokens == 3
    assert up.metric("vllm:request_success_total") == 1  # model_name label follows the config


def test_admin_answers_direct_callers_only(up):
    """Through a proxy (Envoy's public port) the demo's admin is not there: /admin/last shows the
    last caller's Authorization and /admin/config reconfigures the upstream."""
    up.sdk.chat.completions.create(model="m", messages=HELLO, max_tokens=2)
    assert up.get("/admin/last").status == 200
    for proxied in ({"x-forwarded-for": "203.0.113.7"}, {"x-envoy-expected-rq-timeout-ms": "15000"}):
        assert up.get("/admin/last", headers=proxied).status == 404
        assert up.get("/admin/config", headers=proxied).status == 404
    assert up.get("/health", headers={"x-forwarded-for": "203.0.113.7"}).status == 200


def test_admin_last_shows_forwarded_headers_and_body(up):
    up.sdk.chat.completions.create(
        model="rewritten", messages=HELLO, max_tokens=2, extra_headers={"X-Tenant": "blue"}
    )
    last = up.get("/admin/last").json()
    assert last["headers"]["x-tenant"] == "blue"
    assert last["headers"]["authorization"] == "Bearer x"
    assert last["body"]["model"] == "rewritten"
    assert last["body"]["messages"] == HELLO
    assert last["body"]["max_tokens"] == 2


def test_reset_stats(up):
    up.chat()
    assert up.stats()["completed"] == 1
    reset = up.post("/admin/reset-stats").json()
    assert reset["completed"] == 0 and reset["disconnects"] == []
    up.wait_stats(requests=0, completed=0, errors=0, disconnected=0)


def test_disconnect_while_generating_frees_slot(up):
    up.configure(capacity=1, ttft_ms=5000)
    sock = up.raw_chat({"messages": HELLO})
    up.wait_stats(running=1)
    sock.close()
    stats = up.wait_stats(disconnected=1, running=0, completed=0)
    [left] = stats["disconnects"]                          # what the client left behind
    assert left["ran"] and left["preemptions"] == 0 and 0 < left["after_s"] < 5
    up.configure(ttft_ms=0)
    assert up.chat().choices[0].finish_reason == "stop"  # the slot is free again


def test_disconnect_mid_stream_is_counted(up):
    up.configure(tokens=50, tokens_per_s=20)  # 2.5 s stream
    sock = up.raw_chat({"messages": HELLO, "stream": True})
    received = b""
    while b'"content"' not in received:
        received += sock.recv(4096)
    sock.close()
    up.wait_stats(disconnected=1, running=0, completed=0)


def test_queued_request_whose_client_left_is_not_served(up):
    up.configure(capacity=1, ttft_ms=400, tokens=1)
    first = up.raw_chat({"messages": HELLO})
    up.wait_stats(running=1)
    queued = up.raw_chat({"messages": HELLO})
    up.wait_stats(waiting=1)
    queued.close()
    stats = up.wait_stats(disconnected=1, waiting=0, running=1)
    assert [left["ran"] for left in stats["disconnects"]] == [False]   # it never had a slot
    first.settimeout(3)
    assert first.recv(65536).startswith(b"HTTP/1.1 200")
    first.close()
    # Had the queued request been admitted it would hold the slot for 400 ms now.
    up.wait_stats(requests=2, completed=1, running=0, waiting=0)


def test_cli_flags_and_clean_sigterm_exit():
    proc, port = start_upstream("up-b", "--model", "cli-model", "--tokens", "4", "--ttft-ms", "0", "--error-rate", "0")
    try:
        config = request(port, "GET", "/admin/config").json()
        assert (config["model"], config["tokens"], config["ttft_ms"]) == ("cli-model", 4, 0)
        assert request(port, "GET", "/admin/last").status == 404  # nothing yet
        body = request(port, "POST", "/v1/chat/completions", {"messages": HELLO}).json()
        assert (body["model"], body["usage"]["completion_tokens"]) == ("cli-model", 4)
    finally:
        assert stop(proc) == 0
    bad = subprocess.run(
        [sys.executable, "-m", "devtools.demo_upstream", "--port", "0", "--error-rate", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=10,
    )
    assert bad.returncode == 2 and "--error-rate" in bad.stderr
