"""The one token estimate: for admission's charge before an answer exists, the upstream
timeout's prompt size, and an answer whose upstream sent no usage.

Four characters a token, rounded up: cheap, and close for English text with the common
tokenizers; the upstream's own usage corrects a tenant's budget once the answer ends.
"""
from __future__ import annotations

import math

CHARS_PER_TOKEN = 4


def estimate_tokens(text: str) -> int:
    return math.ceil(len(text) / CHARS_PER_TOKEN)
