"""The guide's "bring your own Envoy" snippet (docs/snippets/byo-envoy.yaml), run as it is against
the stock Envoy and the sidecar: only the ports change. If the guide rots, this fails."""
import json
import subprocess

import pytest
import yaml

from devtools.stack import BIN, ROOT, Stack, http_get, wait_until
from sidecar.service.lint import lint_text
from tests.support.e2e import client, steered_within, wait_for_access_lines

SNIPPET = ROOT / "docs" / "snippets" / "byo-envoy.yaml"
UPSTREAM = ["--ttft-ms", "5", "--tokens-per-s", "2000", "--tokens", "4"]


def _with_ports(stack: Stack) -> dict:
    """The snippet with this stack's ports: listener, the sidecar, model_a/_b on the demo upstreams."""
    config = yaml.safe_load(SNIPPET.read_text())
    static = config["static_resources"]
    static["listeners"][0]["address"]["socket_address"].update(address="127.0.0.1", port_value=stack.ports.http)
    ports = {"sluice": stack.ports.sidecar, "model_a": stack.ports.upstream_a, "model_b": stack.ports.upstream_b}
    for cluster in static["clusters"]:
        endpoint = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
        endpoint["address"]["socket_address"]["port_value"] = ports[cluster["name"]]
    config["admin"] = {"address": {"socket_address": {"address": "127.0.0.1", "port_value": stack.ports.admin}}}
    return config


@pytest.fixture(scope="module")
def byo(tmp_path_factory):
    stack = Stack(tmp_path_factory.mktemp("byo"), sidecar_env={"SLUICE_CACHE": "true"},
                  upstream_args={"a": UPSTREAM, "b": UPSTREAM})
    try:
        for name in ("a", "b"):
            stack.start_upstream(name)
        stack.start_sidecar()
        path = stack.workdir / "envoy.yaml"
        path.write_text(yaml.safe_dump(_with_ports(stack)))
        proc = stack._spawn("envoy", [str(BIN / "envoy"), "-c", str(path), "--concurrency", "1",
                                      "--log-level", "warn", "--base-id", str(stack.ports.admin)])
        wait_until(lambda: http_get(f"http://127.0.0.1:{stack.ports.admin}/ready")[0] == 200, "envoy", proc=proc)
        # Ready is not yet steering: Envoy's first connection to the sidecar may still be opening
        # (fail-open then passes a request by), as with any edge that has just started.
        steered_within(stack, 15.0)
        yield stack
    finally:
        stack.stop()


def test_snippet_is_lint_clean_and_valid_for_envoy(tmp_path):
    assert lint_text(SNIPPET.read_text(), str(SNIPPET)) == []
    result = subprocess.run([str(BIN / "envoy"), "--mode", "validate", "-c", str(SNIPPET)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_requests_through_the_snippet_are_steered_cached_and_logged(byo):
    c = client(byo)
    seen = set()
    for i in range(12):
        raw = c.chat.completions.with_raw_response.create(
            model="byo-model", messages=[{"role": "user", "content": f"byo question {i}"}])
        assert raw.parse().choices[0].message.content
        seen.add(raw.headers["x-sluice-cluster"])
        assert raw.headers["x-sluice-cache"] == "miss"
    assert seen <= {"model_a", "model_b"} and seen       # the sidecar picked among the route's candidates
    again = c.chat.completions.with_raw_response.create(
        model="byo-model", messages=[{"role": "user", "content": "byo question 0"}])
    assert again.headers["x-sluice-cache"] == "exact"
    lines = wait_for_access_lines(byo, lambda e: e["model"] == "byo-model", 13, timeout=10)
    assert {e["route"] for e in lines} == {"chat"}      # the route's metadata reached the sidecar
    assert {e["outcome"] for e in lines} == {"routed", "answered"}


def test_the_sidecar_decides_whatever_the_client_sends(byo):
    c = client(byo, default_headers={"x-sluice-cluster": "sluice", "x-envoy-upstream-rq-timeout-ms": "1"})
    raw = c.chat.completions.with_raw_response.create(
        model="byo-model-2", messages=[{"role": "user", "content": "who routes me?"}])
    assert raw.headers["x-sluice-cluster"] in ("model_a", "model_b")
    [line] = wait_for_access_lines(byo, lambda e: e["model"] == "byo-model-2", 1, timeout=10)
    assert line["why"]["timeout"]["ms"] > 1


def test_fail_open_goes_to_the_default_cluster_whatever_the_client_says(byo):
    byo.stop_sidecar()
    try:
        # Only the edge's default cluster counts, not the client's header.
        raw = client(byo, default_headers={"x-sluice-cluster": "model_b"}).chat.completions.with_raw_response.create(
            model="byo-model-3", messages=[{"role": "user", "content": "sidecar gone"}])
        assert raw.headers.get("x-upstream-name") == "a"          # model_a: the default set at the edge
        assert json.loads(raw.text)["choices"][0]["message"]["content"]
    finally:
        byo.start_sidecar()
