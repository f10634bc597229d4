"""aiohttp application: OpenAI endpoints, vLLM-style metrics and /admin."""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import os
import random
import socket
import struct
import time
from typing import Any

from aiohttp import web

from . import canned
from . import openai_format as fmt
from .config import Config, validate
from .engine import ChatPlan, RequestError, Stats, plan_chat
from .scheduler import Run, Slots

_JSON = "application/json"
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
_METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_INVALID = object()


# Headers a proxy adds on the way: Envoy sets both (use_remote_address; the route's timeout).
_PROXIED = ("x-forwarded-for", "x-envoy-expected-rq-timeout-ms")


@web.middleware
async def _admin_only_direct(request: web.Request, handler):
    """/admin/* answers direct callers only (tests, benchmarks): through Envoy's public port
    anyone could reconfigure the demo, and /admin/last shows the last caller's Authorization."""
    if request.path.startswith("/admin/") and any(h in request.headers for h in _PROXIED):
        return error_response(404, "not found", "not_found_error")
    return await handler(request)


def reset_connection(request: web.BaseRequest) -> None:
    """Drop the client's connection with a TCP RST, like a crashed server."""
    transport = request.transport
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        # Linger 0 turns close() into an RST instead of an orderly FIN.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


def json_response(payload: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=json.dumps(payload).encode(), content_type=_JSON)


def error_response(status: int, message: str, type_: str, param: str | None = None) -> web.Response:
    return web.Response(status=status, body=fmt.error_body(message, type_, param), content_type=_JSON)


class DemoUpstream:
    def __init__(self, name: str, config: Config) -> None:
        self.name = name
        self.config = config
        self.stats = Stats()
        self.slots = Slots(config.capacity, config.scheduling_policy, config.kv_tokens)
        self.rng = random.Random(config.seed)
        self.started = int(time.time())
        self.last: tuple[Any, Any] | None = None  # (headers, parsed body) of the last chat request
        self._ids = itertools.count(1)
        self._id_prefix = os.urandom(4).hex()
        # The last requests whose client left before their answer: how long they had been
        # here, whether they held a slot and how often they were preempted (bounded).
        self.disconnects: collections.deque[dict] = collections.deque(maxlen=100)

    def app(self) -> web.Application:
        # Prompts can be long; aiohttp's 1 MiB default would reject real traffic.
        app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[_admin_only_direct])
        app.on_response_prepare.append(self._tag_response)
        app.router.add_post("/v1/chat/completions", self.chat)
        # Azure OpenAI's shape: the deployment (the model run) in the path, api-version in the query.
        app.router.add_post("/openai/deployments/{deployment}/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/admin/config", self.get_config)
        app.router.add_post("/admin/config", self.set_config)
        app.router.add_get("/admin/stats", self.get_stats)
        app.router.add_post("/admin/reset-stats", self.reset_stats)
        app.router.add_get("/admin/last", self.get_last)
        canned.install(app)
        return app

    async def _tag_response(self, request: web.Request, response: web.StreamResponse) -> None:
        response.headers["x-upstream-name"] = self.name

    # --- chat -----------------------------------------------------------

    async def chat(self, request: web.Request) -> web.StreamResponse:
        self.stats.requests += 1
        arrived = time.monotonic()
        try:
            return await self._chat(request)
        except asyncio.CancelledError:
            # The runner cancels a handler when its client disconnects; this
            # covers queued requests and ones waiting for a token alike.
            self._disconnected(request, arrived)
            raise
        except ConnectionResetError:
            # A write raced the disconnect notice; the reply goes nowhere.
            self._disconnected(request, arrived)
            return web.Response()

    def _disconnected(self, request: web.Request, arrived: float) -> None:
        self.stats.disconnected += 1
        run: Run | None = request.get("run")
        self.disconnects.append({"after_s": round(time.monotonic() - arrived, 3), "ran": run is not None,
                                 "preemptions": run.preemptions if run is not None else 0,
                                 "priority": run.priority if run is not None else None})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        try:
            body = json.loads(await request.read())
        except ValueError:
            body = _INVALID
        self.last = (request.headers, None if body is _INVALID else body)
        try:
            if body is _INVALID:
                raise RequestError("request body is not valid JSON")
            plan = plan_chat(body, self.config)
        except RequestError as exc:
            self.stats.errors += 1
            return error_response(400, str(exc), "invalid_request_error", exc.param)

        failure = self._draw_failure()
        if failure == "500":
            self.stats.errors += 1
            return error_response(500, f"{self.name}: injected failure", "server_error")
        if failure == "reset":
            self.stats.errors += 1
            reset_connection(request)
            return web.Response()  # aiohttp finds the socket gone and stays quiet
        if failure == "hang":
            self.stats.errors += 1
            await asyncio.Event().wait()  # a stuck server: ends only when the client leaves

        async with self.slots.run(plan.priority, plan.prompt_tokens + len(plan.tokens)) as run:
            request["run"] = run
            try:
                if plan.stream:
                    return await self._stream(request, plan, run, cut=failure == "midstream")
                return await self._complete(request, plan, run, cut=failure == "midstream")
            finally:
                self.stats.preempted += run.preemptions

    def _draw_failure(self) -> str | None:
        rate = self.config.error_rate
        if rate and self.rng.random() < rate:
            return self.config.error_mode
        return None

    def _ttft_s(self) -> float:
        """Time to first token; a tail_rate share of requests take tail_factor times longer."""
        cfg = self.config
        tail = cfg.tail_rate and self.rng.random() < cfg.tail_rate
        return cfg.ttft_ms / 1000 * (cfg.tail_factor if tail else 1.0)

    def _token_interval(self) -> float:
        """Seconds per token now; a fuller batch decodes each token slower."""
        cfg = self.config
        factor = 1.0
        if cfg.capacity and cfg.slowdown_per_running:
            factor += cfg.slowdown_per_running * max(0.0, self.slots.running - cfg.capacity / 2)
        return factor / cfg.tokens_per_s

    def _new_id(self) -> str:
        return f"chatcmpl-{self._id_prefix}{next(self._ids):x}"

    def _count_success(self, plan: ChatPlan) -> None:
        self.stats.completed += 1
        self.stats.prompt_tokens += plan.prompt_tokens
        self.stats.generation_tokens += len(plan.tokens)

    async def _generate(self, run: Run, tokens: int, ttft_s: float):
        """Engine time of a request, step by step: the prefill, then one step per token.
        Yields (index, due) when token `index` is due; a preemption (priority scheduling)
        pauses the steps and costs a prefill again (run.until)."""
        due = asyncio.get_running_loop().time() + ttft_s
        await run.until(due, 0.0)
        for i in range(tokens):
            yield i, due
            due += self._token_interval()
            await run.until(due, ttft_s)

    async def _complete(self, request: web.Request, plan: ChatPlan, run: Run, cut: bool) -> web.StreamResponse:
        async for _ in self._generate(run, len(plan.tokens), self._ttft_s()):
            pass
        body = fmt.completion_body(self._new_id(), int(time.time()), plan)
        if cut:
            return await self._send_partial(request, body)
        self._count_success(plan)
        return web.Response(body=body, content_type=_JSON)

    async def _send_partial(self, request: web.Request, body: bytes) -> web.StreamResponse:
        """Promise the whole body, send half, then reset: a truncated answer."""
        self.stats.errors += 1
        response = web.StreamResponse(headers={"Content-Type": _JSON})
        response.content_length = len(body)
        await response.prepare(request)
        await response.write(body[: len(body) // 2])
        reset_connection(request)
        return response

    async def _stream(self, request: web.Request, plan: ChatPlan, run: Run, cut: bool) -> web.StreamResponse:
        response = web.StreamResponse(headers=_SSE_HEADERS)
        await response.prepare(request)
        chunks = fmt.ChunkFormatter(self._new_id(), int(time.time()), plan.model)
        cut_after = max(1, len(plan.tokens) // 2) if cut else 0
        # Token i is due at ttft + i * interval, the stop step one interval after
        # the last, so a stream takes as long as the same non-stream answer.
        async for i, _ in self._generate(run, len(plan.tokens), self._ttft_s()):
            if i == 0:
                await response.write(chunks.role())
            await response.write(chunks.content(plan.tokens[i]))
            if i + 1 == cut_after:
                self.stats.errors += 1
                reset_connection(request)
                return response
        tail = chunks.finish(plan.finish_reason)
        if plan.include_usage:
            tail += chunks.usage(plan.usage)
        await response.write(tail + fmt.DONE)
        self._count_success(plan)
        return response

    # --- info endpoints -------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
        model = {"id": self.config.model, "object": "model", "created": self.started, "owned_by": "demo-upstream"}
        return json_response({"object": "list", "data": [model]})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def metrics(self, request: web.Request) -> web.Response:
        running, waiting, capacity = self.slots.running, self.slots.waiting, self.config.capacity
        usage = min(1.0, running / capacity) if capacity else 0.0
        if self.slots.kv_tokens:
            usage = max(usage, min(1.0, self.slots.tokens_running / self.slots.kv_tokens))
        labels = '{model_name="%s"}' % self.config.model.replace("\\", "\\\\").replace('"', '\\"')
        series = (
            ("vllm:num_requests_running", "gauge", "Requests in the batch now.", running),
            ("vllm:num_requests_waiting", "gauge", "Requests queued for a batch slot.", waiting),
            ("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage, 1 = full (running/capacity, or tokens/kv_tokens).", usage),
            # Pre-v0.10 name, still scraped by some routers.
            ("vllm:gpu_cache_usage_perc", "gauge", "KV-cache usage, legacy name.", usage),
            ("vllm:request_success_total", "counter", "Requests answered in full.", self.stats.completed),
            ("vllm:prompt_tokens_total", "counter", "Prompt tokens of answered requests.", self.stats.prompt_tokens),
            ("vllm:generation_tokens_total", "counter", "Tokens generated.", self.stats.generation_tokens),
            ("vllm:num_preemptions_total", "counter", "Running requests preempted.", self.stats.preempted),
        )
        lines = []
        for name, kind, help_text, value in series:
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name}{labels} {float(value)}"]
        return web.Response(body=("\n".join(lines) + "\n").encode(), headers={"Content-Type": _METRICS_TYPE})

    # --- admin ----------------------------------------------------------

    async def get_config(self, request: web.Request) -> web.Response:
        return json_response(self.config.as_dict())

    async def set_config(self, request: web.Request) -> web.Response:
        try:
            changes = validate(json.loads(await request.read()))
        except ValueError as exc:  # ConfigError is one, so is a JSON syntax error
            return error_response(400, str(exc), "invalid_request_error", getattr(exc, "name", None))
        for name, value in changes.items():
            setattr(self.config, name, value)
        if "capacity" in changes:
            self.slots.capacity = self.config.capacity  # may admit waiters
        if "kv_tokens" in changes:
            self.slots.kv_tokens = self.config.kv_tokens
        if "scheduling_policy" in changes:
            self.slots.policy = self.config.scheduling_policy  # for requests arriving from now
        if "seed" in changes:
            self.rng.seed(self.config.seed)
        return json_response(self.config.as_dict())

    async def get_stats(self, request: web.Request) -> web.Response:
        s = self.stats
        return json_response(
            {
                "requests": s.requests,
                "completed": s.completed,
                "errors": s.errors,
                "running": self.slots.running,
                "waiting": self.slots.waiting,
                "disconnected": s.disconnected,
                "preempted": s.preempted,
                "disconnects": list(self.disconnects),
            }
        )

    async def reset_stats(self, request: web.Request) -> web.Response:
        self.stats.reset()
        self.disconnects.clear()
        return await self.get_stats(request)

    async def get_last(self, request: web.Request) -> web.Response:
        if self.last is None:
            return error_response(404, "no chat request received yet", "not_found_error")
        raw_headers, body = self.last
        headers: dict[str, str] = {}
        for key, value in raw_headers.items():
            key = key.lower()  # HTTP names are case-insensitive; Envoy sends lower case
            headers[key] = f"{headers[key]}, {value}" if key in headers else value
        return json_response({"headers": headers, "body": body})
