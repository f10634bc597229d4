"""Parse an OpenAI chat-completions body into what Sluice needs to decide on it.

Validation is deliberately shallow: Sluice checks what it relies on (types of the fields it
reads) and leaves the rest of the body to the upstream, which it forwards byte for byte.
"""
from __future__ import annotations

import functools
import json
import math
import sys
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

from sidecar.memo import BoundedMemo

# Settings that change the answer: part of any cache scope, and forwarded untouched.
SAMPLING_FIELDS = (
    "temperature", "top_p", "max_tokens", "max_completion_tokens", "n", "stop", "seed",
    "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs",
    "response_format", "reasoning_effort",
)
# Fields known not to change the answer's content. Every field neither read above nor listed
# here (legacy `functions`, vLLM's `top_k` or `guided_json`, `verbosity`, ones not invented
# yet) is kept in ChatRequest.other and keys the cache scope: a miss, never a wrong hit.
ANSWER_NEUTRAL_FIELDS = frozenset({"stream", "stream_options", "user", "metadata", "store",
                                   "prompt_cache_key", "safety_identifier"})
# What does not go into ChatRequest.other: fields read into its own attributes, and the neutral ones.
_NOT_OTHER = frozenset({"model", "messages", "tools", "tool_choice", *SAMPLING_FIELDS, *ANSWER_NEUTRAL_FIELDS})
ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
_NUMERIC = ("temperature", "top_p", "presence_penalty", "frequency_penalty")
_INTEGER = ("max_tokens", "max_completion_tokens", "n", "seed", "top_logprobs")
_AT_LEAST_ONE = ("max_tokens", "max_completion_tokens", "n")
# What an upstream can hold (a seed is a 64-bit integer); a bigger max_tokens once crashed
# the timeout arithmetic (no float holds it) and Envoy failed the request open.
MAX_INTEGER = 2**63 - 1


class BadRequest(ValueError):
    """The body is not a usable chat request; `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ChatRequest:
    model: str
    messages: tuple[dict, ...]
    stream: bool = False
    include_usage: bool = False
    user: str | None = None
    sampling: Mapping[str, Any] = field(default_factory=dict)   # read-only when parsed
    tools: tuple[dict, ...] = ()
    tool_choice: Any = None
    other: Mapping[str, Any] = field(default_factory=dict)      # see ANSWER_NEUTRAL_FIELDS

    @property
    def uses_tools(self) -> bool:
        """Tools offered, the current way or the legacy one (`functions`)."""
        return bool(self.tools) or self.other.get("functions") is not None

    @functools.cached_property
    def text(self) -> str:
        """All message text joined (what token estimates count); computed once per request."""
        return "".join(message_text(m) for m in self.messages)

    @functools.cached_property
    def prompt_parts(self):
        """The last user turn's text and the key of the rest (sidecar.embedding.prompt), or
        None when there is no user text; split once per request (scope, key and policy use it)."""
        from sidecar.embedding.errors import NothingToEmbed
        from sidecar.embedding.prompt import split_prompt
        try:
            return split_prompt(self.messages)
        except NothingToEmbed:
            return None

    @property
    def max_tokens(self) -> int | None:
        return self.sampling.get("max_completion_tokens", self.sampling.get("max_tokens"))


def _reject_constant(name: str) -> None:
    raise BadRequest(f"invalid JSON number {name}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    return _is_int(value) and abs(value) <= sys.float_info.max     # a bigger int is no float


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):             # 1e999: JSON has no infinity to send on
        raise BadRequest(f"JSON number {text[:40]} is too large")
    return value


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    # A key given twice is read by the sidecar as its last value, but by some upstream parsers
    # as its first: the answer to one question could be stored under another's key.
    data = dict(pairs)
    if len(data) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise BadRequest(f"request body repeats the key {json.dumps(key)[:80]} in one JSON object")
            seen.add(key)
    return data


# One decoder for every request: json.loads with an argument builds a new one each call.
_DECODER = json.JSONDecoder(object_pairs_hook=_unique_keys, parse_constant=_reject_constant,
                            parse_float=_finite_float)
# Deepest nesting of objects and arrays accepted. Real requests (JSON schemas in tools and
# response_format included) stay far below; deeper ones would exhaust Python's recursion
# limit in the code that digests a request for cache keys.
MAX_NESTING = 64


# Byte-identical bodies (a popular question, the same app's template, retries) are parsed
# once: a 2 KB body costs ~25 µs to decode and check, a large part of an exact cache hit's
# own work. Only light bodies are remembered: at most PARSE_MEMO_MAX_BODY bytes and
# PARSE_MEMO_MAX_CONTAINERS JSON objects and arrays (a small body of many empty objects parses
# into ~30 times its size), so the memo holds at most a few MB.
PARSE_MEMO_ENTRIES = 256
PARSE_MEMO_MAX_BODY = 8 * 1024
PARSE_MEMO_MAX_CONTAINERS = 32
_parsed: BoundedMemo[ChatRequest] = BoundedMemo(PARSE_MEMO_ENTRIES)


def parse_chat_request(body: bytes, remember: bool = True) -> ChatRequest:
    """The chat request in `body`; BadRequest when it is not a usable one. The result may be
    shared with other requests of the same body: never change it (or its dicts). remember=False
    (a client's Cache-Control: no-store) keeps no trace of the body."""
    if (remember and type(body) is bytes and len(body) <= PARSE_MEMO_MAX_BODY
            and body.count(b"{") + body.count(b"[") <= PARSE_MEMO_MAX_CONTAINERS):
        return _parsed.get(body, lambda: _parse(body))
    return _parse(body)


def forget_parsed(body: bytes) -> None:
    """Drop `body` from the parse memo (the guard rewrote it: its original must not linger)."""
    _parsed.discard(body)


def _parse(body: bytes) -> ChatRequest:
    if not body:
        raise BadRequest("request body is empty; expected a JSON chat completion request")
    try:
        data = _DECODER.decode(body.decode("utf-8-sig"))   # a BOM is tolerated, as json.loads does
    except BadRequest:
        raise
    except UnicodeDecodeError:
        raise BadRequest("request body is not valid UTF-8") from None
    except json.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc.msg} at position {exc.pos}") from None
    except ValueError as exc:       # an integer of more digits than Python converts (4,300)
        raise BadRequest(f"request body is not usable JSON: {exc}") from None
    except RecursionError:
        raise BadRequest(f"request body is nested more than {MAX_NESTING} levels deep") from None
    if not isinstance(data, dict):
        raise BadRequest("request body must be a JSON object")
    # Depth never exceeds the number of containers: most bodies need no walk.
    if body.count(b"{") + body.count(b"[") > MAX_NESTING and _nesting(data) > MAX_NESTING:
        raise BadRequest(f"request body is nested more than {MAX_NESTING} levels deep")

    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' must be a non-empty string", "model")
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty array", "messages")
    for index, message in enumerate(messages):
        _check_message(message, f"messages[{index}]")

    stream = data.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", "stream")
    stream_options = data.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise BadRequest("'stream_options' must be an object", "stream_options")
    user = data.get("user")
    if user is not None and not isinstance(user, str):
        raise BadRequest("'user' must be a string", "user")

    sampling = {name: data[name] for name in SAMPLING_FIELDS if data.get(name) is not None}
    for name in _NUMERIC:
        if name in sampling and not _is_number(sampling[name]):
            raise BadRequest(f"'{name}' must be a number", name)
    for name in _INTEGER:
        if name in sampling and not (_is_int(sampling[name]) and abs(sampling[name]) <= MAX_INTEGER):
            raise BadRequest(f"'{name}' must be an integer of at most 64 bits", name)
    for name in _AT_LEAST_ONE:
        if name in sampling and sampling[name] < 1:
            # OpenAI's minimum; a negative bound would also count as negative work in admission.
            raise BadRequest(f"'{name}' must be at least 1", name)
    stop = sampling.get("stop")
    if stop is not None and not (isinstance(stop, str) or
                                 (isinstance(stop, list) and all(isinstance(s, str) for s in stop))):
        raise BadRequest("'stop' must be a string or an array of strings", "stop")

    tools = data.get("tools") or []
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise BadRequest("'tools' must be an array of objects", "tools")

    return ChatRequest(
        model=model, messages=tuple(messages), stream=stream,
        include_usage=bool(stream_options.get("include_usage", False)), user=user,
        sampling=MappingProxyType(sampling), tools=tuple(tools), tool_choice=data.get("tool_choice"),
        other=MappingProxyType({name: value for name, value in data.items() if name not in _NOT_OTHER}),
    )


def _nesting(value: Any) -> int:
    """How deep objects and arrays nest in a decoded JSON value (1 for a flat object); stops
    counting past MAX_NESTING. Only containers are visited: strings and numbers cost a type
    check each."""
    deepest, level = 1, [value.values() if isinstance(value, dict) else value]
    while level and deepest <= MAX_NESTING:
        deepest += 1
        level = [child.values() if isinstance(child, dict) else child
                 for items in level for child in items if isinstance(child, (dict, list))]
    return deepest - 1 if not level else deepest


def _check_message(message: Any, where: str) -> None:
    if not isinstance(message, dict):
        raise BadRequest(f"'{where}' must be an object", where)
    role = message.get("role")
    if not isinstance(role, str) or role not in ROLES:      # a list or object is unhashable
        raise BadRequest(f"'{where}.role' must be one of {sorted(ROLES)}", f"{where}.role")
    content = message.get("content")
    if content is None or isinstance(content, str):
        return
    if not isinstance(content, list):
        raise BadRequest(f"'{where}.content' must be a string or an array of parts", f"{where}.content")
    for index, part in enumerate(content):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise BadRequest(f"'{where}.content[{index}]' must be an object with a 'type'",
                             f"{where}.content[{index}]")
        if part["type"] == "text" and not isinstance(part.get("text"), str):
            raise BadRequest(f"'{where}.content[{index}].text' must be a string",
                             f"{where}.content[{index}].text")


def message_text(message: dict) -> str:
    """The text of one message: its string content, or its text parts joined by newlines."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p["text"] for p in content if p.get("type") == "text")
    return ""
