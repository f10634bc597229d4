"""The text the word filter sees: NFKC, without invisible characters, case-folded.

Full-width letters (ｓｅｃｒｅｔ), ligatures and compatibility forms fold to their plain
letters under NFKC; zero-width spaces, joiners, soft hyphens, bidi controls and other format
(Cf) and control (Cc) characters are dropped, so a word split by one still matches. The whole
string is folded at once (C code, fast); the offsets of a match in the original text are
worked out only when a match must be masked (`fold_with_offsets`, which folds each distinct
character once).
"""
from __future__ import annotations

import functools
import re
import unicodedata
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from sidecar.guard.compiled import NGRAMS as _compiled     # None: numpy does the lookups

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


# The ASCII ones, for bytes.translate: a C table lookup per byte (str.isprintable and str.translate
# look each character up in Unicode's tables: ~3x the time of the whole ASCII fold).
_ASCII_DROP = bytes(cp for cp in _DROP if cp < 128)


def fold(text: str) -> str:
    """NFKC, invisible characters dropped, case-folded."""
    if text.isascii():
        # NFKC changes no ASCII character; only control characters can go.
        return text.encode("ascii").translate(None, _ASCII_DROP).lower().decode("ascii")
    by_table = _by_table(text, offsets=False)
    if by_table is not None:
        return by_table[0]
    # Most texts need neither step; the checks cost a fraction of doing them.
    if not text.isprintable() and _INVISIBLE.search(text):
        text = text.translate(_DROP)
    if not unicodedata.is_normalized("NFKC", text):
        text = unicodedata.normalize("NFKC", text)
    return text.casefold()


def fold_keeping_offsets(text: str) -> tuple[str, Sequence[int] | None]:
    """fold(text), and fold_with_offsets(text)'s offsets where the same work gives them (a text
    folded by table lookups, an ASCII text without control characters); None elsewhere. A word
    scan that masks then needs no second fold. Where every character folds to one, the offsets
    are a range: nothing to build for the many texts that have nothing to mask."""
    if text.isascii():
        folded = fold(text)
        return folded, (range(len(text)) if len(folded) == len(text) else None)
    by_table = _by_table(text, offsets=True)
    if by_table is not None:
        return by_table
    return fold(text), None


def fold_with_offsets(text: str) -> tuple[str, Sequence[int]]:
    """fold(text) character by character, and for each folded character the index of the
    original character it came from (a match [i, j) in the folded text covers the original
    text from offsets[i] to offsets[j - 1] + 1)."""
    if text.isascii():
        folded = fold(text)
        if len(folded) == len(text):          # no control character dropped
            return folded, np.arange(len(text))
    by_table = _by_table(text, offsets=True)
    if by_table is not None:
        return by_table
    # A printable text has no format or control character: the costly search is skipped.
    if (text.isprintable() or not _INVISIBLE.search(text)) and unicodedata.is_normalized("NFKC", text):
        folded = text.casefold()
        if len(folded) == len(text):     # casefold never shortens: every character maps to one
            return folded, np.arange(len(text))
    points = _code_points(text)
    if len(points) and points.max() >= _BMP:
        # Rare (emoji, historic scripts): each distinct character folded once.
        distinct, inverse = np.unique(points, return_inverse=True)
        table = {int(cp): _fold_char(chr(cp)) for cp in distinct}
        lengths = np.array([len(table[int(cp)]) for cp in distinct])[inverse]
        return text.translate(table), np.repeat(np.arange(len(text)), lengths)
    return _pieces(text, points)


def _pieces(text: str, points: np.ndarray) -> tuple[str, np.ndarray]:
    """Each character of a BMP text folded alone, with offsets."""
    # Most characters fold to themselves: only the others (capitals, full-width forms,
    # invisibles) are looked up, and the text between them is copied in slices.
    tables = _bmp_tables()
    pieces, at = [], 0
    for index in np.flatnonzero(tables.changes[points]).tolist():
        pieces.append(text[at:index])
        pieces.append(tables.folds[ord(text[index])])
        at = index + 1
    pieces.append(text[at:])
    return "".join(pieces), np.repeat(np.arange(len(text)), tables.lengths[points])


def _by_table(text: str, offsets: bool) -> tuple[str, Sequence[int] | None] | None:
    """fold(text) one character at a time by table lookups, where that is what folding the
    whole text gives: a text of the Basic Multilingual Plane without a character that NFKC
    could join to or reorder with the one before it (_Tables.joins). None for other texts.
    A 2 KB CJK text with full-width punctuation: ~15 us, against ~60 for NFKC of the whole;
    ~5 us where the compiled module does the lookups in one pass (sidecar/guard/_ngrams.c)."""
    if _compiled is not None:
        tables = _bmp_tables()
        kinds = _compiled.fold_by_table(text, tables.kinds, tables.single, _JOINS | _NOT_ONE, _CHANGES)
        if isinstance(kinds, str):
            return kinds, (range(len(text)) if offsets else None)
        if kinds & (_compiled.BEYOND_BMP | _JOINS):
            return None
        return _pieces(text, _code_points(text))
    points = _code_points(text)
    if not len(points) or points.max() >= _BMP:
        return None
    tables = _bmp_tables()
    kinds = np.bitwise_or.reduce(tables.kinds.take(points))
    if kinds & _JOINS:
        return None
    if not kinds & _CHANGES:
        return text, (range(len(text)) if offsets else None)
    if not kinds & _NOT_ONE:               # every change one character for one
        folded = tables.single.take(points).tobytes().decode("utf-32-le", "surrogatepass")
        return folded, (range(len(text)) if offsets else None)
    return _pieces(text, points)


_BMP = 0x10000
_CHANGES, _NOT_ONE, _JOINS = 1, 2, 4


def _fold_char(ch: str) -> str:
    return "" if ord(ch) in _DROP else unicodedata.normalize("NFKC", ch).casefold()


@dataclass(frozen=True)
class _Tables:
    """For every character of the Basic Multilingual Plane: whether folding changes it, the
    length of its fold, the folds that differ, the fold of those that fold to one character,
    and `kinds` (_CHANGES, _NOT_ONE, _JOINS: its NFKD starts with a combining mark or with a
    character that composes with one before it, so NFKC of a text can join it to or reorder
    it with its neighbour, and folding alone would differ)."""
    changes: np.ndarray
    lengths: np.ndarray
    folds: dict[int, str]
    single: np.ndarray
    kinds: np.ndarray


@functools.cache
def _bmp_tables() -> _Tables:
    """Built once per process (~0.1 s: see prepare_offsets)."""
    changes, lengths, folds = np.zeros(_BMP, bool), np.ones(_BMP, np.int64), {}
    single, kinds = np.arange(_BMP, dtype=np.uint32), np.zeros(_BMP, np.uint8)
    for cp in range(_BMP):
        ch = chr(cp)
        folded = _fold_char(ch)
        if folded != ch:
            changes[cp], lengths[cp], folds[cp] = True, len(folded), folded
            kinds[cp] |= _CHANGES
            if len(folded) == 1:
                single[cp] = ord(folded)
            else:
                kinds[cp] |= _NOT_ONE
    # Second characters of canonical pairs (a composed character's two-part decomposition;
    # Hangul vowel and final jamo compose by rule), the ones NFC joins to what precedes them.
    seconds = set(range(0x1161, 0x1176)) | set(range(0x11A8, 0x11C3))
    for cp in range(0x20000):             # composed characters are all in planes 0 and 1
        parts = unicodedata.decomposition(chr(cp)).split()
        if len(parts) == 2 and not parts[0].startswith("<"):
            seconds.add(int(parts[1], 16))
    # NFKD of every character in one call: a NUL between them neither composes nor reorders.
    decomposed = unicodedata.normalize("NFKD", "\0".join(map(chr, range(1, _BMP)))).split("\0")
    for cp, nfkd in enumerate(decomposed, start=1):
        if nfkd and (unicodedata.combining(nfkd[0]) or ord(nfkd[0]) in seconds):
            kinds[cp] |= _JOINS
    return _Tables(changes, lengths, folds, single, kinds)


def prepare_offsets() -> None:
    """Builds the tables fold_with_offsets and squeeze_offsets use, so the first request that
    masks a word does not wait for them (a guard policy and a WordMatcher call it when built)."""
    _bmp_tables()
    _bmp_kept()


def _code_points(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-32-le", "surrogatepass"), np.uint32)


# Spaces, punctuation and symbols a writer puts between the characters of a word to dodge a
# filter ("加 微 信", "加.微.信"). Removed only for lists that ask for it (WordList.squeeze).
_GAPS = re.compile(r"[\W_]+")
_KEPT = re.compile(r"[^\W_]")


def squeeze(folded: str) -> str:
    """The folded text without gap characters."""
    return squeezed(folded)[0]


def squeeze_offsets(folded: str) -> np.ndarray:
    """For each character squeeze(folded) keeps, its offset in `folded`."""
    return squeezed(folded)[1]


def squeezed(folded: str) -> tuple[str, np.ndarray]:
    """squeeze(folded) and squeeze_offsets(folded) from one look at each character."""
    if _compiled is not None:       # the same lookups in one pass
        tight = _compiled.squeeze_by_table(folded, _bmp_kept().view(np.uint8))
        if tight is not None:
            return tight[0], np.frombuffer(tight[1], np.int64)
    points = _code_points(folded)
    if len(points) and points.max() >= _BMP:
        return _GAPS.sub("", folded), np.array([m.start() for m in _KEPT.finditer(folded)], np.int64)
    # A table lookup per code point in numpy: the regex costs ~5x more on CJK text.
    kept = _bmp_kept().take(points)
    return points[kept].tobytes().decode("utf-32-le", "surrogatepass"), np.flatnonzero(kept)


@functools.cache
def _bmp_kept() -> np.ndarray:
    """Whether squeeze keeps each character of the Basic Multilingual Plane."""
    kept = np.zeros(_BMP, bool)
    kept[[m.start() for m in _KEPT.finditer("".join(map(chr, range(_BMP))))]] = True
    return kept
