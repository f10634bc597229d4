"""Turn an upstream response body into a CachedAnswer, or refuse to.

Only a complete, plain-text, single-choice answer is stored. The caller feeds only bodies
of responses that `response_refusal` lets through: status 200, not content-encoded, the
content type the request asked for, and an upstream Cache-Control that allows it (`no_store`
for `no-store`, `private` for `private`: a scope may hold many users, an organisation's key
or a route's tenant header). `no-cache` is no refusal: event-stream servers send it by
convention, to keep proxies from buffering (OpenAI's streams carry it), and a route that
turns the cache on has said its answers may be reused. Both capture paths then refuse
(`NotCaptured.reason`):

| reason        | JSON body                                  | SSE stream                          |
|---------------|--------------------------------------------|-------------------------------------|
| too_large     | body over max_bytes                        | bytes fed over max_bytes            |
| invalid_json  | not JSON, not an object, choices not a list| a data line that is not a JSON object|
| error         | an "error" member                          | an "error" member or `event: error` |
| no_choice     | no choices                                 | no chunk with a choice              |
| n_gt_1        | more than one choice                       | a choice index other than 0         |
| tool_calls    | message.tool_calls / function_call         | delta.tool_calls / function_call    |
| not_text      | any other message field with a value:      | the same in a delta                 |
|               | audio, refusal, reasoning, annotations, ...|                                     |
| finish_reason | finish_reason not "stop" / "length"        | the same (missing: "partial")       |
| no_content    | content missing, not a string, or empty    | no content at all                   |
| partial       |                                            | `data: [DONE]` never came, or no    |
|               |                                            | finish_reason before it             |

Every byte is untrusted: a body that is not JSON, not UTF-8, nested past the parser's recursion
limit or holding an integer past Python's conversion limit is `invalid_json`; token counts
past answer.MAX_TOKENS are no usage.

Usage: the `usage` object when the upstream sent one (the last one in a stream: vLLM may
send running totals). Otherwise estimated at one token per 4 characters (of the content,
and of `prompt_text` when the caller gives it) and marked `usage_estimated`.

SSE framing: sidecar/openai/sse.py.

Pure (no I/O); `SseCapture` keeps state but only of the bytes it is given.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sidecar.cache.answer import FINISH_REASONS, MAX_TOKENS, CachedAnswer
from sidecar.cache.policy import cache_directives
from sidecar.openai.sse import SseEvents
from sidecar.token_estimate import estimate_tokens

MAX_BYTES = 1 << 20
_LAST_DONE = (b"[DONE]", b"data: [DONE]", b"data:[DONE]")


@dataclass(frozen=True)
class NotCaptured:
    """Why an answer is not stored (the cache's refusal; admission's is sidecar.admission.Refusal)."""
    reason: str


# Asked of the upstream for every answer the sidecar reads: clients such as the openai SDK
# accept gzip, and a compressed body can be neither captured nor metered.
IDENTITY_ENCODING = ("accept-encoding", "identity")


def is_encoded(headers: Mapping[str, str]) -> bool:
    """The response body is compressed (or otherwise content-encoded)."""
    return (headers.get("content-encoding") or "identity").strip().lower() != "identity"


def response_refusal(headers: Mapping[str, str], stream: bool) -> NotCaptured | None:
    """Whether a response's headers allow capturing its body at all (None: they do)."""
    if headers.get(":status") != "200":
        return NotCaptured("status")
    if is_encoded(headers):
        return NotCaptured("encoded")
    content_type = (headers.get("content-type") or "").split(";")[0].strip().lower()
    if content_type != ("text/event-stream" if stream else "application/json"):
        return NotCaptured("content_type")
    directives = cache_directives(headers)
    for name in ("no-store", "private"):
        if name in directives:
            return NotCaptured(name.replace("-", "_"))
    return None


def usage_of(value: Any) -> tuple[int, int] | None:
    """(prompt, completion) tokens of an OpenAI `usage` object; None when it is not one,
    or counts more than MAX_TOKENS (then the estimate stands)."""
    if not isinstance(value, dict):
        return None
    prompt, completion = value.get("prompt_tokens"), value.get("completion_tokens")
    if all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= MAX_TOKENS for n in (prompt, completion)):
        return prompt, completion
    return None


NOT_JSON = object()


def read_json(data: bytes | str) -> Any:
    """The JSON value of upstream bytes, or NOT_JSON. RecursionError is one of the ways to
    fail: an answer nested ~1,000 deep exhausts the decoder's stack (it is no answer to read)."""
    try:
        return json.loads(data)
    except (ValueError, RecursionError):     # JSONDecodeError, UnicodeDecodeError, int digits
        return NOT_JSON


def _answer(content: str, finish_reason: str, model: Any, usage: tuple[int, int] | None,
            now: float, prompt_text: str) -> CachedAnswer:
    estimated = usage is None
    if usage is None:
        usage = (estimate_tokens(prompt_text), estimate_tokens(content))
    return CachedAnswer(content=content, finish_reason=finish_reason,
                        model=model if isinstance(model, str) else "",
                        prompt_tokens=usage[0], completion_tokens=usage[1],
                        created_at=now, usage_estimated=estimated)


# A stored answer keeps a message's role and content only.
_KEPT_FIELDS = frozenset(("role", "content"))


def _part_refusal(part: Any) -> NotCaptured | None:
    """What in one message or delta makes the answer more than text: tool calls, or any other
    field with a value (audio, refusal, reasoning_content, annotations, ...), which a hit
    would silently drop."""
    if not isinstance(part, dict):
        return NotCaptured("invalid_json")
    if part.get("tool_calls") or part.get("function_call"):
        return NotCaptured("tool_calls")
    if part.get("role") not in (None, "assistant"):
        return NotCaptured("invalid_json")
    for name, value in part.items():
        if name not in _KEPT_FIELDS and value is not None and value != "" and value != [] and value != {}:
            return NotCaptured("not_text")
    return None


def _finish_refusal(finish_reason: Any) -> NotCaptured | None:
    return None if finish_reason in FINISH_REASONS else NotCaptured("finish_reason")


def _parse_object(data: bytes | str) -> dict | NotCaptured:
    value = read_json(data)
    if not isinstance(value, dict):
        return NotCaptured("invalid_json")
    if value.get("error") is not None:
        return NotCaptured("error")
    if not isinstance(value.get("choices", []), list):
        return NotCaptured("invalid_json")
    return value


def capture_json(body: bytes, now: float, *, prompt_text: str = "",
                 max_bytes: int = MAX_BYTES) -> CachedAnswer | NotCaptured:
    """A `chat.completion` body to an answer stored at `now`, or why not."""
    if len(body) > max_bytes:
        return NotCaptured("too_large")
    value = _parse_object(body)
    if isinstance(value, NotCaptured):
        return value
    choices = value.get("choices", [])
    if not choices:
        return NotCaptured("no_choice")
    if len(choices) > 1:
        return NotCaptured("n_gt_1")
    choice = choices[0]
    if not isinstance(choice, dict):
        return NotCaptured("invalid_json")
    message = choice.get("message")
    refusal = _part_refusal(message) or _finish_refusal(choice.get("finish_reason"))
    if refusal:
        return refusal
    content = message.get("content")
    if not isinstance(content, str) or not content:
        return NotCaptured("no_content")
    return _answer(content, choice["finish_reason"], value.get("model"),
                   usage_of(value.get("usage")), now, prompt_text)


class SseCapture:
    """Collects a streamed answer chunk by chunk: feed() as bytes arrive, then finish()."""

    def __init__(self, max_bytes: int = MAX_BYTES):
        self._max_bytes = max_bytes
        self._seen = 0
        self._events = SseEvents()
        self._content: list[str] = []
        self._finish_reason: str | None = None
        self._model: Any = None
        self._usage: tuple[int, int] | None = None
        self._saw_choice = False
        self._done = False
        self._refusal: NotCaptured | None = None

    @property
    def refused(self) -> NotCaptured | None:
        """Set as soon as the stream cannot be stored; the caller may stop feeding."""
        return self._refusal

    @property
    def done(self) -> bool:
        """`data: [DONE]` has been read: finish() may be called without waiting for the end."""
        return self._done

    def feed(self, chunk: bytes) -> None:
        if self._refusal or self._done:
            return
        self._seen += len(chunk)
        if self._seen > self._max_bytes:
            self._refuse("too_large")
            return
        for event, data in self._events.feed(chunk):
            self._on_event(event, data)
            if self._refusal or self._done:
                return

    def finish(self, now: float, *, prompt_text: str = "") -> CachedAnswer | NotCaptured:
        if self._refusal:
            return self._refusal
        if not self._done and self._events.pending.strip() in _LAST_DONE:
            self._done = True                # "[DONE]" without the blank line after it
        if not self._done or self._finish_reason is None:
            return NotCaptured("no_choice" if self._done and not self._saw_choice else "partial")
        content = "".join(self._content)
        if not content:
            return NotCaptured("no_content")
        return _answer(content, self._finish_reason, self._model, self._usage, now, prompt_text)

    # ------------------------------------------------------------ internals

    def _refuse(self, reason: str) -> None:
        self._refusal = NotCaptured(reason)
        self._events, self._content = SseEvents(), []

    def _on_event(self, event: bytes, data: bytes) -> None:
        if event == b"error":
            self._refuse("error")
        elif data == b"[DONE]":
            self._done = True
        elif data:
            self._on_chunk(data)

    def _on_chunk(self, data: bytes) -> None:
        value = _parse_object(data)
        if isinstance(value, NotCaptured):
            self._refuse(value.reason)
            return
        if self._model is None:
            self._model = value.get("model")
        usage = usage_of(value.get("usage"))
        if usage is not None:
            self._usage = usage
        for choice in value.get("choices", []):
            self._on_choice(choice)
            if self._refusal:
                return

    def _on_choice(self, choice: Any) -> None:
        if not isinstance(choice, dict):
            self._refuse("invalid_json")
            return
        if choice.get("index", 0) != 0:
            self._refuse("n_gt_1")
            return
        self._saw_choice = True
        delta = choice.get("delta") or {}
        refusal = _part_refusal(delta)
        if refusal is None and choice.get("finish_reason") is not None:
            refusal = _finish_refusal(choice["finish_reason"])
            self._finish_reason = choice["finish_reason"]
        if refusal:
            self._refuse(refusal.reason)
            return
        content = delta.get("content")
        if isinstance(content, str):
            self._content.append(content)
