"""Secret detectors: API keys and tokens by their provider's prefix or shape (the rules of
pii_rules.toml), unprefixed tokens by character entropy, values assigned to credential names,
passwords in URLs. pii.py runs them as its `secret` detector."""
from __future__ import annotations

import base64
import math
import re
from collections import Counter
from typing import Iterable

from sidecar.guard.pii_rules import JOINERS, RULES, PiiRules
from sidecar.guard.spans import Span, matches

# Any long run of token characters that names no provider; kept only when its characters look random.
_TOKEN = re.compile(r"[A-Za-z0-9+/_-](?<![A-Za-z0-9+/=_-].)[A-Za-z0-9+/_-]{31,99}={0,2}(?![A-Za-z0-9+/=_-])")
_LONGEST_TOKEN = 102         # _TOKEN's 100 characters and two of padding
_TOKEN_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")
DEFAULT_MIN_ENTROPY = 4.3   # bits per character; chosen on the dev split (reports/guard.json)


def entropy(value: str) -> float:
    counts = Counter(value)
    n = len(value)
    return -sum(c / n * math.log2(c / n) for c in counts.values())


def _mixed(token: str) -> bool:
    """Hex (hashes, UUIDs) and one-case runs are ids, not credentials; a key mixes cases and digits."""
    return any(c.islower() for c in token) and any(c.isupper() for c in token) and any(c.isdigit() for c in token)


# Every secret lies in a run of token characters of 20 or more: the patterns above run only
# inside such runs, rare in prose, instead of at every position of the text. (The lookbehind
# starts a run only at its first character: a plain [...]{20,} reads each shorter word again
# from each of its characters.)
RUN_CHARS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.+/=-"
MIN_RUN = 20
_RUN_CLASS = "[" + re.escape(RUN_CHARS) + "]"
_RUN = re.compile(f"{_RUN_CLASS}(?<!{_RUN_CLASS}.){_RUN_CLASS}{{{MIN_RUN - 1},}}")


def find(text: str, runs: list[tuple[int, int]], min_entropy: float) -> Iterable[Span]:
    """Secrets in `text`, whose runs of 20 or more token characters are `runs` (pii.Candidates)."""
    rules = RULES
    public = None                            # PEM blocks other than private keys
    near = None                              # whether each `near` rule's pattern is in the text
    for run in matches(_RUN, text, runs):
        # A full stop after a token ends the sentence, not the token (no token shape ends in one).
        value, offset = run.group().rstrip("."), run.start()
        known = []
        for m in rules.known.finditer(value):
            if rules.placeholder.search(m.group()):
                continue                     # sk-xxxxxxxx...: a placeholder in a README
            start, end = offset + m.start(), offset + m.end()
            if rules.secret[int(m.lastgroup[1:])].whole_field:
                start, end = _field(text, start, end)
            known.append((start, end))
        for rule in rules.before:                 # the run starts where its head ends
            head = rule.before.search(text, max(0, offset - 24), offset)
            m = rule.pattern.fullmatch(value) if head is not None else None
            if m is not None and _mixed(value):   # a generic body: only a random-looking one
                known.append((head.start(), offset + m.end()))
        for index, rule in rules.near:
            for m in rule.pattern.finditer(value):
                if _bounded(value, m.start(), m.end()) and (_mixed(m.group()) or not rule.mixed):
                    if near is None:         # `near` read once per text, and only for a candidate
                        near = {}
                    if index not in near:
                        near[index] = rule.near.search(text) is not None
                    if near[index]:
                        known.append((offset + m.start(), offset + m.end()))
        for start, end in known:
            yield Span("secret", start, end)
        if not known and _named(text, offset, value, rules):
            yield Span("secret", offset, offset + len(value))
            continue
        if public is None:
            public = _public_blocks(text)
        if (any(a <= offset < b for a, b in public) or text[max(0, offset - 28):offset].lower().endswith(rules.public_after)
                or value[:8].lower().startswith(rules.public_prefix)):
            continue                         # a certificate's lines, an image, an SSH public key
        if len(value) > _LONGEST_TOKEN and not known and _holds_secret(_encoded_words(value), min_entropy):
            yield Span("secret", offset, offset + len(value))     # longer base64 of text: read as the shorter
            continue
        for m in _TOKEN.finditer(value):
            token = m.group()
            if any(s < offset + m.end() and offset + m.start() < e for s, e in known) or not _mixed(token):
                continue
            score = entropy(token)
            if score < min_entropy or _words_or_path(token):
                continue
            words = _encoded_words(token)
            if words is None or _holds_secret(words, min_entropy):
                yield Span("secret", offset + m.start(), offset + m.end(), round(score, 2))
    yield from _assigned(text, rules)
    yield from _stated(text, rules)
    yield from _url_passwords(text)
    yield from _cli_passwords(text)


# A token named by the words just before it, with no sign or a colon between ("Datadog API key
# 3f9a...", "access token: 9c1e..."): one or two words, read backwards from the token.
_NAME_WORDS_REVERSED = re.compile(r"[ \t]{0,3}[:\uff1a]?[ \t]{1,3}[\"'`]?([\w-]{1,32})(?:[ \t]([\w-]{1,32}))?")
_NAMED_VALUE = re.compile(r"[A-Za-z0-9_+/=-]+")


def _named(text: str, offset: int, value: str, rules: "PiiRules") -> bool:
    """Whether the token at text[offset:] follows a credential's name (`[named]` of the rules):
    then any token of letters and digits is one, hex included (an API key of 32 hex digits has
    the shape of a digest; only its name tells them apart)."""
    if not (_NAMED_VALUE.fullmatch(value) and any(c.isdigit() for c in value) and any(c.isalpha() for c in value)):
        return False
    name = _NAME_WORDS_REVERSED.match(text[max(0, offset - 72):offset][::-1])
    if name is None:
        return False
    words = ((name.group(2) or "")[::-1] + name.group(1)[::-1]).lower().translate(JOINERS)
    return words.endswith(rules.named)


_PEM = re.compile(r"-----BEGIN ([A-Z0-9 ]+)-----.*?(?:-----END \1-----|\Z)", re.DOTALL)


def _public_blocks(text: str) -> list[tuple[int, int]]:
    """PEM blocks that are not private keys: certificates, public keys, requests."""
    if "-----BEGIN " not in text:
        return []
    return [m.span() for m in _PEM.finditer(text) if "PRIVATE" not in m.group(1)]


# A capitalised word (Account, Settings) and a path's segment of seven or more lowercase letters.
_CAPITALISED = re.compile(r"[A-Z][a-z]{3,}")
_PATH_WORD = re.compile(r"(?:^|/)[a-z]{7,}(?:/|$)")


def _words_or_path(token: str) -> bool:
    """Whether a token is an identifier made of words (UserAccountSettings2Controller: three
    quarters or more of it capitalised words) or a path of two slashes or more with a word
    between them (/subscriptions/<id>/resourceGroups/..., a URL's document/d/<id>/edit). Of
    random base62 and base64 tokens the entropy rule finds, ~4 in 100,000 look so."""
    words = sum(m.end() - m.start() for m in _CAPITALISED.finditer(token))
    return words * 4 >= len(token) * 3 or (token.count("/") >= 2 and _PATH_WORD.search(token) is not None)


def _holds_secret(words: str | None, min_entropy: float) -> bool:
    """Whether base64 of a sentence or a JSON object (`_encoded_words`) is a secret: where what
    it encodes holds one ('{"user":"svc","password":"..."}'), found by these same rules."""
    return words is not None and next(iter(find(words, [(0, len(words))], min_entropy)), None) is not None


def _encoded_words(token: str) -> str | None:
    """The text a token encodes where it is base64 of text with spaces or of a JSON object: an
    encoded sentence, a JWT's payload alone (a prompt asking to decode one), not a key, whose
    bytes are random. (A JWT whole, with its signature, is found by its own rule.)"""
    try:
        words = base64.b64decode(token + "=" * (-len(token) % 4), altchars=b"-_" if "-" in token or "_" in token else None,
                                 validate=True).decode("utf-8")
    except (ValueError, UnicodeDecodeError):
        return None
    return words if (" " in words or words.startswith("{")) and words.isprintable() else None


def _bounded(value: str, start: int, end: int) -> bool:
    return (start == 0 or value[start - 1] not in _TOKEN_CHARS) and (end == len(value) or value[end] not in _TOKEN_CHARS)


_FIELD_END = re.compile(r"[^\s\"'<>`]*")


def _field(text: str, start: int, end: int) -> tuple[int, int]:
    """The whitespace- or quote-delimited field around text[start:end]."""
    while start > 0 and not text[start - 1].isspace() and text[start - 1] not in "\"'<>`":
        start -= 1
    return start, _FIELD_END.match(text, end).end()


# A credential's name before an assignment in code, config, JSON or YAML (`DB_PASSWORD=`,
# `"api_key": `), and the value after it. (An Authorization header's scheme word stands before its
# credential.) Found from the assignment signs, few in prose, not by reading every word.
# A name, then a closing quote and up to three spaces before the sign, reversed.
_NAME_REVERSED = re.compile(r"[ \t]{0,3}[\"']?([\w.-]{1,48})")
# A value is judged by its first _VALUE_HEAD characters: read whole at each sign, a value of
# many signs ("password=password=...") would be read again from each of them.
_VALUE_HEAD = 256
# An ampersand ends a value only before a query's next parameter (?password=...&user=) or as
# an entity (&amp;): in a password it is a sign like any other (password=Tr0ub4dor&3xK).
_VALUE_CHAR = r"(?:[^\s\"'`<>,;&(){}\[\]]|&(?![\w.-]*=|amp;))"
_VALUE = re.compile(r"[=>]?\s{0,3}[\"'`]?(?:(?:Bearer|Basic|Token|token|bearer) +)?(%s{1,%d})" % (_VALUE_CHAR, _VALUE_HEAD))
_VALUE_REST = re.compile(_VALUE_CHAR + "*")
# What is assigned but is not the credential itself: a URL, a variable, a path.
_NOT_VALUES = ("http", "$", "%", "process.", "os.", "/", "~/", "./", "../")
# A digit or sign in the value (one search in C, not a comparison per character).
_SIGN_IN_VALUE = re.compile(r"[0-9!@#$%^&*+=?~/|\\]")


def _password_like(value: str) -> bool:
    """A letter and a digit or sign: what a password has and a word or a number has not."""
    return any(c.isalpha() for c in value) and _SIGN_IN_VALUE.search(value) is not None


# An assignment sign, unless it stands between two digits: a time, a ratio, an address and port
# (12:41, 3:2, 10.0.0.1:8080), which a log has many of, skipped in one search.
_ASSIGNING = {sign: re.compile(sign + "(?:(?<![0-9].)|(?![0-9]))") for sign in ":=\uff1a"}


def _assigned(text: str, rules: "PiiRules") -> Iterable[Span]:
    """Values assigned to a name that says it is a credential (password=, "api_key": ...)."""
    reverse = None
    for assigning in _ASSIGNING.values():
        at = _next(assigning, text, 0)
        while at >= 0:
            # The name before the sign, read backwards by one anchored match on the reversed
            # text (a log's many colons cost one C call each).
            if reverse is None:
                reverse = text[::-1]
            name = _NAME_REVERSED.match(reverse, len(text) - at)
            if name is not None and rules.assignment_names.search(name.group(1)):
                m = _VALUE.match(text, at + 1)
                value = m.group(1).rstrip(".?:") if m else ""     # a sentence's end is not part of the value
                if (len(value) >= rules.assignment_min_length and _password_like(value)
                        and not value.startswith(_NOT_VALUES)):
                    end = m.start(1) + len(value)
                    if m.end(1) - m.start(1) == _VALUE_HEAD:      # a longer value is redacted whole
                        end = m.start(1) + len(text[m.start(1):_VALUE_REST.match(text, m.end(1)).end()].rstrip(".?:"))
                    yield Span("secret", m.start(1), end)
                    # A sign inside the value is part of it (its own value would end where this
                    # one does); one that ends it may start a value of its own ("password= pw=").
                    at = _next(assigning, text, end - 1)
                    continue
            at = _next(assigning, text, at + 1)


def _next(assigning: re.Pattern, text: str, start: int) -> int:
    m = assigning.search(text, start)
    return -1 if m is None else m.start()


_VOWELS = frozenset("aeiouy")


def _stated(text: str, rules: "PiiRules") -> Iterable[Span]:
    """A password stated in a sentence ("a senha do app é Pb7#kW2q!vXm", "app password qzvw mkxe
    hbtr pnla": `[stated]` of the rules). The names are found in the case-folded text by one
    automaton pass, the pattern read only after one."""
    # İ is the one letter whose lowercase is two characters (i and a combining dot): as i, the
    # offsets stay the text's (ŞİFRE is şifre).
    folded = text.replace("\u0130", "i").lower()
    if len(folded) != len(text):
        return                               # a case-folding that changes offsets: not read
    for _, _, end in stated_names(folded, rules):
        m = rules.stated.match(text, end)
        if m is not None:
            app = 1 if m.group(1) else 3 if m.group(3) else 0
            if app and any(not _VOWELS.intersection(group) for group in m.group(app).split()):
                yield Span("secret", m.start(app), m.end(app))
            elif m.group(2) and _password_like(m.group(2)) and not m.group(2).startswith(_NOT_VALUES):
                yield Span("secret", m.start(2), m.end(2))


def stated_names(folded: str, rules: "PiiRules") -> list[tuple[int, int, int]]:
    """(name index, start, end) of every stated name in the case-folded text, overlapping ones
    included."""
    try:
        return rules.stated_automaton.find_matches_as_indexes(folded, overlapping=True)
    except UnicodeEncodeError:
        # A lone surrogate (a JSON "\ud800" escape) is no character the automaton can read:
        # U+FFFD stands in for it, one for one, so offsets hold.
        return rules.stated_automaton.find_matches_as_indexes(_SURROGATE.sub("\ufffd", folded), overlapping=True)


_SURROGATE = re.compile("[\ud800-\udfff]")


# A password on a command line: curl's and wget's `-u user:password` / `--user user:password`,
# and the MySQL clients' `-pPASSWORD` (written right after -p), each within 200 characters of
# the client's name on its line (a bounded read, whatever the number of names; docker's
# `-u 1000:1000` is a user and a group).
_CLI_USER = re.compile(r"(?<!\S)(?:curl|wget)\b[^\n]{0,200}?(?<!\S)(?:-u|--user|--http-user)[ =][\"']?[^\s:\"']{1,64}:([^\s\"']{4,128})")
_MYSQL_PASSWORD = re.compile(r"(?<!\S)(?:mysql|mysqldump|mariadb|mysqladmin)\b[^\n]{0,200}?(?<!\S)-p([^\s\"']{4,128})")


# Any of the options above: one search of the text's dashes (most prose has none) before the
# tests of each option and client name.
_CLI_OPTION = re.compile(r"-(?:u |-user|-http-user|p)")


def _cli_passwords(text: str) -> Iterable[Span]:
    if _CLI_OPTION.search(text) is None:
        return
    if ("-u " in text or "--user" in text or "--http-user" in text) and ("curl" in text or "wget" in text):
        for m in _CLI_USER.finditer(text):
            yield Span("secret", m.start(1), m.end(1))
    if "-p" in text and ("mysql" in text or "mariadb" in text):
        for m in _MYSQL_PASSWORD.finditer(text):
            value = m.group(1)
            if _password_like(value):
                yield Span("secret", m.start(1), m.end(1))


# A password in a URL's user information (postgres://app:s3cret@db:5432/prod).
_URL_PASSWORD = re.compile(r"[A-Za-z][A-Za-z0-9+.-]{1,15}://[^\s:/@]*:([^\s/@<>{}$*]{1,128})@")


def _url_passwords(text: str) -> Iterable[Span]:
    at = text.find("@")
    last = -1
    while at >= 0:
        slashes = text.rfind("://", max(last + 1, at - 200), at)
        if slashes >= 0:
            m = _URL_PASSWORD.search(text, max(last + 1, slashes - 16), at + 1)
            if m is not None and m.end() == at + 1:
                yield Span("secret", m.start(1), m.end(1))
        last = at
        at = text.find("@", at + 1)
