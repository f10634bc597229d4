"""Experiment: a learned keep/drop decision over the phone, IP and secret detectors'
candidates against the shipped rules, by grouped cross-validation by file (docs/guard-quality.md,
"Personal data: a learned decision over candidates").

A candidate is what the detector's pattern proposes and its hard check accepts: libphonenumber
finds it a valid number of some region (pii.py's regions and `context_regions`), `ipaddress`
parses it, or (secrets) the rules find it at the default entropy bound, at none, or it is a
run of 16 or more token characters. Its features need no word list: the candidate's shape
(digits, signs, groups; a token's length, character classes, entropy, first characters), the
validator's outputs (valid with a country code, in a default region as written at home,
grouped as the region formats it, the number's type; the address's kind; which secret rule
path found the token), the kind of line it sits in (CSV, JSON, key=value, log), and hashed
character n-grams of the text around it, which carry context words of any language without
anyone listing them. A logistic regression per detector over hashed features (numpy,
full-batch, deterministic).

    nice -n 19 .venv/bin/python scripts/exp_pii_learned.py [--detectors phone,ip,secret]
    nice -n 19 .venv/bin/python scripts/exp_pii_learned.py --without-context-words
    nice -n 19 .venv/bin/python scripts/exp_pii_learned.py --blind data/guard/pii_holdout5.txt

Sources (one group each): pii.jsonl (generated), pii_handwritten.txt, pii_holdout.txt,
pii_holdout2.txt, pii_holdout3.txt, pii_holdout4.txt. For each, a model per detector is trained
on the other five (plus half of the ordinary and paraphrase prompts, every candidate in them a
negative, by a hash of the prompt) and scores the held-out file; its threshold is chosen on the
training files alone (leave one training file out: the lowest score at which the out-of-fold
candidates reach 0.98 precision). The other detectors' spans are the shipped ones, and overlaps
are resolved as pii.find resolves them, so the figures are those `make eval-guard` would print.
Per detector: precision and recall of the rules and of the model on the held-out files, each
file and pooled, with Wilson 95% intervals, and a paired bootstrap over prompts of the pooled
difference; false matches on the other half of the ordinary and paraphrase prompts. Writes
reports/pii_learned.json (~5 minutes). `--without-context-words`: the shipped rules with their
phone and IP context word lists off, per file (reports/pii_without_context_words.json).
`--blind FILE`: the rules and the models trained on all six files (thresholds chosen on them
as above) on a file never used, per detector (reports/pii_learned_blind.json); the
cross-validation never reads pii_holdout5.txt.
"""
from __future__ import annotations

import argparse
import ipaddress
import json
import re
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np
import phonenumbers

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench import stats  # noqa: E402
from bench.guard import pii_rates, pii_row_counts  # noqa: E402
from bench.guard_data import (PII_HANDWRITTEN, PII_HOLDOUT, PII_HOLDOUT2, PII_HOLDOUT3,  # noqa: E402
                              PII_HOLDOUT4, pii_examples, pii_handwritten)
from sidecar.guard import pii, secrets  # noqa: E402
from sidecar.guard.pii_rules import RULES  # noqa: E402
from sidecar.guard.spans import Span  # noqa: E402

# --- candidates and their features ------------------------------------------------------------

BUCKETS = 1 << 14
_BEFORE, _NEAR, _AFTER = 32, 8, 12
_DIGITS = str.maketrans("0123456789", "0000000000")
_SEPARATORS = re.compile(r"[ ().\-–/]+")


@dataclass(frozen=True)
class Candidate:
    detector: str
    start: int
    end: int
    features: tuple[str, ...]


def hashed(features: Iterable[str]) -> np.ndarray:
    """The features' buckets (crc32: the same in every process, unlike hash())."""
    return np.unique(np.fromiter((zlib.crc32(f.encode("utf-8", "surrogatepass")) % BUCKETS for f in features), np.int64))


def _grams(tag: str, window: str, sizes=(2, 3, 4)) -> list[str]:
    window = window.lower().translate(_DIGITS)
    return [f"{tag}{n}:{window[i:i + n]}" for n in sizes for i in range(len(window) - n + 1)]


def _line_kind(text: str, start: int) -> str:
    line_start = text.rfind("\n", 0, start) + 1
    line_end = text.find("\n", start)
    line = text[line_start:line_end if line_end >= 0 else len(text)]
    if '":' in line or "':" in line:
        return "json"
    if line.count(",") >= 2 or line.count("\t") >= 2 or line.count("|") >= 2 or line.count(";") >= 2:
        return "table"
    if re.match(r"\s*[\[\d]", line) and re.search(r"\d\d:\d\d", line):
        return "log"
    if re.match(r"\s*[\w.-]+\s*[=:]", line):
        return "kv"
    return "prose"


def _context(text: str, start: int, end: int) -> list[str]:
    before = text[max(0, start - _BEFORE):start]
    near = text[max(0, start - _NEAR):start]
    after = text[end:end + _AFTER]
    out = _grams("b", before) + _grams("n", near) + _grams("a", after, (1, 2, 3))
    out.append("line=" + _line_kind(text, start))
    out.append("prev=" + (text[start - 1:start].translate(_DIGITS) or "^"))
    out.append("next=" + (text[end:end + 1].translate(_DIGITS) or "$"))
    return out


def _shape(value: str) -> list[str]:
    groups = [g for g in _SEPARATORS.split(value) if g]
    signs = "".join(_SEPARATORS.findall(value))
    return [f"len={len(value)}", f"groups={min(len(groups), 8)}", f"signs={''.join(sorted(set(signs)))}",
            "grouping=" + "-".join(str(len(g)) for g in groups[:6]), f"first={value[:1].translate(_DIGITS)}",
            f"head={value[:2]}"]


_TYPES = {phonenumbers.PhoneNumberType.MOBILE: "mobile", phonenumbers.PhoneNumberType.FIXED_LINE: "fixed",
          phonenumbers.PhoneNumberType.FIXED_LINE_OR_MOBILE: "fixed_or_mobile",
          phonenumbers.PhoneNumberType.TOLL_FREE: "toll_free"}


def _phone_readings(candidate: str) -> list[str]:
    """The validator's outputs: which readings of the candidate libphonenumber accepts. Empty
    where none does (then it is no candidate)."""
    value = "+" + candidate[2:] if candidate.startswith("00") else candidate
    digits = pii._NOT_DIGIT.sub("", value)
    out: list[str] = []
    if value.startswith(("+", "(+")):
        try:
            number = phonenumbers.parse(value, None, keep_raw_input=True)
        except phonenumbers.NumberParseException:
            return []
        if not phonenumbers.is_valid_number(number):
            return []
        out += ["intl", "intl_type=" + _TYPES.get(phonenumbers.number_type(number), "other"),
                f"intl_grouped={pii._grouped_as_formatted(value, number)}",
                "intl_cc=" + str(number.country_code)]
        return out
    bare = pii._NOT_DIGIT.search(value) is None
    for region in RULES.phone_context_regions:
        if not pii._could_be(region, digits):
            continue
        try:
            number = phonenumbers.parse(value, region, keep_raw_input=True)
        except phonenumbers.NumberParseException:
            continue
        if not phonenumbers.is_valid_number(number):
            continue
        home = "default" if region in pii.DEFAULT_PHONE_REGIONS else "grouped" if region in pii.GROUPED_PHONE_REGIONS else "other"
        written = pii._written_nationally(value, number)
        national = pii._national_digits(number, digits)
        strict = pii._grouped_as_formatted(value, number)
        exact = pii._grouped_as_formatted(value, number, exactly=True)
        kind = _TYPES.get(phonenumbers.number_type(number), "other")
        out += [f"valid_{home}", f"valid_{home}_written={written}", f"valid_{home}_strict={written and strict}",
                f"valid_{home}_exact={written and exact}", f"valid_national_strict={national and strict}",
                f"type_{home}={kind}", f"bare_{home}_type={bare and kind}"]
    regions = sum(1 for f in out if f.startswith("type_"))
    return sorted(set(out)) + ([f"regions={min(regions, 4)}"] if out else [])


def phone_candidates(text: str) -> list[Candidate]:
    out = []
    for m in pii._PHONE.finditer(text):
        candidate = m.group()
        if "/" in candidate and not pii._AREA_SLASH.fullmatch(candidate):
            continue
        if not 7 <= sum(ch.isdigit() for ch in candidate) <= 15:
            continue
        readings = _phone_readings(candidate)
        if not readings:
            continue
        features = ["bias", *readings, *_shape(candidate), *_context(text, m.start(), m.end())]
        if pii._DATE.fullmatch(candidate) or pii._TIMESTAMP.match(candidate):
            features.append("date")
        if pii._DECIMAL.fullmatch(candidate):
            features.append("decimal")
        if pii._CODE_BEFORE.search(text, max(0, m.start() - 16), m.start()):
            features.append("code_before")
        out.append(Candidate("phone", m.start(), m.end(), tuple(features)))
    # Numbers come in lists ("+61 3 9011 4728, 1300 975 707"): whether the previous candidate
    # stands just before, with only signs between, and whether the text holds a number with a
    # country code.
    intl = any("intl" in c.features for c in out)
    for k, c in enumerate(out):
        gap = text[out[k - 1].end:c.start] if k else None
        listed = gap is not None and len(gap) <= 24 and _LIST_GAP.fullmatch(gap) is not None
        out[k] = Candidate("phone", c.start, c.end, c.features + (f"listed={listed}", f"text_intl={intl}"))
    return out


_LIST_GAP = re.compile(r"[\s,;/|·•]*")


def _octets(value: str) -> list[str]:
    parts = [int(p) for p in value.split(".")]
    return [f"o1={parts[0] if parts[0] in (0, 1, 2, 10, 127, 169, 172, 192, 255) else 'x'}",
            f"small={sum(p < 10 for p in parts)}", f"o4={'0' if parts[3] == 0 else '1' if parts[3] == 1 else 'x'}",
            f"big={sum(p > 99 for p in parts)}", f"zeros={sum(p == 0 for p in parts)}"]


def ip_candidates(text: str, where: pii.Candidates | None = None) -> list[Candidate]:
    where = where or pii.Candidates.whole(text)
    heads = None
    out = []
    for m, _, value, length, address in pii.addresses(text, where):
        features = ["bias", f"v{address.version}", f"cidr={bool(length)}", f"private={address.is_private}",
                    f"global={address.is_global}", f"loopback={address.is_loopback}",
                    f"link_local={address.is_link_local}", f"multicast={address.is_multicast}",
                    f"reserved={address.is_reserved}", f"unspecified={address.is_unspecified}"]
        if address.version == 4:
            if heads is None:
                heads = pii._dotted_heads(text, where)
            first, second, _ = value.split(".", 2)
            features += _octets(value)
            features += [f"product={pii._product_version(text, m.start())}",
                         f"head_major={first in heads}", f"head_minor={first + '.' + second in heads}"]
        else:
            features += [f"groups6={value.count(':')}", f"compressed={'::' in value}"]
        features += _context(text, m.start(), m.end())
        out.append(Candidate("ip", m.start(), m.end(), tuple(features)))
    if " > " in text:
        for m in pii.matches(pii._TRACE, text, where.digits):
            for group in (1, 2):
                try:
                    ipaddress.IPv4Address(m.group(group))
                except ValueError:
                    continue
                out.append(Candidate("ip", m.start(group), m.end(group), ("bias", "trace", "v4")))
    return out


CANDIDATES = {"phone": phone_candidates, "ip": ip_candidates}


@dataclass(frozen=True)
class Model:
    """A logistic regression over hashed features, and the score at which a candidate is kept."""
    weights: np.ndarray
    threshold: float

    def scores(self, candidates: list[Candidate]) -> np.ndarray:
        return np.array([1 / (1 + np.exp(-float(self.weights[hashed(c.features)].sum()))) for c in candidates])


_RUN = re.compile(r"[A-Za-z0-9_.+/=-]{16,}")


def _bucket(value: float, step: float) -> str:
    return f"{round(value / step) * step:.2f}"


def _token_shape(value: str) -> list[str]:
    classes = "".join(c for c, test in (("l", str.islower), ("u", str.isupper), ("d", str.isdigit)) if any(map(test, value)))
    signs = "".join(sorted(set(c for c in value if not c.isalnum())))
    hexish = all(c in "0123456789abcdefABCDEF-" for c in value)
    return [f"tlen={min(len(value), 120) // 8}", f"classes={classes}", f"tsigns={signs}", f"hex={hexish}",
            f"entropy={_bucket(secrets.entropy(value), 0.25)}", f"mixed={secrets._mixed(value)}",
            f"known={RULES.known.search(value) is not None}",
            f"placeholder={RULES.placeholder.search(value) is not None}", f"t3={value[:3]}", f"t4={value[:4]}",
            f"digits={_bucket(sum(c.isdigit() for c in value) / len(value), 0.1)}"]


def secret_candidates(text: str, where: pii.Candidates | None = None) -> list[Candidate]:
    """The secret rules' spans at the default entropy, those found at no entropy bound, and every
    other run of 16 or more token characters: each with the path that found it as a feature."""
    where = where or pii.Candidates.whole(text)
    runs = where.runs
    found: dict[tuple[int, int], str] = {}
    for span in secrets.find(text, runs, secrets.DEFAULT_MIN_ENTROPY):
        found.setdefault((span.start, span.end), "rule")
    for span in secrets.find(text, runs, 0.0):
        found.setdefault((span.start, span.end), "low_entropy")
    for m in _RUN.finditer(text):
        start, end = m.start(), m.end() - (len(m.group()) - len(m.group().rstrip(".")))
        if end - start >= 16 and not any(a < end and start < b for a, b in found):
            found[(start, end)] = "run"
    out = []
    for (start, end), path in sorted(found.items()):
        value = text[start:end]
        features = ["bias", "path=" + path, *_token_shape(value), *_context(text, start, end)]
        out.append(Candidate("secret", start, end, tuple(features)))
    return out


CANDIDATES["secret"] = secret_candidates


# --- the experiment ----------------------------------------------------------------------------

LEARNED = ("phone", "ip", "secret")
TARGET_PRECISION = 0.98
STEPS, L2 = 300, 1e-3


def sources() -> dict[str, list[dict]]:
    out = {"generated": pii_examples(), "handwritten": pii_handwritten(PII_HANDWRITTEN, holdout=True)}
    for name, path in (("holdout", PII_HOLDOUT), ("holdout2", PII_HOLDOUT2), ("holdout3", PII_HOLDOUT3),
                       ("holdout4", PII_HOLDOUT4)):
        out[name] = pii_handwritten(path, holdout=True)
    return out


def ordinary_prompts() -> list[str]:
    """The distinct paraphrase and ordinary prompts (none holds personal data)."""
    from check_pii_false_matches import FILES, texts
    seen = dict.fromkeys(texts(*FILES["paraphrase"]))
    seen.update(dict.fromkeys(texts(*FILES["ordinary"])))
    return list(seen)


def _text(text: str) -> str:
    return text.translate(pii._FULL_WIDTH) if not text.isascii() and pii._FULL_WIDTH_ALNUM.search(text) else text


class Featurised:
    """Every candidate of a set of prompts, with its row, label and hashed features."""

    def __init__(self, rows: list[dict], detector: str):
        self.rows, self.row_of, self.labels, self.spans, features = rows, [], [], [], []
        find = CANDIDATES[detector]
        for r, row in enumerate(rows):
            text = _text(row["text"])
            items = [(a, b) for d, a, b in _bounds(row) if d == detector]
            for c in find(text):
                self.row_of.append(r)
                self.spans.append((c.start, c.end))
                self.labels.append(int(any(a < c.end and c.start < b for a, b in items)))
                features.append(hashed(c.features))
        self.row_of, self.labels = np.array(self.row_of, np.int64), np.array(self.labels, np.float64)
        self.indptr = np.concatenate([[0], np.cumsum([len(f) for f in features])]).astype(np.int64)
        self.indices = np.concatenate(features) if features else np.zeros(0, np.int64)

    def take(self, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        rows = np.flatnonzero(mask)
        parts = [self.indices[self.indptr[i]:self.indptr[i + 1]] for i in rows]
        indptr = np.concatenate([[0], np.cumsum([len(p) for p in parts])]).astype(np.int64)
        return (np.concatenate(parts) if parts else np.zeros(0, np.int64)), indptr, self.labels[rows]


def _bounds(row: dict) -> list[tuple[str, int, int]]:
    from bench.guard import pii_item_bounds
    return pii_item_bounds(row) if row.get("items") else []


def margins(weights: np.ndarray, indices: np.ndarray, indptr: np.ndarray) -> np.ndarray:
    if len(indptr) == 1:
        return np.zeros(0)
    return np.add.reduceat(weights[indices], indptr[:-1])


def train(indices: np.ndarray, indptr: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Logistic regression, full-batch Adam from zero (deterministic)."""
    l2, steps = L2, STEPS
    w = np.zeros(BUCKETS)
    m, v = np.zeros_like(w), np.zeros_like(w)
    counts = np.diff(indptr)
    n = len(labels)
    for t in range(1, steps + 1):
        p = 1 / (1 + np.exp(-margins(w, indices, indptr)))
        g = np.bincount(indices, weights=np.repeat(p - labels, counts), minlength=len(w)) / n + l2 * w
        m = 0.9 * m + 0.1 * g
        v = 0.999 * v + 0.001 * g * g
        w -= 0.05 * (m / (1 - 0.9 ** t)) / (np.sqrt(v / (1 - 0.999 ** t)) + 1e-8)
    return w


def threshold_for(scores: np.ndarray, labels: np.ndarray) -> float:
    """The lowest score at which the candidates kept reach TARGET_PRECISION (precision first;
    then as much recall as that allows)."""
    order = np.argsort(-scores, kind="stable")
    tp = np.cumsum(labels[order])
    precision = tp / np.arange(1, len(order) + 1)
    ok = np.flatnonzero(precision >= TARGET_PRECISION)
    if not len(ok):
        return 1.0
    return float(scores[order][ok[-1]])


def fit(data: dict[str, Featurised], train_groups: list[str]) -> Model:
    """A model on `train_groups`, its threshold from leave-one-group-out scores on them."""
    def stack(groups):
        parts = [data[g].take(np.ones(len(data[g].labels), bool)) for g in groups]
        indices = np.concatenate([p[0] for p in parts])
        offsets = np.cumsum([0] + [p[1][-1] for p in parts[:-1]])
        indptr = np.concatenate([[0]] + [p[1][1:] + o for p, o in zip(parts, offsets)])
        return indices, indptr, np.concatenate([p[2] for p in parts])

    held_scores, held_labels = [], []
    files = [g for g in train_groups if not g.startswith("ordinary")]
    for out in files:
        w = train(*stack([g for g in train_groups if g != out]))
        i, p, y = stack([out])
        held_scores.append(1 / (1 + np.exp(-margins(w, i, p))))
        held_labels.append(y)
    w = train(*stack(train_groups))
    return Model(w, threshold_for(np.concatenate(held_scores), np.concatenate(held_labels)))


def compare(models: dict[str, "Model"], featurised: dict[str, Featurised], rows: list[dict],
            per_prompt: dict[str, list] | None = None) -> dict[str, dict]:
    """tp / fp / fn per detector of the rules and of the models on `rows` (the models' detectors'
    spans in place of the rules', the others' as shipped, overlaps resolved as pii.find does);
    each prompt's counts appended to `per_prompt`."""
    kept: dict[int, list[Span]] = {}
    for d, model in models.items():
        f = featurised[d]
        i, p, _ = f.take(np.ones(len(f.labels), bool))
        scores = 1 / (1 + np.exp(-margins(model.weights, i, p)))
        for k in np.flatnonzero(scores >= model.threshold):
            kept.setdefault(int(f.row_of[k]), []).append(Span(d, *f.spans[k]))
    others = tuple(x for x in pii.DETECTORS if x not in models)
    totals = {k: {x: {"tp": 0, "fp": 0, "fn": 0} for x in pii.DETECTORS} for k in ("rules", "learned")}
    for r, row in enumerate(rows):
        text = row["text"]
        rules = pii.find(text, pii.DETECTORS)
        learned = pii._without_overlaps(pii.find(text, others) + kept.get(r, []))
        for key, spans in (("rules", rules), ("learned", learned)):
            counts = pii_row_counts(row, spans)
            if per_prompt is not None:
                per_prompt[key].append(counts)
            for x, c in counts.items():
                for k, v in c.items():
                    totals[key][x][k] += v
    return totals


def blind(path: Path) -> dict:
    """The rules and the models trained on all six files (and the ordinary prompts' training
    half), thresholds chosen on them, on a file never used: precision and recall per detector."""
    groups = sources()
    ordinary = [{"text": t, "items": []} for t in ordinary_prompts()
                if zlib.crc32(t.encode("utf-8", "surrogatepass")) % 2 == 0]
    rows = pii_handwritten(path, holdout=True)
    models, featurised = {}, {}
    for d in LEARNED:
        data = {**{g: Featurised(v, d) for g, v in groups.items()}, "ordinary": Featurised(ordinary, d)}
        models[d] = fit(data, list(data))
        featurised[d] = Featurised(rows, d)
    totals = compare(models, featurised, rows)
    return {"file": str(path), "prompts": len(rows), "thresholds": {d: m.threshold for d, m in models.items()},
            **{k: pii_rates(v) for k, v in totals.items()}}


def without_context_words() -> dict:
    """The shipped rules with their context word lists off (no phone or id word before a
    number, no version or address word around four dotted numbers), per held-out file and
    pooled: what those lists earn."""
    from unittest import mock

    from sidecar.guard.pii_rules import PiiRules
    groups = sources()
    pii.detector_functions.cache_clear()
    out = {}
    with mock.patch.object(PiiRules, "phone_context", lambda self, text, start: None), \
            mock.patch.object(PiiRules, "version_like", lambda self, text, start, end: None):
        pooled = {x: {"tp": 0, "fp": 0, "fn": 0} for x in pii.DETECTORS}
        for name, rows in groups.items():
            totals = {x: {"tp": 0, "fp": 0, "fn": 0} for x in pii.DETECTORS}
            for row in rows:
                for x, c in pii_row_counts(row, pii.find(row["text"], pii.DETECTORS)).items():
                    for k, v in c.items():
                        totals[x][k] += v
                        pooled[x][k] += v
            out[name] = pii_rates(totals)
        out["pooled"] = pii_rates(pooled)
    return out


def main() -> int:
    global LEARNED, STEPS, L2
    parser = argparse.ArgumentParser()
    parser.add_argument("--bootstrap", type=int, default=1000)
    parser.add_argument("--detectors", default=",".join(LEARNED))
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--l2", type=float, default=L2)
    parser.add_argument("--out", default="reports/pii_learned.json")
    parser.add_argument("--without-context-words", action="store_true",
                        help="only measure the shipped rules with their context word lists off")
    parser.add_argument("--blind", type=Path, help="only score this file (pii_handwritten format), never used before")
    args = parser.parse_args()
    LEARNED, STEPS, L2 = tuple(args.detectors.split(",")), args.steps, args.l2
    if args.blind:
        out = blind(args.blind)
        for d in pii.DETECTORS:
            print(d, {k: (out[k][d]["precision"], out[k][d]["recall"]) for k in ("rules", "learned")})
        (ROOT / "reports").mkdir(exist_ok=True)
        (ROOT / "reports" / "pii_learned_blind.json").write_text(json.dumps(out, indent=1))
        return 0
    if args.without_context_words:
        out = without_context_words()
        for name, rates in out.items():
            print(name, {d: (rates[d]["precision"]["rate"], rates[d]["recall"]["rate"]) for d in ("phone", "ip")})
        (ROOT / "reports").mkdir(exist_ok=True)
        (ROOT / "reports" / "pii_without_context_words.json").write_text(json.dumps(out, indent=1))
        return 0
    groups = sources()
    ordinary = ordinary_prompts()
    half = [zlib.crc32(t.encode("utf-8", "surrogatepass")) % 2 for t in ordinary]
    ordinary_train = [{"text": t, "items": []} for t, h in zip(ordinary, half) if h == 0]
    ordinary_test = [{"text": t, "items": []} for t, h in zip(ordinary, half) if h == 1]
    names = list(groups)
    data = {d: {**{g: Featurised(groups[g], d) for g in names}, "ordinary": Featurised(ordinary_train, d)} for d in LEARNED}
    for d in LEARNED:
        print(d, {g: (len(f.labels), int(f.labels.sum())) for g, f in data[d].items()}, flush=True)
    # Per held-out file and prompt: the rules' counts and the model's.
    per_prompt = {"rules": [], "learned": []}
    by_file: dict[str, dict] = {}
    for held in names:
        models = {d: fit(data[d], [g for g in names if g != held] + ["ordinary"]) for d in LEARNED}
        totals = compare(models, {d: data[d][held] for d in LEARNED}, groups[held], per_prompt)
        by_file[held] = {k: pii_rates(v) for k, v in totals.items()}
        by_file[held]["thresholds"] = {d: models[d].threshold for d in LEARNED}
        print(held, {d: {k: (round(by_file[held][k][d]["precision"]["rate"], 3), round(by_file[held][k][d]["recall"]["rate"], 3))
                         for k in ("rules", "learned")} for d in LEARNED}, by_file[held]["thresholds"], flush=True)
    pooled = {}
    for key, rows in per_prompt.items():
        totals = {x: {k: sum(r[x][k] for r in rows) for k in ("tp", "fp", "fn")} for x in pii.DETECTORS}
        pooled[key] = pii_rates(totals)
    # Paired bootstrap over prompts of the pooled difference (learned - rules): both judged on
    # the same draws.
    draws = [d["prompts"] for d in stats.resamples({"prompts": np.arange(len(per_prompt["rules"]))}, args.bootstrap)]
    diff = {}
    for d in LEARNED:
        arr = {k: np.array([[r[d]["tp"], r[d]["fp"], r[d]["fn"]] for r in per_prompt[k]]) for k in per_prompt}
        values = []
        for idx in draws:
            rates = {}
            for k, a in arr.items():
                tp, fp, fn = a[idx].sum(axis=0)
                rates[k] = (tp / max(tp + fp, 1), tp / max(tp + fn, 1))
            values.append((rates["learned"][0] - rates["rules"][0], rates["learned"][1] - rates["rules"][1]))
        (p_low, r_low), (p_high, r_high) = stats.interval(np.array(values))
        diff[d] = {"precision": [float(p_low), float(p_high)], "recall": [float(r_low), float(r_high)]}
    # False matches on the ordinary prompts not trained on, by a model on every file.
    final = {d: fit(data[d], names + ["ordinary"]) for d in LEARNED}
    false = {"prompts": len(ordinary_test), "rules": {d: 0 for d in LEARNED}, "learned": {d: 0 for d in LEARNED}}
    for row in ordinary_test:
        text = _text(row["text"])
        for d in LEARNED:
            false["rules"][d] += len(pii.find(row["text"], (d,)))
            cands = CANDIDATES[d](text)
            if cands:
                false["learned"][d] += int((final[d].scores(cands) >= final[d].threshold).sum())
    out = {"by_file": by_file, "pooled": pooled, "bootstrap_difference_95": diff, "ordinary_false_matches": false,
           "final_thresholds": {d: final[d].threshold for d in LEARNED}}
    out["settings"] = {"detectors": LEARNED, "steps": STEPS, "l2": L2, "target_precision": TARGET_PRECISION}
    (ROOT / args.out).parent.mkdir(exist_ok=True)
    (ROOT / args.out).write_text(json.dumps(out, indent=1))
    for d in LEARNED:
        for k in ("rules", "learned"):
            p, r = pooled[k][d]["precision"], pooled[k][d]["recall"]
            print(f"{d:6s} {k:8s} P {p['rate']:.3f} {p['ci95']} n={p['n']}  R {r['rate']:.3f} {r['ci95']} n={r['n']}")
        print(f"{d:6s} learned-rules 95%: P {diff[d]['precision']}, R {diff[d]['recall']}")
    print("ordinary false matches:", false)
    return 0


if __name__ == "__main__":
    sys.exit(main())
