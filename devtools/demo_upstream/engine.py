"""Model-like behaviour: deterministic completions, request plans, batch slots."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, fields
from functools import lru_cache
from typing import Any

from .config import Config

_VOCAB = (
    "river", "stone", "light", "cloud", "signal", "garden", "copper", "window",
    "market", "engine", "forest", "harbor", "lantern", "meadow", "orbit", "puzzle",
    "quartz", "ribbon", "saddle", "timber", "umbrella", "velvet", "wander", "yonder",
    "anchor", "bridge", "candle", "dune", "ember", "falcon", "glacier", "hollow",
    "island", "jungle", "kettle", "ladder", "mirror", "nectar", "oasis", "pepper",
    "quiet", "rocket", "summit", "tunnel", "upward", "valley", "whisper", "zenith",
    "amber", "breeze", "canyon", "drift", "echo", "fable", "granite", "horizon",
    "ivory", "jasper", "kindle", "lumen", "marble", "north", "opal", "prism",
)
_MASK64 = (1 << 64) - 1


def completion_tokens(prompt: str, count: int, seed: int | None) -> tuple[str, ...]:
    """The answer to `prompt`: same prompt and seed, same words; one word per token."""
    key = b"" if seed is None else str(seed).encode()
    # surrogatepass: JSON may carry a lone surrogate (\ud800); it is still a prompt.
    digest = hashlib.blake2b(prompt.encode("utf-8", "surrogatepass"), digest_size=8, key=key).digest()
    return _words(int.from_bytes(digest, "little") or 1, count)


# Keyed by the prompt's hash, not the prompt, so long prompts are not kept
# alive; benchmarks replay a few prompts thousands of times.
@lru_cache(maxsize=4096)
def _words(state: int, count: int) -> tuple[str, ...]:
    tokens = []
    for i in range(count):
        # xorshift64: a cheap, deterministic stream of word picks.
        state ^= (state << 13) & _MASK64
        state ^= state >> 7
        state ^= (state << 17) & _MASK64
        word = _VOCAB[state % len(_VOCAB)]
        tokens.append(word.capitalize() if i == 0 else " " + word)
    return tuple(tokens)


class RequestError(ValueError):
    """A client mistake, answered 400 invalid_request_error."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ChatPlan:
    """What one chat request will produce, decided before any waiting."""

    model: str
    tokens: tuple[str, ...]
    finish_reason: str
    prompt_tokens: int
    stream: bool
    include_usage: bool
    priority: int = 0  # vLLM's: lower runs first under the priority scheduling policy

    @property
    def usage(self) -> dict[str, int]:
        n = len(self.tokens)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": n, "total_tokens": self.prompt_tokens + n}


def message_text(content: Any) -> str:
    """Text of a message's content: a string or a list of {type: text, text} parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def plan_chat(body: Any, config: Config) -> ChatPlan:
    """Validate an OpenAI chat body and decide the answer; raises RequestError."""
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise RequestError("'messages' must be a non-empty array of message objects", "messages")
    model = body.get("model")
    if model is None:
        model = config.model
    if not isinstance(model, str) or not model:
        raise RequestError("'model' must be a non-empty string", "model")
    limit_param = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    limit = body.get(limit_param)
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise RequestError(f"'{limit_param}' must be a positive integer", limit_param)

    priority = body.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise RequestError("'priority' must be an integer", "priority")
    if priority and config.scheduling_policy != "priority":   # as vLLM answers it
        raise RequestError(f"Got priority {priority} but Priority scheduling is not enabled.", "priority")

    count = config.tokens if limit is None else min(config.tokens, limit)
    user_texts = [message_text(m.get("content")) for m in messages if m.get("role") == "user"]
    prompt = user_texts[-1] if user_texts else message_text(messages[-1].get("content"))
    stream = body.get("stream") is True
    options = body.get("stream_options")
    return ChatPlan(
        model=model,
        tokens=completion_tokens(prompt, count, config.seed),
        finish_reason="length" if count < config.tokens else "stop",
        # ~4 characters per token, the usual rule of thumb for English text.
        prompt_tokens=max(1, sum(len(message_text(m.get("content"))) for m in messages) // 4),
        stream=stream,
        include_usage=stream and isinstance(options, dict) and options.get("include_usage") is True,
        priority=priority,
    )


@dataclass
class Stats:
    requests: int = 0
    completed: int = 0
    errors: int = 0
    disconnected: int = 0
    preempted: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0

    def reset(self) -> None:
        for f in fields(self):
            setattr(self, f.name, 0)
