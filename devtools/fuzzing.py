"""Hostile inputs for the sidecar, and a driver that feeds them through its real request path.

Two kinds of input, both from a seeded `random.Random` (fast enough for millions; the
property tests in tests/unit/extproc/test_fuzz.py draw the same shapes through Hypothesis):

- client bodies (`client_body`): valid chat requests with fields replaced by JSON of any
  type (arrays, objects, numbers past every bound, NaN, lone surrogates, nesting past any
  limit), deleted, added, and byte-level damage (cut, spliced, invalid UTF-8, repeated keys);
- upstream answers (`upstream_answer`): chat.completion bodies and SSE streams mutated the
  same way, plus usage counts of hundreds of digits and nesting thousands deep.

`Driver` runs each through `sidecar.service.server.ExternalProcessor` as Envoy would send it (codec,
processor, the pipeline's cache and route stages with admission and token limits, capture, usage
meter, replay of what was stored), and counts outcomes. An unexpected exception is one that
reached the server's last-resort handler (the request was refused with a 500: a bug), a
protocol error, or one that left the stream: each is recorded with its traceback.
"""
from __future__ import annotations

import asyncio
import collections
import json
import random
import sys
import traceback
from dataclasses import dataclass, field
from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2, text_format

from sidecar.extproc.processor import RequestProcessor

# --- JSON of any shape -----------------------------------------------------------------------

_STRINGS = ("", "user", "assistant", "system", "tool", "text", "image_url", "stop", "length",
            "\ud800", "a\udfffb", "\x00", "\u202e", "ü" * 3, "😀", "null", "NaN", "1e999",
            "x" * 5000, " \n\t ", "What is the capital of France?", "Bearer k")
_NUMBERS = (0, 1, -1, 2, 0.5, -0.0, 1e308, -1e308, 5e-324, 2**31, 2**53 + 1, 2**63 - 1, 2**63,
            -2**63, 2**64, 10**400, -10**400, 10**4000, 3.0, 1.5)


def any_json(rng: random.Random, depth: int = 0) -> Any:
    """A JSON value of any type; NaN and infinities too (json.dumps writes them as literals)."""
    kind = rng.randrange(12 if depth < 4 else 8)
    if kind == 0:
        return None
    if kind == 1:
        return rng.random() < 0.5
    if kind == 2:
        return rng.choice(_NUMBERS)
    if kind == 3:
        return rng.choice((float("nan"), float("inf"), float("-inf"), rng.uniform(-5, 5)))
    if kind == 4:
        return rng.randrange(-10, 5000)
    if kind in (5, 6, 7):
        return rng.choice(_STRINGS) if rng.random() < 0.8 else _random_text(rng)
    if kind in (8, 9):
        return [any_json(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {rng.choice(_KEYS): any_json(rng, depth + 1) for _ in range(rng.randrange(4))}


def _random_text(rng: random.Random) -> str:
    return "".join(chr(rng.choice((rng.randrange(32, 127), rng.randrange(0x80, 0x800),
                                   rng.randrange(0xD800, 0xE000), rng.randrange(0x10000, 0x10FFFF))))
                   for _ in range(rng.randrange(1, 12)))


_DEEP = "\u2063deep:"     # a string the encoder swaps for nesting json.dumps cannot write


def deep_text(levels: int) -> bytes:
    """JSON nesting arrays and objects `levels` deep."""
    half = levels // 2
    return b'{"a":[' * half + b"[" * (levels % 2) + b"1" + b"]" * (levels % 2) + b"]}" * half


def encode(value: Any, ascii_only: bool) -> bytes:
    """JSON of `value` as an upstream or client might send it: NaN and infinities as literals,
    lone surrogates as they are, and the nesting markers (`_hostile`) expanded."""
    try:
        text = json.dumps(value, ensure_ascii=ascii_only)
    except ValueError:          # an integer past int's digit limit: written by hand
        text = json.dumps(value, ensure_ascii=ascii_only, default=str)
    raw = text.encode("utf-8", "surrogatepass")
    marker = json.dumps(_DEEP, ensure_ascii=ascii_only).encode()[:-1]
    while marker in raw:
        start = raw.index(marker)
        end = raw.index(b'"', start + len(marker))
        raw = raw[:start] + deep_text(int(raw[start + len(marker):end])) + raw[end + 1:]
    return raw


# --- client bodies ---------------------------------------------------------------------------

_KEYS = ("model", "messages", "role", "content", "type", "text", "name", "tool_calls", "stream",
         "stream_options", "include_usage", "temperature", "top_p", "max_tokens",
         "max_completion_tokens", "n", "stop", "seed", "logprobs", "top_logprobs", "logit_bias",
         "response_format", "tools", "tool_choice", "user", "metadata", "functions", "x", "")
_TEMPLATES = (
    {"model": "demo-model", "messages": [{"role": "user", "content": "What is the capital of France?"}]},
    {"model": "demo-model", "messages": [{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": "hi"},
                                         {"role": "assistant", "content": "Hello!"},
                                         {"role": "user", "content": "How do I reset my password?"}],
     "temperature": 0, "max_tokens": 64, "seed": 7},
    {"model": "demo-model", "stream": True, "stream_options": {"include_usage": True},
     "messages": [{"role": "user", "content": [{"type": "text", "text": "Describe"},
                                               {"type": "image_url", "image_url": {"url": "x"}}]}]},
    {"model": "demo-model", "messages": [{"role": "user", "content": "weather?"}],
     "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
     "tool_choice": "auto", "stop": ["\n"], "top_p": 0.9, "n": 1, "user": "u1"},
)


def client_body(rng: random.Random) -> bytes:
    """A chat body, damaged in one to three ways."""
    body = json.loads(json.dumps(rng.choice(_TEMPLATES)))
    for _ in range(rng.randrange(1, 4)):
        _mutate(rng, body)
    raw = encode(body, rng.random() < 0.5)
    return _damage(rng, raw) if rng.random() < 0.15 else raw


def _containers(value: Any, found: list) -> list:
    stack = [value]
    while stack and len(found) < 64:
        item = stack.pop()
        if isinstance(item, (dict, list)):
            found.append(item)
            stack.extend(item.values() if isinstance(item, dict) else item)
    return found


# Fields Sluice forwards without reading their type (they key the cache scope): a hostile value
# there is accepted, and goes on through the cache, admission and routing.
_FREE_FIELDS = ("logit_bias", "response_format", "logprobs", "reasoning_effort", "tool_choice",
                "metadata", "functions", "guided_json", "x", "")
_FREE_MESSAGE_FIELDS = ("name", "tool_calls", "tool_call_id", "refusal", "x")


def _mutate(rng: random.Random, body: dict) -> None:
    if rng.random() < 0.35:
        messages = body.get("messages")
        if isinstance(messages, list) and messages and isinstance(messages[-1], dict) and rng.random() < 0.5:
            messages[-1][rng.choice(_FREE_MESSAGE_FIELDS)] = _hostile(rng)
        else:
            body[rng.choice(_FREE_FIELDS)] = _hostile(rng)
        return
    target = rng.choice(_containers(body, []))
    choice = rng.random()
    if isinstance(target, dict):
        keys = list(target)
        if keys and choice < 0.6:
            target[rng.choice(keys)] = _hostile(rng)
        elif keys and choice < 0.75:
            del target[rng.choice(keys)]
        else:
            target[rng.choice(_KEYS)] = _hostile(rng)
    elif target and choice < 0.7:
        target[rng.randrange(len(target))] = _hostile(rng)
    else:
        target.append(_hostile(rng))


def _hostile(rng: random.Random) -> Any:
    if rng.random() < 0.03:
        return f"{_DEEP}{rng.choice((62, 63, 64, 65, 200, 3000))}"
    return any_json(rng)


def _damage(rng: random.Random, raw: bytes) -> bytes:
    """Byte-level damage: a cut, a splice, invalid UTF-8, a repeated key, a BOM."""
    kind = rng.randrange(6)
    at = rng.randrange(len(raw) + 1)
    if kind == 0:
        return raw[:at]
    if kind == 1:
        return raw[:at] + bytes([rng.randrange(256)]) + raw[at:]
    if kind == 2:
        return raw[:at] + b"\xff\xfe\xc0" + raw[at:]
    if kind == 3:
        return raw.replace(b"{", b'{"model":"x",', 1)
    if kind == 4:
        return b"\xef\xbb\xbf" + raw
    return raw[:at] + raw[at:][::-1]


# --- upstream answers ------------------------------------------------------------------------

_CONTENT = "Paris is the capital of France."


def _completion(usage: Any) -> dict:
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "demo-model",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": _CONTENT},
                         "logprobs": None, "finish_reason": "stop"}], "usage": usage}


def _chunks(usage: Any) -> list[dict]:
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "demo-model"}
    pieces = [{"role": "assistant", "content": ""}, {"content": "Paris is "}, {"content": "the capital."}]
    chunks = [{**head, "choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in pieces]
    chunks.append({**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    chunks.append({**head, "choices": [], "usage": usage})
    return chunks


_USAGES = ({"prompt_tokens": 10**400, "completion_tokens": 3, "total_tokens": 10**400 + 3},
           {"prompt_tokens": 5, "completion_tokens": -1}, {"prompt_tokens": 1.5, "completion_tokens": 2},
           {"prompt_tokens": 2**63, "completion_tokens": 2**63}, {"prompt_tokens": True, "completion_tokens": 1})


def upstream_answer(rng: random.Random, stream: bool) -> list[bytes]:
    """An answer's body in the pieces Envoy would hand over (one for JSON, several for SSE)."""
    usage = rng.choice(_USAGES) if rng.random() < 0.3 else {"prompt_tokens": 5, "completion_tokens": 7,
                                                             "total_tokens": 12}
    if rng.random() < 0.03:
        return [deep_text(rng.choice((1000, 2000, 3000)))]
    objects = _chunks(usage) if stream else [_completion(usage)]
    for _ in range(rng.randrange(0, 3)):
        _mutate(rng, rng.choice(objects))
    encoded = [encode(o, rng.random() < 0.5) for o in objects]
    if not stream:
        raw = encoded[0]
        return [_damage(rng, raw) if rng.random() < 0.1 else raw]
    events = b"".join(b"data: " + e + b"\n\n" for e in encoded)
    if rng.random() < 0.9:
        events += b"data: [DONE]\n\n"
    if rng.random() < 0.1:
        events = _damage(rng, events)
    cuts = sorted(rng.randrange(len(events) + 1) for _ in range(rng.randrange(4)))
    return [events[a:b] for a, b in zip([0, *cuts], [*cuts, len(events)])]


# --- the driver ------------------------------------------------------------------------------

def _route_attribute(route: dict) -> str:
    metadata = base_pb2.Metadata()
    struct = struct_pb2.Struct()
    struct.update(route)
    metadata.filter_metadata["sluice"].CopyFrom(struct)
    return text_format.MessageToString(metadata)


# Two routes: the cache, admission and generous token limits (every answer is captured and
# metered); and one of 3 requests a minute per tenant (refusals, refunds).
ROUTES = {
    "chat": _route_attribute({"name": "chat", "candidates": [{"cluster": "a"}, {"cluster": "b"}],
                              "cache": {"semantic": False},
                              "admission": {"enabled": True, "requests_per_minute": 1_000_000,
                                            "tokens_per_minute": 1_000_000_000}}),
    "tight": _route_attribute({"name": "tight", "candidates": [{"cluster": "a"}],
                               "cache": {"semantic": False},
                               "admission": {"enabled": True, "requests_per_minute": 3}}),
}


def request_headers(route: str, key: str, path: str = "/v1/chat/completions") -> pb.ProcessingRequest:
    headers = {":method": "POST", ":path": path, ":authority": "llm.internal",
               "content-type": "application/json", "authorization": f"Bearer {key}"}
    request = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=_header_map(headers)))
    fields = request.attributes["envoy.filters.http.ext_proc"].fields
    fields["xds.route_metadata"].string_value = ROUTES[route]
    fields["xds.route_name"].string_value = route
    return request


def _header_map(headers: dict) -> base_pb2.HeaderMap:
    return base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers.items()])


@dataclass
class Unexpected:
    kind: str                  # the exception's type
    where: str                 # "handled" (the server's last resort), "protocol", "stream"
    traceback: str
    sample: bytes              # the input that raised it (first 300 bytes)


@dataclass
class Tally:
    outcomes: collections.Counter = field(default_factory=collections.Counter)
    unexpected: list[Unexpected] = field(default_factory=list)

    @property
    def unexpected_count(self) -> int:
        return sum(self.outcomes[k] for k in self.outcomes if k.startswith("unexpected"))


class _Recording(RequestProcessor):
    """The real processor; `fail` (the server's last resort, called in its except block) notes
    the exception."""

    driver: "Driver"

    def fail(self, event, refuse):
        self.driver._note(sys.exc_info()[1], "handled")
        return super().fail(event, refuse)


class Driver:
    """One sidecar (cache in memory, no embedding model) and what it answered."""

    def __init__(self, keep: int = 20) -> None:
        from sidecar.service.app import build
        from sidecar.config import SidecarConfig
        from sidecar.service.server import ExternalProcessor
        self.app = build(SidecarConfig(semantic=False, metrics_listen="", access_log=False))
        recording = type("Recording", (_Recording,), {"driver": self})
        self.servicer = ExternalProcessor(self.app.pipeline, recording)
        self.tally = Tally()
        self._keep = keep
        self._input = b""

    async def start(self) -> None:
        await self.app.start()

    async def close(self) -> None:
        await self.app.close()

    def _note(self, error: BaseException | None, where: str) -> None:
        self.tally.outcomes[f"unexpected_{where}"] += 1
        if len(self.tally.unexpected) < self._keep and error is not None:
            self.tally.unexpected.append(Unexpected(
                type(error).__name__, where,
                "".join(traceback.format_exception(error)), self._input[:300]))

    async def client(self, body: bytes, route: str, key: str, answer: list[bytes] | None = None,
                     stream: bool | None = None) -> str:
        """One request with `body` on one ext_proc stream, as Envoy drives it: when the sidecar
        lets it go upstream, the answer (`answer`, else a plain one) follows on the stream."""
        from sidecar.observability import metrics
        if stream is None:
            stream = b'"stream": true' in body or b'"stream":true' in body
        pieces = answer if answer is not None else _plain_answer(stream)
        content_type = "text/event-stream" if stream else "application/json"
        tail = [pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=_header_map(
            {":status": "200", "content-type": content_type})))]
        tail += [pb.ProcessingRequest(response_body=pb.HttpBody(body=piece, end_of_stream=i == len(pieces) - 1))
                 for i, piece in enumerate(pieces)]
        decided = asyncio.Event()
        upstream: list[pb.ProcessingRequest] = []

        async def requests():
            yield request_headers(route, key)
            yield pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))
            await decided.wait()
            for message in upstream:
                yield message

        self._input = body
        protocol_before = metrics.PROTOCOL_ERRORS._value.get()
        outcome = "no_reply"
        try:
            async for reply in self.servicer.Process(requests(), None):
                if reply.HasField("immediate_response"):
                    outcome = f"answered_{reply.immediate_response.status.code}"
                    decided.set()
                elif reply.HasField("request_body") and not decided.is_set():
                    outcome = "upstream"
                    upstream.extend(tail)
                    self._input = b"".join(pieces)
                    decided.set()
        except Exception as error:  # noqa: BLE001 - what the harness looks for
            self._note(error, "stream")
        if metrics.PROTOCOL_ERRORS._value.get() != protocol_before:
            self._note(None, "protocol")
        self.tally.outcomes[outcome] += 1
        return outcome


def _plain_answer(stream: bool) -> list[bytes]:
    usage = {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}
    if stream:
        return [b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in _chunks(usage)) + b"data: [DONE]\n\n"]
    return [json.dumps(_completion(usage)).encode()]


async def run_client_inputs(driver: Driver, count: int, seed: int) -> None:
    rng = random.Random(seed)
    keys = [f"k{i}" for i in range(8)]
    for _ in range(count):
        await driver.client(client_body(rng), "tight" if rng.random() < 0.1 else "chat", rng.choice(keys))


async def run_upstream_answers(driver: Driver, count: int, seed: int) -> None:
    """Each answer is the upstream's to a fresh question; the question is then asked again,
    so whatever was stored is replayed (or found unreadable)."""
    rng = random.Random(seed)
    for number in range(count):
        stream = rng.random() < 0.5
        body = json.dumps({"model": "demo-model", "stream": stream,
                           "messages": [{"role": "user", "content": f"question {seed} {number}"}]}).encode()
        await driver.client(body, "chat", "answers", upstream_answer(rng, stream), stream)
        await driver.client(body, "chat", "answers", None, stream)


def run(coroutine_function, *args) -> Tally:
    """A fresh driver, started and closed around `coroutine_function(driver, *args)`."""
    async def main() -> Tally:
        driver = Driver()
        await driver.start()
        try:
            await coroutine_function(driver, *args)
        finally:
            await driver.close()
        return driver.tally
    return asyncio.run(main())
