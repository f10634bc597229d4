"""The why of a decision through the real Envoy and sidecar: the request log line's decision
record, and `sluice admin tail` streaming the same records live (prompts only with prompt
logging on)."""
import json
import subprocess
import threading
import time

import pytest

from devtools.stack import BIN
from tests.support.e2e import chat_route, client, wait_for_access_lines

ROUTES = [
    chat_route("admitted", "/admitted/", [{"cluster": "upstream_a", "max_in_flight": 4}], rewrite="/"),
    chat_route("chat", "/", [{"cluster": "upstream_a", "weight": 1}, {"cluster": "upstream_b", "weight": 1}]),
]
ROUTES[0]["metadata"]["filter_metadata"]["sluice"]["admission"] = {"enabled": True, "default_deadline_s": 20,
                                                                   "default_priority": "vip"}
ROUTES[1]["metadata"]["filter_metadata"]["sluice"]["cache"] = {"enabled": True}
UPSTREAM = ["--ttft-ms", "5", "--tokens-per-s", "2000", "--tokens", "4"]


@pytest.fixture(scope="module")
def stack(make_module_stack):
    return make_module_stack(routes=ROUTES, sidecar_env={"SLUICE_CACHE": "true", "SLUICE_SEMANTIC": "true"},
                             upstream_args={"a": UPSTREAM, "b": UPSTREAM})


def ask(c, content, model):
    """A chat call with a model name of its own: Envoy replaces clients' request ids, so the
    request log line is found by its model."""
    raw = c.chat.completions.with_raw_response.create(model=model, messages=[{"role": "user", "content": content}])
    return raw.parse(), raw.headers


def _lines(stack, model, count=1):
    lines = wait_for_access_lines(stack, lambda e: e["model"] == model, count, timeout=10)
    assert len(lines) == count, lines
    return lines


def _line(stack, model):
    return _lines(stack, model)[0]


def test_request_log_line_carries_cache_candidates_and_timeout(stack):
    c = client(stack)
    _, first = ask(c, "How do I reset my password on the portal?", "m-log")
    ask(c, "How do I reset my password on the portal?", "m-log")
    miss, hit = _lines(stack, "m-log", 2)

    assert miss["why"]["cache"]["verdict"] == "miss"
    assert miss["why"]["cache"]["reason"] in ("below_threshold", "no_semantic_tier")
    assert set(miss["why"]["scores"]) == {"upstream_a", "upstream_b"}
    assert all(0 <= score <= 1 for score in miss["why"]["scores"].values())
    assert miss["cluster"] == first["x-sluice-cluster"] and "picked" not in miss["why"]   # a primary
    assert miss["why"]["timeout"]["from"] in ("seed", "observed", "route_min", "route_max")
    assert str(miss["why"]["timeout"]["ms"]).isdigit()

    assert hit["why"]["cache"] == {"verdict": "exact", "reason": "exact", "similarity": 1.0}
    assert "scores" not in hit["why"]                      # answered before any cluster was picked
    assert "prompt" not in miss and "password" not in json.dumps(miss)


def test_semantic_hit_says_its_similarity(stack):
    c = client(stack)
    ask(c, "What is the capital city of France?", "m-sem")
    _, headers = ask(c, "what is the capital city of France?!", "m-sem")
    line = _lines(stack, "m-sem", 2)[1]
    assert line["why"]["cache"]["verdict"] == headers["x-sluice-cache"]
    if headers["x-sluice-cache"] == "semantic":
        assert line["why"]["cache"]["reason"] == "ok"
        assert line["why"]["cache"]["similarity"] == pytest.approx(float(headers["x-sluice-similarity"]), abs=1e-3)


def test_client_deadline_names_the_timeout_source(stack):
    ask(client(stack, default_headers={"x-request-deadline-ms": "1500"}), "deadline please", "m-deadline")
    line = _line(stack, "m-deadline")
    assert line["why"]["timeout"]["from"] == "client_deadline"
    assert line["why"]["timeout"]["ms"] <= 1500


def test_admission_class_wait_and_limit(stack):
    ask(client(stack, "/admitted/v1"), "admit me", "m-admit")
    admission = _line(stack, "m-admit")["why"]["admission"]
    assert admission["class"] == "vip" and admission["result"] == "admitted"
    assert admission["waited_ms"] >= 0 and admission["limit"] >= 1 and admission["in_flight"] >= 1


class Tail:
    """`sluice admin tail` running, its lines collected as they come."""

    def __init__(self, stack, *args):
        self.proc = subprocess.Popen([str(BIN / "sluice"), "admin", "tail", "--target",
                                      f"127.0.0.1:{stack.ports.sidecar}", "--for", "60", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(iter(self.proc.stdout.readline, "")),
                                        daemon=True)
        self._reader.start()

    def ready(self, send, seen) -> None:
        """Sends warm-up requests until the tail shows one: then it is surely subscribed."""
        deadline = time.monotonic() + 30
        while not any(seen(line) for line in self.lines):
            assert time.monotonic() < deadline and self.proc.poll() is None, self.proc.stderr.read()
            send()
            time.sleep(0.5)

    def stop(self) -> list[str]:
        time.sleep(1.5)                 # the last records reach the reader
        self.proc.terminate()
        self.proc.wait(timeout=10)
        self._reader.join(timeout=5)
        return list(self.lines)


def test_admin_tail_streams_filtered_records_without_prompts(stack):
    tail = Tail(stack, "--json", "--route", "admitted")
    tail.ready(lambda: ask(client(stack, "/admitted/v1"), "warm up", "m-warm-admitted"),
               lambda line: "m-warm-admitted" in line)
    c = client(stack)
    ask(c, "secret plans for the tail test", "m-tail-other")
    ask(client(stack, "/admitted/v1"), "secret plans for the admitted route", "m-tail")
    records = [json.loads(line) for line in tail.stop()]
    models = [r["model"] for r in records]
    assert "m-tail" in models and "m-tail-other" not in models
    assert all(r["route"] == "admitted" for r in records)
    [record] = [r for r in records if r["model"] == "m-tail"]
    assert record["why"]["admission"]["class"] == "vip"
    assert "secret" not in json.dumps(records)


def test_admin_tail_outcome_filter_and_readable_summary(stack):
    tail = Tail(stack, "--outcome", "answered")
    c = client(stack)
    tail.ready(lambda: ask(c, "warm up the summary", "m-warm"), lambda line: "outcome=answered" in line)
    ask(c, "tail summary question", "m-summary")
    ask(c, "tail summary question", "m-summary")
    lines = tail.stop()
    assert lines and all("outcome=answered" in line for line in lines)
    assert sum("route=chat" in line and "cache=exact(reason=exact" in line for line in lines) >= 2


def test_admin_tail_with_prompt_logging_on(make_stack):
    stack = make_stack(routes=[ROUTES[1]], sidecar_env={"SLUICE_LOG_PROMPTS": "true", "SLUICE_ACCESS_LOG": "false"},
                       upstream_args={"a": UPSTREAM, "b": UPSTREAM})
    tail = Tail(stack, "--json")
    tail.ready(lambda: ask(client(stack), "warm", "m-warm"), lambda line: "m-warm" in line)
    ask(client(stack), "logged on purpose", "m-prompt")
    [record] = [r for r in map(json.loads, tail.stop()) if r["model"] == "m-prompt"]
    assert record["prompt"] == "logged on purpose"
    # The request log itself is off: the tail still sees every request.
    assert not wait_for_access_lines(stack, lambda e: True, 1, timeout=1.5)
