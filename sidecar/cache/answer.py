"""A stored answer: what the cache keeps of one upstream chat completion.

Only what a replay needs (sidecar/cache/replay.py) and nothing that could identify the
caller: the text, why it ended, the model the upstream reported, the token counts and
when it was stored. `to_bytes` / `from_bytes` are the value stored in Redis: compact
JSON, version-tagged, validated on the way back in so that a corrupt or foreign value is
a ValueError (a miss for the caller), never a half-built answer.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from typing import Any

from sidecar.memo import BoundedMemo

FINISH_REASONS = ("stop", "length")
# Answers served again and again are decoded once (~15 µs each): at most this many of at most
# DECODED_MAX_BYTES each (about 4 MB with the decoded text).
DECODED_ENTRIES = 256
DECODED_MAX_BYTES = 8 * 1024
FORMAT_VERSION = 1
# Token counts above any model's context are no usage: bounded here, they stay exact in a
# float (Envoy's dynamic metadata, Prometheus counters) and in the token budgets' arithmetic,
# where an upstream's 400-digit count once overflowed and failed every replay of the entry.
MAX_TOKENS = 10**9


def compact_json(value: Any) -> bytes:
    """JSON without spaces, as UTF-8; escapes to ASCII only when the text cannot be UTF-8
    (lone surrogates, which JSON can carry and UTF-8 cannot)."""
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=True,
                          allow_nan=False).encode("ascii")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class CachedAnswer:
    content: str
    finish_reason: str          # "stop" | "length"
    model: str                  # as the upstream reported it ("" when it did not)
    prompt_tokens: int
    completion_tokens: int
    created_at: float           # unix time when stored
    role: str = "assistant"
    usage_estimated: bool = False   # token counts estimated (len/4): the upstream sent none

    def __post_init__(self) -> None:
        if not isinstance(self.content, str):
            raise ValueError("content: must be a string")
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason: must be one of {FINISH_REASONS}, "
                             f"got {self.finish_reason!r}")
        if not isinstance(self.model, str):
            raise ValueError("model: must be a string")
        for name in ("prompt_tokens", "completion_tokens"):
            value = getattr(self, name)
            if not _is_int(value) or not 0 <= value <= MAX_TOKENS:
                raise ValueError(f"{name}: must be an integer from 0 to {MAX_TOKENS}, got {str(value)[:40]}")
        if (not isinstance(self.created_at, (int, float)) or isinstance(self.created_at, bool)
                or not math.isfinite(self.created_at)):
            raise ValueError(f"created_at: must be a finite number, got {self.created_at!r}")
        if self.role != "assistant":
            raise ValueError(f"role: must be 'assistant', got {self.role!r}")
        if not isinstance(self.usage_estimated, bool):
            raise ValueError("usage_estimated: must be a boolean")

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def to_bytes(self) -> bytes:
        return compact_json({"v": FORMAT_VERSION, **asdict(self)})

    @classmethod
    def from_bytes(cls, data: bytes) -> CachedAnswer:
        """The answer stored by `to_bytes`; ValueError for anything else."""
        try:
            value = json.loads(data)
        except (ValueError, TypeError, RecursionError) as exc:   # JSONDecodeError, UnicodeDecodeError, nesting
            raise ValueError(f"cached answer is not JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError("cached answer must be a JSON object")
        if value.pop("v", None) != FORMAT_VERSION:
            raise ValueError(f"cached answer: unknown format version (want {FORMAT_VERSION})")
        try:
            return cls(**value)
        except TypeError as exc:                 # missing or unknown fields
            raise ValueError(f"cached answer: {exc}") from None


_decoded: BoundedMemo[CachedAnswer] = BoundedMemo(DECODED_ENTRIES)


def decode_answer(data: bytes) -> CachedAnswer:
    """CachedAnswer.from_bytes, remembered for small answers (they are frozen, so shared)."""
    if type(data) is bytes and len(data) <= DECODED_MAX_BYTES:
        return _decoded.get(data, lambda: CachedAnswer.from_bytes(data))
    return CachedAnswer.from_bytes(data)
