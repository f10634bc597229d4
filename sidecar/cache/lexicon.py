"""The word tables of the same-question checks, read from a data file (lexicon.toml here).

The checks' logic is code; which words count as negations, opposites, units or question
words is data, edited without touching it.  `load_lexicon` checks every table's shape and
refuses a malformed file with an error that names the file and the table, so a bad edit
stops the sidecar at start rather than silently weakening a check.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

__all__ = ["LEXICON_PATH", "Lexicon", "LexiconError", "load_lexicon", "lexicon"]

LEXICON_PATH = Path(__file__).with_name("lexicon.toml")

# Each table's shape (the file's header describes them).
WORDS, CLASSES, NUMBERED, LENGTHS, PAIRS = "words", "classes", "numbered", "lengths", "pairs"
TABLES = {
    "stopwords": WORDS, "cardinals": NUMBERED, "tens": NUMBERED, "scales": NUMBERED, "ordinals": NUMBERED,
    "symmetric": WORDS, "unit_names": CLASSES, "negations": WORDS, "interrogatives": CLASSES,
    "relatives": WORDS, "comparisons": CLASSES, "gradable": WORDS, "opposed_classes": PAIRS,
    "particles": CLASSES, "negating_prefixes": LENGTHS, "swapped_prefixes": PAIRS, "tenses": CLASSES,
    "quantifiers": CLASSES, "persons": CLASSES, "not_labels": WORDS, "not_entities": WORDS,
    "directions": WORDS, "infinitive_after": WORDS,
}


class LexiconError(ValueError):
    """The lexicon file is missing, not TOML, or a table has the wrong shape."""


@dataclass(frozen=True)
class Lexicon:
    """The parsed tables: `words[name]` a set, `classes[name]` word -> class, `numbered[name]`
    word -> value, `lengths[name]` prefix -> length, `pairs[name]` a tuple of pairs."""
    words: dict[str, frozenset[str]]
    classes: dict[str, dict[str, str]]
    numbered: dict[str, dict[str, int]]
    lengths: dict[str, dict[str, int]]
    pairs: dict[str, tuple[tuple[str, str], ...]]


def _entries(where: str, value: object) -> list[str]:
    """A space-separated string, or a list of entries taken whole (for "por qué")."""
    if isinstance(value, str):
        found = value.split()
    elif isinstance(value, list) and all(isinstance(v, str) for v in value):
        found = [v.strip() for v in value]
    else:
        raise LexiconError(f"{where}: expected a string of words or a list of strings, got {type(value).__name__}")
    if not found or any(not w for w in found):
        raise LexiconError(f"{where}: no words, or an empty one")
    return found


def _inverse(where: str, table: dict, key_of) -> dict:
    out: dict = {}
    for key, value in table.items():
        mapped = key_of(f"{where}.{key}", key)
        for word in _entries(f"{where}.{key}", value):
            if word in out and out[word] != mapped:
                raise LexiconError(f"{where}: {word!r} is in two classes ({out[word]!r} and {mapped!r})")
            out[word] = mapped
    return out


def _number_key(where: str, key: str) -> int:
    try:
        return int(key)
    except ValueError:
        raise LexiconError(f"{where}: the key must be an integer value") from None


def _parse(name: str, shape: str, table: object, lex: Lexicon) -> None:
    where = f"[{name}]"
    if not isinstance(table, dict):
        raise LexiconError(f"{where}: expected a table, got {type(table).__name__}")
    if shape in (WORDS, PAIRS):
        key = "words" if shape == WORDS else "pairs"
        if set(table) != {key}:
            raise LexiconError(f"{where}: expected exactly the key {key!r}, got {sorted(table)}")
        if shape == WORDS:
            lex.words[name] = frozenset(_entries(where, table[key]))
            return
        pairs = table[key]
        if not isinstance(pairs, list) or not pairs or not all(
                isinstance(p, list) and len(p) == 2 and all(isinstance(x, str) and x for x in p) for p in pairs):
            raise LexiconError(f"{where}: pairs must be a non-empty list of [\"a\", \"b\"] strings")
        lex.pairs[name] = tuple((a, b) for a, b in pairs)
    elif not table:
        raise LexiconError(f"{where}: empty")
    elif shape == CLASSES:
        lex.classes[name] = _inverse(where, table, lambda _where, key: key)
    elif shape == NUMBERED:
        lex.numbered[name] = _inverse(where, table, _number_key)
    else:
        for prefix, length in table.items():
            if not prefix.strip():  # an empty prefix would make every word its own opposite
                raise LexiconError(f"{where}: an empty prefix")
            if not isinstance(length, int) or isinstance(length, bool) or length < 1:
                raise LexiconError(f"{where}.{prefix}: expected a positive integer, got {length!r}")
        lex.lengths[name] = dict(table)


def load_lexicon(path: Path | None = None) -> Lexicon:
    """Read and check the lexicon file (the shipped one by default); LexiconError says what is
    wrong and where."""
    path = LEXICON_PATH if path is None else path
    try:
        with open(path, "rb") as handle:
            data = tomllib.load(handle)
    except OSError as exc:
        raise LexiconError(f"{path}: cannot read the lexicon: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise LexiconError(f"{path}: not valid TOML: {exc}") from None
    missing, unknown = set(TABLES) - set(data), set(data) - set(TABLES)
    if missing or unknown:
        wrong = [f"{what} tables {sorted(names)}" for what, names in (("missing", missing), ("unknown", unknown))
                 if names]
        raise LexiconError(f"{path}: {', '.join(wrong)}")
    lex = Lexicon({}, {}, {}, {}, {})
    for name, shape in TABLES.items():
        try:
            _parse(name, shape, data[name], lex)
        except LexiconError as exc:
            raise LexiconError(f"{path}: {exc}") from None
    return lex


_loaded: Lexicon | None = None


def lexicon() -> Lexicon:
    """The shipped lexicon, read once."""
    global _loaded
    if _loaded is None:
        _loaded = load_lexicon()
    return _loaded
