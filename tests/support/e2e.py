"""Helpers for end-to-end tests through a real Envoy, sidecar and demo upstreams."""
from __future__ import annotations

import json
import re
import time
import urllib.request
from typing import Callable

import openai

from devtools.envoy_config import chat_route  # noqa: F401  (re-exported for tests)
from devtools.stack import Stack, http_get


def client(stack: Stack, path: str = "/v1", **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{stack.ports.http}{path}", api_key="test-key",
                         max_retries=0, timeout=30, **kwargs)


def ask(c: openai.OpenAI, content: str = "hello", **kwargs):
    """A non-streamed chat call; returns (completion, response headers)."""
    raw = c.chat.completions.with_raw_response.create(
        model="demo-model", messages=[{"role": "user", "content": content}], **kwargs)
    return raw.parse(), raw.headers


def post(stack: Stack, path: str, body: bytes, headers: dict | None = None, method: str = "POST"):
    """A raw request through Envoy: (status, headers, body)."""
    request = urllib.request.Request(f"http://127.0.0.1:{stack.ports.http}{path}", data=body,
                                     method=method,
                                     headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def metric(stack: Stack, name: str, **labels) -> float:
    """Sum of a sidecar metric's samples whose labels include `labels`."""
    _, text = http_get(f"http://127.0.0.1:{stack.ports.metrics}/metrics")
    total = 0.0
    for line in text.splitlines():
        match = re.match(rf"^{re.escape(name)}(\{{.*\}})? (\S+)$", line)
        if not match:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            total += float(match.group(2))
    return total


def wait_for_metric(stack: Stack, name: str, expected: float, timeout: float = 5.0, **labels) -> float:
    """The metric once it reaches `expected` (a stream is counted when Envoy closes it, which can
    be just after the client has its answer); its last value after `timeout` otherwise."""
    deadline = time.monotonic() + timeout
    while (value := metric(stack, name, **labels)) != expected and time.monotonic() < deadline:
        time.sleep(0.05)
    return value


def upstream_stats(stack: Stack, name: str) -> dict:
    port = getattr(stack.ports, f"upstream_{name}")
    return json.loads(http_get(f"http://127.0.0.1:{port}/admin/stats")[1])


def access_lines(stack: Stack) -> list[dict]:
    """The sidecar's request-log lines so far."""
    lines = []
    for line in (stack.workdir / "sidecar.log").read_text().splitlines():
        if line.startswith('{"time":') and '"logger":"sluice.access"' in line:
            lines.append(json.loads(line))
    return lines


def wait_for_access_lines(stack: Stack, keep: Callable[[dict], bool], count: int,
                          timeout: float = 5.0) -> list[dict]:
    """The request-log lines `keep` accepts, once there are `count` of them or at the timeout
    (the log is flushed each second)."""
    deadline = time.monotonic() + timeout
    while True:
        found = [entry for entry in access_lines(stack) if keep(entry)]
        if len(found) >= count or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def steered_within(stack: Stack, seconds: float = 2.0) -> float:
    """Seconds until a request is steered by the sidecar again (x-sluice-cluster), asking at
    once and then every 50 ms; fails after `seconds`. Envoy lifts an outlier ejection of a
    restarted sidecar within max_ejection_time (1 s)."""
    started = time.monotonic()
    while True:
        status, headers, _ = post(stack, "/v1/chat/completions",
                                  b'{"model": "demo-model", "messages": [{"role": "user", "content": "hello"}]}',
                                  {"content-type": "application/json", "authorization": "Bearer test-key"})
        if status == 200 and "x-sluice-cluster" in headers:
            return time.monotonic() - started
        assert time.monotonic() - started < seconds, f"not steered {seconds}s after the sidecar came back"
        time.sleep(0.05)
