"""What of a chat request is embedded, and what goes into the context key instead.

`split_prompt(messages)` takes an OpenAI chat `messages` list (dicts as in the request
JSON) and returns:

- `text`: the text of the LAST user turn: its string content, or its text parts
  (`{"type": "text", "text": ...}`) joined by newlines. Image, audio and file parts are
  not text and are left out of it. This is what is embedded: the question being asked.
- `context_key`: SHA-256 hex of a canonical JSON of everything else that shapes the
  answer: every message before the last user turn (system/developer prompt, earlier
  turns), every message after it (tool results, assistant prefill), and the last user
  turn itself minus its text parts (its non-text parts and other fields, so two
  questions about different images never share a key).

A semantic cache matches vectors only among entries with an equal context key: the same
question under another system prompt or conversation is another question. The key is
exact, not semantic; any difference in the context, even in form (a string content vs
the same text as one text part), gives another key: a miss, never a wrong hit.
Request fields outside `messages` (model, tools, sampling) are the cache's to add.

Canonical JSON: keys sorted, no spaces, ASCII escapes (so lone surrogates and every
code point encode), version-tagged so a change of the rule changes every key. Pure
function; it never raises anything but NothingToEmbed (a ValueError) for odd input.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sidecar.canonical import canonical_digest
from sidecar.embedding.errors import NothingToEmbed

KEY_VERSION = 1


@dataclass(frozen=True)
class PromptParts:
    text: str         # to embed (raw; the engine normalises it)
    context_key: str  # 64 hex digits


def split_prompt(messages: Sequence[Any]) -> PromptParts:
    if not isinstance(messages, (list, tuple)):
        raise NothingToEmbed("messages must be a list")
    turn = _last_user_turn(messages)
    if turn is None:
        raise NothingToEmbed("no user message to embed")
    message = messages[turn]
    text, other_parts = _split_content(message.get("content"))
    if not text.strip():
        raise NothingToEmbed("the last user message has no text")
    rest_of_turn = {k: v for k, v in message.items() if k != "content"}
    rest_of_turn["content_parts"] = other_parts
    context = {"v": KEY_VERSION, "before": list(messages[:turn]),
               "turn": rest_of_turn, "after": list(messages[turn + 1:])}
    return PromptParts(text=text, context_key=context_key(context))


def context_key(value: Any) -> str:
    """SHA-256 hex of the canonical JSON of a JSON-like value (sidecar.canonical)."""
    try:
        return canonical_digest(value)
    except (TypeError, ValueError) as exc:  # not JSON-like: mixed key types, a cycle
        raise NothingToEmbed(f"messages are not JSON-like: {exc}") from None


def _last_user_turn(messages: Sequence[Any]) -> int | None:
    for index in range(len(messages) - 1, -1, -1):
        message = messages[index]
        if isinstance(message, dict) and message.get("role") == "user":
            return index
    return None


def _split_content(content: Any) -> tuple[str, list]:
    """(text, the parts that are not text) of a message's content."""
    if isinstance(content, str):
        return content, []
    if not isinstance(content, list):
        return "", []
    texts, others = [], []
    for part in content:
        if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            others.append(part)
    return "\n".join(texts), others
