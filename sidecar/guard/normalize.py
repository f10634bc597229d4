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

import numpy as np

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
    # Most texts need neither step; the checks cost a fraction of doing them.
    if not text.isprintable() and _INVISIBLE.search(text):
        text = text.translate(_DROP)
    if not unicodedata.is_normalized("NFKC", text):
        text = unicodedata.normalize("NFKC", text)
    return text.casefold()


def fold_with_offsets(text: str) -> tuple[str, np.ndarray]:
    """fold(text) character by character, and for each folded character the index of the
    original character it came from (a match [i, j) in the folded text covers the original
    text from offsets[i] to offsets[j - 1] + 1)."""
    if text.isascii():
        folded = fold(text)
        if len(folded) == len(text):          # no control character dropped
            return folded, np.arange(len(text))
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
    # Most characters fold to themselves: only the others (capitals, full-width forms,
    # invisibles) are looked up, and the text between them is copied in slices.
    changes, lengths, folds = _bmp_tables()
    pieces, at = [], 0
    for index in np.flatnonzero(changes[points]).tolist():
        pieces.append(text[at:index])
        pieces.append(folds[ord(text[index])])
        at = index + 1
    pieces.append(text[at:])
    return "".join(pieces), np.repeat(np.arange(len(text)), lengths[points])


_BMP = 0x10000


def _fold_char(ch: str) -> str:
    return "" if ord(ch) in _DROP else unicodedata.normalize("NFKC", ch).casefold()


@functools.cache
def _bmp_tables() -> tuple[np.ndarray, np.ndarray, dict[int, str]]:
    """For every character of the Basic Multilingual Plane: whether folding changes it, the
    length of its fold, and the folds that differ (built once per process, ~50 ms: see
    prepare_offsets)."""
    changes, lengths, folds = np.zeros(_BMP, bool), np.ones(_BMP, np.int64), {}
    for cp in range(_BMP):
        ch = chr(cp)
        folded = _fold_char(ch)
        if folded != ch:
            changes[cp], lengths[cp], folds[cp] = True, len(folded), folded
    return changes, lengths, folds


def prepare_offsets() -> None:
    """Builds the tables fold_with_offsets and squeeze_offsets use, so the first request that
    masks a word does not wait for them (WordMatcher calls it when it is compiled)."""
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
    points = _code_points(folded)
    if len(points) and points.max() >= _BMP:
        return _GAPS.sub("", folded)
    # A table lookup per code point in numpy: the regex costs ~5x more on CJK text.
    return points[_bmp_kept()[points]].tobytes().decode("utf-32-le", "surrogatepass")


def squeeze_offsets(folded: str) -> np.ndarray:
    """For each character squeeze(folded) keeps, its offset in `folded`."""
    points = _code_points(folded)
    if len(points) and points.max() >= _BMP:
        return np.array([m.start() for m in _KEPT.finditer(folded)], np.int64)
    return np.flatnonzero(_bmp_kept()[points])


@functools.cache
def _bmp_kept() -> np.ndarray:
    """Whether squeeze keeps each character of the Basic Multilingual Plane."""
    kept = np.zeros(_BMP, bool)
    kept[[m.start() for m in _KEPT.finditer("".join(map(chr, range(_BMP))))]] = True
    return kept
