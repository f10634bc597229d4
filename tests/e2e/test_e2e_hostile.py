"""Hostile clients and upstreams through the real Envoy, sidecar and demo upstream: each ends in
a well-formed answer, never a crashed stream, a bypassed limit or a poisoned cache entry."""
import http.client
import json
import socket

import httpx
import pytest

from devtools.envoy_config import chat_route
from devtools.fuzzing import deep_text
from tests.support.e2e import metric, upstream_stats

ROLE_LIST = {"model": "demo-model", "messages": [{"role": ["user"], "content": "hi"}]}
BODY = {"model": "demo-model", "messages": [{"role": "user", "content": "What is the capital of France?"}]}


def _route(name, prefix, **sluice):
    route = chat_route(name, prefix, [{"cluster": "upstream_a"}], rewrite="/")
    route["metadata"]["filter_metadata"]["sluice"].update(sluice)
    return route


ROUTES = [
    _route("limited", "/limited/", admission={"enabled": True, "requests_per_minute": 3}, cache={"enabled": False}),
    # The cache, and token limits (so the usage meter reads every answer).
    _route("metered", "/", admission={"enabled": True, "tokens_per_minute": 1_000_000},
           cache={"semantic": False}),
]


@pytest.fixture(scope="module")
def stack(make_module_stack):
    # Fail-closed: a stream the sidecar lets fail would show as a 500, not pass unnoticed.
    return make_module_stack(routes=ROUTES, envoy_vars={"FAILURE_MODE_ALLOW": "false"},
                             sidecar_env={"SLUICE_CACHE": "true", "SLUICE_SEMANTIC": "false"})


def _post(stack, prefix, body, key="k1"):
    return httpx.post(f"http://127.0.0.1:{stack.ports.http}{prefix}v1/chat/completions", json=body,
                      headers={"authorization": f"Bearer {key}"}, timeout=30)


def _can(stack, body: bytes, content_type="application/json", count=1):
    port = stack.ports.upstream_a
    response = httpx.post(f"http://127.0.0.1:{port}/admin/canned?count={count}", content=body,
                          headers={"content-type": content_type}, timeout=5)
    assert response.status_code == 200


def test_a_message_role_of_another_json_type_is_a_400_and_never_reaches_the_upstream(stack):
    """Once a TypeError in the parser: fail-open sent 10 of 10 past a 3-a-minute limit."""
    before = upstream_stats(stack, "a")["requests"]
    for _ in range(10):
        response = _post(stack, "/limited/", ROLE_LIST, key="role-list")
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["param"] == "messages[0].role" and error["type"] == "invalid_request_error"
    assert upstream_stats(stack, "a")["requests"] == before
    statuses = [_post(stack, "/limited/", BODY, key="role-list").status_code for _ in range(4)]
    assert statuses == [200, 200, 200, 429]
    assert metric(stack, "sluice_internal_errors_total") == 0


def test_an_answer_with_a_401_digit_token_count_is_relayed_then_replayed_with_an_estimate(stack):
    """Once stored, then OverflowError failed that stream and every hit on the entry (500s
    fail-closed for the TTL)."""
    body = {"model": "demo-model", "messages": [{"role": "user", "content": "How big is the usage?"}]}
    answer = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "demo-model",
              "choices": [{"index": 0, "message": {"role": "assistant", "content": "Very big."},
                           "finish_reason": "stop"}],
              "usage": {"prompt_tokens": 10 ** 400, "completion_tokens": 3, "total_tokens": 10 ** 400 + 3}}
    _can(stack, json.dumps(answer).encode())
    first = _post(stack, "/", body, key="huge")
    assert first.status_code == 200 and first.headers["x-sluice-cache"] == "miss"
    assert first.json()["choices"][0]["message"]["content"] == "Very big."       # relayed as sent
    for _ in range(2):
        hit = _post(stack, "/", body, key="huge")
        assert hit.status_code == 200 and hit.headers["x-sluice-cache"] == "exact"
        usage = hit.json()["usage"]
        assert usage["prompt_tokens"] < 100 and usage["completion_tokens"] == 3     # estimated
    assert metric(stack, "sluice_internal_errors_total") == 0


@pytest.mark.parametrize("content_type, answer", [
    ("application/json", deep_text(3000)),
    ("text/event-stream", b"data: " + deep_text(3000) + b"\n\ndata: [DONE]\n\n"),
])
def test_an_answer_nested_thousands_deep_is_relayed_not_stored(stack, content_type, answer):
    body = {"model": "demo-model", "stream": content_type == "text/event-stream",
            "messages": [{"role": "user", "content": f"Deep {content_type}?"}]}
    _can(stack, answer, content_type)
    first = _post(stack, "/", body, key="deep")
    assert first.status_code == 200 and first.content == answer
    again = _post(stack, "/", body, key="deep")                 # not stored: upstream again
    assert again.status_code == 200 and again.headers["x-sluice-cache"] == "miss"
    assert metric(stack, "sluice_internal_errors_total") == 0


def _raw(stack, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", stack.ports.http), timeout=10) as sock:
        sock.sendall(request)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    return received


@pytest.mark.parametrize("request_bytes, status", [
    (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n", 431),
    (b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: a\r\n" % i for i in range(150)) + b"\r\n", 431),
    (b"POST * HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}", 400),
])
def test_a_request_envoy_cannot_parse_gets_its_status_not_a_closed_connection(stack, request_bytes, status):
    reply = _raw(stack, request_bytes)
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 %d" % status), reply[:200]
    assert json.loads(body)["error"]["code"] == "bad_http_request"


def test_the_sidecar_still_processes_every_routed_request(stack):
    """ext_proc is off by default in the Envoy config and on for the routes' host."""
    connection = http.client.HTTPConnection("127.0.0.1", stack.ports.http, timeout=30)
    connection.request("POST", "/v1/chat/completions", json.dumps(BODY),
                       {"content-type": "application/json", "authorization": "Bearer k9"})
    response = connection.getresponse()
    assert response.status == 200 and response.getheader("x-sluice-cache") in ("miss", "exact")
