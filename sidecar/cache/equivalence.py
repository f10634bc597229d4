"""Is a stored answer for one prompt a correct answer to another?  ("same question?")

A semantic-cache hit is served only when the two prompts' embeddings are close
(cosine >= threshold) *and* cheap lexical checks agree.  Sentence embeddings are
nearly blind to the details that change an answer: a number, a "not", a name,
"why" versus "how", "best" versus "worst", one extra clause.  Each check below is
a pure function of the two texts; the first that disagrees names the verdict.

Serving a wrong answer is the worst failure, so every check errs towards a miss.
The defaults and their measured effect are documented in docs/semantic-checks.md
(reproduce with scripts/tune_semantic.py).
"""

from __future__ import annotations

import re
import sys
from bisect import bisect_left
from collections import OrderedDict
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

from sidecar.cache.lexicon import lexicon
from sidecar.cache.stopwords import STOPWORDS
from sidecar.embedding.normalize import normalize_text

__all__ = ["DEFAULT_MAX_FALSE_HIT_RATE", "EquivalenceSettings", "Verdict", "Requirement", "Profile", "profile",
           "requirement", "STOPWORDS", "CHECK_ORDER", "Disagreements", "disagreements"]


# A route's target false-hit rate when it sets none (CachePolicy, the proto's Cache). 0.05 meets
# the chat goal (precision >= 0.95, recall >= 0.50) on every hand-written chat suite; on the public
# non-chat pairs its precision is below the lexical decision's (docs/semantic-quality.md, "Why the
# default is what it is"), which a route of such traffic keeps with `max_false_hit_rate: 0`.
DEFAULT_MAX_FALSE_HIT_RATE = 0.05


@dataclass(frozen=True)
class EquivalenceSettings:
    """Threshold and switches for `same_question`.

    The defaults are what scripts/tune_semantic.py picks (docs/semantic-checks.md):
    the most recall with at most 2 % false hits on every source of the labelled pairs,
    and no hit on its suite of different-question prompts.
    """

    threshold: float = 0.93
    check_numbers: bool = True
    check_negation: bool = True
    check_question_words: bool = True
    check_comparisons: bool = True
    check_entities: bool = True
    check_word_order: bool = True
    check_symbols: bool = True
    check_tense: bool = True
    check_quantifiers: bool = True
    check_content_words: bool = True
    # Case: "Is Polish hard to learn?" / "Is polish hard to learn?" (see _case_differs). Off:
    # measured on the held-out QQP half it turns 23 correct hits into misses and no wrong one
    # (docs/semantic-quality.md); the verifier reads it as a feature instead.
    check_case: bool = False
    # Content words that only one prompt has ("how do I center a div [vertically]") raise
    # the cosine needed: + extra_word_cost for each, counted on the side with more ...
    extra_word_cost: float = 0.0
    # ... and more than max_extra_words of them is a miss outright.
    max_extra_words: int = 6
    # When *both* prompts have a word the other lacks (a substitution: "install docker on
    # ubuntu" / "on windows", and every lower-cased name the entity check cannot see),
    # the cosine must clear the threshold by this much more; >= 1 means never a hit.
    # The labelled pairs reward little of these three (their label-1 pairs reword freely),
    # so the defaults are loose; extra_word_cost=0.02, max_extra_words=2,
    # substitution_margin=1.0 is the strict setting the report also measures.
    substitution_margin: float = 0.02
    # In a long prompt one changed word barely moves the mean of its token vectors (a word
    # of the context swapped in a 60-word prompt: cosine 0.95-0.999, as for a synonym), and
    # the embedding reads only its last 256 tokens.  Past this many words (either prompt),
    # every content word must match, whatever the knobs above.  40: no labelled pair is that
    # long; on chat prompts of 40-150 words it turned 5 of 7 served context swaps into misses.
    long_prompt_words: int = 40
    # A prompt of this many words or more is mostly context, which makes almost every word
    # of the other prompt "match" somewhere: its last sentence (the instruction or
    # question) must then match the other's last sentence, content word for content word.
    tail_prompt_words: int = 40
    # Longer prompts (either one, in characters) get exact hits only: the embedding reads only
    # the last 256 tokens, past 40 words every content word must match anyway, and the checks
    # run on the event loop (a 1 MB prompt's profile takes about a second there).
    max_prompt_chars: int = 4000
    # The learned verifier (sidecar/cache/verifier.py): above 0, candidates come from the
    # model's measured cosine floor instead of `threshold`, and a hit needs its score to
    # clear the threshold calibrated for this false-hit rate; the checks then act only as
    # features, except those in `verifier_vetoes` (Disagreements fields), which still say no
    # outright.  0: the threshold and every check decide, as described above.
    max_false_hit_rate: float = DEFAULT_MAX_FALSE_HIT_RATE
    # Kept by measurement with the verifier in place (docs/semantic-quality.md, "Checks as vetoes").
    verifier_vetoes: tuple[str, ...] = ("symbols",)

    def __post_init__(self) -> None:
        if not 0.0 < self.threshold <= 1.0:
            raise ValueError(f"threshold: must be in (0, 1], got {self.threshold!r}")
        for name in ("extra_word_cost", "substitution_margin"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)!r}")
        if not 0.0 <= self.max_false_hit_rate < 1.0:
            raise ValueError(f"max_false_hit_rate: must be in [0, 1), got {self.max_false_hit_rate!r}")
        unknown = set(self.verifier_vetoes) - {f for _, f, _ in CHECK_ORDER}
        if unknown:
            raise ValueError(f"verifier_vetoes: unknown checks {sorted(unknown)}")
        for name in ("max_extra_words", "long_prompt_words", "tail_prompt_words", "max_prompt_chars"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class Verdict:
    hit: bool
    reason: str  # "ok" or the check that said no, e.g. "numbers_differ"; "verifier_rejected"
    score: float | None = None   # the verifier's P(same question), when it was asked


@dataclass(frozen=True)
class Requirement:
    """The least cosine at which two prompts may share an answer, and why it is that high.

    reason: "ok" (min_cosine is the threshold), "content_differs" (raised by extra or
    swapped content words) or a check that rules the pair out (min_cosine is infinite).
    """
    min_cosine: float
    reason: str


@dataclass(frozen=True)
class Profile:
    """What the checks need to know about one prompt (see `profile`)."""

    numbers: frozenset[str]          # canonical values: "1698.02", "30000000000", "3th", "-40", "15%", "1/2"
    number_order: tuple[str, ...]    # the same, in the order written
    units: frozenset[tuple[str, str]]  # (value, unit) where a unit follows: ("30", "s"), ("100", "f"), ("9", "pm")
    suffixed: frozenset[str]         # values with letters glued on: "8a", "9pm", "30°C"
    symmetric: bool                  # has a connector under which numbers may swap: and, plus, vs, +, ...
    operators: tuple[str, ...]       # operator symbols in order, with the side(s) they touch
    negations: int                   # count of negation cues
    question_words: frozenset[str]   # interrogative classes: "what", "why", "when", ...
    comparisons: frozenset[str]      # classes of polar words: "+good" (best), "-more" (lower)
    particles: frozenset[str]        # classes of polar particles: "+on" (turn on), "-in" (log out)
    entities: frozenset[str]         # lower-cased names, acronyms, camel-case words
    letters: tuple[str, ...]         # one-letter labels, sorted: "b", "c" (option B or C), "x"
    content: frozenset[str]          # stems of the remaining content words
    directions: frozenset[tuple[str, str]]  # ("to", "fahrenheit"), ("than", "android")
    roles: tuple[str, ...]           # each token as its role: stem, number, label or person ("1" for I/me)
    tenses: frozenset[str]           # tenses of the auxiliaries: "present", "past", "future"
    quantifiers: tuple[frozenset[str], int, int, int]  # ({"all"} / {"some"}, "only"s, "and"s, "or"s)
    words: frozenset[str]            # every lower-cased word and its stem, for matching
    sorted_words: tuple[str, ...]    # the same, sorted, for prefix look-ups
    length: int                      # words, numbers left out
    capitalized: frozenset[str]      # lower-cased words written capitalised mid-sentence
    lowered: frozenset[str]          # words written all in lower case
    uses_case: bool                  # some letter is upper case
    tail: str                        # the last sentence
    identifiers: frozenset[str]      # hashes, UUIDs, order numbers: "inv20240042" (see _identifiers)


# ---------------------------------------------------------------- word tables

# Which words count is data (sidecar/cache/lexicon.toml, each table with why it is as it is);
# read and checked once, at import.
_LEX = lexicon()
_UNITS = _LEX.numbered["cardinals"]
_TENS = _LEX.numbered["tens"]
_SCALES = _LEX.numbered["scales"]
_ORDINALS = _LEX.numbered["ordinals"]
# "dozen", "percent" and "per cent" are read by _numbers.
_NUMBER_WORDS = frozenset(_UNITS) | frozenset(_TENS) | frozenset(_SCALES) | {"dozen", "percent", "per", "cent"}
_NEGATIONS = _LEX.words["negations"]
_INTERROGATIVES = _LEX.classes["interrogatives"]
_RELATIVES = _LEX.words["relatives"]
_COMPARISONS = _LEX.classes["comparisons"]
_PARTICLES = _LEX.classes["particles"]
_TENSES = _LEX.classes["tenses"]
_QUANTIFIERS = _LEX.classes["quantifiers"]
_PERSONS = _LEX.classes["persons"]
_NOT_LABELS = _LEX.words["not_labels"]
_OPPOSED_CLASSES = frozenset(frozenset(pair) for pair in _LEX.pairs["opposed_classes"])
_GRADABLE = _LEX.words["gradable"]
_STOPWORDS = STOPWORDS
_DIRECTIONS = _LEX.words["directions"]
_INFINITIVE_AFTER = _LEX.words["infinitive_after"]
_SYMMETRIC = _LEX.words["symmetric"]
_SYMMETRIC_SIGN = re.compile(r"\d\s*[+*×xX]\s*\d")
_UNITS_OF = _LEX.classes["unit_names"]
_NOT_ENTITIES = _LEX.words["not_entities"]
_NEGATING_PREFIXES = _LEX.lengths["negating_prefixes"]
_SWAPPED_PREFIXES = _LEX.pairs["swapped_prefixes"]


# ---------------------------------------------------------------- tokens

_TOKEN = re.compile(
    r"(?P<acronym>(?:[^\W\d_]\.){2,}|[^\W\d_]\.[^\W\d_](?![\w.]))"   # U.S., e.g., M.S
    r"|(?P<code>[A-Za-z]\+\+|[A-Za-z]#)"             # C++, C#
    r"|(?P<ordinal>\d+(?:st|nd|rd|th)\b)"           # 3rd
    r"|(?P<number>(?:(?<![\w.])-)?(?:\d+(?:[.,]\d+)*|(?<![\w.])\.\d+)(?:/\d+)*)"   # -40, .5, 1/2
    r"|(?P<word>[^\W\d_]+(?:['’][^\W\d_]+)*)"
    r"|(?P<percent>%)"
    r"|(?P<stop>[.!?:;]+)")


@dataclass(frozen=True)
class _Token:
    text: str        # as written (acronym dots removed)
    lower: str
    kind: str        # acronym | code | ordinal | number | word
    starts_sentence: bool
    glued: bool = False   # written right after the previous token, or after a degree sign ("9pm", "30°C")


def _tokens(normalized: str) -> list[_Token]:
    """The tokens of normalize_text's output (the text as embedded: NFKC, invisibles removed)."""
    out: list[_Token] = []
    sentence_start = True
    previous_end = None          # where the last token kept ended ("3.x": the stop breaks the glue)
    for m in _TOKEN.finditer(normalized):
        kind = m.lastgroup
        raw = m.group()
        gap = None if previous_end is None else normalized[previous_end:m.start()]
        glued = gap is not None and (gap == "" or gap.strip() in ("°", "º"))      # "30 °C" too
        if kind == "stop":
            # "Dr. Smith" does not start a sentence.
            if not (raw == "." and out and out[-1].lower in _NOT_ENTITIES):
                sentence_start = True
            continue
        if kind == "acronym":
            raw = raw.replace(".", "")
        elif kind == "percent":
            raw, kind = "percent", "word"
        raw = raw.replace("’", "'")
        out.append(_Token(raw, raw.lower(), kind, sentence_start, glued))
        previous_end = m.end()
        sentence_start = False
    return out


def _stem(word: str) -> str:
    """A crude, consistent stem: enough to match "shares"/"share", "playing"/"played"."""
    if word.endswith("'s"):
        word = word[:-2]
    if len(word) <= 3:
        return word
    if word.endswith("ies") and len(word) > 4:
        return word[:-3] + "y"
    for suffix in ("ing", "ed"):
        if word.endswith(suffix) and len(word) - len(suffix) >= 3:
            word = word[: -len(suffix)]
            if word[-1] == word[-2] and word[-1] not in "lsz":
                word = word[:-1]  # stopped -> stop
            return word.rstrip("e") if len(word) > 3 else word
    if word.endswith("s") and not word.endswith(("ss", "us", "is")):
        word = word[:-1]
    return word.rstrip("e") if len(word) > 3 else word


# ---------------------------------------------------------------- numbers

def _canonical_number(text: str, scale: int = 1) -> str:
    if re.fullmatch(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?", text):
        text = text.replace(",", "")
    try:
        value = Decimal(text)
    except InvalidOperation:
        return text  # "1.2.3", "3,5": kept verbatim
    return format((value * scale).normalize(), "f")


_LARGEST_NUMBER = 10**36


def _numbers(tokens: list[_Token]) -> list[tuple[str, int]]:
    """Digits and number words as canonical values, in order, each with the index of its
    last token: "twenty-five" == "25", "$3bn" == "3 billion", "a hundred" == "100"; a
    percent sign or word stays with its number ("15% of 80" is not "80% of 15").

    A lone "one" is skipped: it is more often a pronoun ("which one") than a count.
    """
    found: list[tuple[str, int]] = []
    total: int | None = None  # a run of number words: total + current
    current = 0
    last = 0                  # index of the run's last token

    def add(value: str, end: int) -> None:
        following = tokens[end + 1].lower if end + 1 < len(tokens) else ""
        if following == "percent" or (following == "per" and end + 2 < len(tokens)
                                       and tokens[end + 2].lower == "cent"):
            value += "%"
        found.append((value, end))

    def flush() -> None:
        nonlocal total, current
        if total is not None:
            add(str(total + current), last)
        total, current = None, 0

    for i, tok in enumerate(tokens):
        word = tok.lower
        after = tokens[i + 1].lower if i + 1 < len(tokens) else ""
        if tok.kind == "ordinal":
            flush()
            found.append((_canonical_number(word[:-2]) + "th", i))
        elif tok.kind == "number":
            flush()
            if after in _SCALES and _SCALES[after] >= 1000:
                add(_canonical_number(word, _SCALES[after]), i + 1)
            else:
                add(_canonical_number(word), i)
        elif word in _UNITS or word in _TENS:
            if word == "one" and total is None and after not in _SCALES:
                continue
            total = total or 0
            current += _UNITS.get(word, 0) + _TENS.get(word, 0)
            last = i
        elif word in _SCALES and total is not None:
            # Capped: "a hundred hundred hundred ..." would pass the 4,300 digits str() takes.
            current = min(max(current, 1) * _SCALES[word], _LARGEST_NUMBER)
            if _SCALES[word] >= 1000:
                total, current = total + current, 0
            last = i
        elif word in _SCALES and _SCALES[word] >= 100 and i and tokens[i - 1].lower in ("a", "an") \
                and len(word) > 2:   # "a hundred", "a million" (not "a k")
            total, current, last = 0, _SCALES[word], i
        elif word == "and" and total is not None:
            continue
        else:
            flush()
            if word in _ORDINALS:
                found.append((f"{_ORDINALS[word]}th", i))
            elif word == "dozen":
                found.append(("12", i))
    flush()
    return found


def _units(tokens: list[_Token], numbers: list[tuple[str, int]]
           ) -> tuple[frozenset[tuple[str, str]], frozenset[str]]:
    """(value, unit) for each number a unit follows within two tokens ("100 degrees fahrenheit"),
    or that has up to three letters glued on ("9pm", "30°C", "8a": a unit or a model's suffix);
    and the values with letters glued on."""
    units, suffixed = set(), set()
    for value, end in numbers:
        value = value.rstrip("%")
        after = tokens[end + 1] if end + 1 < len(tokens) else None
        if after is not None and after.glued and after.kind == "word" and len(after.text) <= 3:
            units.add((value, _UNITS_OF.get(after.lower, after.lower)))
            suffixed.add(value)
            continue
        for tok in tokens[end + 1:end + 3]:
            unit = _UNITS_OF.get(tok.lower)
            if unit is not None:
                units.add((value, unit))
                break
    return frozenset(units), frozenset(suffixed)


# ---------------------------------------------------------------- symbols

# Runs of anything but letters, digits, spaces, quotes, prose punctuation, backticks and
# currency signs.
_PROSE_PUNCTUATION = frozenset(".:!?;")
_SYMBOL_RUN = re.compile(r"[^\w\s'’\"“”«»¿¡，。？！、：；,–—`$€£¥]+")


def _operators(text: str) -> tuple[str, ...]:
    """Operator symbols in order ("==", "===", ">&", "**"); an increment or decrement marked
    by the side it touches ("i++" is "L++", "++i" is "++R"). Sentence punctuation after a word,
    hyphens, dots and slashes inside words (two-factor, os.path, and/or), prose dashes,
    parentheses and a percent after a number are not operators."""
    out = []
    for m in _SYMBOL_RUN.finditer(text):
        run, start, end = m.group(), m.start(), m.end()
        before = text[start - 1] if start else " "
        after = text[end] if end < len(text) else " "
        if before.isalnum() and after.isspace():
            run = run.rstrip(".:!?;")
        if set(run) <= _PROSE_PUNCTUATION and not after.isalnum() and (
                not before.isspace() or not text[end:].strip()):     # '"is"?', "e.g.,", "Python ?" at the end
            continue
        if not run or run in ("(", ")", "()") or (run == "%" and before.isdigit()):
            continue
        if run in ("-", ".", "/") and before.isalnum() and after.isalnum():
            continue
        if run in ("-", "--", "...") and before.isspace() and after.isspace():
            continue
        if run in ("++", "--"):         # "i++" is not "++i"; elsewhere spacing is free ("2+2")
            run = ("L" if before.isalnum() else "") + run + ("R" if after.isalnum() else "")
        out.append(run)
    return tuple(out)


# ---------------------------------------------------------------- profile

def _is_entity(tok: _Token) -> bool:
    if tok.kind == "code":
        return True
    if tok.kind not in ("word", "acronym") or tok.lower in _NOT_ENTITIES or len(tok.text) < 2:
        return False
    if tok.lower in _STOPWORDS or tok.lower in _INTERROGATIVES:
        return False
    inner_caps = any(c.isupper() for c in tok.text[1:])  # NASA, iPhone, LendingTree
    return inner_caps or (tok.text[0].isupper() and not tok.starts_sentence)


def _is_label(tok: _Token) -> bool:
    """A one-letter label: option B, size M, solve for x; not "a", "I", nor a unit ("9am")."""
    return (tok.kind == "word" and len(tok.text) == 1 and tok.text.isascii() and not tok.glued
            and tok.text not in _NOT_LABELS and not tok.starts_sentence)


def _capitalized(tokens: list[_Token]) -> frozenset[str]:
    """Words capitalised mid-sentence, as names are; none in a Title Case Prompt."""
    words = [t for t in tokens if t.kind == "word" and len(t.text) > 1]
    found = [t for t in words if not t.starts_sentence and t.text[:1].isupper() and t.text[1:].islower()]
    return frozenset() if 2 * len(found) > len(words) else frozenset(t.lower for t in found)


def _roles(tokens: list[_Token]) -> tuple[str, ...]:
    """Every token as what fills its role: a pronoun by person ("I" and "me" are one), a
    number or label as written, marked ("=A": no article, "=s": no stopword), a word by its stem."""
    return tuple(_PERSONS.get(t.lower) or ("=" + t.text if t.kind in ("number", "ordinal") or _is_label(t)
                                           else _stem(t.lower)) for t in tokens)


_SENTENCE_END = re.compile(r"(?<=[.!?:。？！])\s+|\n+")


# Profiles of prompts up to this long are cached, as stored prompts recur, within a byte bound
# (the cache budget's share, sidecar/cache/budget.py; least recently used first). A profile is
# charged PROFILE_BYTES and PROFILE_BYTES_PER_CHAR a character of its text: measured with
# tracemalloc, a 4,000-character English prompt's takes ~170 KB, a 300-character one ~13 KB;
# texts in other scripts take less. Longer texts (the checks see none with the default
# max_prompt_chars) are profiled each time.
CACHED_PROFILE_CHARS = 4000
PROFILE_CACHE_BYTES = 16 * 2**20
PROFILE_BYTES = 4_000
PROFILE_BYTES_PER_CHAR = 44


# An opaque identifier: a hash, UUID, order, ticket or tracking number, SKU.  Word pieces of
# such a token carry no meaning to the embedding, and the verifier never saw one in training:
# "no trace 079eeded81ce…" / "trace me 607016e4b05c…" scored 0.90, a hit.
# A token with a digit in it, of Latin letters and digits: scripts written without spaces
# (Chinese, Japanese) would make a whole clause with a year in it one token.
_DIGIT_TOKEN = re.compile(r"(?<![A-Za-z\d_-])[A-Za-z\d_-]*?\d[A-Za-z\d_-]*")
_NOT_ALNUM = re.compile(r"[\W_]+")
_QUANTITY = re.compile(r"\d+[^\W\d_]+")      # a number and its unit, glued: 26years, 2000inr, 512mb


def _identifiers(text: str) -> list[str]:
    """The prompt's identifiers, case-folded and without separators: tokens of six or more Latin
    letters and digits with a run that mixes letters and two digits ("4c19841f", "A12345X",
    "rtx4090", but not a number glued to its unit, "2000inr"), a run of six digits, or two
    runs of digits ("INV-2024-0042").  "12-hour", "COVID-19" and "10-year-old" are words."""
    found = []
    for token in _DIGIT_TOKEN.findall(text):
        key = _NOT_ALNUM.sub("", token).casefold()
        if len(key) < 6:
            continue
        runs = [run for run in _NOT_ALNUM.split(token) if run]
        digits = [sum(c.isdigit() for c in run) for run in runs]
        mixed = [d >= 2 and d < len(run) and not _QUANTITY.fullmatch(run) for d, run in zip(digits, runs)]
        if any(mixed) or max(digits) >= 6 or sum(d > 0 for d in digits) >= 2:
            found.append(key)
    return found


def profile(text: str) -> Profile:
    """Everything the checks need from one prompt (cached when it is short)."""
    return _profiles.get(text) if len(text) <= CACHED_PROFILE_CHARS else _profile(text)


def forget_profiles(max_bytes: int | None = PROFILE_CACHE_BYTES) -> None:
    """Empty the profile cache and give it `max_bytes` (None: no bound; scripts/tune_semantic.py
    profiles every labelled prompt many times over)."""
    global _profiles
    _profiles = _ProfileCache(max_bytes)


def cached_profile_bytes() -> int:
    """What the profile cache holds now, as charged against its bound."""
    return _profiles.nbytes


class _ProfileCache:
    def __init__(self, max_bytes: int | None) -> None:
        self._max_bytes = max_bytes
        self._held: OrderedDict[str, tuple[Profile, int]] = OrderedDict()   # least recent first
        self.nbytes = 0

    def get(self, text: str) -> Profile:
        found = self._held.get(text)
        if found is not None:
            self._held.move_to_end(text)
            return found[0]
        made = _profile(text)
        cost = PROFILE_BYTES + PROFILE_BYTES_PER_CHAR * len(text) + _identifier_bytes(made.identifiers)
        if self._max_bytes is None or cost <= self._max_bytes:
            self._held[text] = (made, cost)
            self.nbytes += cost
            while self._max_bytes is not None and self.nbytes > self._max_bytes:
                self.nbytes -= self._held.popitem(last=False)[1][1]
        return made

    def __len__(self) -> int:
        return len(self._held)


def _identifier_bytes(identifiers: frozenset[str]) -> int:
    """What a profile's identifiers take, charged besides PROFILE_BYTES_PER_CHAR (measured on
    prose): a text of order numbers or hashes holds hundreds, ~110 bytes each."""
    return sys.getsizeof(identifiers) + sum(map(sys.getsizeof, identifiers)) if identifiers else 0


def _profile(text: str) -> Profile:
    normalized = normalize_text(text)
    tokens = _tokens(normalized)
    words = [t.lower for t in tokens if t.kind not in ("number", "ordinal")]
    questions = set()
    for i, tok in enumerate(tokens):
        word = tok.lower
        if word == "qué" and i and tokens[i - 1].lower == "por":
            word = "por qué"
        if word in _INTERROGATIVES and (word not in _RELATIVES or tok.starts_sentence
                                        or (i and tokens[i - 1].lower in ("and", "or"))):
            questions.add(_INTERROGATIVES[word])
    entities = frozenset(t.lower for t in tokens if not t.text.islower() and _is_entity(t))
    directions = set()
    for i, tok in enumerate(tokens):
        if tok.lower in _DIRECTIONS and not (tok.lower == "to" and i and tokens[i - 1].lower in _INFINITIVE_AFTER):
            # Not stemmed: the stem of "https" is "http".
            follower = next((t.lower for t in tokens[i + 1:i + 4] if t.lower not in _STOPWORDS), None)
            if follower:
                directions.add((tok.lower, follower))
    stems = {w: _stem(w) for w in set(words)}
    content = frozenset(
        stem for w, stem in stems.items()
        if w not in _STOPWORDS and w not in _NEGATIONS and w not in _NUMBER_WORDS
        and w not in _ORDINALS and w not in _COMPARISONS and w not in entities
        and not w.endswith("n't") and len(w) > 1)
    all_words = frozenset(stems) | frozenset(stems.values())
    numbers = _numbers(tokens)
    units, suffixed = _units(tokens, numbers)
    sentences = [part for part in _SENTENCE_END.split(normalized.strip()) if part.strip()]
    letters = [t.lower for t in tokens if _is_label(t)]
    return Profile(
        numbers=frozenset(value for value, _ in numbers),
        number_order=tuple(value for value, _ in numbers),
        units=units,
        suffixed=suffixed,
        symmetric=bool(_SYMMETRIC.intersection(words)) or bool(_SYMMETRIC_SIGN.search(normalized)),
        operators=_operators(normalized),
        negations=sum(1 for w in words if w in _NEGATIONS or w.endswith("n't")),
        question_words=frozenset(questions),
        comparisons=frozenset(_COMPARISONS[w] for w in stems if w in _COMPARISONS),
        particles=frozenset((_stem(tokens[i - 1].lower), _PARTICLES[t.lower])
                            for i, t in enumerate(tokens) if i and t.lower in _PARTICLES),
        entities=entities,
        letters=tuple(sorted(letters)),
        content=content,
        directions=frozenset(directions),
        roles=_roles(tokens),
        tenses=frozenset(_TENSES[t.lower] for i, t in enumerate(tokens) if t.lower in _TENSES
                         and not (t.lower == "am" and i and tokens[i - 1].kind == "number")),   # "9 am"
        quantifiers=(frozenset(_QUANTIFIERS[w] for w in words if w in _QUANTIFIERS), words.count("only"),
                     words.count("and"), words.count("or")),
        words=all_words,
        sorted_words=tuple(sorted(all_words)),
        length=len(words),
        capitalized=_capitalized(tokens),
        lowered=frozenset(t.lower for t in tokens if t.kind == "word" and t.text.islower()),
        uses_case=normalized != normalized.lower(),
        tail=sentences[-1] if sentences else normalized,
        identifiers=frozenset(_identifiers(text)),
    )


_profiles = _ProfileCache(PROFILE_CACHE_BYTES)


# ---------------------------------------------------------------- the checks

_LONGEST_PREFIX = 40


def _matches(word: str, other: Profile) -> bool:
    """Same word, same stem, or one stem a prefix of the other ("Afghan"/"Afghanistan")."""
    stem = _stem(word)
    if word in other.words or stem in other.words:
        return True
    if len(stem) < 4:
        return False
    # A longer word of the other's that starts with this stem ...
    i = bisect_left(other.sorted_words, stem)
    if i < len(other.sorted_words) and other.sorted_words[i].startswith(stem):
        return True
    # ... or a word of the other's (4 to _LONGEST_PREFIX letters) that this stem starts with;
    # bounded, as a 1 MB "word" would otherwise take minutes.
    return any(stem[:n] in other.words for n in range(4, min(len(stem), _LONGEST_PREFIX)))


def _unmatched(mine: frozenset[str], other: Profile) -> int:
    return sum(1 for w in mine if not _matches(w, other))


def _swapped(a: Profile, b: Profile) -> bool:
    """The same words in other roles: "celsius to fahrenheit" / "fahrenheit to celsius"."""
    for prep, word in a.directions - b.directions:
        if word in b.words and any(p == prep and w in a.words and w != word
                                   for p, w in b.directions - a.directions):
            return True
    return False


def _numbers_differ(a: Profile, b: Profile) -> bool:
    """Other values, the same values in another order (unless both prompts join them
    symmetrically: "3 + 5", "3 and 5"), or one value with other units."""
    if a.numbers != b.numbers:
        return True
    if a.number_order != b.number_order and not (a.symmetric and b.symmetric):
        return True
    units_a, units_b = dict(a.units), dict(b.units)
    if any(units_b.get(value, unit) != unit for value, unit in units_a.items()):
        return True
    # Letters glued on one side only: "Pixel 8" / "Pixel 8a", "at 9" / "at 9pm".
    return any(value not in units_b for value in a.suffixed) or any(value not in units_a for value in b.suffixed)


def _prefix_opposite_in(word: str, others: set[str]) -> bool:
    """`others` holds `word` negated by a prefix (able/unable, aktivieren/deaktivieren), or
    `word` with its prefix swapped (encrypt/decrypt); the prefixes are the lexicon's."""
    for prefix, shortest in _NEGATING_PREFIXES.items():
        if len(word) >= shortest and (prefix + word in others or f"{prefix}-{word}" in others):
            return True
    for p, q in _SWAPPED_PREFIXES:
        for mine, theirs in ((p, q), (q, p)):
            if word.startswith(mine) and len(word) - len(mine) >= 4 and theirs + word[len(mine):] in others:
                return True
    return False


def _only_in(mine: Profile, other: Profile) -> frozenset[str]:
    """Content words of `mine` that match no word of `other`."""
    return frozenset(w for w in mine.content if not _matches(w, other))


def _opposed_words(only_a: frozenset[str], only_b: frozenset[str]) -> bool:
    """A word only one prompt has is the opposite by prefix of one only the other has."""
    return any(_prefix_opposite_in(x, only_b) for x in only_a) or any(_prefix_opposite_in(y, only_a) for y in only_b)


def _compared_differently(a: Profile, b: Profile) -> bool:
    """Each prompt has a polar word the other lacks, and the two are a word and its opposite
    ("left"/"right"), or both gradable ("fastest"/"cheapest" ask different things; "open"/
    "read" a file, "drop"/"remove" a column ask one)."""
    only_a = a.comparisons - b.comparisons
    only_b = b.comparisons - a.comparisons if only_a else ()
    return any(x[1:] == y[1:] or (x[1:] in _GRADABLE and y[1:] in _GRADABLE)
               or frozenset((x, y)) in _OPPOSED_CLASSES for x in only_a for y in only_b)


def _particles_opposed(a: Profile, b: Profile) -> bool:
    """After the same word, a particle in one and its opposite in the other ("turn on" /
    "turn off"), neither having both."""
    only_b = b.particles - a.particles
    return any((word, ("-" if cls[0] == "+" else "+") + cls[1:]) in only_b for word, cls in a.particles - b.particles)


def _roles_exchanged(a: Profile, b: Profile) -> bool:
    """One prompt is the other with two words, numbers, labels or persons exchanged, all else
    equal: "baking soda instead of baking powder" reversed, "copy column A to column B" /
    "column B to column A", "bite me when I pet her" / "bite her when she pets me". Not two
    neighbours ("local git branch" / "git local branch"), nor two with only small words between
    them ("a fruit or a vegetable", "3 plus 5", "compare Python with Java") or joined with the
    words before the first repeated ("python 2 and python 3"); "the sky is blue and the grass
    green" has another word between. A rewording that moves words otherwise ("email finding
    tools" / "tools for finding email") is no exchange."""
    roles_a, roles_b = a.roles, b.roles
    if len(roles_a) != len(roles_b) or roles_a == roles_b:
        return False
    moved = [i for i, (x, y) in enumerate(zip(roles_a, roles_b)) if x != y]
    x, y = roles_a[moved[0]], roles_b[moved[0]]
    if moved[-1] - moved[0] < 2 or x in _STOPWORDS or y in _STOPWORDS:
        return False
    if any(roles_b[i] != {x: y, y: x}.get(roles_a[i]) for i in moved):
        return False
    between = roles_a[moved[0] + 1:moved[-1]]
    words_between = [r for r in between if r not in _STOPWORDS and r not in _SYMMETRIC]
    if not words_between:
        return False
    # "python 2 and python 3": joined, with the words before the first repeated after "and".
    head = [r for r in roles_a[:moved[0]] if r not in _STOPWORDS and r not in _SYMMETRIC][-len(words_between):]
    return not (any(r in _SYMMETRIC for r in between) and words_between == head)


def _quantified_differently(a: Profile, b: Profile) -> bool:
    """"all" for "some", "only" added, or "and" traded for "or" ("x > 0 and y > 0")."""
    (class_a, only_a, and_a, or_a), (class_b, only_b, and_b, or_b) = a.quantifiers, b.quantifiers
    return bool(class_a and class_b and class_a != class_b) or only_a != only_b \
        or (and_a - and_b) * (or_a - or_b) < 0


def _flipped(a: Profile, b: Profile) -> bool:
    """The same thing after "to" in one and "from" in the other ("translate to Spanish")."""
    for prep, word in a.directions - b.directions:
        if prep in ("to", "into") and ("from", word) in b.directions:
            return True
        if prep == "from" and (("to", word) in b.directions or ("into", word) in b.directions):
            return True
    return False


def _identifiers_differ(a_text: str, a: Profile, b_text: str, b: Profile) -> bool:
    """One prompt names an identifier the other does not: an answer about one order, commit or
    ticket is wrong for another.  Compared without case and separators, so "SHA-256" / "sha256"
    and "RTX 4090" / "RTX4090" agree."""
    if not a.identifiers and not b.identifiers:
        return False
    flat_a, flat_b = _NOT_ALNUM.sub("", a_text).casefold(), _NOT_ALNUM.sub("", b_text).casefold()
    return any(key not in flat_b for key in a.identifiers) or any(key not in flat_a for key in b.identifiers)


def _tail_differs(a: Profile, b: Profile) -> bool:
    """The last sentences (the instruction after a long context) differ in a content word."""
    last_a, last_b = profile(a.tail), profile(b.tail)
    return _unmatched(last_a.content, last_b) > 0 or _unmatched(last_b.content, last_a) > 0


@dataclass(frozen=True)
class Disagreements:
    """What each check finds about a pair, all of them (the verifier's features; `requirement`
    reads them in order).  Counts are content words (and polar-word classes) only one side has."""
    numbers: bool
    negation: bool
    question_word: bool
    comparison: bool
    entities: bool
    order: bool
    symbols: bool
    tense: bool
    quantifiers: bool
    case: bool
    tail: bool
    extra_a: int
    extra_b: int
    length: int          # words of the longer prompt
    # Never a hit, whatever the decision (not a switch: the embedding and the verifier cannot
    # read identifiers; see _identifiers).
    identifiers: bool


# (check switch, Disagreements field, reason), in the order `requirement` asks them.
CHECK_ORDER = (
    ("check_numbers", "numbers", "numbers_differ"),
    ("check_negation", "negation", "negation_differs"),
    ("check_question_words", "question_word", "question_word_differs"),
    ("check_comparisons", "comparison", "comparison_differs"),
    ("check_entities", "entities", "entities_differ"),
    ("check_case", "case", "case_differs"),
    ("check_word_order", "order", "order_differs"),
    ("check_symbols", "symbols", "symbols_differ"),
    ("check_tense", "tense", "tense_differs"),
    ("check_quantifiers", "quantifiers", "quantifiers_differ"),
)


def _case_differs(a: Profile, b: Profile) -> bool:
    """A word written as a name mid-sentence in one prompt ("Is Polish hard") and in lower case
    in the other ("Is polish hard"), when that other prompt uses capitals at all: the model
    reads both in lower case, so only this tells a name from a word.  A prompt typed all in
    lower case says nothing about names."""
    return bool((a.capitalized & b.lowered and b.uses_case) or (b.capitalized & a.lowered and a.uses_case))


def disagreements(a_text: str, b_text: str, tail_words: int = 40) -> Disagreements:
    """Every check's finding on the pair (pure, symmetric but for extra_a / extra_b); the
    last sentences are compared once a prompt has `tail_words` words."""
    a, b = profile(a_text), profile(b_text)
    only_a, only_b = _only_in(a, b), _only_in(b, a)
    length = max(a.length, b.length)
    return Disagreements(
        numbers=_numbers_differ(a, b),
        negation=a.negations != b.negations,
        question_word=bool(a.question_words and b.question_words and a.question_words != b.question_words),
        comparison=(_compared_differently(a, b) or _opposed_words(only_a, only_b)
                    or _particles_opposed(a, b) or _particles_opposed(b, a)),
        entities=bool(_unmatched(a.entities, b) or _unmatched(b.entities, a) or a.letters != b.letters),
        order=_swapped(a, b) or _swapped(b, a) or _flipped(a, b) or _flipped(b, a) or _roles_exchanged(a, b),
        symbols=bool(a.operators and b.operators and a.operators != b.operators),
        tense=bool(a.tenses and b.tenses and not a.tenses & b.tenses),
        quantifiers=_quantified_differently(a, b),
        case=_case_differs(a, b),
        tail=length >= tail_words and _tail_differs(a, b),
        extra_a=len(only_a) + len(a.comparisons - b.comparisons),
        extra_b=len(only_b) + len(b.comparisons - a.comparisons),
        length=length,
        identifiers=_identifiers_differ(a_text, a, b_text, b),
    )


def requirement(a_text: str, b_text: str, settings: EquivalenceSettings) -> Requirement:
    """The least cosine at which the answer for one prompt may serve the other.

    Pure and symmetric.  `same_question` is this compared with the embeddings' cosine;
    it is public so that a threshold sweep need not re-run the checks.
    """
    never = float("inf")
    if max(len(a_text), len(b_text)) > settings.max_prompt_chars:
        return Requirement(never, "too_long")
    found = disagreements(a_text, b_text, settings.tail_prompt_words)
    if found.identifiers:
        return Requirement(never, "identifiers_differ")
    for switch, field_name, reason in CHECK_ORDER:
        if getattr(settings, switch) and getattr(found, field_name):
            return Requirement(never, reason)
    if settings.check_content_words:
        extra_a, extra_b = found.extra_a, found.extra_b
        long = found.length > settings.long_prompt_words
        if max(extra_a, extra_b) > (0 if long else settings.max_extra_words):
            return Requirement(never, "content_differs")
        if found.tail:
            return Requirement(never, "content_differs")
        raise_by = settings.extra_word_cost * max(extra_a, extra_b)
        if extra_a and extra_b:
            raise_by += settings.substitution_margin
        if raise_by > 0:
            return Requirement(settings.threshold + raise_by, "content_differs")
    return Requirement(settings.threshold, "ok")
