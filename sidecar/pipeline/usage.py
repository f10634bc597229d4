"""Token usage of an upstream answer, read from its JSON body or its SSE stream, for token
budgets (admission settles them) and the dynamic metadata Envoy's access log reads.

Every answer counts, whatever the cache thinks of it: tool calls, n > 1, a content filter's
stop, a stream of any length. The upstream's own `usage` object wins (in a stream the last
one seen: the include_usage chunk, or vLLM's running totals). Without one, completion
tokens are estimated from the characters the answer carried (content, reasoning, refusal,
tool-call names and arguments, every choice) and prompt tokens from the prompt, at
sidecar/token_estimate.py. An answer that is an error, or has neither choices nor usage,
gives None: the estimate charged at admission stands.

A stream is read event by event and only counters are kept. A JSON body is parsed whole up
to max_bytes; past it the completion is estimated from the body's size.
"""
from __future__ import annotations

import math
from typing import Any

from sidecar.cache.capture import MAX_BYTES, read_json, usage_of
from sidecar.openai.sse import SseEvents
from sidecar.token_estimate import CHARS_PER_TOKEN, estimate_tokens

# Fields of a message or delta whose text the model generated.
_TEXT_FIELDS = ("content", "reasoning_content", "reasoning", "refusal")


class UsageMeter:
    def __init__(self, stream: bool, prompt_text: str = "", max_bytes: int = MAX_BYTES):
        self._events = SseEvents() if stream else None
        self._prompt_text = prompt_text
        self._max_bytes = max_bytes
        self._body = bytearray()
        self._body_size = 0
        self._usage: tuple[int, int] | None = None
        self._chars = 0                 # generated characters seen, for the estimate
        self._saw_choice = False
        self._failed = False            # an error event or object: no correction
        self._done = False

    def feed(self, chunk: bytes, end_of_stream: bool) -> tuple[int, int] | None:
        """(prompt, completion) tokens once the answer is complete; None before (or never)."""
        if self._done:
            return None
        if self._events is not None:
            finished = self._feed_stream(chunk) or end_of_stream
        else:
            self._body_size += len(chunk)
            if self._body_size <= self._max_bytes:
                self._body += chunk
            finished = end_of_stream
        if not finished:
            return None
        self._done = True
        if self._events is None:
            self._read_body()
        return self._result()

    def cut_short(self) -> tuple[int, int] | None:
        """The usage of an answer whose end was never read: a client gone mid-stream, or a
        JSON body past Envoy's buffer (only its first part reaches the sidecar). What it
        carried so far, at the least: the tokens were generated all the same."""
        if self._done:
            return None
        self._done = True
        if self._events is None and self._body_size:
            self._estimate_from_size()
        return self._result()

    # ------------------------------------------------------------ internals

    def _feed_stream(self, chunk: bytes) -> bool:
        """True once `data: [DONE]` has been read."""
        for event, data in self._events.feed(chunk):
            if event == b"error":
                self._failed = True
            elif data == b"[DONE]":
                return True
            elif data:
                self._read_object(data, "delta")
        if self._events.buffered > self._max_bytes:      # one endless line: stop reading it
            self._events = SseEvents()
        return False

    def _read_body(self) -> None:
        if self._body_size > self._max_bytes:
            self._estimate_from_size()
        else:
            self._read_object(bytes(self._body), "message")

    def _estimate_from_size(self) -> None:
        """A JSON body not parsed (too big, or only its first part seen): its size."""
        self._saw_choice = True
        self._chars = self._body_size                     # JSON overhead counted too: an upper bound

    def _read_object(self, data: bytes, part: str) -> None:
        value = read_json(data)
        if not isinstance(value, dict):
            return
        if value.get("error") is not None:
            self._failed = True
            return
        usage = usage_of(value.get("usage"))
        if usage is not None:
            self._usage = usage
        choices = value.get("choices")
        for choice in choices if isinstance(choices, list) else ():
            if isinstance(choice, dict):
                self._saw_choice = True
                self._chars += _generated_chars(choice.get(part))

    def _result(self) -> tuple[int, int] | None:
        if self._failed:
            return None
        if self._usage is not None:
            return self._usage
        if not self._saw_choice:
            return None
        return estimate_tokens(self._prompt_text), math.ceil(self._chars / CHARS_PER_TOKEN)


def _generated_chars(part: Any) -> int:
    """Characters the model generated in one message or delta."""
    if not isinstance(part, dict):
        return 0
    chars = sum(len(part[name]) for name in _TEXT_FIELDS if isinstance(part.get(name), str))
    calls = part.get("tool_calls")
    for call in calls if isinstance(calls, list) else [part.get("function_call")]:
        function = call.get("function", call) if isinstance(call, dict) else None
        if isinstance(function, dict):
            chars += sum(len(function[name]) for name in ("name", "arguments")
                         if isinstance(function.get(name), str))
    return chars
