"""Personal-data and secret detectors: each finds spans in a text, checked where a checksum
or a parser can check them, so look-alikes (order numbers, versions, dates, hashes) pass.

Every detector is a cheap regular expression that proposes candidates and a validator that
decides: Luhn and the issuer's prefix for cards, ISO 13616 mod-97 for IBANs (python-stdnum),
libphonenumber's validity rules for phone numbers (phonenumbers), the address parser for IPs,
known token prefixes or character entropy for secrets (secrets.py).

A regular expression costs ~10-30 ns per character it is tried at, so each detector's pattern
runs only where it can match (`Candidates`): around digits (phone, card, IBAN, IPv4), colons
(IPv6), at signs (e-mail), inside runs of 20 or more token characters (secrets). One table
lookup per character finds those places; prose between them is not read again.
"""
from __future__ import annotations

import bisect
import functools
import ipaddress
import itertools
import re
import string
from dataclasses import dataclass, field
from typing import Callable, Iterable

import numpy as np
import phonenumbers
from phonenumbers import phonenumbermatcher as _phonenumbermatcher
from stdnum import iban as stdnum_iban
from stdnum import numdb as stdnum_numdb

from sidecar.guard import secrets
from sidecar.guard.compiled import NGRAMS
from sidecar.guard.pii_rules import RULES
from sidecar.guard.secrets import DEFAULT_MIN_ENTROPY
from sidecar.guard.spans import Span, matches

DETECTORS = ("email", "phone", "card", "iban", "ip", "secret", "private_key")
# Regions whose national-format numbers (without +country code) count as phone numbers.
DEFAULT_PHONE_REGIONS = ("US", "GB", "DE", "FR", "ES", "IT", "CN", "JP", "RU", "BR", "IN")


def _grouped_regions() -> tuple[str, ...]:
    """Where a route names no regions, national numbers written in groups and starting with the
    trunk prefix 0 (0412 738 195, 0722 418 396), grouped exactly as the region writes them, also
    count in these: the other regions of `context_regions` (pii_rules.toml) whose numbers are
    dialled at home with that prefix. The prefix and a grouping the region's format confirms
    are the evidence; an unbroken run of digits, weaker evidence (~75% of random 10-digit runs
    starting with 0 are a valid mobile number of one of them), counts in DEFAULT_PHONE_REGIONS
    only. Regions without a trunk prefix (DK, NO, SG, HK, MX, PL) are left out: their national
    numbers are bare runs of 8 to 10 digits, as years, ids and amounts are."""
    return tuple(r for r in RULES.phone_context_regions if r not in DEFAULT_PHONE_REGIONS
                 and (phonenumbers.PhoneMetadata.metadata_for_region(r).national_prefix or "").startswith("0"))


GROUPED_PHONE_REGIONS = _grouped_regions()


# Local parts and domain labels of ASCII and Latin letters (Zoë.Ng@, o'connor@,
# @bäckerei-müller.de), not \w: a CJK sentence runs into an address without a space, and \w
# would take it along.
# A leading lookbehind is tried at every position of the text; after the first character it is
# tried only where that character matched (the patterns below put it there: ~5x faster).
_EMAIL = re.compile(r"[A-Za-z0-9._%+\u00c0-\u024f-](?<![A-Za-z0-9._%+\u00c0-\u024f-].)[A-Za-z0-9._%+'\u00c0-\u024f-]{0,63}@(?:[A-Za-z0-9\u00c0-\u024f](?:[A-Za-z0-9\u00c0-\u024f-]{0,61}[A-Za-z0-9\u00c0-\u024f])?\.)+"
                    r"[A-Za-z]{2,24}(?![A-Za-z0-9@-])")

# Not after a dash (SN-7734-0021, a code's part), unless the dash follows a letter of another
# script than Latin: Hebrew joins its prefixes so (ב-052-719-4836, "at"). (A negative
# lookbehind of its own, not an alternation: ~2x faster on a log's many numbers.)
_AFTER_PREFIX = r"(?<![\x00-\x7f\W\d_]-.)"
# A run of 13 or more digits in groups split by single spaces or dashes, read whole (a log's
# many shorter numbers cost no match). A comma beside it is a CSV field's
# (txn_1,4929183047265511,42.80): thousands separators leave groups of three digits, and a
# decimal fraction of 13 or more digits is rare; a point before or after one is not, nor a plus
# before (+49 1517 1638468 is a phone number's country code, whatever Luhn says).
_DIGIT_GROUPS = re.compile(r"\d(?<![A-Za-z0-9.+/_].)%s(?:[ -]?\d){12,}(?![A-Za-z0-9/_-]|\.\d)" % _AFTER_PREFIX)
_GROUP_SIGN = re.compile(r"[ -]")
_GROUP = re.compile(r"\d+")
_CARD_DIGITS = range(13, 20)


def _card_shaped(digits: str) -> bool:
    """Whether a network issues numbers of this issuer prefix (IIN) and length (`[[card]]` of
    pii_rules.toml): a Luhn-valid number outside them is some other number."""
    return any(len(digits) in lengths and prefix.match(digits) for prefix, lengths in RULES.card)


def luhn_ok(digits: str) -> bool:
    total = 0
    for i, ch in enumerate(reversed(digits)):
        n = ord(ch) - 48
        if i % 2 == 1:
            n = n * 2 - 9 if n > 4 else n * 2
        total += n
    return total % 10 == 0


def _card(digits: str) -> bool:
    return len(digits) in _CARD_DIGITS and _card_shaped(digits) and luhn_ok(digits)


def _cards(text: str, where: "Candidates") -> Iterable[Span]:
    for m in matches(_DIGIT_GROUPS, text, where.cards):
        run = m.group()
        digits = _GROUP_SIGN.sub("", run)
        if len(digits) < _CARD_DIGITS.stop:
            if _card(digits):
                yield Span("card", m.start(), m.end())
            continue
        # More digits than a card: a list of cards ("6250 9470 0018 3943 3008 4417 2093 58")
        # only where the groups split wholly into valid cards; otherwise one longer number whose
        # leading groups may pass Luhn by chance (a parcel's 22 digits, 9400 1118 9922 3384 1067 05).
        for start, end in _card_list(run):
            yield Span("card", m.start() + start, m.start() + end)


def _card_list(run: str) -> list[tuple[int, int]]:
    """The cards a run of digit groups splits into, each whole groups, as offsets in the run;
    none unless every group belongs to a card."""
    bounds = [g.span() for g in _GROUP.finditer(run)]
    # last[i]: where the last card of a split of the groups before i into cards starts (one
    # index per group, not a list per split: a pasted list of thousands of cards stays linear).
    last: dict[int, int] = {0: 0}
    for i in range(len(bounds)):
        if i not in last:
            continue
        digits = ""
        for j in range(i, len(bounds)):
            digits += run[bounds[j][0]:bounds[j][1]]
            if len(digits) >= _CARD_DIGITS.stop:
                break
            if j + 1 not in last and _card(digits):
                last[j + 1] = i
    if len(bounds) not in last:
        return []
    cards, end = [], len(bounds)
    while end:
        start = last[end]
        cards.append((bounds[start][0], bounds[end - 1][1]))
        end = start
    return cards[::-1]


# In any case: an IBAN typed or pasted in lowercase is still one, and the mod-97 checksum and
# the country's length and format (stdnum) keep words out. One character per step: groups of
# one to four characters could split a run in exponentially many ways, each tried before the
# lookahead failed (~5 ms per "ab12" starting a hash).
_IBAN = re.compile(r"[A-Za-z](?<![A-Za-z0-9].)[A-Za-z]\d{2}(?:[ -]?[A-Za-z0-9]){11,32}(?![A-Za-z0-9])")


# Where an IBAN can start: two letters before a run of digits. The digit is found first (a
# pattern led by a letter is tried at every letter of the text).
_IBAN_START = re.compile(r"\d(?<=[A-Za-z]{2}\d)(?<![A-Za-z0-9].{3})\d")


def _iban_lengths() -> dict[str, int]:
    """Each country's IBAN length, from the registry stdnum checks against (its BBAN's parts
    are all of fixed length: "8!n10!n")."""
    registry = stdnum_numdb.get("iban")
    lengths = {}
    for code in map("".join, itertools.product(string.ascii_uppercase, repeat=2)):
        bban = registry.info(code)[0][1].get("bban")
        if bban:
            lengths[code] = 4 + sum(map(int, re.findall(r"(\d+)!", bban)))
    return lengths


_IBAN_LENGTHS = _iban_lengths()
# The first n characters of a candidate, with the single spaces or dashes between them
# (DE89-3704-0044-0532-0130-00, as some forms and banks print it).
_IBAN_PREFIX = {n: re.compile(r"(?:[ -]?[A-Za-z0-9]){%d}" % n) for n in set(_IBAN_LENGTHS.values())}


def _ibans(text: str, where: "Candidates") -> Iterable[Span]:
    end = 0
    for anchor in matches(_IBAN_START, text, where.ibans):
        if anchor.start() - 2 < end:
            continue            # inside the IBAN found last
        m = _IBAN.match(text, anchor.start() - 2)
        if m is None:
            continue
        # The match may run into the following words. Only its prefix that holds as many
        # characters as its country's IBANs and ends at a space (or at its end) can be valid:
        # the checksum runs once per candidate, not once per word.
        length = _IBAN_LENGTHS.get(m.group()[:2].upper())
        prefix = _IBAN_PREFIX[length].match(text, m.start(), m.end()) if length else None
        if prefix is not None and (prefix.end() == m.end() or text[prefix.end()] in " -") and stdnum_iban.is_valid(prefix.group()):
            end = prefix.end()
            yield Span("iban", m.start(), end)


# A phone-number candidate: a + (also in brackets: "(+34) 912 345 678") or a digit, then digits
# with spaces, dots, dashes, brackets, slashes. Not right after a number sign: #0412 345 678 is
# an order's or a ticket's number; nor after a dash (_AFTER_PREFIX).
_PHONE = re.compile(r"[+(\d](?<![A-Za-z0-9+./_#].)%s(?:(?<=\()\+)?[\d ().\-–/]{5,22}\d(?![A-Za-z0-9_]|[.-]?[A-Za-z0-9])" % _AFTER_PREFIX)
# Dates and times: libphonenumber accepts some as numbers of some region.
_NOT_DIGIT = re.compile(r"\D")
_DATE = re.compile(r"\d{4}[-./]\d{1,2}[-./]\d{1,2}|\d{1,2}[-./]\d{1,2}[-./]\d{2,4}|\d{4}-\d{1,2}")
# One point between two runs of digits is a decimal number (a log's 912.448371 seconds, a
# price); numbers written with points have two or more (555.123.4567, 06.12.34.56.78).
_DECIMAL = re.compile(r"\d+\.\d+")
# A slash splits an area code (with its trunk prefix, or after a country code) from its number
# (030/4492 1837, 089 / 12 34 56, +49 30/4492 1837: as German and Austrian numbers are
# written); anywhere else it makes a fraction, a path or a date.
_AREA_SLASH = re.compile(r"(?:\+\d{1,3} ?(?:\(0\) ?)?\(?\d{1,5}\)?|\(?0\d{1,5}\)?) ?/ ?[^/]*")
# An ISO 8601 date and the hour after it (2024-06-05 12:41 in a log): a look-alike that costs a
# parse in every region before the grouping rejects it.
_TIMESTAMP = re.compile(r"\d{4}-\d{2}-\d{2}[ T]\d")


# Each candidate costs a libphonenumber parse per region (~50 µs each): a text of many
# digit groups ("1 2 3 4 ...", a table of numbers) would cost seconds, and so would a request
# of many short texts (a thousand content parts, each with a number). Equal candidates are
# judged once per request, and a request (its texts together: `PhoneVerdicts`) is allowed this
# many parses (~30-100 ms). Past them a candidate fails closed: it takes the verdict of the
# parsed candidates of its shape (its digits as 9, its signs as written: a phone number if any
# of them was one), and of a shape not parsed it counts as a phone number. A pasted contact
# list of a thousand rows is redacted whole, a table of ids whose shape was judged is not, and
# the cost stays linear in the request. Such spans carry score 0.0 (not checked by
# libphonenumber).
MAX_PHONE_PARSES = 512


class _OutOfParses(Exception):
    pass


class PhoneVerdicts:
    """What the phone detector judged in one request's texts, under one policy's settings: its
    budget of libphonenumber parses, each candidate's verdict and each shape's."""

    def __init__(self, parses: int = MAX_PHONE_PARSES):
        self.left = parses
        self.of: dict[tuple[str, bool], bool] = {}          # (candidate, context) -> a phone number
        self.shapes: dict[tuple[str, bool], bool] = {}      # whether a parsed candidate of the shape was one

    def parse(self, candidate: str, region: str | None) -> phonenumbers.PhoneNumber:
        if self.left <= 0:
            raise _OutOfParses
        self.left -= 1
        # The raw input is kept: the grouping check reads it (a national prefix where needed).
        return phonenumbers.parse(candidate, region, keep_raw_input=True)


_AS_NINES = str.maketrans("0123456789", "9999999999")


# A word that mixes letters and digits just before a number makes the number part of a code
# (a UPS tracking number, 1Z 999 AA1 01 2345 6784), not a phone number.
_CODE_BEFORE = re.compile(r"(?<![A-Za-z0-9])(?=[A-Za-z0-9]*[A-Za-z])(?=[A-Za-z0-9]*\d)[A-Za-z0-9]+ \Z")
# What may stand between the numbers of a list ("+61 3 9011 4728, 1300 975 707").
_LIST_GAP = re.compile(r"[\s,;/|·•]*(?:(?:and|or|y|o|et|ou|und|oder|e|и|или)[\s,;]+)?")


def _phones(text: str, where: "Candidates", regions: tuple[str, ...], grouped: tuple[str, ...],
            context_regions: tuple[str, ...], judged: PhoneVerdicts) -> Iterable[Span]:
    verdicts, shapes = judged.of, judged.shapes
    last = -1                                # the end of the last phone number found
    for m in matches(_PHONE, text, where.phones):
        candidate = m.group()
        if not _phone_shaped(candidate):
            continue                         # a date, a timestamp, a decimal: no words read
        national = not candidate.startswith(("+", "(+", "00"))
        words = RULES.phone_context(text, m.start()) if national else None
        if words == 0 or national and _CODE_BEFORE.search(text, max(0, m.start() - 16), m.start()):
            continue                         # an order's, a parcel's, a QQ account's number
        # A phone word among the nearest words, or further back in a text that already holds
        # a phone number ("mi celular es 55 4821 3376 y el de la oficina (81) 8342 1190"), or
        # the previous number of a list.
        context = words == 2 or words == 1 and last >= 0 or (
            national and last >= 0 and m.start() - last <= 24 and _LIST_GAP.fullmatch(text, last, m.start()) is not None)
        key = (candidate, bool(context))
        valid, score = verdicts.get(key), 1.0
        if valid is None:
            shape = (candidate.translate(_AS_NINES), bool(context))
            try:
                valid = verdicts[key] = _is_phone(candidate, regions, grouped, context_regions if context else (), judged.parse)
                shapes[shape] = shapes.get(shape, False) or valid
            except _OutOfParses:
                valid, score = shapes.get(shape, True), 0.0
        if valid:
            last = m.end()
            yield Span("phone", m.start(), m.end(), score)


def _phone_shaped(candidate: str) -> bool:
    """The checks of a candidate that need no parse: not a date, a log's timestamp or a decimal
    number, a slash only after an area code, 7 to 15 digits."""
    # (A log's timestamps first: the candidates a log has most of.)
    if _TIMESTAMP.match(candidate) or _DATE.fullmatch(candidate) or _DECIMAL.fullmatch(candidate):
        return False
    if "/" in candidate and not _AREA_SLASH.fullmatch(candidate):
        return False
    return 7 <= sum(ch.isdigit() for ch in candidate) <= 15


def _is_phone(candidate: str, regions: tuple[str, ...], grouped: tuple[str, ...] = (), context: tuple[str, ...] = (),
              parse: Callable[[str, str | None], phonenumbers.PhoneNumber] = functools.partial(phonenumbers.parse, keep_raw_input=True)) -> bool:
    """Whether a candidate `_phone_shaped` passed (the caller checks) is a phone number."""
    if candidate.startswith("00"):
        candidate = "+" + candidate[2:]      # 00 dials abroad from most countries, as + does
    international = candidate.startswith(("+", "(+"))
    bare = not international and _NOT_DIGIT.search(candidate) is None
    home = len(regions)
    digits = _NOT_DIGIT.sub("", candidate)
    if not (international or bare) and candidate.lstrip("(")[:1] == "0":
        # Only the regions whose numbering plan can hold the digits are parsed.
        regions += tuple(r for r in grouped if _could_be(r, digits))
    valid: dict[str | None, phonenumbers.PhoneNumber] = {}      # the regions' valid readings, for the context's loop
    for index, region in enumerate((None,) if international else regions):
        try:
            number = parse(candidate, region)
        except phonenumbers.NumberParseException:
            continue
        if not phonenumbers.is_valid_number(number):
            continue
        valid[region] = number
        if not international and not _written_nationally(candidate, number):
            continue
        if bare and phonenumbers.number_type(number) not in _BARE_TYPES:
            continue
        # A country code is evidence enough: an order number or ISBN rarely starts with +49,
        # and people group international numbers in many ways (+49 30 901820, +49 (0)30 ...).
        if international or _grouped_as_formatted(candidate, number, exactly=index >= home):
            return True
    if international or bare:
        return False
    # A phone word before it: a national number of the context regions, with or without the
    # trunk prefix, its groups within the region's (strict grouping: Austria's 0664 218 7730,
    # formatted 0664 2187730); the word is the evidence the exact grouping stands in for
    # without it. A region read above is not parsed again, nor one whose numbering plan cannot
    # hold the digits.
    for region in context:
        if region in regions:
            number = valid.get(region)
        elif not _could_be(region, digits):
            continue
        else:
            try:
                number = parse(candidate, region)
            except phonenumbers.NumberParseException:
                continue
            number = number if phonenumbers.is_valid_number(number) else None
        if number is not None and _national_digits(number, digits) and _grouped_as_formatted(candidate, number):
            return True
    return False


def _national_digits(number, digits: str) -> bool:
    """Whether the digits are the number's national form, with or without its trunk prefix (a
    cheap check before the grouping's, which formats the number again)."""
    national = _NOT_DIGIT.sub("", phonenumbers.format_number(number, phonenumbers.PhoneNumberFormat.NATIONAL))
    return digits == national or national.endswith(digits) and len(national) - len(digits) <= 2


@functools.cache
def _plan(region: str) -> tuple[frozenset[int], re.Pattern, str] | None:
    """A region's national number lengths, its numbers' pattern and its trunk prefix."""
    metadata = phonenumbers.PhoneMetadata.metadata_for_region(region)
    if metadata is None or metadata.general_desc is None or not metadata.general_desc.national_number_pattern:
        return None
    desc = metadata.general_desc
    return frozenset(desc.possible_length or ()), re.compile(desc.national_number_pattern), metadata.national_prefix or ""


def _could_be(region: str, digits: str) -> bool:
    """Whether the digits, without the region's trunk prefix where they start with it, can be
    a national number of the region: a set lookup and one pattern, not a parse (~60 µs, and
    phonenumbers' own patterns of many regions overflow the re module's cache)."""
    plan = _plan(region)
    if plan is None:
        return False
    lengths, pattern, prefix = plan
    if prefix and digits.startswith(prefix) and len(digits) - len(prefix) in lengths and pattern.fullmatch(digits, len(prefix)):
        return True
    return len(digits) in lengths and pattern.fullmatch(digits) is not None


@functools.cache
def prepare(regions: tuple[str, ...]) -> None:
    """Loads libphonenumber's metadata of the regions and compiles its matcher's patterns (5 to
    35 ms each on first use), so the first request with a phone number does not wait for them.
    Once per set of regions a process is configured with."""
    for region in regions:
        example = phonenumbers.example_number(region)
        if example is not None:
            for style in (phonenumbers.PhoneNumberFormat.NATIONAL, phonenumbers.PhoneNumberFormat.INTERNATIONAL):
                _is_phone(phonenumbers.format_number(example, style), regions)


def prepare_tables() -> None:
    """Builds the character table the detectors' candidate search reads (~10 ms), so the first
    request with non-ASCII text does not wait for it."""
    _bmp_classes()


# A national number written as one run of digits carries the least evidence: fixed-line
# numbering plans are dense (of random 10-digit strings starting with 0, ~90% are valid numbers
# of a default region as written; mobile ranges, ~17%). Such a run counts only as a mobile
# number, which people do write unbroken (13800138000); a fixed-line one needs its +country
# code or the groups its region writes it in.
_BARE_TYPES = (phonenumbers.PhoneNumberType.MOBILE, phonenumbers.PhoneNumberType.FIXED_LINE_OR_MOBILE)


def _grouped_as_formatted(candidate: str, number, exactly: bool = False) -> bool:
    """libphonenumber's STRICT_GROUPING: no group of the candidate's digits runs across two
    groups of the number as its region formats it (4471-2290-18 is not the Brazilian
    (44) 7122-9018; 0-306-40615-2, an ISBN, is not 030 6406152). The check PhoneNumberMatcher
    makes, on the number already parsed: a matcher over the candidate parses it again and
    runs its own patterns, ~15x the time. `exactly`: EXACT_GROUPING, the region's groups as
    they are (0301-23 45 67 in Sweden, not 0301-2345-67), for GROUPED_PHONE_REGIONS, where the
    grouping is the evidence."""
    if exactly:
        return _phonenumbermatcher._verify_exact_grouping(number, candidate, _GROUPING)
    return _phonenumbermatcher._verify_strict_grouping(number, candidate, _GROUPING)


# Only its grouping check is used (it reads no state of the matcher).
_GROUPING = phonenumbers.PhoneNumberMatcher("", "ZZ", leniency=phonenumbers.Leniency.STRICT_GROUPING)


def _written_nationally(candidate: str, number) -> bool:
    """Whether a number without a country code is written as the region writes it at home:
    with its trunk prefix (the 0 of 030 901820) where the region dials one. libphonenumber
    accepts a national number without it, and then many order numbers, ids and counts of
    seven to twelve digits are valid numbers of some region."""
    national = _NOT_DIGIT.sub("", phonenumbers.format_number(number, phonenumbers.PhoneNumberFormat.NATIONAL))
    digits = _NOT_DIGIT.sub("", candidate)
    if digits == national:
        return True
    # Where the national format leaves the trunk prefix out (North America's 1: (800) 642-7736
    # is dialled 1-800-642-7736), the prefix written as a group of its own counts too; the
    # grouping check then holds it to its own group.
    prefix = phonenumbers.ndd_prefix_for_region(phonenumbers.region_code_for_number(number), True)
    return (bool(prefix) and not national.startswith(prefix) and digits == prefix + national
            and _NOT_DIGIT.search(candidate[len(prefix):len(prefix) + 1]) is not None)


# An IPv4 address, with its network's prefix length when it has one (10.0.0.0/8).
_IPV4 = re.compile(r"\d(?<![A-Za-z0-9_.].)\d{0,2}\.(?:\d{1,3}\.){2}\d{1,3}(?:/\d{1,2})?(?![A-Za-z0-9_]|\.\d|-[A-Za-z])")
# IPv6: full, compressed, ending in an IPv4 address (::ffff:192.0.2.1), with a zone (fe80::1%eth0)
# and a prefix length (2001:db8::/32); also with a port written after it without brackets, as
# HAProxy and other logs do (2a02:c207::1:40022): five digits are no group of an address.
_IPV6 = re.compile(r"[0-9A-Fa-f:](?<![A-Za-z0-9_:.].)[0-9A-Fa-f]{0,3}:?(?:[0-9A-Fa-f]{0,4}:){1,7}"
                   r"(?:\d{1,3}(?:\.\d{1,3}){3}|[0-9A-Fa-f]{0,4})(?:%[A-Za-z0-9_]+)?(?:/\d{1,3})?"
                   r"(?:(?![A-Za-z0-9_:]|\.\d)|(?=:\d{5}(?![A-Za-z0-9_:]|\.\d)))")


# A packet trace's addresses with their ports after a fifth number (tcpdump: `192.168.1.104.53188
# > 192.168.1.1.53:`), which the IPv4 pattern leaves alone as a five-part version: the arrow
# between two of them, or the colon after the second, says what they are.
_TRACE = re.compile(r"(?<![A-Za-z0-9_.])(\d{1,3}(?:\.\d{1,3}){3})\.\d{1,5} > (\d{1,3}(?:\.\d{1,3}){3})\.\d{1,5}:")
# Dotted numbers of three parts or of five and more: versions and OIDs, never addresses (a
# trace's address and port aside).
_DOTTED = re.compile(r"(?<![\d.])\d+(?:\.\d+){2,}(?!\d|\.\d)")


# A product token's word (User-Agent: Chrome/131.0.0.0, AppleWebKit/537.36, com.example-app/1.2.3.4).
_PRODUCT_WORD = re.compile(r"[A-Za-z][A-Za-z0-9_.-]*\Z")


def _product_version(text: str, start: int) -> bool:
    """Whether the number at text[start] is a product's version: it follows "word/" and the
    word is not itself a segment of a path or URL (/hosts/10.0.0.12, /nodes/10.0.0.12), where the
    number is read like any other: an address unless a version word decides (fail closed)."""
    if start < 2 or text[start - 1] != "/" or not text[start - 2].isalpha():
        return False
    word = _PRODUCT_WORD.search(text, max(0, start - 65), start - 1)
    return word is not None and text[word.start() - 1:word.start()] != "/"


def _dotted_heads(text: str, where: "Candidates") -> set[str]:
    """The heads that make the text's four-part numbers of the same head versions or OIDs: the
    first two numbers of its three-part dotted numbers (versions: 2.4.57 makes 2.4.58.1 one,
    not 18.204.12.9 beside node 18.17.1: a release's siblings share its major and minor
    numbers), the first number of those of five parts or more outside a packet trace (long
    versions); and 0, 1 and 2 where one of those starts with them (an OID, 1.3.6.1.4.1.311.21.8:
    every OID's first arc is one of them, X.660). An address of another head in the same text
    is still an address."""
    heads: set[str] = set()
    for m in matches(_DOTTED, text, where.digits):
        parts = m.group().split(".")
        if len(parts) == 3:
            heads.add(parts[0] + "." + parts[1])
        elif len(parts) > 4 and text[m.end():m.end() + 3] != " > " and text[m.end():m.end() + 1] != ":":
            heads.update(("0", "1", "2") if parts[0] in ("0", "1", "2") else (parts[0],))
    return heads


def addresses(text: str, where: "Candidates") -> Iterable[tuple[re.Match, re.Pattern, str, str, ipaddress.IPv4Address | ipaddress.IPv6Address]]:
    """The IPv4 and IPv6 pattern's matches the address parser accepts: (match, pattern, the
    address as written, its prefix length or "", the address)."""
    for pattern, ranges in ((_IPV4, where.ipv4), (_IPV6, where.ipv6)):
        for m in matches(pattern, text, ranges):
            value, _, length = m.group().partition("/")
            if pattern is _IPV6 and (value.count(":") < 3 and "::" not in value or not any(c.isdigit() for c in value)):
                continue               # a time of day (12:30:45), a ratio, a C++ scope (Ab::Cd)
            try:
                address = ipaddress.ip_address(value)
            except ValueError:
                continue
            if length and int(length) > address.max_prefixlen:
                continue
            yield m, pattern, value, length, address


def _ips(text: str, where: "Candidates") -> Iterable[Span]:
    # Four dotted numbers with no word of their own around them are read as a version where the
    # text has a version of the same first (major) number that a word decides: "firmware
    # 4.2.1.0. Is that newer than 4.2.0.15?", "Firmware-Version 11.2.4.0 ... auf 11.3.0.2"; a
    # three-part number of the same first two numbers ("2.4.58.1 ... and 2.4.57"; a three-part
    # number is a version); or a number of five parts or more of the same first number (an
    # OID's, of first number 0, 1 or 2, makes any of those an OID's sibling: 2.5.4.3).
    # (Addresses of one network share their first number too, but a text rarely names a version
    # and an address of the same first number.)
    versions: set[str] = set()
    unread: list[tuple[str, Span]] = []
    for m, pattern, value, length, _ in addresses(text, where):
        span = Span("ip", m.start(), m.end())
        # 0.x.y.z is no host's address; versions, sections and OIDs are told by the words
        # around them, except with a prefix length, which only a network has (10.0.0.0/8).
        if pattern is _IPV4 and not length:
            if value.startswith("0.") and value != "0.0.0.0":
                continue
            if _product_version(text, m.start()):
                continue
            version = RULES.version_like(text, m.start(), m.end())
            first, second, _ = value.split(".", 2)
            if version:
                versions.add(first)
            if version is None:
                unread.append((first, first + "." + second, span))
            if version is not False:
                continue
        yield span
    if unread:
        versions |= _dotted_heads(text, where)
        for first, minor, span in unread:
            if first not in versions and minor not in versions:
                yield span
    if " > " in text:
        for m in matches(_TRACE, text, where.digits):
            for group in (1, 2):
                try:
                    ipaddress.IPv4Address(m.group(group))
                except ValueError:
                    continue
                yield Span("ip", m.start(group), m.end(group))


_PRIVATE_KEY = re.compile(r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY(?: BLOCK)?-----.*?(?:-----END [A-Z0-9 ]*PRIVATE KEY(?: BLOCK)?-----|\Z)",
                          re.DOTALL)


def _private_keys(text: str, where: "Candidates") -> Iterable[Span]:
    if "PRIVATE KEY" not in text:
        return
    for m in _PRIVATE_KEY.finditer(text):
        yield Span("private_key", m.start(), m.end())


def _emails(text: str, where: "Candidates") -> Iterable[Span]:
    for m in matches(_EMAIL, text, where.ats):
        yield Span("email", m.start(), m.end())


@dataclass(frozen=True)
class PiiSettings:
    phone_regions: tuple[str, ...] = DEFAULT_PHONE_REGIONS
    min_entropy: float = DEFAULT_MIN_ENTROPY
    grouped_phone_regions: tuple[str, ...] = GROUPED_PHONE_REGIONS


@functools.cache   # per settings: a policy's are built once, not on every text
def detector_functions(settings: PiiSettings) -> dict[str, Callable[[str, "Candidates", PhoneVerdicts], Iterable[Span]]]:
    # A phone word lets a national number count in more regions (pii_rules.toml), unless the
    # route names its own: then in those.
    context = RULES.phone_context_regions if settings.grouped_phone_regions else settings.phone_regions
    return {"email": lambda t, w, _: _emails(t, w),
            "phone": lambda t, w, judged: _phones(t, w, settings.phone_regions, settings.grouped_phone_regions, context, judged),
            "card": lambda t, w, _: _cards(t, w), "iban": lambda t, w, _: _ibans(t, w), "ip": lambda t, w, _: _ips(t, w),
            "secret": lambda t, w, _: secrets.find(t, w.runs, settings.min_entropy),
            "private_key": lambda t, w, _: _private_keys(t, w)}


# Without the compiled run finder (and for the IP detector's version and packet-trace patterns)
# the text is read in blocks; a block with a digit is scanned with the block before and the one
# after it. No character of a phone, card or IPv4 match lies further than 23 characters from a
# digit of it (a phone's leading "(" and spaces), nor of an IPv6 one from a colon, and no
# lookaround reads more than 2 beyond: every match lies in the blocks scanned. (IBANs are
# matched on the whole text from the digits these blocks hold: `_ibans`.)
_BLOCK = 32
# Each character's classes, one bit each: what the patterns' characters are made of.
_DIGIT_BIT, _COLON_BIT, _SPACE_DASH_BIT, _DOT_BIT, _SLASH_BIT, _SIGN_BIT, _LETTER_BIT, _HEX_BIT = (1 << i for i in range(8))


def _ascii_class(ch: str) -> int:
    return ((ch.isdigit() and _DIGIT_BIT) | (ch == ":" and _COLON_BIT) | (ch in " -" and _SPACE_DASH_BIT)
            | (ch == "." and _DOT_BIT) | (ch == "/" and _SLASH_BIT) | (ch in "+()" and _SIGN_BIT)
            | (ch.isalpha() and _LETTER_BIT) | (ch in "abcdefABCDEF" and _HEX_BIT))


_ASCII_CLASSES = bytes(_ascii_class(chr(i)) if i < 128 else 0 for i in range(256))
_BLOCK_STARTS = np.arange(0, 1 << 16, _BLOCK)
# Token characters as "a", all else (bytes of non-ASCII characters too) as " ".
_TOKEN_BYTES = bytes(97 if i < 128 and chr(i) in secrets.RUN_CHARS else 32 for i in range(256))
_LONG_RUN = b"a" * secrets.MIN_RUN
_DOMAIN_RUN = re.compile(r"[A-Za-z0-9.\u00c0-\u024f-]*")
_LOCAL_PART = 64     # an e-mail's local part is at most this long (_EMAIL)


@functools.cache
def _bmp_classes() -> np.ndarray:
    """The classes of each character of the Basic Multilingual Plane; U+FFFF stands for every
    character beyond it, counted as a digit (scanned around, never skipped)."""
    classes = np.zeros(0x10000, np.uint8)
    classes[:128] = np.frombuffer(_ASCII_CLASSES[:128], np.uint8)
    classes[[m.start() for m in re.finditer(r"\d", "".join(map(chr, range(0x10000))))]] |= _DIGIT_BIT
    classes[ord("\u2013")] |= _SIGN_BIT           # the en dash between a phone number's groups
    classes[0xFFFF] |= _DIGIT_BIT
    return classes


# The compiled run finder (sidecar/guard/compiled.py decides whether the build is current).
RUN_FINDER = NGRAMS.runs if NGRAMS is not None else None


# (member classes, counted classes, least, also counted, also least, lookahead): each pattern's
# characters, and what a run of them holds at least where the pattern can match in it. A phone
# candidate is 7 digits or more (`_phone_shaped`) among digits and signs; a card's digit groups,
# 13 digits among spaces and dashes; an IPv4 address, 3 points among digits (and the slash of
# its prefix length); an IBAN's start, two digits and two letters (the rest is matched on the
# whole text); an IPv6 address, three colons among hex digits and points (or "::", looked for
# apart). A match never leaves its run, and a run with less than that holds no match that
# counts, so a pattern that reads only such runs (and the characters its lookahead reads after
# them) finds what it finds over the whole text, reading a log's timestamps, order numbers and
# amounts once (in C) instead of trying each pattern at each of their digits.
_PHONE_RUNS = (_DIGIT_BIT | _SPACE_DASH_BIT | _DOT_BIT | _SLASH_BIT | _SIGN_BIT, _DIGIT_BIT, 7, 0, 0, 2)
_CARD_RUNS = (_DIGIT_BIT | _SPACE_DASH_BIT, _DIGIT_BIT, 13, 0, 0, 2)
_IPV4_RUNS = (_DIGIT_BIT | _DOT_BIT | _SLASH_BIT, _DOT_BIT, 3, _DIGIT_BIT, 4, 2)
_IBAN_RUNS = (_DIGIT_BIT | _LETTER_BIT, _DIGIT_BIT, 2, _LETTER_BIT, 2, 0)
_IPV6_RUNS = (_DIGIT_BIT | _HEX_BIT | _COLON_BIT | _DOT_BIT, _COLON_BIT, 3, 0, 0, 0)
_RUNS = (_PHONE_RUNS, _CARD_RUNS, _IPV4_RUNS, _IBAN_RUNS, _IPV6_RUNS)


@dataclass(frozen=True)
class Candidates:
    """Where in a text each detector's pattern can match: the runs of its characters that can
    hold a match (phone, card, IPv4, IBAN), character ranges around colons in a text that can
    hold an IPv6 address, around each at sign (e-mail), and the runs of 20 or more token
    characters (secrets). Without the compiled run finder, the ranges around digits for each
    pattern of digits."""
    ats: list[tuple[int, int]]
    runs: list[tuple[int, int]]
    phones: list[tuple[int, int]]
    cards: list[tuple[int, int]]
    ipv4: list[tuple[int, int]]
    ipv6: list[tuple[int, int]]
    ibans: list[tuple[int, int]]
    length: int
    classes: object = field(default=None, compare=False, repr=False)    # each character's classes; None: the whole text

    @functools.cached_property
    def digits(self) -> list[tuple[int, int]]:
        """The ranges around digits, where the IP detector's version and packet-trace patterns
        run (only for a text with a candidate address, or an arrow: worked out when read)."""
        if self.classes is None:
            return [(0, self.length)]
        return _around(_blocks(self.classes, self.length), _DIGIT_BIT, self.length)

    @classmethod
    def whole(cls, text: str) -> "Candidates":
        """Every pattern over the whole text: what `of` must find the same matches as."""
        everything = [(0, len(text))]
        return cls(everything if "@" in text else [], everything, everything, everything, everything,
                   everything if text.count(":") > 1 else [], everything, len(text))

    @classmethod
    def of(cls, text: str, runs=RUN_FINDER) -> "Candidates":
        """`runs`: the compiled run finder (_ngrams.runs: the runs of each of _RUNS in one
        pass); None: the ranges around digits for every pattern of digits (the same matches,
        more of the text read)."""
        n = len(text)
        if not n:
            return cls([], [], [], [], [], [], [], 0)
        ascii_text = text.isascii()
        if ascii_text:
            raw = text.encode("ascii")
            classes = raw.translate(_ASCII_CLASSES)
        else:
            raw = text.encode("utf-8", "surrogatepass")
            points = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), np.uint32)
            classes = _bmp_classes().take(np.minimum(points, 0xFFFF))
        ats, long_runs = _at_signs(text), _long_runs(raw, ascii_text)
        colons = text.count(":") > 1
        if runs is None:
            flags = _blocks(classes, n)
            digits = _around(flags, _DIGIT_BIT, n)
            return cls(ats, long_runs, digits, digits, digits, _around(flags, _COLON_BIT, n) if colons else [], digits, n, classes)
        phones, cards, ipv4, ibans, ipv6 = runs(classes, _RUNS)
        # Two colons are a time of day (12:30:45): the IPv6 pattern reads the text only where it
        # has "::" or three colons in a run of hex digits and points.
        ipv6 = colons and ("::" in text or ipv6)
        return cls(ats, long_runs, phones, cards, ipv4, _around(_blocks(classes, n), _COLON_BIT, n) if ipv6 else [], ibans, n, classes)


def _blocks(classes, n: int) -> np.ndarray:
    """The classes of each block of _BLOCK characters."""
    starts = _BLOCK_STARTS[:-(-n // _BLOCK)] if n <= 1 << 16 else np.arange(0, n, _BLOCK)
    return np.bitwise_or.reduceat(np.frombuffer(classes, np.uint8), starts)


def _around(flags: np.ndarray, bit: int, n: int) -> list[tuple[int, int]]:
    """The blocks with `bit`, each with its neighbours, merged, as character ranges."""
    out: list[tuple[int, int]] = []
    for index in np.flatnonzero(flags & bit).tolist():
        start, end = max(0, (index - 1) * _BLOCK), min(n, (index + 2) * _BLOCK)
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


def _at_signs(text: str) -> list[tuple[int, int]]:
    """Each at sign from the longest local part before it to the end of the domain characters
    after it (and one more, which the pattern's lookahead reads)."""
    out: list[tuple[int, int]] = []
    at = text.find("@")
    while at >= 0:
        start, end = max(0, at - _LOCAL_PART), min(len(text), _DOMAIN_RUN.match(text, at + 1).end() + 1)
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
        at = text.find("@", at + 1)
    return out


def _long_runs(raw: bytes, ascii_text: bool) -> list[tuple[int, int]]:
    """The runs of 20 or more token characters of the text whose UTF-8 is `raw`."""
    tokens = raw.translate(_TOKEN_BYTES)
    at = tokens.find(_LONG_RUN)
    out: list[tuple[int, int]] = []
    byte, char = 0, 0                # a byte offset already mapped to its character offset
    while at >= 0:                   # most prose: not once (no word of 20 token characters)
        end = tokens.find(b" ", at)
        end = len(tokens) if end < 0 else end
        # A run is ASCII: its characters are its bytes; before it, UTF-8 bytes are not
        # characters, counted from the previous run on (once each: linear in the text).
        start = at if ascii_text else char + len(raw[byte:at].decode("utf-8", "surrogatepass"))
        out.append((start, start + end - at))
        byte, char = end, start + end - at
        at = tokens.find(_LONG_RUN, end)
    return out


_FULL_WIDTH = {cp: cp - 0xFEE0 for cp in range(0xFF01, 0xFF5F)} | {0x3000: 0x20}
_FULL_WIDTH_ALNUM = re.compile("[\uff08\uff09\uff0b\uff0d\uff0e\uff10-\uff19\uff20-\uff3a\uff41-\uff5a]")


# Where spans overlap, the stricter check wins: a phone-number candidate also covers many IP
# addresses, cards and IBAN digits, which their own checks confirm more narrowly.
_PRIORITY = {name: rank for rank, name in enumerate(("private_key", "secret", "email", "iban", "card", "ip", "phone"))}


def find(text: str, detectors: Iterable[str], settings: PiiSettings = PiiSettings(),
         locate: Callable[[str], Candidates] = Candidates.of, phones: PhoneVerdicts | None = None) -> list[Span]:
    """Spans of the given detectors in `text`, in text order; of overlapping spans, the one of
    the stricter detector (_PRIORITY), then the longer, is kept. `locate` says where the
    patterns run (Candidates.whole: everywhere, the definition). `phones`: the phone verdicts
    of the request's other texts, checked under the same settings (one budget of parses for
    them all); without it, the text's own."""
    functions = detector_functions(settings)
    if not text.isascii() and _FULL_WIDTH_ALNUM.search(text):
        # Full-width digits, letters and signs (typed by Japanese and Chinese input methods)
        # become ASCII one character for one, so every offset stays valid for redaction.
        # Without a full-width digit, letter or number sign (most CJK text has only its
        # punctuation, ，。！) the text is left as it is.
        text = text.translate(_FULL_WIDTH)
    spans: list[Span] = []
    where = locate(text)
    phones = PhoneVerdicts() if phones is None else phones
    for name in detectors:
        spans.extend(functions[name](text, where, phones))
    return _without_overlaps(spans) if len(spans) > 1 else spans


def _without_overlaps(spans: list[Span]) -> list[Span]:
    """Of overlapping spans, the one of the stricter detector (_PRIORITY), then the longer,
    then the one found first; the spans kept, in text order."""
    spans = sorted(spans, key=lambda s: (_PRIORITY[s.detector], s.start - s.end))
    # The kept spans do not overlap: ordered by start, their ends are in order too, so the
    # only kept span that can overlap a new one is the last to start before it ends (a
    # bisection, not a comparison with every kept span: a text of many items, each also
    # found by a laxer detector, would cost quadratic time).
    bounds: list[tuple[int, int]] = []
    kept: list[Span] = []
    for span in spans:
        at = bisect.bisect_left(bounds, (span.end,))
        if at == 0 or bounds[at - 1][1] <= span.start:
            bounds.insert(at, (span.start, span.end))
            kept.append(span)
    return sorted(kept, key=lambda s: s.start)
