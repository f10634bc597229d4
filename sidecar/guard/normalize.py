"""The text the word filter sees: NFKC, without invisible characters, case-folded.

Full-width letters (ｓｅｃｒｅｔ), ligatures and compatibility forms fold to their plain
letters under NFKC; zero-width spaces, joiners, soft hyphens, bidi controls and other format
(Cf) and control (Cc) characters are dropped, so a word split by one still matches. The whole
string is folded at once (C code, fast); the offsets of a match in the original text are
worked out only when a match must be masked (`fold_with_offsets`, a slower per-character walk).
"""
from __future__ import annotations

import re
import unicodedata

# Every format and control character, except the line breaks and tabs that separate words.
_KEEP = {"\t", "\n", "\r"}
# Only the planes Unicode assigns characters in (4-13 are unassigned, 15-16 private use): a
# scan of all 1.1M code points made up a fifth of the sidecar's start-up. A test checks that
# the full scan finds nothing more under the running Python's Unicode version.
_PLANES = (range(0x00000, 0x40000), range(0xE0000, 0xF0000))
_DROP = {cp: None for plane in _PLANES for cp in plane
         if unicodedata.category(chr(cp)) in ("Cf", "Cc") and chr(cp) not in _KEEP}




def _char_class(code_points) -> str:
    """A regex class of ranges: a class of single characters scans ~10x slower."""
    ranges: list[list[int]] = []
    for cp in sorted(code_points):
        if ranges and cp == ranges[-1][1] + 1:
            ranges[-1][1] = cp
        else:
            ranges.append([cp, cp])
    return "[" + "".join(re.escape(chr(a)) + ("-" + re.escape(chr(b)) if b > a else "") for a, b in ranges) + "]"


_INVISIBLE = re.compile(_char_class(_DROP))


def fold(text: str) -> str:
    """NFKC, invisible characters dropped, case-folded."""
    if text.isascii():
        # NFKC changes no ASCII character; only control characters can go.
        return (text.translate(_DROP) if not text.isprintable() else text).lower()
    # Most texts need neither step; the checks cost a fraction of doing them.
    if not text.isprintable() and _INVISIBLE.search(text):
        text = text.translate(_DROP)
    if not unicodedata.is_normalized("NFKC", text):
        text = unicodedata.normalize("NFKC", text)
    return text.casefold()


def fold_with_offsets(text: str) -> tuple[str, list[int]]:
    """fold(text) character by character, and for each folded character the index of the
    original character it came from (a match [i, j) in the folded text covers the original
    text from offsets[i] to offsets[j - 1] + 1)."""
    if text.isascii() and text.isprintable():
        return text.lower(), list(range(len(text)))
    if not _INVISIBLE.search(text) and unicodedata.is_normalized("NFKC", text):
        folded = text.casefold()
        if len(folded) == len(text):     # casefold never shortens: every character maps to one
            return folded, list(range(len(text)))
    out: list[str] = []
    offsets: list[int] = []
    for index, ch in enumerate(text):
        if ord(ch) in _DROP:
            continue
        folded = unicodedata.normalize("NFKC", ch).casefold()
        out.append(folded)
        offsets.extend([index] * len(folded))
    return "".join(out), offsets


# Spaces, punctuation and symbols a writer puts between the characters of a word to dodge a
# filter ("加 微 信", "加.微.信"). Removed only for lists that ask for it (WordList.squeeze).
_GAPS = re.compile(r"[\W_]+")
_KEPT = re.compile(r"[^\W_]")


def squeeze(folded: str) -> str:
    """The folded text without gap characters."""
    return _GAPS.sub("", folded)


def squeeze_offsets(folded: str) -> list[int]:
    """For each character squeeze(folded) keeps, its offset in `folded`."""
    return [m.start() for m in _KEPT.finditer(folded)]
