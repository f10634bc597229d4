"""OpenAI wire shapes: errors, chat.completion objects and SSE chunks."""

from __future__ import annotations

import json
from functools import partial
from typing import Any

from .engine import ChatPlan

DONE = b"data: [DONE]\n\n"
_dumps = partial(json.dumps, separators=(",", ":"))  # compact, like real servers


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> bytes:
    return _dumps({"error": {"message": message, "type": type_, "param": param, "code": code}}).encode()


def completion_body(completion_id: str, created: int, plan: ChatPlan) -> bytes:
    return _dumps(
        {
            "id": completion_id,
            "object": "chat.completion",
            "created": created,
            "model": plan.model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "".join(plan.tokens)},
                    "logprobs": None,
                    "finish_reason": plan.finish_reason,
                }
            ],
            "usage": plan.usage,
        }
    ).encode()


class ChunkFormatter:
    """Builds `data: {chat.completion.chunk}\\n\\n` events.

    The envelope is serialised once per stream and only the delta per token,
    since a full json.dumps per token is the main cost of a busy stream.
    """

    def __init__(self, completion_id: str, created: int, model: str) -> None:
        envelope = {"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": model}
        self._head = "data: " + _dumps(envelope)[:-1] + ',"choices":['

    def _choice(self, delta: dict[str, Any], finish_reason: str | None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return (self._head + _dumps(choice) + "]}\n\n").encode()

    def role(self) -> bytes:
        return self._choice({"role": "assistant"}, None)

    def content(self, text: str) -> bytes:
        return self._choice({"content": text}, None)

    def finish(self, finish_reason: str) -> bytes:
        return self._choice({}, finish_reason)

    def usage(self, usage: dict[str, int]) -> bytes:
        return (self._head + '],"usage":' + _dumps(usage) + "}\n\n").encode()
