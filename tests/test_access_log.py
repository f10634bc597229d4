"""The request log: one JSON line per request, cheap, and nothing secret in it by default."""
import json
import logging

import pytest

from sidecar.access_log import LOG, PROMPT_CHARS, AccessLog
from sidecar.chat import parse_chat_request
from sidecar.context import Outcome, RequestContext
from sidecar.server import ExternalProcessor
from sidecar.tracing import Tracing
from tests.ext_proc_stream import CHAT_HEADERS, FakeDirector, chat_body, chat_messages, run_stream

SECRET_PROMPT = "my card number is 4111 1111 1111 1111"


@pytest.fixture
def lines():
    """Lines written to the sluice.access logger during the test."""
    captured: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            captured.append(record.getMessage())

    handler = Collect()
    LOG.addHandler(handler)
    level, LOG.level = LOG.level, logging.INFO
    yield captured
    LOG.removeHandler(handler)
    LOG.setLevel(level)


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
        "cluster": "upstream_a", "outcome": "routed", "cache": "miss", "status": 200,
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


def test_log_prompts_logs_the_last_user_turn_cut_short(lines):
    AccessLog(log_prompts=True).emit(routed_context("first question", "an answer", "x" * 500))
    entry = json.loads(lines[0])
    assert entry["prompt"] == "x" * PROMPT_CHARS
    assert "sk-very-secret" not in lines[0] and "first question" not in lines[0]


def test_disabled_writes_nothing(lines):
    AccessLog(enabled=False).emit(routed_context("hi"))
    assert lines == []


async def test_one_line_when_the_stream_ends(lines):
    servicer = ExternalProcessor(FakeDirector(), access_log=AccessLog(), tracing=Tracing())
    await run_stream(servicer, chat_messages(chat_body(SECRET_PROMPT)))
    assert len(lines) == 1
    entry = json.loads(lines[0])
    assert (entry["request_id"], entry["cluster"], entry["status"], entry["outcome"]) == (
        "req-1", "upstream_a", 200, "routed")
    assert entry["ttfb_ms"] >= 0 and entry["duration_ms"] >= entry["ttfb_ms"]
    assert len(entry["trace_id"]) == 32
    assert "sk-very-secret" not in lines[0] and "4111" not in lines[0]


async def test_bad_request_is_logged_too(lines):
    servicer = ExternalProcessor(FakeDirector(), access_log=AccessLog())
    await run_stream(servicer, chat_messages(b"not json")[:2])
    entry = json.loads(lines[0])
    assert (entry["outcome"], entry["status"], entry["model"]) == ("bad_request", 400, None)
