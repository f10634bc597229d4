"""`make eval-guard`: the guard's quality and cost, printed and written to reports/guard.json.

- injection: detection and false alarms on the held-out test splits (bench/guard_data.py) at the
  thresholds a route gets for false_alarm_rate 0.01, 0.005 and 0.001 and at the goal's operating
  points (each threshold set on validation prompts), per source and language, with Wilson 95%
  intervals (the hand-written held-out sets, data/guard/injections_holdout.jsonl and, when
  present, data/guard/injections_holdout2.jsonl, each as its own source, by language); prompts
  the model does not embed are judged, as in the sidecar, by the n-gram model at its own
  threshold, which is also reported alone, per language;
- words: planted denied words (with zero-width characters, full-width letters, case and CJK
  spacing tricks) in paraphrase prompts, and false matches on clean ones, per squeeze mode;
- personal data: per detector, precision and recall on data/guard/pii.jsonl (generated) and
  data/guard/pii_handwritten.txt (hand-written), dev and test each, and, each as one source when
  it exists, on data/guard/pii_holdout.txt, data/guard/pii_holdout2.txt and
  data/guard/pii_holdout3.txt and data/guard/pii_holdout4.txt (written apart; development data
  since their misses were read) and data/guard/pii_holdout5.txt (written apart, blind);
- cost: guard CPU time for a 2 KB prompt with 10,000 denied words loaded, every detector on, and
  the injection classifier's scoring (bench/guard_cost.py).
"""
from __future__ import annotations

import random
import sys

import numpy as np

from bench import report, stats
from bench.guard_data import (HOLDOUT_SOURCES, LATER_BATCH, ORDINARY_SOURCES, PII_HOLDOUT, PII_HOLDOUT2, PII_HOLDOUT3, PII_HOLDOUT4,
                              PII_HOLDOUT5, ROOT, embed_all, holdout_files, injection_examples,
                              pii_examples, pii_handwritten)
from sidecar.guard.injection import threshold_for as _threshold_for


def wilson(hits: int, n: int) -> dict:
    if n == 0:
        return {"rate": None, "n": 0, "ci95": None}
    low, high = stats.wilson(hits, n)
    return {"rate": round(hits / n, 4), "hits": hits, "n": n, "ci95": [round(low, 4), round(high, 4)]}


# --- injection -------------------------------------------------------------------------------

def _scores(head, examples) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per example, as the sidecar computes them: whether the model embeds the text, the full
    model's score (NaN where it does not) and the n-gram model's score (every example)."""
    vectors = embed_all([e.text for e in examples])
    embedded = ~np.isnan(vectors).any(axis=1)
    full = np.array([head.score(v, e.text) if ok else np.nan for v, e, ok in zip(vectors, examples, embedded)])
    return embedded, full, np.array([head.score(None, e.text) for e in examples])


def appended_documents(attacks: list[str], ordinary: list[str], size: int, rng: random.Random,
                       joiner: str = "\n\n") -> list[str]:
    """Each attack after ordinary prompts run together to `size` characters (`joiner` between
    them: a blank line, a new paragraph), then 200 such documents alone."""
    def document() -> str:
        parts, length = [], 0
        while length < size:
            parts.append(rng.choice(ordinary))
            length += len(parts[-1]) + 1
        return " ".join(parts)[:size]

    return [document() + joiner + a for a in attacks] + [document() for _ in range(200)]


# Attacks appended to documents: the name, the document's size, what stands between them.
APPENDED_SHAPES = (("500_chars", 500, "\n\n"), ("2000_chars", 2000, "\n\n"), ("500_chars_same_paragraph", 500, " "))


def _appended(head) -> dict:
    """Attacks appended to an ordinary document (test attacks after test paraphrase prompts run
    together to 500 and 2,000 characters, as a paragraph of their own, and after 500 characters
    in the same paragraph), and such documents without an attack, at the route thresholds for
    false_alarm_rate 0.01 and 0.001: an order pasted after a document is indirect injection's
    common shape."""
    examples = injection_examples()
    ordinary = [e.text for e in examples if e.source == "paraphrase" and e.split == "test"]
    attacks = [e.text for e in examples if e.split == "test" and e.label == 1 and e.source in DEVELOPMENT]
    rng = random.Random(22)
    out = {}
    for name, size, joiner in APPENDED_SHAPES:
        texts = appended_documents(attacks, ordinary, size, rng, joiner)
        vectors = embed_all(texts)
        embedded = ~np.isnan(vectors).any(axis=1)
        scores = np.array([head.score(v if ok else None, t) for v, t, ok in zip(vectors, texts, embedded)])
        for rate in (0.01, 0.001):
            flagged = scores >= np.where(embedded, head.threshold(rate), head.threshold(rate, embedded=False))
            out[f"{name}_false_alarm_rate_{rate}"] = {
                "detection": wilson(int(flagged[:len(attacks)].sum()), len(attacks)),
                "false_alarms": wilson(int(flagged[len(attacks):].sum()), len(texts) - len(attacks))}
    return out


# The sets the model was developed on (their test splits); the held-out set is reported apart.
DEVELOPMENT = ("deepset", "sluice")


def _rates(flagged: np.ndarray, test: list, by_language: bool = True) -> dict:
    """Detection (attacks) and false alarms (hard look-alikes; ordinary prompts apart: the
    English paraphrase set, data/guard/ordinary.jsonl) of `flagged`, per source and per language of
    the Sluice prompts. The held-out set counts only under its own source (and its languages)."""
    def group(pred) -> tuple[dict, dict]:
        idx = [i for i, e in enumerate(test) if pred(e)]
        attacks = [i for i in idx if test[i].label == 1]
        benign = [i for i in idx if test[i].label == 0]
        return (wilson(int(flagged[attacks].sum()), len(attacks)),
                wilson(int(flagged[benign].sum()), len(benign)))

    detect, fa = group(lambda e: e.source in DEVELOPMENT)
    result = {"detection": detect, "false_alarms": fa,
              "false_alarms_paraphrase": group(lambda e: e.source == "paraphrase")[1],
              "false_alarms_ordinary": group(lambda e: e.source == "ordinary")[1], "by_source": {}}
    # The test rows below guard_data.LATER_BATCH's ids (deepset's too): comparable with figures
    # measured on those rows alone.
    earlier_detect, earlier_fa = group(lambda e: e.source in DEVELOPMENT and e.earlier)
    result["earlier_rows"] = {"detection": earlier_detect, "false_alarms": earlier_fa,
                              "false_alarms_ordinary": group(lambda e: e.source == "ordinary" and e.earlier)[1]}
    for source in DEVELOPMENT + HOLDOUT_SOURCES:
        d, f = group(lambda e, s=source: e.source == s)
        if d["n"] or f["n"]:
            result["by_source"][source] = {"detection": d, "false_alarms": f}
    for source in HOLDOUT_SOURCES:
        if by_language and source in result["by_source"]:
            result[f"{source}_by_language"] = {}
            for lang in sorted({e.lang for e in test if e.source == source}):
                d, f = group(lambda e, lang=lang, s=source: e.source == s and e.lang == lang)
                result[f"{source}_by_language"][lang] = {"detection": d, "false_alarms": f}
    if by_language:
        result["ordinary_by_language"] = {
            lang: group(lambda e, lang=lang: e.source == "ordinary" and e.lang == lang)[1]
            for lang in sorted({e.lang for e in test if e.source == "ordinary"})}
        result["by_language"] = {}
        for lang in sorted({e.lang for e in test if e.source == "sluice"}):
            d, f = group(lambda e, lang=lang: e.source == "sluice" and e.lang == lang)
            ordinary = group(lambda e, lang=lang: e.source == "ordinary" and e.lang == lang)[1]
            result["by_language"][lang] = {"detection": d, "false_alarms": f,
                                           **({"false_alarms_ordinary": ordinary} if ordinary["n"] else {})}
    return result


def injection() -> dict:
    from sidecar.guard.injection import InjectionHead
    head = InjectionHead.load()
    examples = injection_examples()
    test = [e for e in examples if e.split == "test"]
    val = [e for e in examples if e.split == "val"]
    embedded, full, text = _scores(head, test)
    val_embedded, val_full, val_text = _scores(head, val)
    out: dict = {"not_embedded": int((~embedded).sum()),
                 "not_embedded_by_language": {lang: int(sum(1 for e, ok in zip(test, embedded) if not ok and e.lang == lang))
                                              for lang in sorted({e.lang for e, ok in zip(test, embedded) if not ok})}}

    def section(threshold: float, text_threshold: float) -> dict:
        # As the sidecar judges: the full model where there is an embedding, else the n-gram model.
        flagged = np.where(embedded, np.nan_to_num(full, nan=-1.0) >= threshold, text >= text_threshold)
        return {"threshold": round(threshold, 4), "text_threshold": round(text_threshold, 4), **_rates(flagged, test)}

    # What a route gets: the threshold for a share of the ordinary validation prompts.
    for rate in (0.01, 0.005, 0.001):
        out[f"false_alarm_rate_{rate}"] = section(head.threshold(rate), head.threshold(rate, embedded=False))
    # The goal's operating points: a threshold set on the hard look-alikes (written to resemble
    # attacks) of validation, and the route thresholds (the ordinary validation prompts, as the
    # head's file calibrates them).
    hard = np.array([e.label == 0 and e.source not in ORDINARY_SOURCES for e in val])
    out["appended"] = _appended(head)
    out["operating_points"] = {
        "hard_lookalikes_0.01": section(_threshold_for(val_full[hard & val_embedded], 0.01), _threshold_for(val_text[hard], 0.01)),
        "ordinary_0.01": out["false_alarm_rate_0.01"], "ordinary_0.001": out["false_alarm_rate_0.001"]}
    # The n-gram model alone, on every test prompt (as if none had an embedding), and on those
    # the model does not embed (the prompts it judges in the sidecar).
    out["text_only"] = {}
    for rate in (0.01, 0.001):
        threshold = head.threshold(rate, embedded=False)
        out["text_only"][f"false_alarm_rate_{rate}"] = {
            "threshold": round(threshold, 4), "all_prompts": _rates(text >= threshold, test),
            "not_embedded": _rates(text[~embedded] >= threshold, [e for e, ok in zip(test, embedded) if not ok])}
    return out


# --- words -----------------------------------------------------------------------------------

def _denied_words() -> list[str]:
    lines = (ROOT / "data/guard/denied_words.txt").read_text(encoding="utf-8").splitlines()
    return [w.strip() for w in lines if w.strip() and not w.startswith("#")]


def _hide(word: str, rng: random.Random) -> tuple[str, str]:
    trick = rng.choice(["plain", "upper", "zero_width", "full_width", "soft_hyphen", "spaced_cjk"])
    if trick == "upper":
        return trick, word.upper()
    if trick == "zero_width":
        at = rng.randrange(1, len(word))
        return trick, word[:at] + "\u200b" + word[at:]
    if trick == "soft_hyphen":
        at = rng.randrange(1, len(word))
        return trick, word[:at] + "\u00ad" + word[at:]
    if trick == "full_width":
        return trick, "".join(chr(ord(c) + 0xFEE0) if "!" <= c <= "~" else c for c in word)
    if trick == "spaced_cjk" and any(ord(c) > 0x3000 for c in word):
        return trick, " ".join(word)
    return "plain", word


def words() -> dict:
    from sidecar.guard.words import WordMatcher
    denied = _denied_words()
    benign = [e.text for e in injection_examples() if e.source == "paraphrase" and e.split == "test"]
    rng = random.Random(22)
    planted, tricks = [], []
    for i in range(300):
        base = benign[i % len(benign)].split(" ")
        trick, hidden = _hide(rng.choice(denied), rng)
        base.insert(rng.randrange(len(base) + 1), hidden)
        planted.append(" ".join(base))
        tricks.append(trick)
    clean = benign[300:]
    out = {"denied_words": len(denied), "planted": len(planted), "clean_prompts": len(clean), "modes": {}}
    for mode in ("cjk", "all", "off"):
        matcher = WordMatcher([(denied, mode)])
        found = [bool(matcher.scan(t)) for t in planted]
        false = sum(bool(matcher.scan(t)) for t in clean)
        by_trick = {t: wilson(sum(f for f, k in zip(found, tricks) if k == t), tricks.count(t)) for t in sorted(set(tricks))}
        out["modes"][mode] = {"recall": wilson(sum(found), len(found)), "by_trick": by_trick,
                              "false_matches_on_clean": wilson(false, len(clean)),
                              "precision": wilson(sum(found), sum(found) + false)}
    return out


# --- personal data ---------------------------------------------------------------------------

def _occurrence(text: str, value: str, start: int) -> int:
    """Where `value` first stands in `text` from `start` on with no ASCII letter or digit just
    beside it (else its first occurrence)."""
    at = first = text.index(value, start)
    while at >= 0:
        before, after = text[at - 1:at], text[at + len(value):at + len(value) + 1]
        if not (before.isascii() and before.isalnum() or after.isascii() and after.isalnum()):
            return at
        at = text.find(value, at + 1)
    return first


def pii_item_bounds(row: dict) -> list[tuple[str, int, int]]:
    """(detector, start, end) of each planted item of a row, in its text."""
    text, items, after = row["text"], [], {}
    for item in row["items"]:
        # Items are listed in text order: a value planted twice is two items, the second
        # one after the first. An occurrence inside a longer token is not the item
        # (192.168.1.1 in 192.168.1.104).
        start = _occurrence(text, item["value"], after.get(item["value"], 0))
        after[item["value"]] = start + 1
        items.append((item["detector"], start, start + len(item["value"])))
    return items


def pii_row_counts(row: dict, spans) -> dict[str, dict[str, int]]:
    """Per detector, tp / fp / fn of the found `spans` in one row: a found span counts as a hit
    only when it covers a whole planted item of its detector (a partial redaction leaks the
    rest)."""
    from sidecar.guard.pii import DETECTORS
    counts = {d: {"tp": 0, "fp": 0, "fn": 0} for d in DETECTORS}
    items = pii_item_bounds(row)
    matched = set()
    for span in spans:
        hit = [k for k, (d, a, b) in enumerate(items) if d == span.detector and span.start <= a and b <= span.end]
        counts[span.detector]["tp" if hit else "fp"] += 1
        matched.update(hit)
    for k, (d, _, _) in enumerate(items):
        if k not in matched:
            counts[d]["fn"] += 1
    return counts


def pii_rates(counts: dict[str, dict[str, int]]) -> dict:
    return {d: {"precision": wilson(c["tp"], c["tp"] + c["fp"]), "recall": wilson(c["tp"], c["tp"] + c["fn"])}
            for d, c in counts.items()}


def _pii_counts(rows: list[dict]) -> dict:
    """Per detector, precision and recall on `rows` (pii_row_counts)."""
    from sidecar.guard.pii import DETECTORS, find
    counts = {d: {"tp": 0, "fp": 0, "fn": 0} for d in DETECTORS}
    for row in rows:
        for d, c in pii_row_counts(row, find(row["text"], DETECTORS)).items():
            for k, v in c.items():
                counts[d][k] += v
    return {"prompts": len(rows), "detectors": pii_rates(counts)}


# What each personal-data source is, for the printed tables.
PII_SOURCES = {"generated": "generated set (pii.jsonl), test split",
               "handwritten": "hand-written set (pii_handwritten.txt), test split",
               "holdout": "pii_holdout.txt, all prompts (development data: its misses were read)",
               "holdout2": "pii_holdout2.txt, all prompts (development data: its misses were read)",
               "holdout3": "pii_holdout3.txt, all prompts (development data: its misses were read)",
               "holdout4": "pii_holdout4.txt, all prompts (development data: its misses were read)",
               "holdout5": "pii_holdout5.txt, all prompts (blind held-out set)"}


def personal_data() -> dict:
    generated, handwritten = pii_examples(), pii_handwritten()
    out = {"generated": {split: _pii_counts([r for r in generated if r["split"] == split]) for split in ("dev", "test")},
           "handwritten": {split: _pii_counts([r for r in handwritten if r["split"] == split]) for split in ("dev", "test")}}
    for name, path in (("holdout", PII_HOLDOUT), ("holdout2", PII_HOLDOUT2), ("holdout3", PII_HOLDOUT3),
                       ("holdout4", PII_HOLDOUT4), ("holdout5", PII_HOLDOUT5)):
        if path.exists():
            out[name] = {"holdout": _pii_counts(pii_handwritten(path, holdout=True))}
    return out


# --- cost ------------------------------------------------------------------------------------

def cost() -> dict:
    """CPU time per request (bench/guard_cost.py: scan, injection scoring, total)."""
    from bench.guard_cost import measure
    return measure()


def main() -> int:
    data = {"words": words(), "personal_data": personal_data(), "cost": cost(), "injection": injection()}
    points = data["injection"]["operating_points"]
    print("injection (test splits; each threshold set on validation prompts):")
    rows = []
    for name, label in (("hard_lookalikes_0.01", "1% of hard look-alikes"), ("ordinary_0.01", "1% of ordinary"),
                        ("ordinary_0.001", "0.1% of ordinary")):
        p = points[name]
        rows.append({"threshold set for": label, "detection": _cell(p["detection"]), "fa hard look-alikes": _cell(p["false_alarms"]),
                     "fa paraphrase": _cell(p["false_alarms_paraphrase"]), "fa ordinary non-English": _cell(p["false_alarms_ordinary"]),
                     "deepset / sluice attacks": f'{p["by_source"]["deepset"]["detection"]["rate"]} / {p["by_source"]["sluice"]["detection"]["rate"]}'})
    print(report.table(rows, list(rows[0])))
    below = ", ".join(f"{series}-{number:03d}" for series, number in LATER_BATCH.items())
    print(f"\ntest rows of deepset and of data/guard/ with ids below {below} (same thresholds):")
    print(report.table([{"threshold set for": label, "detection": _cell(points[name]["earlier_rows"]["detection"]),
                         "fa hard look-alikes": _cell(points[name]["earlier_rows"]["false_alarms"]),
                         "fa ordinary non-English": _cell(points[name]["earlier_rows"]["false_alarms_ordinary"])}
                        for name, label in (("hard_lookalikes_0.01", "1% of hard look-alikes"), ("ordinary_0.01", "1% of ordinary"),
                                            ("ordinary_0.001", "0.1% of ordinary"))],
                       ["threshold set for", "detection", "fa hard look-alikes", "fa ordinary non-English"]))
    for source, path in holdout_files().items():
        if source not in points["ordinary_0.001"]["by_source"]:
            continue
        print(f"\nhand-written held-out set ({path.relative_to(ROOT)}), same thresholds:")
        print(report.table([{"threshold set for": label, "detection": _cell(points[name]["by_source"][source]["detection"]),
                             "false alarms": _cell(points[name]["by_source"][source]["false_alarms"])}
                            for name, label in (("hard_lookalikes_0.01", "1% of hard look-alikes"), ("ordinary_0.01", "1% of ordinary"),
                                                ("ordinary_0.001", "0.1% of ordinary"))],
                           ["threshold set for", "detection", "false alarms"]))
        print(f"{path.name} by language, route rate 0.001 / 0.01 (detection; false alarms on its benign prompts):")
        by_rate = {rate: data["injection"][f"false_alarm_rate_{rate}"][f"{source}_by_language"] for rate in ("0.001", "0.01")}
        print(report.table([{"language": lang, "detection 0.001": _cell(v["detection"]), "false alarms 0.001": _cell(v["false_alarms"]),
                             "detection 0.01": _cell(by_rate["0.01"][lang]["detection"]),
                             "false alarms 0.01": _cell(by_rate["0.01"][lang]["false_alarms"])}
                            for lang, v in by_rate["0.001"].items()],
                           ["language", "detection 0.001", "false alarms 0.001", "detection 0.01", "false alarms 0.01"]))
    print("\nattacks appended to an ordinary document, and such documents alone:")
    print(report.table([{"document, route rate": k, "detection": _cell(v["detection"]), "false alarms": _cell(v["false_alarms"])}
                        for k, v in data["injection"]["appended"].items()], ["document, route rate", "detection", "false alarms"]))
    inj = data["injection"]["false_alarm_rate_0.001"]
    print(f"\nroute default (false_alarm_rate 0.001, thresholds {inj['threshold']} / n-grams alone {inj['text_threshold']}), "
          "Sluice prompts by language (false alarms: hard look-alikes; ordinary non-English prompts):")
    print(report.table([{"language": k, "detection": _cell(v["detection"]), "false alarms": _cell(v["false_alarms"]),
                         "fa ordinary": _cell(v["false_alarms_ordinary"]) if "false_alarms_ordinary" in v else ""}
                        for k, v in inj["by_language"].items()], ["language", "detection", "false alarms", "fa ordinary"]))
    routes = {rate: data["injection"][f"false_alarm_rate_{rate}"] for rate in ("0.001", "0.01")}
    print("\nordinary non-English test prompts flagged by language (data/guard/ordinary.jsonl), route rate 0.001 / 0.01:")
    print(report.table([{"language": lang, "0.001": _cell(w), "0.01": _cell(routes["0.01"]["ordinary_by_language"][lang])}
                        for lang, w in routes["0.001"]["ordinary_by_language"].items()], ["language", "0.001", "0.01"]))
    text_only = data["injection"]["text_only"]
    print(f"\nn-gram model alone (prompts without an embedding: {data['injection']['not_embedded_by_language']}), "
          "Sluice prompts by language, every test prompt scored by it:")
    rows = []
    for rate, v in text_only.items():
        for lang, w in v["all_prompts"]["by_language"].items():
            rows.append({"route rate": rate.rsplit("_", 1)[1], "language": lang, "detection": _cell(w["detection"]),
                         "false alarms": _cell(w["false_alarms"]) + (" ordinary " + _cell(w["false_alarms_ordinary"])
                                                                     if "false_alarms_ordinary" in w else "")})
        rows.append({"route rate": rate.rsplit("_", 1)[1], "language": "all (+deepset)", "detection": _cell(v["all_prompts"]["detection"]),
                     "false alarms": _cell(v["all_prompts"]["false_alarms"]) + " paraphrase " + _cell(v["all_prompts"]["false_alarms_paraphrase"])})
        rows.append({"route rate": rate.rsplit("_", 1)[1], "language": "not embedded", "detection": _cell(v["not_embedded"]["detection"]),
                     "false alarms": _cell(v["not_embedded"]["false_alarms"]) + " ordinary " + _cell(v["not_embedded"]["false_alarms_ordinary"])})
    print(report.table(rows, ["route rate", "language", "detection", "false alarms"]))
    for name, sets in data["personal_data"].items():
        split = "test" if "test" in sets else "holdout"
        print(f"\npersonal data, {PII_SOURCES[name]}:")
        print(report.table([{"detector": d, "precision": _cell(v["precision"]), "recall": _cell(v["recall"])}
                            for d, v in sets[split]["detectors"].items()], ["detector", "precision", "recall"]))
    print("\nwords (planted with tricks; false matches on clean paraphrase prompts):")
    print(report.table([{"squeeze": m, "recall": v["recall"]["rate"], "precision": v["precision"]["rate"],
                         "false_match_rate": v["false_matches_on_clean"]["rate"]} for m, v in data["words"]["modes"].items()],
                       ["squeeze", "recall", "precision", "false_match_rate"]))
    print("\ncost (2 KB prompt, 10,000 denied words, every detector, injection scoring; CPU ms per request):")
    quantiles = ("p50", "p99", "best_p50")
    print(report.table([{"prompt": k, **{f"{part} {q}": v[part][f"{q}_ms"] for part in ("scan", "injection", "total") for q in quantiles}}
                        for k, v in data["cost"].items() if isinstance(v, dict)],
                       ["prompt"] + [f"{part} {q}" for part in ("scan", "injection", "total") for q in quantiles]))
    print(f"\nwrote {report.write('guard', data).relative_to(ROOT)}")
    return 0


def _cell(w: dict) -> str:
    return "n=0" if w["n"] == 0 else f'{w["rate"]:.3f} [{w["ci95"][0]:.3f}, {w["ci95"][1]:.3f}] n={w["n"]}'


if __name__ == "__main__":
    sys.exit(main())
