"""Envoy-side limits and sidecar failure modes, each with its own stack."""
import json
import threading
import time

import openai
import pytest

from tests.e2e import ask, client, post, upstream_stats


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
    assert "x-sluice-cluster" in ask(client(stack))[1]


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
