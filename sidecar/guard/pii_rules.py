"""sidecar/guard/pii_rules.toml, loaded: the providers' token shapes and credential names that
secrets.py matches, and the words around four dotted numbers that tell pii.py's IPv4 detector a
version or a section number from an address."""
from __future__ import annotations

import functools
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

import ahocorasick_rs

# What joins the words of a credential's name ("API key", "api_key", "api-key": "apikey").
JOINERS = str.maketrans("", "", " _-")


@dataclass(frozen=True)
class SecretRule:
    provider: str
    pattern: re.Pattern
    before: re.Pattern | None = None
    near: re.Pattern | None = None
    whole_field: bool = False
    mixed: bool = True                     # a `near` rule's body must mix cases and digits


_WORDS = re.compile(r"\w+")
# A word (of any script: मोबाइल's vowel signs are not \w) and the point of its abbreviation
# (tel., ref.); a CJK run is one word, so its last characters are read apart too.
_CONTEXT_WORDS = re.compile(r"[^\s\d.,;:!?()\[\]{}\"'“”‘’«»「」、。，：；！？+/=<>*-]+\.?")
# Scripts written without spaces between words (Thai, Lao, Myanmar, Khmer, CJK, kana, Hangul):
# only a word with one of their characters is read by its last characters (a Latin word's last
# letters are no word of their own: Ärztin does not end in the word "tin").
_RUN_TOGETHER = re.compile("[\u0e00-\u0eff\u1000-\u109f\u1780-\u17ff\u2e80-\u9fff\ua960-\ua97f"
                           "\uac00-\ud7af\uf900-\ufaff\uff66-\uffdc]")


def _copulas(copulas: list[str]) -> str:
    """The copulas as one pattern. A copula that is a word stands apart ("is", not the end of
    "this"; 是 and は after a space: written against the name they begin most questions about
    passwords, 密码是否需要...); a sign (":") is written against the name (Lösenord: ...). The
    words share one lookbehind: tried once per position, not once per word."""
    ordered = sorted(copulas, key=len, reverse=True)
    words = "|".join(re.escape(c) for c in ordered if c[-1].isalnum())
    signs = "|".join(re.escape(c) for c in ordered if not c[-1].isalnum())
    return "|".join(([r"(?<!\w)(?:%s)(?![\w-])" % words] if words else []) + ([signs] if signs else []))


def _stated(copulas: list[str]) -> re.Pattern:
    """After a stated credential's name: the rest of its word, up to three short words, a
    copula, then an app password (group 1) or a value (group 2); or, right after the name,
    an app password (group 3). An app password is four groups of four lowercase letters."""
    copula = _copulas(copulas)
    app = r"([a-z]{4}(?: [a-z]{4}){3})(?!\w)"
    return re.compile(r"[\w-]{0,8}(?:(?:[ \t]+[\w-]{1,5}){0,3}?[ \t]*(?:%s)[ \t]*[:\uff1a]?[ \t]*[\"'`]?"
                      r"(?:%s|([^\s\"'`<>,;(){}\[\]]{8,64})(?<![.?!:]))|[ \t]+%s)" % (copula, app, app))


@dataclass(frozen=True)
class PiiRules:
    """sidecar/guard/pii_rules.toml: the providers' token shapes, credential names, and the
    words that make four dotted numbers a version or a section number."""
    secret: tuple[SecretRule, ...]
    known: re.Pattern                      # the rules without `near` or `before`, one group each (r<index>)
    near: tuple[tuple[int, SecretRule], ...]
    before: tuple[SecretRule, ...]
    assignment_names: re.Pattern           # the keys reversed, case-folded, as one pattern
    assignment_min_length: int
    named: tuple[str, ...]                 # credential names a token may follow without a sign
    ip_window: int
    ip_not_after: tuple[str, ...]
    ip_not_before: tuple[str, ...]
    ip_address_words: frozenset[str]
    public_after: tuple[str, ...]
    public_prefix: tuple[str, ...]
    placeholder: re.Pattern                # a run of equal characters
    stated_names: tuple[str, ...]
    stated: re.Pattern                     # what follows a stated name: fillers, a copula, the value
    card: tuple[tuple[re.Pattern, frozenset[int]], ...]      # issuer prefix, lengths
    phone_window: int
    phone_words: frozenset[str]
    phone_not_after: frozenset[str]
    phone_neutral: frozenset[str]
    phone_context_regions: tuple[str, ...]

    @classmethod
    def load(cls, path: Path) -> "PiiRules":
        """The rules of `path`; a missing or malformed entry is a ValueError naming the file and
        the entry, raised at load (at import, for the shipped file), not on a request."""
        try:
            with path.open("rb") as handle:
                return cls._of(tomllib.load(handle))
        except (KeyError, TypeError, ValueError, re.error) as exc:
            raise ValueError(f"{path}: invalid personal-data rules: {exc!r}") from exc

    @classmethod
    def _of(cls, data: dict) -> "PiiRules":
        repeated = int(data["placeholder"]["repeated"])
        if repeated < 2:             # one character "repeated" would make every token a placeholder
            raise ValueError(f"[placeholder] repeated must be 2 or more, not {repeated}")
        rules = tuple(SecretRule(r["provider"], re.compile(r["pattern"]),
                                 re.compile(r["before"] + r"\Z") if "before" in r else None,
                                 re.compile(r["near"]) if "near" in r else None, bool(r.get("whole_field")),
                                 bool(r.get("mixed", True)))
                      for r in data["secret"])
        known = "|".join(f"(?P<r{i}>{rule.pattern.pattern})" for i, rule in enumerate(rules)
                         if rule.near is None and rule.before is None)
        return cls(rules, re.compile(f"(?<![A-Za-z0-9_-])(?:{known})(?![A-Za-z0-9_-])"),
                   tuple((i, rule) for i, rule in enumerate(rules) if rule.near is not None),
                   tuple(rule for rule in rules if rule.before is not None),
                   re.compile("|".join(re.escape(k[::-1]) for k in data["assignment"]["keys"]), re.IGNORECASE),
                   int(data["assignment"]["min_length"]),
                   tuple(w.lower().translate(JOINERS) for w in data["named"]["names"]),
                   int(data["ip"]["window"]), tuple(w.lower() for w in data["ip"]["not_after"]),
                   tuple(data["ip"]["not_before"]), frozenset(w.lower() for w in data["ip"]["address_words"]),
                   tuple(w.lower() for w in data["public"]["after"]), tuple(w.lower() for w in data["public"]["prefix"]),
                   re.compile(r"(.)\1{%d}" % (repeated - 1)),
                   tuple(w.lower() for w in data["stated"]["names"]), _stated(data["stated"]["copulas"]),
                   tuple((re.compile(c["prefix"]), frozenset(c["lengths"])) for c in data["card"]),
                   int(data["phone"]["window"]), frozenset(w.lower() for w in data["phone"]["words"]),
                   frozenset(w.lower() for w in data["phone"]["not_after"]), frozenset(w.lower() for w in data["phone"]["neutral"]),
                   tuple(data["phone"]["context_regions"]))

    def phone_context(self, text: str, start: int) -> int | None:
        """What the words before text[start:] say of it: 0, an id's number (an id's word
        nearest, neutral words skipped); 2, a phone number (a phone word among the three
        nearest); 1, perhaps one (a phone word further back in the window); None, nothing."""
        seen = 0
        for word in reversed(_CONTEXT_WORDS.findall(text[max(0, start - self.phone_window):start].lower())):
            # CJK text runs its words together (加我QQ, 我的电话): there its last characters count.
            forms = {word} if word.isascii() or not _RUN_TOGETHER.search(word) else {word, *(word[-k:] for k in range(1, min(len(word), 5)))}
            if forms & self.phone_neutral:
                continue
            if not seen and (forms & self.phone_not_after or self._compound(word, self.phone_not_after)):
                return 0
            if forms & self.phone_words or self._compound(word, self.phone_words):
                return 2 if seen < 3 else 1
            seen += 1
        return None

    def version_like(self, text: str, start: int, end: int) -> bool | None:
        """Whether a context word stands just before text[start:end] ("version 1.2.3.4") or just
        after it ("4.2.1.3章"): True; False where an address word decides ("the IP of the build
        server is 10.2.0.1"); None where no word of either list is near."""
        if text[end:end + 3].lstrip().startswith(self.ip_not_before):
            return True
        before = text[max(0, start - self.ip_window):start].lower().rstrip(" \t:#=(\"'")
        # A plural stands for its word ("versions 1.2.3.4 and earlier").
        for candidate in (before, before[:-1]) if before.endswith("s") else (before,):
            for word in self._not_after_by_last.get(candidate[-1:], ()):
                if candidate.endswith(word):
                    head = candidate[:-len(word)]
                    # A word of letters stands on its own (not "item" in "system").
                    if not (word[0].isalpha() and head and head[-1].isalpha()):
                        return True
        words = _WORDS.findall(before)[-4:]
        for word in words[-1:]:               # the nearest word: an address word, or a compound just before
            if word in self.ip_address_words or word.endswith("s") and word[:-1] in self.ip_address_words:
                return False
            if before.endswith(word) and self._compound(word, self._not_after_words):
                return True                   # Versionsnummer 8.0.1.2
        for word in reversed(words[:-1]):
            for form in (word, word[:-1]) if word.endswith("s") else (word,):
                if form in self.ip_address_words:
                    return False
                if form in self._not_after_words or self._compound(form, self._not_after_words):
                    return True
        return None

    def _compound(self, word: str, heads: frozenset[str]) -> bool:
        """A word of `heads` joined to a neutral one, as German, Dutch and the Nordic languages
        write them, with a linking s or a dash: Rechnungsnummer, Telefonnummer, Versionsnummer,
        Build-Nummer."""
        if not word.endswith(self._compound_tails):
            return False                     # one C call for most words
        for neutral in self._compound_tails:
            if len(word) > len(neutral) + 2 and word.endswith(neutral):
                head = word[:-len(neutral)].rstrip("-")
                if head in heads or head.endswith("s") and head[:-1] in heads:
                    return True
        return False

    @functools.cached_property
    def stated_automaton(self) -> ahocorasick_rs.AhoCorasick:
        """The stated names in one automaton: the text is read once for all of them, not once
        per name."""
        return ahocorasick_rs.AhoCorasick(self.stated_names)

    @functools.cached_property
    def _compound_tails(self) -> tuple[str, ...]:
        return tuple(w for w in self.phone_neutral if len(w) >= 4)

    @functools.cached_property
    def _not_after_by_last(self) -> dict[str, tuple[str, ...]]:
        """The not_after words by their last character: only those can end the text before an
        address (one dictionary lookup, not a comparison with each word, per address)."""
        by_last: dict[str, tuple[str, ...]] = {}
        for word in self.ip_not_after:
            by_last[word[-1:]] = by_last.get(word[-1:], ()) + (word,)
        return by_last

    @functools.cached_property
    def _not_after_words(self) -> frozenset[str]:
        return frozenset(w for w in self.ip_not_after if w.isalpha())


RULES = PiiRules.load(Path(__file__).with_name("pii_rules.toml"))
