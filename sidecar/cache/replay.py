"""Serve a CachedAnswer as an immediate response that clients parse like the upstream's.

- `json_body(answer, request_model, now, id)`: a `chat.completion` object.
- `sse_body(answer, request_model, now, id, include_usage)`: a whole `text/event-stream`
  body as OpenAI streams it: a role chunk, content chunks, a finish chunk, the usage chunk
  (empty `choices`) only when the client asked for `stream_options.include_usage`, and
  `data: [DONE]`. With include_usage every other chunk carries `"usage": null`, as
  OpenAI's do. The content is cut into pieces of about `chunk_chars` characters at word
  ends (a word longer than twice that is cut inside), so the pieces join back to the
  exact content.
- `hit_headers(tier, similarity, age_s, stream=...)`: the response headers of a hit.

`id` is the caller's (a fresh "chatcmpl-..." per response, see `completion_id`); `created`
is `now`. `model` is the model the upstream reported for the stored answer, so a hit looks
like the answer it replays; `request_model` stands in when none was reported.

Usage on a hit: the stored answer's own prompt/completion token counts (estimated ones
when the upstream sent none), i.e. what the upstream charged for producing it. Clients
that count tokens keep working; tokens saved are the hit's usage, and `x-sluice-cache`
says the answer did not cost them. For a semantic hit the prompt_tokens are those of the
stored prompt, not of this request's similar one.

Pure functions; no I/O.
"""
from __future__ import annotations

import math
import re
from typing import Any

from sidecar.cache.answer import CachedAnswer, compact_json

TIERS = ("exact", "semantic", "coalesced")
JSON_CONTENT_TYPE = "application/json"
SSE_CONTENT_TYPE = "text/event-stream"
DONE = b"data: [DONE]\n\n"

_WORD_ENDS = re.compile(r"(?<=\s)(?=\S)")


def completion_id(entropy: bytes) -> str:
    """A completion id from fresh random bytes (the caller's, e.g. os.urandom(12))."""
    return "chatcmpl-" + entropy.hex()


def _usage(answer: CachedAnswer) -> dict[str, int]:
    return {"prompt_tokens": answer.prompt_tokens, "completion_tokens": answer.completion_tokens,
            "total_tokens": answer.total_tokens}


def json_body(answer: CachedAnswer, request_model: str, now: float, id: str) -> bytes:
    return compact_json({
        "id": id, "object": "chat.completion", "created": int(now),
        "model": answer.model or request_model,
        "choices": [{"index": 0, "message": {"role": answer.role, "content": answer.content},
                     "finish_reason": answer.finish_reason, "logprobs": None}],
        "usage": _usage(answer),
    })


def content_pieces(content: str, chunk_chars: int = 20) -> list[str]:
    """The content in pieces of about chunk_chars characters, cut after whitespace; a run
    without whitespace longer than 2 * chunk_chars (code, CJK) is cut every chunk_chars."""
    pieces: list[str] = []
    current = ""
    for word in _WORD_ENDS.split(content):
        while len(word) > 2 * chunk_chars:
            if current:
                pieces.append(current)
                current = ""
            pieces.append(word[:chunk_chars])
            word = word[chunk_chars:]
        current += word
        if len(current) >= chunk_chars:
            pieces.append(current)
            current = ""
    if current:
        pieces.append(current)
    return pieces


def sse_body(answer: CachedAnswer, request_model: str, now: float, id: str,
             include_usage: bool, chunk_chars: int = 20) -> bytes:
    head = {"id": id, "object": "chat.completion.chunk", "created": int(now),
            "model": answer.model or request_model}
    tail = {"usage": None} if include_usage else {}

    def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return b"data: " + compact_json({**head, "choices": [choice], **tail}) + b"\n\n"

    events = [chunk({"role": answer.role, "content": ""})]
    events += [chunk({"content": piece}) for piece in content_pieces(answer.content, chunk_chars)]
    events.append(chunk({}, answer.finish_reason))
    if include_usage:
        events.append(b"data: " + compact_json({**head, "choices": [], "usage": _usage(answer)})
                      + b"\n\n")
    events.append(DONE)
    return b"".join(events)


def hit_headers(tier: str, similarity: float | None, age_s: float, *,
                stream: bool) -> tuple[tuple[str, str], ...]:
    """content-type, x-sluice-cache (the tier), x-sluice-similarity (semantic hits only,
    4 decimals) and age (whole seconds, never negative)."""
    if tier not in TIERS:
        raise ValueError(f"tier: must be one of {TIERS}, got {tier!r}")
    headers = [("content-type", SSE_CONTENT_TYPE if stream else JSON_CONTENT_TYPE),
               ("x-sluice-cache", tier)]
    if tier == "semantic":
        if similarity is None or not math.isfinite(similarity):
            raise ValueError("similarity: a semantic hit needs a finite similarity")
        headers.append(("x-sluice-similarity", f"{similarity:.4f}"))
    if stream:
        headers.append(("cache-control", "no-cache"))
    headers.append(("age", str(max(0, int(age_s)) if math.isfinite(age_s) else 0)))
    return tuple(headers)
