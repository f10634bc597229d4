"""The ext_proc servicer ends a stream as soon as Envoy will send nothing more for its request."""
import asyncio
import json

import pytest
from prometheus_client import REGISTRY
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from sidecar.extproc.events import BodyMode, ImmediateReply, Plan
from sidecar.extproc.noop import NoopProcessor
from sidecar.extproc.processor import RequestProcessor
from sidecar.service import server
from sidecar.observability.logs import Throttle
from sidecar.pipeline import Pipeline
from sidecar.service.server import ExternalProcessor
from tests.support.ext_proc_stream import FakeRoute, chat_body, chat_messages, run_stream


class FinishCounting(FakeRoute):
    finished = 0

    def on_finish(self, ctx, state) -> None:
        self.finished += 1


async def replies_until_stream_ends(servicer, messages, envoy_ends: asyncio.Event | None = None) -> list[str]:
    """The reply kinds until the stream ends; Envoy's side stays open until envoy_ends is set."""
    return [response.WhichOneof("response")
            for response in await run_stream(servicer, messages, envoy_ends or asyncio.Event())]


def _response_body_end() -> pb.ProcessingRequest:
    return pb.ProcessingRequest(response_body=pb.HttpBody(body=b"{}", end_of_stream=True))


def _answer_starts() -> list[pb.ProcessingRequest]:
    """A chat request and the 200 response headers of an answer whose body follows."""
    return chat_messages(chat_body("hi"), answer_ends=False)


async def test_an_immediate_reply_ends_the_stream_without_waiting_for_envoy():
    reply = ImmediateReply(200, b"{}", (("content-type", "application/json"),))
    director = FinishCounting(plan=Plan(reply=reply))
    kinds = await asyncio.wait_for(replies_until_stream_ends(
        ExternalProcessor(Pipeline(director)), chat_messages(chat_body("hi"))[:2]), timeout=5)
    assert kinds == ["request_headers", "immediate_response"]
    assert director.finished == 1       # the request's bookkeeping ran, Envoy still silent


async def test_a_bad_request_ends_the_stream_with_its_400():
    servicer = ExternalProcessor(Pipeline(FakeRoute()))
    messages = chat_messages(b"{not json")[:2]
    kinds = await asyncio.wait_for(replies_until_stream_ends(servicer, messages), timeout=5)
    assert kinds == ["request_headers", "immediate_response"]


async def test_the_answers_last_chunk_ends_the_stream():
    director = FinishCounting(plan=Plan(cluster="upstream_a", response_body=BodyMode.BUFFERED))
    messages = _answer_starts() + [_response_body_end()]
    kinds = await asyncio.wait_for(replies_until_stream_ends(
        ExternalProcessor(Pipeline(director)), messages), timeout=5)
    assert kinds == ["request_headers", "request_body", "response_headers", "response_body"]
    assert director.finished == 1


@pytest.mark.parametrize("new_processor", [RequestProcessor, NoopProcessor])
async def test_a_request_still_streaming_its_answer_keeps_the_stream_open(new_processor):
    """Envoy ends the stream when the answer has streamed to the client; until then the
    request is in flight (the scheduler's load), so the sidecar must not end it first."""
    director = FinishCounting()
    servicer = ExternalProcessor(Pipeline(director), new_processor)
    envoy_ends = asyncio.Event()
    messages = _answer_starts()
    task = asyncio.create_task(replies_until_stream_ends(servicer, messages, envoy_ends))
    await asyncio.sleep(0.05)
    assert not task.done() and director.finished == 0      # still in flight
    envoy_ends.set()
    assert await asyncio.wait_for(task, timeout=5) == ["request_headers", "request_body", "response_headers"]
    assert director.finished == 1


class SwallowsCancellation(FakeRoute):
    """A decision that, like a Python 3.11 wait_for whose call ended in the same tick, ignores
    its cancellation and takes something (a lease, a queue slot) that on_finish must release."""

    def __init__(self):
        super().__init__()
        self.deciding, self.let_go = asyncio.Event(), asyncio.Event()
        self.taken_when_finished: list[bool] = []

    async def admitted(self, ctx):
        self.deciding.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            await self.let_go.wait()       # runs on
        ctx.taken = True

    def on_finish(self, ctx, state) -> None:
        self.taken_when_finished.append(getattr(ctx, "taken", False))


async def test_a_client_gone_during_a_decision_is_finished_after_the_decision_unwinds():
    director = SwallowsCancellation()
    stream = asyncio.ensure_future(run_stream(ExternalProcessor(Pipeline(director)), chat_messages(chat_body("hi"))[:2],
                                              asyncio.Event()))
    await asyncio.wait_for(director.deciding.wait(), timeout=5)
    stream.cancel()                         # Envoy resets the stream: the client went away
    with pytest.raises(asyncio.CancelledError):
        await stream
    assert director.taken_when_finished == []          # not yet: the decision still runs
    director.let_go.set()
    for _ in range(20):
        await asyncio.sleep(0)
    assert director.taken_when_finished == [True]      # once, after it took what it took


def _bug():
    raise OverflowError("int too large to convert to float")


class FailsOnAnswer(FinishCounting):
    def on_response_body(self, ctx, state, chunk, end_of_stream) -> None:
        _bug()


@pytest.fixture
def fresh_error_log(monkeypatch):
    """The once-a-minute log of internal errors, due now."""
    monkeypatch.setattr(server, "_internal_error_log", Throttle())


def _internal_errors(phase: str) -> float:
    return REGISTRY.get_sample_value("sluice_internal_errors_total", {"phase": phase}) or 0.0


async def test_a_director_bug_refuses_the_request_with_an_openai_shaped_500(caplog, fresh_error_log):
    """Never past admission undecided (as Envoy's fail-open would send it), and logged once
    a minute however many requests trip it."""
    director = FinishCounting(during=_bug)
    before = _internal_errors("RequestBody")
    for _ in range(3):
        responses = await asyncio.wait_for(run_stream(
            ExternalProcessor(Pipeline(director)), chat_messages(chat_body("hi"))[:2], asyncio.Event()), timeout=5)
        reply = responses[-1].immediate_response
        assert reply.status.code == 500
        error = json.loads(reply.body)["error"]
        assert (error["type"], error["code"]) == ("server_error", "sidecar_error") and error["message"]
    assert _internal_errors("RequestBody") - before == 3
    logged = [r for r in caplog.records if "failed (a bug" in r.getMessage()]
    assert len(logged) == 1 and logged[0].exc_info is not None
    assert director.finished == 3                # its bookkeeping still ran


async def test_a_director_bug_lets_the_request_go_undecided_when_so_configured(fresh_error_log):
    director = FinishCounting(during=_bug)
    responses = await asyncio.wait_for(run_stream(
        ExternalProcessor(Pipeline(director), refuse_on_error=False), chat_messages(chat_body("hi"))[:3]), timeout=5)
    kinds = [r.WhichOneof("response") for r in responses]
    assert kinds == ["request_headers", "request_body", "response_headers"]
    assert not responses[1].request_body.response.header_mutation.set_headers


async def test_a_bug_while_reading_the_answer_passes_the_answer_on(fresh_error_log):
    director = FailsOnAnswer()
    kinds = await asyncio.wait_for(replies_until_stream_ends(
        ExternalProcessor(Pipeline(director)), [*_answer_starts(), _response_body_end()]), timeout=5)
    assert kinds == ["request_headers", "request_body", "response_headers", "response_body"]
    assert director.finished == 1
