"""Operations through the real Envoy, sidecar and demo upstreams: the request log, traceparent
forwarding, the Admin service and its CLI, config reload under load, documented metrics."""
import json
import re
import signal
import subprocess
import threading
import time
import uuid

import httpx
import pytest

from devtools.stack import BIN, ROOT, http_get
from sidecar.cache.policy import CachePolicy
from sidecar.cache.scope import scope_for
from sidecar.openai.chat import parse_chat_request
from sidecar.observability.tracing import parse_traceparent
from tests.support.e2e import chat_route, metric, post, wait_for_access_lines, wait_for_metric

SECRET = "ops-test-cache-secret-0123456789"
API_KEY = "Bearer sk-ops-e2e-do-not-log"
ROUTES = [chat_route("chat", "/", [{"cluster": "upstream_a", "weight": 1}, {"cluster": "upstream_b", "weight": 1}])]


@pytest.fixture(scope="module")
def config_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("config") / "sluice.env"
    path.write_text("SLUICE_LOG_LEVEL=INFO\n")
    return path


@pytest.fixture(scope="module")
def stack(make_module_stack, config_file):
    args = ["--ttft-ms", "10", "--tokens", "4", "--tokens-per-s", "1000"]
    return make_module_stack(routes=ROUTES, upstream_args={"a": args, "b": args}, sidecar_env={
        "SLUICE_CACHE": "true", "SLUICE_SEMANTIC": "true", "SLUICE_CACHE_SECRET": SECRET,
        "SLUICE_CONFIG_FILE": str(config_file), "SLUICE_TRACE_SAMPLE_RATIO": "1"})


# --- helpers ------------------------------------------------------------------------------

def body_for(prompt: str) -> bytes:
    return json.dumps({"model": "demo-model", "messages": [{"role": "user", "content": prompt}]}).encode()


def chat(stack, prompt: str, traceparent: str | None = None, key: str = API_KEY):
    headers = {"authorization": key, **({"traceparent": traceparent} if traceparent else {})}
    status, response_headers, raw = post(stack, "/v1/chat/completions", body_for(prompt), headers)
    assert status == 200, raw
    return {k.lower(): v for k, v in response_headers.items()}


def new_trace() -> tuple[str, str]:
    trace_id = uuid.uuid4().hex
    return trace_id, f"00-{trace_id}-{uuid.uuid4().hex[:16]}-01"


def access_line(stack, trace_id: str, timeout: float = 5.0) -> dict | None:
    found = wait_for_access_lines(stack, lambda entry: entry["trace_id"] == trace_id, 1, timeout)
    return found[0] if found else None


def last_upstream_headers(stack, upstream: str) -> dict:
    port = stack.upstream_port(upstream)
    return json.loads(http_get(f"http://127.0.0.1:{port}/admin/last")[1])["headers"]


def admin(stack, *args: str) -> subprocess.CompletedProcess:
    action, *rest = args
    return subprocess.run([str(BIN / "sluice"), "admin", action, "--target", f"127.0.0.1:{stack.ports.sidecar}", *rest],
                          capture_output=True, text=True, timeout=30)


# --- request log --------------------------------------------------------------------------

def test_one_request_log_line_without_secrets(stack):
    trace_id, traceparent = new_trace()
    prompt = f"my private question {uuid.uuid4().hex}"
    headers = chat(stack, prompt, traceparent)
    entry = access_line(stack, trace_id)
    assert entry is not None
    assert (entry["route"], entry["cluster"], entry["outcome"], entry["status"], entry["cache"]) == (
        "chat", headers["x-sluice-cluster"], "routed", 200, "miss")
    assert (entry["model"], entry["stream"]) == ("demo-model", False)
    assert entry["request_id"] == last_upstream_headers(stack, headers["x-upstream-name"])["x-request-id"]
    assert 0 <= entry["ttfb_ms"] <= entry["duration_ms"]
    log = (stack.workdir / "sidecar.log").read_text()
    assert "sk-ops-e2e-do-not-log" not in log and prompt not in log


def test_envoys_access_log_leaves_out_the_query_string(stack):
    """Clients put API keys in query strings (Azure's ?api-key=): Envoy logs the path without it."""
    envoy_log = stack.workdir / "envoy.log"
    seen = len(envoy_log.read_text().splitlines())
    status, _, raw = post(stack, "/v1/chat/completions?api-key=sk-in-the-query", body_for("query probe"),
                          {"authorization": API_KEY})
    assert status == 200, raw

    def new_chat_lines():
        lines = envoy_log.read_text().splitlines()[seen:]
        return [json.loads(line) for line in lines if line.startswith("{") and '"POST"' in line]
    deadline = time.monotonic() + 15                # Envoy writes its access log in batches
    while not new_chat_lines() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [entry["path"] for entry in new_chat_lines()] == ["/v1/chat/completions"]
    assert "sk-in-the-query" not in envoy_log.read_text()


# --- traceparent ----------------------------------------------------------------------------

def test_incoming_traceparent_reaches_the_upstream_unchanged(stack):
    trace_id, traceparent = new_trace()
    headers = chat(stack, f"trace me {trace_id}", traceparent)
    assert last_upstream_headers(stack, headers["x-upstream-name"])["traceparent"] == traceparent


def test_missing_traceparent_is_created_and_logged(stack):
    headers = chat(stack, f"no trace {uuid.uuid4().hex}")
    forwarded = parse_traceparent(last_upstream_headers(stack, headers["x-upstream-name"]).get("traceparent"))
    assert forwarded is not None and forwarded.sampled           # SLUICE_TRACE_SAMPLE_RATIO=1
    assert access_line(stack, forwarded.trace_id)["cluster"] == headers["x-sluice-cluster"]


# --- the Admin service ------------------------------------------------------------------------

def test_admin_clusters(stack):
    for _ in range(6):
        chat(stack, f"spread {uuid.uuid4().hex}")
    result = admin(stack, "clusters", "--json")
    assert result.returncode == 0, result.stderr
    clusters = {c["name"]: c for c in json.loads(result.stdout)["clusters"]}
    assert set(clusters) == {"upstream_a", "upstream_b"}
    for c in clusters.values():
        assert c["breaker"] == "closed" and c["in_flight"] == "0" and c["requests_in_window"] != "0"
        assert 0 <= c["score"] <= 1 and c["ttfb_p95_s"] > 0 and c["error_rate"] == 0
    table = admin(stack, "clusters").stdout.splitlines()
    assert table[0].split()[:3] == ["cluster", "breaker", "score"]
    assert [row.split()[:2] for row in table[1:]] == [["upstream_a", "closed"], ["upstream_b", "closed"]]


def test_admin_purges_a_cache_scope(stack):
    key = f"Bearer sk-purge-{uuid.uuid4().hex}"
    prompt = "what is a sluice gate?"
    assert chat(stack, prompt, key=key)["x-sluice-cache"] == "miss"
    assert chat(stack, prompt, key=key)["x-sluice-cache"] == "exact"
    asked = {"authorization": key, ":authority": f"127.0.0.1:{stack.ports.http}", ":path": "/v1/chat/completions"}
    scope = scope_for(parse_chat_request(body_for(prompt)), asked, CachePolicy(), SECRET.encode(), route="chat")
    result = admin(stack, "purge", "--scope", scope.key)
    assert result.returncode == 0 and result.stdout.strip() == "deleted 1 cached answers", result
    assert chat(stack, prompt, key=key)["x-sluice-cache"] == "miss"
    unknown = admin(stack, "purge", "--scope", "0" * 64, "--json")
    assert json.loads(unknown.stdout) == {"deleted": "0"}          # proto3 JSON: int64 as a string


def test_admin_purges_everything(stack):
    key = f"Bearer sk-purge-all-{uuid.uuid4().hex}"
    chat(stack, "what is a lock?", key=key)
    assert chat(stack, "what is a lock?", key=key)["x-sluice-cache"] == "exact"
    result = admin(stack, "purge", "--all")
    assert result.returncode == 0 and re.fullmatch(r"deleted [1-9]\d* cached answers", result.stdout.strip()), result
    assert chat(stack, "what is a lock?", key=key)["x-sluice-cache"] == "miss"


def test_admin_drain_stops_the_sidecar_gracefully(make_stack):
    stack = make_stack(sidecar_args=["--drain-delay", "1", "--grace", "5"])
    result = admin(stack, "drain")
    assert result.returncode == 0 and "draining: NOT_SERVING for 1s, then 5s" in result.stdout, result
    stack.wait_sidecar_health(False)
    assert stack.procs["sidecar"].wait(15) == 0
    status, headers, _ = post(stack, "/v1/chat/completions", body_for("still answered?"))
    assert status == 200 and "x-sluice-cluster" not in headers       # fail-open to the default


def test_a_second_signal_cuts_the_drain_short_and_still_stops_cleanly(make_stack):
    slow = ["--ttft-ms", "50", "--tokens", "400", "--tokens-per-s", "20"]     # a 20 s answer
    stack = make_stack(sidecar_args=["--drain-delay", "30", "--grace", "30"],
                       upstream_args={"a": slow, "b": slow})
    trace_id, traceparent = new_trace()

    def stream_slowly():
        body = json.dumps({"model": "demo-model", "stream": True,
                           "messages": [{"role": "user", "content": "tell me a long story"}]}).encode()
        try:
            post(stack, "/v1/chat/completions", body, {"authorization": API_KEY, "traceparent": traceparent})
        except Exception:
            pass                                  # cut off: what matters is how the sidecar stops

    threading.Thread(target=stream_slowly, daemon=True).start()
    time.sleep(1.0)                               # the answer is streaming through the sidecar
    sidecar = stack.procs["sidecar"]
    sidecar.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    sidecar.send_signal(signal.SIGTERM)
    assert sidecar.wait(10) == 0                  # not after 30 s of drain and 30 of grace
    log_text = (stack.workdir / "sidecar.log").read_text()
    assert "second signal" in log_text and "Traceback" not in log_text
    assert trace_id in log_text                   # the cut stream's request line was written


# --- config reload ----------------------------------------------------------------------------

def test_reload_under_load_keeps_requests_succeeding(stack, config_file):
    sidecar = stack.procs["sidecar"]
    ok_before = metric(stack, "sluice_config_reloads_total", result="ok")
    errors_before = metric(stack, "sluice_config_reloads_total", result="error")
    statuses, failures, stop = [], [], threading.Event()

    def load():
        with httpx.Client(base_url=f"http://127.0.0.1:{stack.ports.http}", timeout=10) as http:
            while not stop.is_set():
                try:
                    response = http.post("/v1/chat/completions", content=body_for(f"load {uuid.uuid4().hex}"),
                                         headers={"authorization": API_KEY, "content-type": "application/json"})
                    statuses.append(response.status_code)
                except httpx.HTTPError as exc:
                    failures.append(exc)

    threads = [threading.Thread(target=load) for _ in range(4)]
    for t in threads:
        t.start()
    versions = ["SLUICE_LOG_LEVEL=DEBUG\nSLUICE_LOG_PROMPTS=false\n", "SLUICE_LOG_LEVEL=LOUD\n",
                "SLUICE_LOG_LEVEL=WARNING\nSLUICE_GRACE_S=99\n", "SLUICE_LOG_LEVEL=INFO\n",
                "SLUICE_ACCESS_LOG=false\n", "SLUICE_ACCESS_LOG=true\n"]
    try:
        for text in versions:
            config_file.write_text(text)
            sidecar.send_signal(signal.SIGHUP)
            time.sleep(0.4)
    finally:
        stop.set()
        for t in threads:
            t.join(15)
    assert failures == [] and len(statuses) > 20 and set(statuses) == {200}
    assert sidecar.poll() is None
    assert wait_for_metric(stack, "sluice_config_reloads_total", ok_before + 5, result="ok") == ok_before + 5
    assert metric(stack, "sluice_config_reloads_total", result="error") == errors_before + 1
    log = (stack.workdir / "sidecar.log").read_text()
    assert "failed, keeping the running settings" in log and "'LOUD'" in log
    assert "grace_s changed but need a restart" in log


def test_reload_turns_the_request_log_off_and_on(stack, config_file):
    def reload(text):
        before = metric(stack, "sluice_config_reloads_total", result="ok")
        config_file.write_text(text)
        stack.procs["sidecar"].send_signal(signal.SIGHUP)
        assert wait_for_metric(stack, "sluice_config_reloads_total", before + 1, result="ok") == before + 1

    reload("SLUICE_ACCESS_LOG=false\n")
    quiet_id, traceparent = new_trace()
    chat(stack, "quiet please", traceparent)
    reload("SLUICE_ACCESS_LOG=true\n")
    loud_id, traceparent = new_trace()
    chat(stack, "loud again", traceparent)
    assert access_line(stack, loud_id) is not None
    assert access_line(stack, quiet_id, timeout=0) is None


# --- documented metrics -----------------------------------------------------------------------

def documented_sidecar_metrics() -> set[str]:
    page = (ROOT / "docs" / "metrics.md").read_text()
    # Metrics documented as needing Redis are checked by the Redis tests.
    section = "\n".join(line for line in page.splitlines() if "SLUICE_REDIS_URL" not in line)
    names = set(re.findall(r"\bsluice_[a-z0-9_]+", section))
    for line in (ROOT / "deploy" / "metrics.txt").read_text().splitlines():
        fields = line.split("#", 1)[0].split()
        if fields[1:] == ["sidecar", "exported"]:
            names.add(fields[0])
    return names


def test_every_documented_metric_is_exported_by_a_running_sidecar(stack):
    chat(stack, f"metrics {uuid.uuid4().hex}")
    post(stack, "/v1/models", None, method="GET")
    _, text = http_get(f"http://127.0.0.1:{stack.ports.metrics}/metrics")
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    exported = set(types) | {name + "_total" for name, kind in types.items() if kind == "counter"}
    documented = documented_sidecar_metrics()
    assert len(documented) >= 10
    assert documented <= exported, sorted(documented - exported)


# --- event loop ---------------------------------------------------------------------------

def test_the_sidecar_runs_on_uvloop_and_on_asyncio_when_asked(stack, make_stack):
    """uvloop by default (every other e2e test runs on it); asyncio still serves every tier,
    the semantic one included (the embedder hands its vectors back through the loop)."""
    assert "event loop: uvloop" in (stack.workdir / "sidecar.log").read_text()
    plain = make_stack(sidecar_env={"SLUICE_EVENT_LOOP": "asyncio", "SLUICE_CACHE_SECRET": SECRET})
    tiers = []
    for prompt in ("How do I reset my password?", "How do I reset my password?",
                   "What are the steps to reset my password?"):
        status, headers, _ = post(plain, "/v1/chat/completions", body_for(prompt), {"authorization": API_KEY})
        assert status == 200
        tiers.append(headers["x-sluice-cache"])
    assert tiers == ["miss", "exact", "semantic"]
    assert "event loop: asyncio" in (plain.workdir / "sidecar.log").read_text()
