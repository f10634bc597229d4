"""Check a hand-written personal-data file (pii_handwritten.txt format) before it is used.

    python scripts/check_pii_holdout.py data/guard/pii_holdout2.txt

A planted value that fails its own checksum would measure the writer, not the detector, so
every card must pass Luhn, every IBAN `stdnum.iban`, every phone number libphonenumber for a
region of the prompt's language, every IP `ipaddress`. A look-alike of card length must not be
Luhn-valid (unless its own scheme uses Luhn, like SIRET) and none may be a valid IBAN. A held-out
prompt near one the detectors were built on is not held out, so each text's character 5-gram
Jaccard similarity with the other data files is printed as a number only (their texts are not
shown). Exits 1 on any failure.
"""

import ipaddress
import json
import re
import sys
from pathlib import Path

import phonenumbers
from stdnum import iban, luhn

ITEM = re.compile(r"\[\[(\w+)\|(.*?)\]\]")
LOOK = re.compile(r"\{\{([^|{}]+)\|(.*?)\}\}")
DETECTORS = {"email", "phone", "card", "iban", "ip", "secret", "private_key"}
# Look-alike kinds whose own check digit is Luhn: a valid one is the realistic case.
LUHN_KINDS = {"siret", "imei"}
REGIONS = {
    "en": "US GB AU CA IE NZ IN SG ZA", "de": "DE AT CH", "fr": "FR BE CH CA",
    "es": "ES MX AR CO CL PE", "pt": "BR PT", "it": "IT CH", "nl": "NL BE", "pl": "PL",
    "zh": "CN TW HK SG", "ja": "JP", "ko": "KR", "ru": "RU", "ar": "SA AE EG MA", "tr": "TR",
    "sv": "SE", "hi": "IN", "vi": "VN", "da": "DK", "no": "NO", "fi": "FI", "cs": "CZ",
    "el": "GR", "he": "IL", "id": "ID", "uk": "UA", "th": "TH", "hu": "HU", "ro": "RO",
}
NEAR = 0.5
DATA = Path(__file__).resolve().parent.parent / "data" / "guard"
OTHERS = ("pii_handwritten.txt", "pii_holdout.txt", "pii_holdout2.txt", "pii.jsonl")


def read_txt(path):
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.startswith("#"):
            lang, text = line.split("\t", 1)
            yield lang, text


def phone_ok(value, lang):
    digits = value.translate(str.maketrans("０１２３４５６７８９＋", "0123456789+"))
    for region in REGIONS.get(lang, "US").split():
        try:
            if phonenumbers.is_valid_number(phonenumbers.parse(digits, region)):
                return True
        except phonenumbers.NumberParseException:
            pass
    return False


def ip_ok(value):
    for cand in (value, re.sub(r":\d+$", "", value)):
        try:
            ipaddress.ip_network(cand.split("%")[0], strict=False)
            return True
        except ValueError:
            pass
    return False


def item_errors(lang, det, value):
    if det not in DETECTORS:
        return "unknown detector"
    if det == "card" and not luhn.is_valid(re.sub(r"\D", "", value)):
        return "not Luhn-valid"
    if det == "iban" and not iban.is_valid(value):
        return "invalid IBAN"
    if det == "phone" and not phone_ok(value, lang):
        return "not a valid number for a region of " + lang
    if det == "ip" and not ip_ok(value):
        return "not an IP address or network"
    if det == "email" and not re.fullmatch(r"[^@\s]+@[^@\s]+\.[^@\s]+", value):
        return "not an e-mail address"
    return None


def lookalike_errors(kind, value):
    digits = re.sub(r"\D", "", value)
    card_shaped = re.fullmatch(r"[\d \-]+", value) and 13 <= len(digits) <= 19
    if card_shaped and kind not in LUHN_KINDS and luhn.is_valid(digits):
        return "Luhn-valid"
    if iban.is_valid(value):
        return "a valid IBAN"
    return None


def grams(text):
    text = LOOK.sub(lambda m: m[2], ITEM.sub(lambda m: m[2], text))
    text = re.sub(r"\s+", " ", text.lower()).strip()
    return {text[i:i + 5] for i in range(max(1, len(text) - 4))}


def reference_grams(checked):
    refs = []
    for name in OTHERS:
        path = DATA / name
        if path.resolve() == checked.resolve() or not path.exists():
            continue
        if name.endswith(".jsonl"):
            texts = (json.loads(line)["text"] for line in path.open(encoding="utf-8"))
        else:
            texts = (text for _, text in read_txt(path))
        refs.extend(grams(t) for t in texts)
    return refs


def main(path):
    path = Path(path)
    rows = list(read_txt(path))
    failures = 0
    for n, (lang, text) in enumerate(rows, 1):
        rest = LOOK.sub("", ITEM.sub("", text))
        if any(mark in rest for mark in ("[[", "]]", "{{", "}}")):
            print(f"prompt {n}: unbalanced markup")
            failures += 1
        for det, value in ITEM.findall(text):
            if err := item_errors(lang, det, value):
                print(f"prompt {n}: {det} {value!r}: {err}")
                failures += 1
        for kind, value in LOOK.findall(text):
            if err := lookalike_errors(kind, value):
                print(f"prompt {n}: look-alike {kind} {value!r}: {err}")
                failures += 1
    refs = reference_grams(path)
    own = [grams(text) for _, text in rows]
    worst = 0.0
    for n, g in enumerate(own, 1):
        others = refs + own[:n - 1] + own[n:]
        score = max((len(g & r) / len(g | r) for r in others), default=0.0)
        worst = max(worst, score)
        if score > NEAR:
            print(f"prompt {n}: 5-gram Jaccard {score:.2f} with another text")
            failures += 1
    print(f"{len(rows)} prompts, {sum(len(ITEM.findall(t)) for _, t in rows)} items, "
          f"{sum(len(LOOK.findall(t)) for _, t in rows)} look-alikes, "
          f"highest Jaccard {worst:.2f}, {failures} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
