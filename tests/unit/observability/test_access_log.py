"""The request log: one JSON line per request, cheap, and nothing secret in it by default."""
import dataclasses
import io
import json

import pytest

from sidecar.observability import access_log
from sidecar.observability.access_log import PROMPT_CHARS, AccessLog, LineWriter
from sidecar.openai.chat import parse_chat_request
from sidecar.request.context import MAX_LOGGED_MODEL_CHARS, Outcome, RequestContext
from sidecar.pipeline import Pipeline
from sidecar.service.server import ExternalProcessor
from sidecar.observability.tracing import Tracing, decision_attributes
from tests.support.ext_proc_stream import CHAT_HEADERS, FakeRoute, chat_body, chat_messages, run_stream

SECRET_PROMPT = "my card number is 4111 1111 1111 1111"


@pytest.fixture
def lines(monkeypatch):
    """Lines the request log writes (to stdout, by default) during the test."""
    captured: list[str] = []
    monkeypatch.setattr(access_log, "STDOUT", captured.append)
    return captured


class Stream(io.StringIO):
    def __init__(self):
        super().__init__()
        self.flushes = 0

    def flush(self):
        self.flushes += 1


def test_lines_are_buffered_and_written_once_a_second():
    now = [0.0]
    stream = Stream()
    write = LineWriter(stream, flush_s=1.0, clock=lambda: now[0])
    write("a")
    now[0] = 0.5
    write("b")
    assert stream.getvalue() == "" and stream.flushes == 0
    now[0] = 1.0
    write("c")
    assert stream.getvalue() == "a\nb\nc\n" and stream.flushes == 1
    write("d")
    write.flush()                       # the server's periodic flush (and the one at exit)
    assert stream.getvalue().endswith("c\nd\n") and stream.flushes == 2


def test_a_burst_is_written_before_a_second_has_passed():
    stream = Stream()
    write = LineWriter(stream, clock=lambda: 0.0)
    for i in range(LineWriter.MAX_LINES):
        write(str(i))
    assert stream.getvalue().count("\n") == LineWriter.MAX_LINES


def test_a_closed_stdout_does_not_fail_the_request_path():
    stream = Stream()
    stream.write = lambda text: (_ for _ in ()).throw(ValueError("I/O operation on closed file"))
    write = LineWriter(stream)
    write("a")
    write.flush()


def routed_context(*turns, stream=False) -> RequestContext:
    ctx = RequestContext(headers=dict(CHAT_HEADERS), route_name="chat", started=100.0)
    ctx.chat = parse_chat_request(chat_body(*turns, stream=stream))
    ctx.outcome, ctx.cluster, ctx.status, ctx.cache_status = Outcome.ROUTED, "upstream_a", 200, "miss"
    ctx.response_headers_at = 100.0425
    return ctx


def test_entry_has_the_request_facts():
    entry = AccessLog(clock=lambda: 100.25, wall_clock=lambda: 0.5).entry(routed_context("hi", stream=True), "ab" * 16)
    assert {k: v for k, v in entry.items() if k != "time"} == {
        "logger": "sluice.access", "message": "request", "request_id": "req-1", "route": "chat",
        "cluster": "upstream_a", "outcome": "routed", "cache": "miss", "status": 200, "response_read": True,
        "ttfb_ms": 42.5, "duration_ms": 250.0, "model": "demo-model", "stream": True, "trace_id": "ab" * 16}
    assert entry["time"].endswith(",500")


def test_passthrough_request_has_nulls_not_errors():
    ctx = RequestContext(headers={":method": "GET", ":path": "/v1/models"}, started=1.0)
    ctx.outcome = Outcome.PASSTHROUGH
    entry = AccessLog(clock=lambda: 1.001).entry(ctx)
    assert entry["outcome"] == "passthrough" and entry["request_id"] == ""
    assert entry["model"] is entry["status"] is entry["ttfb_ms"] is entry["stream"] is None


def test_no_authorization_or_prompt_by_default(lines):
    AccessLog().emit(routed_context(SECRET_PROMPT, "an answer", "follow-up " + SECRET_PROMPT))
    assert len(lines) == 1
    assert "sk-very-secret" not in lines[0] and "4111" not in lines[0] and "answer" not in lines[0]
    assert "prompt" not in json.loads(lines[0])


def test_a_huge_model_name_is_cut_short(lines):
    """The model is the client's text: 200 kB of it must not make a 200 kB line (or span)."""
    ctx = routed_context("hi")
    ctx.chat = dataclasses.replace(ctx.chat, model="m" * 200_000)
    AccessLog().emit(ctx)
    model = json.loads(lines[0])["model"]
    assert model == "m" * MAX_LOGGED_MODEL_CHARS + "…" and len(lines[0]) < 2_000
    assert decision_attributes(ctx)["gen_ai.request.model"] == model


def test_log_prompts_logs_the_last_user_turn_cut_short(lines):
    AccessLog(log_prompts=True).emit(routed_context("first question", "an answer", "x" * 500))
    entry = json.loads(lines[0])
    assert entry["prompt"] == "x" * PROMPT_CHARS
    assert "sk-very-secret" not in lines[0] and "first question" not in lines[0]


def test_a_lone_surrogate_costs_no_line_its_own_or_the_ones_buffered_with_it():
    stream = io.TextIOWrapper(io.BytesIO(), encoding="utf-8")         # as stdout encodes
    log = AccessLog(log_prompts=True, write=LineWriter(stream, flush_s=3600))
    log.emit(routed_context("café ok"))
    odd = routed_context("a lone \ud800 surrogate")
    odd.chat = parse_chat_request(json.dumps({"model": "m\ud800", "messages": [
        {"role": "user", "content": "a lone \ud800 surrogate"}]}).encode())
    log.emit(odd)
    log.emit(routed_context("après"))
    log.flush()
    written = [json.loads(line) for line in stream.buffer.getvalue().decode().splitlines()]
    assert [e["prompt"] for e in written] == ["café ok", "a lone \ud800 surrogate", "après"]
    assert written[1]["model"] == "m\ud800"


def test_disabled_writes_nothing(lines):
    AccessLog(enabled=False).emit(routed_context("hi"))
    assert lines == []


async def test_one_line_when_the_stream_ends(lines):
    servicer = ExternalProcessor(Pipeline(FakeRoute()), access_log=AccessLog(), tracing=Tracing())
    await run_stream(servicer, chat_messages(chat_body(SECRET_PROMPT)))
    assert len(lines) == 1
    entry = json.loads(lines[0])
    assert (entry["request_id"], entry["cluster"], entry["status"], entry["outcome"]) == (
        "req-1", "upstream_a", 200, "routed")
    assert entry["ttfb_ms"] >= 0 and entry["duration_ms"] >= entry["ttfb_ms"]
    assert len(entry["trace_id"]) == 32
    assert "sk-very-secret" not in lines[0] and "4111" not in lines[0]


async def test_bad_request_is_logged_too(lines):
    servicer = ExternalProcessor(Pipeline(FakeRoute()), access_log=AccessLog())
    await run_stream(servicer, chat_messages(b"not json")[:2])
    entry = json.loads(lines[0])
    assert (entry["outcome"], entry["status"], entry["model"]) == ("bad_request", 400, None)
