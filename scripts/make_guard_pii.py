"""Writes data/guard/pii.jsonl: prompts with planted personal data and look-alikes.

The sentences are hand-written (data/guard/pii_templates.json); this fills them with items in
many formats (valid checksums, national and international phone formats, grouped and compact
numbers) and with look-alikes that must not match (order and tracking numbers, versions,
dates, commit hashes, UUIDs). Seeded: the same file every run. Half the prompts are `dev`
(what detector settings may be tuned on), half `test` (reported only).
"""
from __future__ import annotations

import base64
import json
import random
import string
import sys
from pathlib import Path

import phonenumbers

ROOT = Path(__file__).resolve().parent.parent
TEMPLATES = ROOT / "data/guard/pii_templates.json"
OUT = ROOT / "data/guard/pii.jsonl"
COUNT_ITEM, COUNT_LOOKALIKE = 1200, 300


def luhn_complete(digits: str) -> str:
    total = 0
    for i, d in enumerate(reversed(digits + "0")):
        n = int(d)
        if i % 2 == 1:
            n = n * 2 - 9 if n > 4 else n * 2
        total += n
    return digits + str((10 - total % 10) % 10)


def luhn_ok(digits: str) -> bool:
    return luhn_complete(digits[:-1]) == digits


def card(rng: random.Random) -> str:
    prefix, length, groups = rng.choice([("4", 16, (4, 4, 4, 4)), ("5" + rng.choice("12345"), 16, (4, 4, 4, 4)),
                                         ("3" + rng.choice("47"), 15, (4, 6, 5)), ("6011", 16, (4, 4, 4, 4)),
                                         ("35" + rng.choice("2345678"), 16, (4, 4, 4, 4))])
    body = prefix + "".join(rng.choice(string.digits) for _ in range(length - len(prefix) - 1))
    number = luhn_complete(body)
    sep = rng.choice(["", " ", "-", " "])
    out, at = [], 0
    for g in groups:
        out.append(number[at:at + g])
        at += g
    return sep.join(out)


IBAN_BBAN = {"DE": "8n10n", "FR": "10n11c2n", "GB": "4a14n", "AT": "5n11n", "PL": "8n16n", "IT": "1a10n12c", "NL": "4a10n", "CH": "5n12c"}


def iban(rng: random.Random) -> str:
    country = rng.choice(sorted(IBAN_BBAN))
    spec, bban, num = IBAN_BBAN[country], "", ""
    for ch in spec:
        if ch.isdigit():
            num += ch
            continue
        alphabet = {"n": string.digits, "a": string.ascii_uppercase, "c": string.digits + string.ascii_uppercase}[ch]
        bban += "".join(rng.choice(alphabet) for _ in range(int(num)))
        num = ""
    moved = bban + country + "00"
    value = int("".join(str(int(c, 36)) for c in moved))
    check = 98 - value % 97
    compact = f"{country}{check:02d}{bban}"
    if rng.random() < 0.5:
        return " ".join(compact[i:i + 4] for i in range(0, len(compact), 4))
    return compact


PHONE_REGIONS = ("US", "GB", "DE", "FR", "ES", "IT", "CN", "JP", "RU", "BR", "IN")
LANG_REGION = {"en": "US", "de": "DE", "fr": "FR", "es": "ES", "it": "IT", "pt": "BR", "zh": "CN", "ja": "JP", "ru": "RU"}


def phone(rng: random.Random, lang: str) -> str:
    region = LANG_REGION[lang] if rng.random() < 0.6 else rng.choice(PHONE_REGIONS)
    kind = rng.choice([phonenumbers.PhoneNumberType.MOBILE, phonenumbers.PhoneNumberType.FIXED_LINE])
    example = phonenumbers.example_number_for_type(region, kind) or phonenumbers.example_number(region)
    for _ in range(50):
        national = str(example.national_number)
        keep = max(3, len(national) - 4)
        candidate = national[:keep] + "".join(rng.choice(string.digits) for _ in range(len(national) - keep))
        number = phonenumbers.parse("+" + str(example.country_code) + candidate)
        if phonenumbers.is_valid_number(number):
            break
    else:
        number = example
    fmt = rng.choice(["e164", "intl", "intl", "national"]) if region == LANG_REGION[lang] else rng.choice(["e164", "intl"])
    if fmt == "e164":
        return phonenumbers.format_number(number, phonenumbers.PhoneNumberFormat.E164)
    if fmt == "intl":
        return phonenumbers.format_number(number, phonenumbers.PhoneNumberFormat.INTERNATIONAL)
    return phonenumbers.format_number(number, phonenumbers.PhoneNumberFormat.NATIONAL)


NAMES = ["anna.schmidt", "j.doe", "maria_garcia", "li.wei", "tanaka", "o.ivanova", "pierre+news", "k.nguyen99", "sam"]
DOMAINS = ["example.com", "mail.example.de", "corp.example.co.uk", "example.fr", "example.cn", "uni-example.edu", "example.io"]


def email(rng: random.Random) -> str:
    return f"{rng.choice(NAMES)}@{rng.choice(DOMAINS)}"


def ip(rng: random.Random) -> str:
    if rng.random() < 0.7:
        return ".".join(str(rng.randint(1, 254)) for _ in range(4))
    return ":".join(f"{rng.randint(0, 0xffff):x}" for _ in range(8)) if rng.random() < 0.5 else \
        f"2001:db8:{rng.randint(1, 0xfff):x}::{rng.randint(1, 0xfff):x}"


def _token(rng: random.Random, n: int, alphabet: str = string.ascii_letters + string.digits) -> str:
    return "".join(rng.choice(alphabet) for _ in range(n))


def secret(rng: random.Random) -> str:
    kind = rng.randrange(8)
    if kind == 0:
        return "sk-" + _token(rng, 48)
    if kind == 1:
        return "sk-proj-" + _token(rng, 40, string.ascii_letters + string.digits + "_-")
    if kind == 2:
        return "ghp_" + _token(rng, 36)
    if kind == 3:
        return "AKIA" + _token(rng, 16, string.ascii_uppercase + string.digits)
    if kind == 4:
        return "xoxb-" + "-".join(_token(rng, n, string.digits) for n in (11, 12)) + "-" + _token(rng, 24)
    if kind == 5:
        return "AIza" + _token(rng, 35, string.ascii_letters + string.digits + "_-")
    if kind == 6:
        return "sk_live_" + _token(rng, 24)
    header = base64.urlsafe_b64encode(b'{"alg":"HS256","typ":"JWT"}').decode().rstrip("=")
    payload = base64.urlsafe_b64encode(json.dumps({"sub": _token(rng, 8)}).encode()).decode().rstrip("=")
    return f"{header}.{payload}.{_token(rng, 43, string.ascii_letters + string.digits + '_-')}"


def private_key(rng: random.Random) -> str:
    kind = rng.choice(["RSA PRIVATE KEY", "PRIVATE KEY", "OPENSSH PRIVATE KEY", "EC PRIVATE KEY"])
    body = "\n".join(_token(rng, 64, string.ascii_letters + string.digits + "+/") for _ in range(rng.randint(2, 5)))
    return f"-----BEGIN {kind}-----\n{body}\n-----END {kind}-----"


def lookalike(rng: random.Random) -> tuple[str, str]:
    kind = rng.randrange(9)
    if kind == 0:        # a 16-digit order number whose checksum fails
        while True:
            n = _token(rng, 16, string.digits)
            if not luhn_ok(n):
                return "order_number", n
    if kind == 1:
        return "order_number", f"ORD-{rng.randint(2020, 2026)}-{rng.randint(100000, 999999)}"
    if kind == 2:
        return "version", f"{rng.randint(1, 20)}.{rng.randint(0, 30)}.{rng.randint(0, 99)}"
    if kind == 3:
        return "version", f"v{rng.randint(1, 9)}.{rng.randint(0, 9)}.{rng.randint(0, 9)}.{rng.randint(0, 9)}"
    if kind == 4:
        return "date", rng.choice([f"{rng.randint(2000, 2030)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}",
                                   f"{rng.randint(1, 28):02d}.{rng.randint(1, 12):02d}.{rng.randint(2000, 2030)}",
                                   f"{rng.randint(1, 12)}/{rng.randint(1, 28)}/{rng.randint(2000, 2030)}"])
    if kind == 5:
        return "tracking", "1Z" + _token(rng, 16, string.ascii_uppercase + string.digits)
    if kind == 6:
        return "commit", _token(rng, 40, "0123456789abcdef")
    if kind == 7:
        u = _token(rng, 32, "0123456789abcdef")
        return "uuid", f"{u[:8]}-{u[8:12]}-{u[12:16]}-{u[16:20]}-{u[20:]}"
    return "build", f"10.0.{rng.randint(19000, 22999)}.{rng.randint(1000, 4000)}"


def make_item(rng: random.Random, lang: str) -> tuple[str, str]:
    detector = rng.choice(["email", "phone", "card", "iban", "ip", "secret", "secret", "private_key"])
    value = {"email": lambda: email(rng), "phone": lambda: phone(rng, lang), "card": lambda: card(rng),
             "iban": lambda: iban(rng), "ip": lambda: ip(rng), "secret": lambda: secret(rng),
             "private_key": lambda: private_key(rng)}[detector]()
    return detector, value


def fill(template: str, item: tuple[str, str] | None, look: tuple[str, str] | None) -> dict:
    text, items, looks = template, [], []
    for slot, got, into in (("{ITEM}", item, items), ("{LOOK}", look, looks)):
        if slot in text:
            at = text.index(slot)
            text = text[:at] + got[1] + text[at + len(slot):]
            into.append({"kind" if into is looks else "detector": got[0], "value": got[1]})
    return {"text": text, "items": items, "lookalikes": looks}


def main() -> int:
    templates = json.loads(TEMPLATES.read_text(encoding="utf-8"))
    rng = random.Random(22)
    rows = []
    langs = sorted(templates["item"])
    for i in range(COUNT_ITEM):
        lang = langs[i % len(langs)]
        template = rng.choice(templates["item"][lang])
        row = fill(template, make_item(rng, lang), lookalike(rng))
        rows.append({"id": f"pii-{i:03d}", "lang": lang, **row})
    langs = sorted(templates["lookalike"])
    for i in range(COUNT_LOOKALIKE):
        lang = langs[i % len(langs)]
        row = fill(rng.choice(templates["lookalike"][lang]), None, lookalike(rng))
        rows.append({"id": f"look-{i:03d}", "lang": lang, **row})
    with OUT.open("w", encoding="utf-8") as f:
        for n, row in enumerate(rows):
            row["split"] = "test" if n % 2 else "dev"
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"wrote {len(rows)} prompts to {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
