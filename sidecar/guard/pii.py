"""Personal-data and secret detectors: each finds spans in a text, checked where a checksum
or a parser can check them, so look-alikes (order numbers, versions, dates, hashes) pass.

Every detector is a cheap regular expression that proposes candidates and a validator that
decides: Luhn and the issuer's prefix for cards, ISO 13616 mod-97 for IBANs (python-stdnum),
libphonenumber's validity rules for phone numbers (phonenumbers), the address parser for IPs,
known token prefixes or character entropy for secrets.
"""
from __future__ import annotations

import ipaddress
import math
import re
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterable

import phonenumbers
from stdnum import iban as stdnum_iban

DETECTORS = ("email", "phone", "card", "iban", "ip", "secret", "private_key")
# Regions whose national-format numbers (without +country code) count as phone numbers.
DEFAULT_PHONE_REGIONS = ("US", "GB", "DE", "FR", "ES", "IT", "CN", "JP", "RU", "BR", "IN")


@dataclass(frozen=True)
class Span:
    detector: str
    start: int
    end: int
    score: float = 1.0


# Local parts of ASCII and Latin letters (Zoë.Ng@, o'connor@), not \w: a CJK sentence runs
# into an address without a space, and \w would take it along.
# A leading lookbehind is tried at every position of the text; after the first character it is
# tried only where that character matched (the patterns below put it there: ~5x faster).
_EMAIL = re.compile(r"[A-Za-z0-9._%+\u00c0-\u024f-](?<![A-Za-z0-9._%+\u00c0-\u024f-].)[A-Za-z0-9._%+'\u00c0-\u024f-]{0,63}@(?:[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.)+"
                    r"[A-Za-z]{2,24}(?![A-Za-z0-9@-])")

# 13 to 19 digits, in groups split by single spaces or dashes.
_CARD = re.compile(r"\d(?<![A-Za-z0-9.,/_-].)(?:[ -]?\d){12,18}(?![A-Za-z0-9/_-]|[.,]\d)")
# Issuer prefixes (IIN) and lengths of the card networks: a Luhn-valid number outside them is
# some other number.
_CARD_PREFIX = (
    (re.compile(r"4"), (13, 16, 19)), (re.compile(r"5[1-5]|2[2-7]"), (16,)), (re.compile(r"3[47]"), (15,)),
    (re.compile(r"3[0689]"), (14, 16, 17, 18, 19)), (re.compile(r"6(?:011|5|4[4-9])|35|62|81"), (16, 17, 18, 19)))


def _card_shaped(digits: str) -> bool:
    return any(prefix.match(digits) and len(digits) in lengths for prefix, lengths in _CARD_PREFIX)


def luhn_ok(digits: str) -> bool:
    total = 0
    for i, ch in enumerate(reversed(digits)):
        n = ord(ch) - 48
        if i % 2 == 1:
            n = n * 2 - 9 if n > 4 else n * 2
        total += n
    return total % 10 == 0


def _cards(text: str) -> Iterable[Span]:
    for m in _CARD.finditer(text):
        digits = re.sub(r"[ -]", "", m.group())
        if _card_shaped(digits) and luhn_ok(digits):
            yield Span("card", m.start(), m.end())


_IBAN = re.compile(r"[A-Z](?<![A-Za-z0-9].)[A-Z]\d{2}(?: ?[A-Z0-9]{1,4}){3,8}(?![A-Za-z0-9])")


def _ibans(text: str) -> Iterable[Span]:
    for m in _IBAN.finditer(text):
        value = m.group()
        # The pattern may run into a following word: try shorter groups until one validates.
        while value:
            if stdnum_iban.is_valid(value):
                yield Span("iban", m.start(), m.start() + len(value))
                break
            cut = value.rfind(" ")
            value = value[:cut] if cut > 4 else ""


# A phone-number candidate: a + or a digit, then digits with spaces, dots, dashes, brackets.
_PHONE = re.compile(r"[+(\d](?<![A-Za-z0-9+./_-].)[\d ().\-–]{5,22}\d(?![A-Za-z0-9_]|[.-]?[A-Za-z0-9])")
# Dates and times: libphonenumber accepts some as numbers of some region.
_NOT_DIGIT = re.compile(r"\D")
_DATE = re.compile(r"\d{4}[-./]\d{1,2}[-./]\d{1,2}|\d{1,2}[-./]\d{1,2}[-./]\d{2,4}|\d{4}-\d{1,2}")


# Each candidate costs a libphonenumber parse per region (~50 µs each): a text of many
# digit groups ("1 2 3 4 ...", a table of numbers) would cost seconds. Equal candidates are
# judged once and at most this many distinct ones per text (later ones pass unchecked).
MAX_PHONE_CANDIDATES = 64


def _phones(text: str, regions: tuple[str, ...]) -> Iterable[Span]:
    verdicts: dict[str, bool] = {}
    for m in _PHONE.finditer(text):
        candidate = m.group()
        valid = verdicts.get(candidate)
        if valid is None:
            if len(verdicts) >= MAX_PHONE_CANDIDATES:
                return
            valid = verdicts[candidate] = _is_phone(candidate, regions)
        if valid:
            yield Span("phone", m.start(), m.end())


def _is_phone(candidate: str, regions: tuple[str, ...]) -> bool:
    if _DATE.fullmatch(candidate):
        return False
    digits = sum(ch.isdigit() for ch in candidate)
    if digits < 7 or digits > 15:
        return False
    if candidate.startswith("00"):
        candidate = "+" + candidate[2:]      # 00 dials abroad from most countries, as + does
    international = candidate.startswith("+")
    for region in (None,) if international else regions:
        try:
            number = phonenumbers.parse(candidate, region)
        except phonenumbers.NumberParseException:
            continue
        if phonenumbers.is_valid_number(number) and (international or _written_nationally(candidate, number)):
            return True
    return False


def _written_nationally(candidate: str, number) -> bool:
    """Whether a number without a country code is written as the region writes it at home:
    with its trunk prefix (the 0 of 030 901820) where the region dials one. libphonenumber
    accepts a national number without it, and then many order numbers, ids and counts of
    seven to twelve digits are valid numbers of some region."""
    national = phonenumbers.format_number(number, phonenumbers.PhoneNumberFormat.NATIONAL)
    return _NOT_DIGIT.sub("", national) == _NOT_DIGIT.sub("", candidate)


_IPV4 = re.compile(r"\d(?<![A-Za-z0-9_.].)\d{0,2}\.(?:\d{1,3}\.){2}\d{1,3}(?![A-Za-z0-9_]|\.\d)")
_IPV6 = re.compile(r"[0-9A-Fa-f:](?<![A-Za-z0-9_:].)[0-9A-Fa-f]{0,3}:?(?:[0-9A-Fa-f]{0,4}:){1,7}[0-9A-Fa-f]{0,4}(?![A-Za-z0-9_:])")


def _ips(text: str) -> Iterable[Span]:
    for pattern in (_IPV4, _IPV6) if text.count(":") > 1 else (_IPV4,):
        for m in pattern.finditer(text):
            value = m.group()
            if pattern is _IPV6 and value.count(":") < 3 and "::" not in value:
                continue               # a time of day (12:30:45) or a ratio
            try:
                ipaddress.ip_address(value)
            except ValueError:
                continue
            yield Span("ip", m.start(), m.end())


# Tokens whose prefix names them: OpenAI, GitHub, AWS, Slack, Google, Stripe, GitLab, Hugging
# Face, npm, JWTs.
_KNOWN_SECRET = re.compile(
    r"(?:sk-(?:proj-|ant-)?[A-Za-z0-9_-]{20,}|(?:ghp|gho|ghs|ghu|ghr)_[A-Za-z0-9]{30,}|github_pat_\w{30,}"
    r"|(?:AKIA|ASIA)[0-9A-Z]{16}|xox[abposr]-[A-Za-z0-9-]{10,}|AIza[0-9A-Za-z_-]{35}"
    r"|(?:sk|rk|pk)_(?:live|test)_[A-Za-z0-9]{16,}|glpat-[A-Za-z0-9_-]{20,}|hf_[A-Za-z0-9]{30,}|npm_[A-Za-z0-9]{36}"
    r"|eyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{4,}\.[A-Za-z0-9_-]{16,})(?![A-Za-z0-9_-])")
# Any other long run of token characters; kept only when its characters look random.
_TOKEN = re.compile(r"[A-Za-z0-9+/_-](?<![A-Za-z0-9+/=_-].)[A-Za-z0-9+/_-]{31,99}={0,2}(?![A-Za-z0-9+/=_-])")
_TOKEN_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")
DEFAULT_MIN_ENTROPY = 4.3   # bits per character; chosen on the dev split (reports/guard.json)


def entropy(value: str) -> float:
    counts = Counter(value)
    n = len(value)
    return -sum(c / n * math.log2(c / n) for c in counts.values())


# Every secret lies in a run of token characters of 20 or more: the patterns above run only
# inside such runs, rare in prose, instead of at every position of the text.
_RUN = re.compile(r"[A-Za-z0-9_.+/=-]{20,}")


def _secrets(text: str, min_entropy: float) -> Iterable[Span]:
    for run in _RUN.finditer(text):
        value, offset = run.group(), run.start()
        known = [(m.start(), m.end()) for m in _KNOWN_SECRET.finditer(value)
                 if m.start() == 0 or value[m.start() - 1] not in _TOKEN_CHARS]
        for start, end in known:
            yield Span("secret", offset + start, offset + end)
        for m in _TOKEN.finditer(value):
            token = m.group()
            if any(s < m.end() and m.start() < e for s, e in known):
                continue
            # Hex (hashes, UUIDs) and one-case runs are ids, not credentials; a key mixes cases and digits.
            if not (any(c.islower() for c in token) and any(c.isupper() for c in token) and any(c.isdigit() for c in token)):
                continue
            score = entropy(token)
            if score >= min_entropy:
                yield Span("secret", offset + m.start(), offset + m.end(), round(score, 2))


_PRIVATE_KEY = re.compile(r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY(?: BLOCK)?-----.*?(?:-----END [A-Z0-9 ]*PRIVATE KEY(?: BLOCK)?-----|\Z)",
                          re.DOTALL)


def _private_keys(text: str) -> Iterable[Span]:
    for m in _PRIVATE_KEY.finditer(text):
        yield Span("private_key", m.start(), m.end())


def _emails(text: str) -> Iterable[Span]:
    for m in _EMAIL.finditer(text):
        yield Span("email", m.start(), m.end())


@dataclass(frozen=True)
class PiiSettings:
    phone_regions: tuple[str, ...] = DEFAULT_PHONE_REGIONS
    min_entropy: float = DEFAULT_MIN_ENTROPY


def detector_functions(settings: PiiSettings) -> dict[str, Callable[[str], Iterable[Span]]]:
    return {"email": _emails, "phone": lambda t: _phones(t, settings.phone_regions), "card": _cards,
            "iban": _ibans, "ip": _ips, "secret": lambda t: _secrets(t, settings.min_entropy),
            "private_key": _private_keys}


# Cheap tests that rule a detector out for most texts before its pattern runs.
_DIGIT = re.compile(r"\d")
_NEEDS = {"email": lambda t, digits: "@" in t, "ip": lambda t, digits: digits or t.count(":") > 1,
          "iban": lambda t, digits: digits and not t.islower(), "phone": lambda t, digits: digits,
          "card": lambda t, digits: digits, "private_key": lambda t, digits: "PRIVATE KEY" in t}


_FULL_WIDTH = {cp: cp - 0xFEE0 for cp in range(0xFF01, 0xFF5F)} | {0x3000: 0x20}
_FULL_WIDTH_ALNUM = re.compile("[\uff08\uff09\uff0b\uff0d\uff0e\uff10-\uff19\uff20-\uff3a\uff41-\uff5a]")


# Where spans overlap, the stricter check wins: a phone-number candidate also covers many IP
# addresses, cards and IBAN digits, which their own checks confirm more narrowly.
_PRIORITY = {name: rank for rank, name in enumerate(("private_key", "secret", "email", "iban", "card", "ip", "phone"))}


def find(text: str, detectors: Iterable[str], settings: PiiSettings = PiiSettings()) -> list[Span]:
    """Spans of the given detectors in `text`, in text order; of overlapping spans, the one of
    the stricter detector (_PRIORITY), then the longer, is kept."""
    functions = detector_functions(settings)
    if not text.isascii() and _FULL_WIDTH_ALNUM.search(text):
        # Full-width digits, letters and signs (typed by Japanese and Chinese input methods)
        # become ASCII one character for one, so every offset stays valid for redaction.
        # Without a full-width digit, letter or number sign (most CJK text has only its
        # punctuation, ，。！) the text is left as it is.
        text = text.translate(_FULL_WIDTH)
    spans: list[Span] = []
    digits = _DIGIT.search(text) is not None
    for name in detectors:
        need = _NEEDS.get(name)
        if need is not None and not need(text, digits):
            continue
        spans.extend(functions[name](text))
    if len(spans) < 2:
        return spans
    spans.sort(key=lambda s: (_PRIORITY[s.detector], s.start - s.end))
    kept: list[Span] = []
    for span in spans:
        if not any(span.start < k.end and k.start < span.end for k in kept):
            kept.append(span)
    return sorted(kept, key=lambda s: s.start)
