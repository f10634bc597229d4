"""Drive sidecar.service.server.ExternalProcessor with Envoy's ext_proc messages, without a server."""
from __future__ import annotations

import asyncio
import json
import time

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from sidecar.request.context import Outcome
from sidecar.extproc.events import Plan

CHAT_HEADERS = {":method": "POST", ":path": "/v1/chat/completions", "content-type": "application/json",
                "authorization": "Bearer sk-very-secret", "x-request-id": "req-1"}


def chat_body(*turns: str, stream: bool = False, model: str = "demo-model") -> bytes:
    roles = ["user", "assistant"]
    messages = [{"role": roles[i % 2], "content": text} for i, text in enumerate(turns)]
    return json.dumps({"model": model, "messages": messages, "stream": stream}).encode()


def _header_map(headers: dict) -> base_pb2.HeaderMap:
    return base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers.items()])


def chat_messages(body: bytes, headers: dict | None = None, status: int = 200,
                  answer_ends: bool = True) -> list[pb.ProcessingRequest]:
    """What Envoy sends for one chat request answered by the upstream with `status`
    (answer_ends=False: a body follows the response headers)."""
    return [
        pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=_header_map(headers or CHAT_HEADERS))),
        pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)),
        pb.ProcessingRequest(response_headers=pb.HttpHeaders(
            headers=_header_map({":status": str(status)}), end_of_stream=answer_ends)),
    ]


async def run_stream(servicer, messages, then_wait: asyncio.Event | None = None) -> list[pb.ProcessingResponse]:
    """The servicer's replies; with then_wait, the stream stays open after `messages` until it
    is set, as Envoy's does until it half-closes."""
    async def requests():
        for message in messages:
            yield message
        if then_wait is not None:
            await then_wait.wait()

    return [response async for response in servicer.Process(requests(), None)]


def upstream_headers(responses) -> dict[str, str]:
    """Headers the sidecar set on the upstream request (the request body phase's reply)."""
    reply = next(r for r in responses if r.HasField("request_body"))
    return {h.header.key: h.header.raw_value.decode()
            for h in reply.request_body.response.header_mutation.set_headers}


class FakeRoute:
    """The stages after the cache (sidecar/pipeline/exchange.py: schedule, admit, route) of a route
    that sends every chat request to `cluster`. Its admission is asked for every request, so the
    decision is always awaited, as on a route whose queue may wait; `during` runs there."""

    def __init__(self, cluster: str = "upstream_a", plan: Plan | None = None, during=None):
        self.cluster, self.plan, self.during = cluster, plan, during
        self.schedule, self.admit = _FakeSchedule(self), _FakeAdmission(self)

    def target(self, ctx):
        return _CONFIG

    def admits(self, ctx) -> bool:
        return True          # always the awaited path

    async def admitted(self, ctx) -> None:
        if self.during is not None:
            self.during()

    def route(self, ctx, state, scheduled) -> Plan:
        ctx.outcome, ctx.cluster = Outcome.ROUTED, self.cluster
        return self.plan or Plan(cluster=self.cluster)

    def reads_response(self, ctx) -> bool:
        return True

    def on_response_headers(self, ctx, state) -> None:
        ctx.response_headers_at = time.monotonic()

    def on_response_body(self, ctx, state, chunk, end_of_stream) -> None:
        pass

    def on_finish(self, ctx, state) -> None:
        pass


_CONFIG, _SCHEDULED, _SETTINGS = object(), object(), object()   # opaque to the exchange


class _FakeSchedule:
    def __init__(self, stages: FakeRoute):
        self._stages = stages

    def target(self, ctx):
        return self._stages.target(ctx)

    def schedule(self, ctx, config, admitting=False):
        return _SCHEDULED


class _FakeAdmission:
    def __init__(self, stages: FakeRoute):
        self._stages = stages

    def settings(self, ctx):
        return _SETTINGS if self._stages.admits(ctx) else None

    async def admit(self, ctx, state, scheduled, settings):
        await self._stages.admitted(ctx)
        return scheduled
