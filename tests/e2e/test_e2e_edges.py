"""Envoy-side limits and sidecar failure modes, each with its own stack."""
import http.client
import json
import socket
import threading
import time

import openai
import pytest

from devtools import envoy_config
from devtools.stack import Stack
from tests.support.e2e import ask, chat_route, client, post, steered_within, upstream_stats


def test_local_rate_limit_gives_openai_429(make_stack):
    stack = make_stack(envoy_vars={"RATE_LIMIT_TOKENS": 3, "RATE_LIMIT_FILL_INTERVAL": "60s"})
    statuses = [post(stack, "/v1/models", None, method="GET")[0] for _ in range(3)]
    assert statuses == [200, 200, 200]
    status, headers, raw = post(stack, "/v1/chat/completions", b'{"model": "m", "messages": []}')
    assert status == 429
    assert json.loads(raw)["error"]["type"] == "rate_limit_error"
    with pytest.raises(openai.RateLimitError):
        ask(client(stack))


def test_fail_open_when_sidecar_is_down(make_stack):
    stack = make_stack()
    assert ask(client(stack))[0].choices[0].message.content
    stack.stop_sidecar()
    for _ in range(5):       # at once (connection refused) and after Envoy marks it unhealthy
        completion, headers = ask(client(stack))
        assert completion.choices[0].message.content
        assert headers["x-upstream-name"] == "a" and "x-sluice-cluster" not in headers
    stack.wait_sidecar_health(False)
    assert ask(client(stack))[1]["x-upstream-name"] == "a"
    stack.start_sidecar()    # and steering resumes once it is back
    stack.wait_sidecar_health(True)
    steered_within(stack)


def test_fail_closed_when_configured(make_stack):
    stack = make_stack(envoy_vars={"FAILURE_MODE_ALLOW": "false"})
    assert ask(client(stack))[0].choices[0].message.content
    stack.stop_sidecar()
    before = upstream_stats(stack, "a")["requests"]
    with pytest.raises(openai.APIStatusError) as err:
        ask(client(stack))
    assert err.value.status_code >= 500
    assert upstream_stats(stack, "a")["requests"] == before


def test_sigterm_drains_open_requests(make_stack):
    stack = make_stack(upstream_args={"a": ["--ttft-ms", "1500", "--tokens", "4"],
                                      "b": ["--ttft-ms", "1500", "--tokens", "4"]},
                       sidecar_args=["--drain-delay", "1", "--grace", "10"])
    results = []

    def slow_call():
        try:
            results.append(ask(client(stack))[0].choices[0].message.content)
        except Exception as exc:  # recorded, asserted below
            results.append(exc)

    callers = [threading.Thread(target=slow_call) for _ in range(4)]
    for t in callers:
        t.start()
    time.sleep(0.5)                          # all four are waiting on the upstream
    stopper = threading.Thread(target=stack.stop_sidecar)
    stopper.start()
    for t in callers:
        t.join(30)
    stopper.join(30)
    assert len(results) == 4 and all(isinstance(r, str) and r for r in results), results


class TrailersStack(Stack):
    """Envoy passing HTTP/1.1 request trailers on (off by default; HTTP/2 clients always can)."""

    def write_envoy_config(self):
        path = super().write_envoy_config()
        config = envoy_config.yaml.safe_load(path.read_text())
        for hcm in envoy_config.http_connection_managers(config):
            hcm.setdefault("http_protocol_options", {})["enable_trailers"] = True
        return envoy_config.write(config, path)


def chunked_with_trailers(port: int, body: bytes) -> tuple[int, dict]:
    """A chunked POST whose body is followed by a trailer: status and response headers."""
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: localhost\r\nauthorization: Bearer test-key\r\n"
               b"content-type: application/json\r\ntransfer-encoding: chunked\r\ntrailer: x-checksum\r\n\r\n"
               + b"%x\r\n" % len(body) + body + b"\r\n0\r\nx-checksum: 1234\r\n\r\n")
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(request)
        response = http.client.HTTPResponse(sock)
        response.begin()
        response.read()
        return response.status, {k.lower(): v for k, v in response.getheaders()}


def test_a_request_with_trailers_is_decided_on_like_any_other(tmp_path):
    """In BUFFERED mode Envoy sends such a body with end_of_stream false (the trailers end the
    stream): the sidecar still routes it and answers it from cache, not passes it undecided."""
    body = json.dumps({"model": "demo-model", "messages": [{"role": "user", "content": "trailers?"}]}).encode()
    with TrailersStack(tmp_path, sidecar_env={"SLUICE_CACHE": "true", "SLUICE_SEMANTIC": "false"}) as stack:
        first = chunked_with_trailers(stack.ports.http, body)
        second = chunked_with_trailers(stack.ports.http, body)
    assert first[0] == second[0] == 200
    assert "x-sluice-cluster" in first[1] and first[1]["x-sluice-cache"] == "miss"
    assert second[1]["x-sluice-cache"] == "exact"


def test_request_log_lines_are_flushed_while_a_long_drain_runs(make_stack):
    """A request that ends during the drain is in the log within a flush interval, not only
    when the last slow stream lets the sidecar exit (lost if the pod is killed first)."""
    stack = make_stack(upstream_args={"a": ["--ttft-ms", "800", "--tokens", "2"],
                                      "b": ["--ttft-ms", "6000", "--tokens", "2"]},
                       routes=[chat_route("quick", "/quick/", [{"cluster": "upstream_a"}], rewrite="/"),
                               chat_route("slow", "/slow/", [{"cluster": "upstream_b"}], rewrite="/")],
                       sidecar_args=["--drain-delay", "0.2", "--grace", "20"])
    # Three quick ones end together: the first line is written at once (the last write was
    # long ago), the other two wait in the buffer for the periodic flush.
    calls = [threading.Thread(target=ask, args=(client(stack, path),)) for path in ("/slow/v1",) + ("/quick/v1",) * 3]
    for call in calls:
        call.start()
    time.sleep(0.3)                                         # all are waiting on their upstream
    stopper = threading.Thread(target=stack.stop_sidecar)
    stopper.start()
    for call in calls[1:]:
        call.join(10)                                       # the quick ones are answered mid-drain
    time.sleep(2.0)                                         # two flush intervals
    draining = stopper.is_alive()
    logged = [json.loads(line) for line in (stack.workdir / "sidecar.log").read_text().splitlines()
              if '"logger":"sluice.access"' in line]
    for thread in (calls[0], stopper):                      # the slow one, then the exit
        thread.join(30)
    assert draining, "the slow request should still hold the drain open"
    assert [entry["route"] for entry in logged] == ["quick"] * 3


def test_a_json_answer_larger_than_envoys_buffer_is_passed_on_whole_and_not_stored(make_stack):
    """The sidecar reads JSON answers it may store (or meter) buffered. Past Envoy's buffer
    limit a fully buffered body stalls until the route's timeout (a 504); BUFFERED_PARTIAL
    hands the sidecar the first part and streams the rest to the client."""
    big = ["--ttft-ms", "0", "--tokens", "60000", "--tokens-per-s", "100000000"]
    stack = make_stack(upstream_args={"a": big, "b": big}, envoy_vars={"MAX_BODY_BYTES": 65536},
                       sidecar_env={"SLUICE_CACHE": "true", "SLUICE_SEMANTIC": "false"})
    sizes, tiers = [], []
    for _ in range(2):
        completion, headers = ask(client(stack), "a long one, please", max_tokens=60000)
        sizes.append(len(completion.choices[0].message.content))
        tiers.append(headers["x-sluice-cache"])
    assert sizes[0] == sizes[1] > 65536
    assert tiers == ["miss", "miss"]                         # too large to store, never cut short


def test_an_encoded_or_doubled_chat_path_is_processed_like_the_plain_one(make_stack):
    """The upstream decodes "%63" to "c": a path the sidecar did not know as the chat path
    went past routing, tenant limits and cache. Envoy normalises it first."""
    stack = make_stack(sidecar_env={"SLUICE_CACHE": "true", "SLUICE_SEMANTIC": "false"})
    body = json.dumps({"model": "demo-model", "messages": [{"role": "user", "content": "encoded?"}]}).encode()
    tiers = [post(stack, path, body, {"authorization": "Bearer k1"})[1].get("x-sluice-cache")
             for path in ("/v1/chat/completions", "/v1/chat/%63ompletions", "/v1/chat//completions",
                          "/v1/chat/completion%73", "/v1/chat/completion%73?x=1")]
    # Processed every time; a query makes another endpoint, so another scope (a miss).
    assert tiers == ["miss", "exact", "exact", "exact", "miss"]
