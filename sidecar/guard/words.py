"""Denied-word lists: every list's words in one Aho-Corasick automaton, each character once
(ahocorasick-rs: half pyahocorasick's time on a 2 KB prompt with 10,000 words).

A word matches the folded text (sidecar/guard/normalize.py): NFKC, invisible characters
dropped, case-folded. A word that starts (ends) with a letter or digit of a spaced script
matches only at a word boundary there, so "ass" is not found in "class"; CJK words, written
without spaces, match anywhere. Lists with `squeeze` also match the text with its spaces and
punctuation removed ("加 微 信" → "加微信"): `cjk` does that for words with a CJK character
only, `all` for every word (which costs false matches across word boundaries in spaced
scripts: see reports/guard.json).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Sequence

import ahocorasick_rs

from sidecar.guard.normalize import fold, fold_keeping_offsets, fold_with_offsets, prepare_offsets, squeeze, squeezed

SQUEEZE_MODES = ("cjk", "all", "off")


_CJK = re.compile("[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff\U00020000-\U0002fa1f]")


_SURROGATE = re.compile("[\ud800-\udfff]")


def is_cjk(ch: str) -> bool:
    cp = ord(ch)
    return (0x3040 <= cp <= 0x30FF or 0x3400 <= cp <= 0x4DBF or 0x4E00 <= cp <= 0x9FFF
            or 0xAC00 <= cp <= 0xD7AF or 0xF900 <= cp <= 0xFAFF or 0x20000 <= cp <= 0x2FA1F)


def _bounded(ch: str) -> bool:
    """Whether a word edge at this character needs a word boundary in the text."""
    return ch.isalnum() and not is_cjk(ch)


@dataclass(frozen=True)
class WordEntry:
    list_index: int
    length: int
    left: bool     # needs a boundary before it
    right: bool    # and after it


class WordMatcher:
    """Several named lists compiled together. `scan` returns, per list index, whether it hit;
    `spans` the original-text ranges to mask."""

    def __init__(self, lists: Iterable[tuple[Iterable[str], str]]):
        """lists: (words, squeeze mode) per list, in order."""
        plain: dict[str, list[WordEntry]] = {}
        squeezed: dict[str, list[WordEntry]] = {}
        self.size = 0
        # Only CJK words are squeezed: a text without CJK characters cannot match one.
        self._squeeze_ascii = False
        for index, (words, mode) in enumerate(lists):
            if mode not in SQUEEZE_MODES:
                raise ValueError(f"squeeze must be one of {SQUEEZE_MODES}, not {mode!r}")
            for word in words:
                key = fold(word).strip()
                if not key:
                    continue
                self.size += 1
                # One key can be in several lists (or twice in one): every entry is kept.
                plain.setdefault(key, []).append(WordEntry(index, len(key), _bounded(key[0]), _bounded(key[-1])))
                self._squeeze_ascii |= mode == "all"
                if mode == "all" or (mode == "cjk" and any(is_cjk(ch) for ch in key)):
                    tight = squeeze(key)
                    if tight:
                        squeezed.setdefault(tight, []).append(WordEntry(index, len(tight), False, False))
        if self.size:
            prepare_offsets()
        self._plain, self._plain_entries = _automaton(plain)
        self._squeezed, self._squeezed_entries = _automaton(squeezed)

    def scan(self, text: str) -> set[int]:
        """Indexes of the lists with a word in `text`."""
        return self.find(text).lists

    def find(self, text: str) -> "Found":
        """The lists with a word in `text`, and the matches, which `spans` can reuse."""
        folded, offsets = fold_keeping_offsets(text)
        hits = self._hits(folded)
        return Found({index for index, _, _ in hits}, folded, hits, offsets)

    def spans(self, text: str, lists: set[int], found: "Found | None" = None) -> list[tuple[int, int]]:
        """Ranges of the original `text` covered by words of `lists`, merged and sorted.
        `found` (this text's `find`) saves a second fold where it kept the offsets, and a second
        pass of the automaton when the text folds the same character by character as at once
        (nearly always)."""
        if found is not None and found.offsets is not None:
            folded, offsets = found.folded, found.offsets
        else:
            folded, offsets = fold_with_offsets(text)
        hits = found.hits if found is not None and found.folded == folded else self._hits(folded)
        ranges = []
        for index, start, end in hits:
            if index in lists:
                ranges.append((int(offsets[start]), int(offsets[end - 1]) + 1))
        return _merge(ranges)

    def _hits(self, folded: str) -> list[tuple[int, int, int]]:
        """(list index, start, end) of every match, as offsets in `folded`."""
        try:
            return self._matches(folded)
        except UnicodeEncodeError:
            # A lone surrogate (a JSON "\ud800" escape) is no character the automaton can
            # read: U+FFFD stands in for it, one for one, so offsets hold.
            return self._matches(_SURROGATE.sub("\ufffd", folded))

    def _matches(self, folded: str) -> list[tuple[int, int, int]]:
        found = []
        if self._plain is not None:
            for key, start, end in self._plain.find_matches_as_indexes(folded, overlapping=True):
                for e in self._plain_entries[key]:
                    if e.left and start > 0 and _bounded(folded[start - 1]):
                        continue
                    if e.right and end < len(folded) and _bounded(folded[end]):
                        continue
                    found.append((e.list_index, start, end))
        # (An ASCII text has no CJK character: known at once, where the search reads all of it.)
        if self._squeezed is not None and (self._squeeze_ascii or (not folded.isascii() and _CJK.search(folded))):
            tight, where = squeezed(folded)
            for key, start, end in self._squeezed.find_matches_as_indexes(tight, overlapping=True):
                for e in self._squeezed_entries[key]:
                    found.append((e.list_index, int(where[start]), int(where[end - 1]) + 1))
        return found


@dataclass(frozen=True)
class Found:
    lists: set[int]                         # indexes of the lists that hit
    folded: str                             # the text as matched
    hits: list[tuple[int, int, int]]        # (list index, start, end) in `folded`
    # For each character of `folded`, the offset in the text of the one it came from, where
    # folding gave them (normalize.fold_keeping_offsets); else None, and `spans` works them out.
    offsets: Sequence[int] | None = None


def _automaton(entries: dict[str, list[WordEntry]]):
    """The automaton of the keys, and each key's entries by pattern index; (None, []) when empty."""
    if not entries:
        return None, []
    keys = list(entries)
    return ahocorasick_rs.AhoCorasick(keys), [tuple(entries[k]) for k in keys]


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged
