"""The lexicon file of the same-question checks: the shipped one loads, a malformed one is
refused at load with an error naming the table."""

import fnmatch
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from sidecar.cache.lexicon import LEXICON_PATH, TABLES, LexiconError, load_lexicon

SHIPPED = LEXICON_PATH.read_text(encoding="utf-8")


def _write(tmp_path, text: str):
    path = tmp_path / "lexicon.toml"
    path.write_text(text, encoding="utf-8")
    return path


def _replace_table(name: str, body: str) -> str:
    """The shipped file with table `name`'s body replaced."""
    pattern = re.compile(rf"^\[{name}\]\n(?:(?!^\[).*\n)*", re.M)
    assert pattern.search(SHIPPED), name
    return pattern.sub(f"[{name}]\n{body}\n\n", SHIPPED, count=1)


def test_the_shipped_lexicon_has_every_table():
    lex = load_lexicon()
    assert lex.numbered["cardinals"]["twelve"] == 12 and lex.numbered["cardinals"]["zwei"] == 2
    assert lex.numbered["scales"]["bn"] == 10**9
    assert lex.classes["comparisons"]["worst"] == "-good"
    assert lex.classes["interrogatives"]["por qué"] == "why"      # an entry with a space, kept whole
    assert lex.classes["unit_names"]["kilometre"] == "km"
    assert "I" in lex.words["not_labels"]                         # matched as written
    assert lex.lengths["negating_prefixes"]["dis"] == 5
    assert ("+keep", "-win") in lex.pairs["opposed_classes"]
    assert "the" in lex.words["stopwords"]
    assert {*lex.words, *lex.classes, *lex.numbered, *lex.lengths, *lex.pairs} == set(TABLES)


def test_the_checks_read_the_lexicon():
    from sidecar.cache import equivalence
    from sidecar.cache.stopwords import STOPWORDS
    lex = load_lexicon()
    assert equivalence._COMPARISONS == lex.classes["comparisons"]
    assert equivalence._NEGATIONS == lex.words["negations"]
    assert STOPWORDS == lex.words["stopwords"]


@pytest.mark.parametrize("text, message", [
    ("[stopwords\nwords = 'a'", "not valid TOML"),
    (SHIPPED.replace("[gradable]", "[gradable_typo]"), "missing tables ['gradable']"),
    (SHIPPED + "\n[extra]\nwords = \"a\"\n", "unknown tables ['extra']"),
    (_replace_table("negations", "words = 3"), "[negations]: expected a string of words"),
    (_replace_table("negations", "word = \"not\""), "[negations]: expected exactly the key 'words'"),
    (_replace_table("negations", "words = \"  \""), "[negations]: no words"),
    (_replace_table("tens", "twenty = \"twenty\""), "[tens].twenty: the key must be an integer"),
    (_replace_table("tenses", "present = \"is\"\npast = \"was is\""), "[tenses]: 'is' is in two classes"),
    (_replace_table("tenses", ""), "[tenses]: empty"),
    (_replace_table("negating_prefixes", "un = \"4\""), "[negating_prefixes].un: expected a positive integer"),
    (_replace_table("negating_prefixes", "\"\" = 4"), "[negating_prefixes]: an empty prefix"),
    (_replace_table("swapped_prefixes", "pairs = [[\"en\"]]"), "[swapped_prefixes]: pairs must be"),
    (_replace_table("comparisons", "\"+good\" = [\"good\", 3]"), "[comparisons].+good: expected a string"),
])
def test_a_malformed_lexicon_is_refused_naming_the_table(tmp_path, text, message):
    path = _write(tmp_path, text)
    with pytest.raises(LexiconError) as raised:
        load_lexicon(path)
    assert message in str(raised.value)
    assert str(path) in str(raised.value)


def test_a_missing_lexicon_is_refused(tmp_path):
    with pytest.raises(LexiconError, match="cannot read the lexicon"):
        load_lexicon(tmp_path / "absent.toml")


def test_a_malformed_shipped_lexicon_stops_the_checks_at_import(tmp_path):
    """At start: importing the checks with a bad file fails with the lexicon's error."""
    bad = _write(tmp_path, _replace_table("tens", "twenty = \"twenty\""))
    code = f"import sidecar.cache.lexicon as l, pathlib; l.LEXICON_PATH = pathlib.Path({str(bad)!r}); " \
        "import sidecar.cache.equivalence"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "LexiconError" in out.stderr and "[tens].twenty: the key must be an integer" in out.stderr


def test_an_installed_wheel_ships_the_lexicon():
    """pyproject's package data takes the file into the wheel (without it: 'cannot read')."""
    root = Path(__file__).resolve().parents[3]
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["sidecar"]
    relative = LEXICON_PATH.relative_to(root / "sidecar").as_posix()
    assert any(fnmatch.fnmatch(relative, p) for p in patterns), patterns
