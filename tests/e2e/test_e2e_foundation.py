"""Foundation behaviour through the real Envoy, the sidecar and two demo upstreams."""
import json
import socket
import ssl
import subprocess
import time

import httpx
import openai
import pytest

from devtools import envoy_config
from devtools.stack import BIN, ROOT, http_get
from tests.support.e2e import ask, chat_route, client, metric, post, upstream_stats, wait_for_metric

ROUTES = [
    chat_route("only-b", "/only-b/", [{"cluster": "upstream_a", "weight": 0},
                                      {"cluster": "upstream_b", "weight": 100}], rewrite="/"),
    chat_route("only-a", "/only-a/", [{"cluster": "upstream_a", "weight": 100},
                                      {"cluster": "upstream_b", "weight": 0}], rewrite="/"),
    chat_route("bad", "/bad/", [{"cluster": "upstream_b", "weight": -3}], rewrite="/"),
    chat_route("chat", "/", [{"cluster": "upstream_a", "weight": 1}, {"cluster": "upstream_b", "weight": 1}]),
]


@pytest.fixture(scope="module")
def stack(make_module_stack):
    return make_module_stack(routes=ROUTES, upstream_args={
        "a": ["--ttft-ms", "20", "--tokens-per-s", "1000", "--tokens", "8"],
        "b": ["--ttft-ms", "20", "--tokens-per-s", "1000", "--tokens", "8"]})


@pytest.mark.parametrize("rendered", [{}, {"FAILURE_MODE_ALLOW": "false"}])
def test_shipped_envoy_config_validates(tmp_path, rendered):
    path = envoy_config.write(envoy_config.render(TLS_CERT=ROOT / "build/tls/cert.pem",
                                                  TLS_KEY=ROOT / "build/tls/key.pem", **rendered),
                              tmp_path / "envoy.yaml")
    from devtools.stack import ensure_certificate
    ensure_certificate(ROOT / "build" / "tls")
    result = subprocess.run([str(BIN / "envoy"), "--mode", "validate", "-c", str(path)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK" in result.stdout + result.stderr


def test_non_streaming_chat_through_envoy(stack):
    completion, headers = ask(client(stack), "what is the capital of France?")
    assert completion.choices[0].message.role == "assistant"
    assert completion.choices[0].message.content
    assert completion.usage.completion_tokens == 8
    assert headers["x-sluice-cluster"] == "upstream_" + headers["x-upstream-name"]


def test_streaming_is_not_buffered(stack):
    port = stack.ports.upstream_a
    httpx.post(f"http://127.0.0.1:{port}/admin/config", json={"ttft_ms": 50, "tokens": 30, "tokens_per_s": 30})
    try:
        started = time.monotonic()
        stream = client(stack, "/only-a/v1").chat.completions.create(
            model="demo-model", messages=[{"role": "user", "content": "tell me a story"}],
            stream=True, stream_options={"include_usage": True})
        arrivals, text, usage = [], "", None
        for chunk in stream:
            arrivals.append(time.monotonic() - started)
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
            usage = chunk.usage or usage
        # 30 tokens at 30/s take about a second upstream; the first chunk must not wait for them.
        assert arrivals[0] < arrivals[-1] / 3, arrivals
        assert len(arrivals) >= 30 and text and usage.completion_tokens == 30
    finally:
        httpx.post(f"http://127.0.0.1:{port}/admin/config", json={"ttft_ms": 20, "tokens": 8, "tokens_per_s": 1000})


def test_default_route_spreads_over_both_clusters(stack):
    seen = {ask(client(stack))[1]["x-upstream-name"] for _ in range(30)}
    assert seen == {"a", "b"}


@pytest.mark.parametrize("path, upstream", [("/only-b/v1", "b"), ("/only-a/v1", "a")])
def test_route_weights_100_0_always_land_on_one_cluster(stack, path, upstream):
    names = [ask(client(stack, path))[1]["x-upstream-name"] for _ in range(15)]
    assert names == [upstream] * 15


def test_invalid_route_settings_fall_back_to_route_default(stack):
    before = metric(stack, "sluice_requests_total", route="bad", outcome="invalid_route")
    completion, headers = ask(client(stack, "/bad/v1"))
    assert headers["x-upstream-name"] == "a"       # the edge's default cluster, not the bad one
    assert "x-sluice-cluster" not in headers
    assert wait_for_metric(stack, "sluice_requests_total", before + 1, route="bad",
                           outcome="invalid_route") == before + 1
    log = (stack.workdir / "sidecar.log").read_text()
    assert "candidates[0].weight must be >= 0" in log


def test_client_cannot_choose_the_cluster(stack):
    c = client(stack, "/only-a/v1", default_headers={"x-sluice-cluster": "upstream_b",
                                                      "x-envoy-upstream-rq-timeout-ms": "1"})
    for _ in range(5):
        assert ask(c)[1]["x-upstream-name"] == "a"
    forwarded = json.loads(http_get(f"http://127.0.0.1:{stack.ports.upstream_a}/admin/last")[1])
    assert forwarded["headers"].get("x-envoy-upstream-rq-timeout-ms") is None


def test_tls_listener(stack):
    context = ssl.create_default_context(cafile=str(ROOT / "build" / "tls" / "cert.pem"))
    c = openai.OpenAI(base_url=f"https://127.0.0.1:{stack.ports.https}/v1", api_key="k", max_retries=0,
                      http_client=httpx.Client(verify=context))
    completion = c.chat.completions.create(model="demo-model", messages=[{"role": "user", "content": "hi"}])
    assert completion.choices[0].message.content


@pytest.mark.parametrize("body, fragment", [
    (b"this is not json", "not valid JSON"),
    (b"", "empty"),
    (b"\xff\xfe\xfd", "UTF-8"),
    (b'{"model": "demo-model"}', "messages"),
    (b'{"model": "demo-model", "messages": "hi"}', "messages"),
    (b'{"model": 42, "messages": [{"role": "user", "content": "x"}]}', "model"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}', "temperature"),
    (b'[1, 2, 3]', "JSON object"),
])
def test_bad_bodies_get_openai_400_without_reaching_upstream(stack, body, fragment):
    before = upstream_stats(stack, "a")["requests"] + upstream_stats(stack, "b")["requests"]
    status, headers, raw = post(stack, "/v1/chat/completions", body)
    assert status == 400
    error = json.loads(raw)["error"]
    assert fragment in error["message"] and error["type"] == "invalid_request_error"
    assert upstream_stats(stack, "a")["requests"] + upstream_stats(stack, "b")["requests"] == before


def test_sdk_raises_bad_request_for_invalid_request(stack):
    with pytest.raises(openai.BadRequestError):
        client(stack).chat.completions.create(model="demo-model", messages=[])


def test_body_over_limit_gets_413_in_openai_shape(stack):
    big = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 2_000_000}]}).encode()
    status, _, raw = post(stack, "/v1/chat/completions", big)
    assert status == 413
    assert json.loads(raw)["error"]["code"] == "request_too_large"


@pytest.mark.parametrize("method, path", [("GET", "/v1/models"), ("GET", "/v1/chat/completions"),
                                          ("POST", "/v1/embeddings")])
def test_other_requests_pass_through_untouched(stack, method, path):
    status, headers, _ = post(stack, path, b'{"input": "x"}' if method == "POST" else None, method=method)
    assert headers.get("x-upstream-name") == "a"        # the default cluster
    assert "x-sluice-cluster" not in headers
    assert status in (200, 404, 405)


def test_client_disconnects_leave_no_open_streams(stack):
    # Mid-body: headers promise 10 kB, half is sent, then the socket closes.
    with socket.create_connection(("127.0.0.1", stack.ports.http)) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"content-length: 10000\r\n\r\n" + b'{"model": "m", "messages": [' + b" " * 4000)
        time.sleep(0.2)
    # Mid-response: a slow stream is dropped after its first chunk.
    httpx.post(f"http://127.0.0.1:{stack.ports.upstream_b}/admin/config", json={"tokens": 50, "tokens_per_s": 20})
    try:
        stream = client(stack, "/only-b/v1").chat.completions.create(
            model="demo-model", messages=[{"role": "user", "content": "long"}], stream=True)
        next(iter(stream))
        stream.close()
    finally:
        httpx.post(f"http://127.0.0.1:{stack.ports.upstream_b}/admin/config", json={"tokens": 8, "tokens_per_s": 1000})
    deadline = time.monotonic() + 10
    while metric(stack, "sluice_open_streams") != 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert metric(stack, "sluice_open_streams") == 0
    assert stack.procs["sidecar"].poll() is None
    assert ask(client(stack))[0].choices[0].message.content   # still serving


def test_metrics_count_requests_by_route_cluster_and_outcome(stack):
    before = metric(stack, "sluice_requests_total", route="only-b", cluster="upstream_b", outcome="routed",
                    status_class="2xx")
    for _ in range(3):
        ask(client(stack, "/only-b/v1"))
    assert wait_for_metric(stack, "sluice_requests_total", before + 3, route="only-b",
                           cluster="upstream_b", outcome="routed", status_class="2xx") == before + 3
    assert metric(stack, "sluice_ext_proc_message_seconds_count", phase="RequestBody") > 0
