"""What a personal-data detector finds, and where its pattern runs: shared by pii.py and
secrets.py."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable


@dataclass(frozen=True)
class Span:
    detector: str
    start: int
    end: int
    score: float = 1.0


def matches(pattern: re.Pattern, text: str, ranges: list[tuple[int, int]]) -> Iterable[re.Match]:
    """The pattern's matches inside `ranges` (lookbehinds still read the text before a range)."""
    for start, end in ranges:
        yield from pattern.finditer(text, start, end)
