"""Experiment: how the injection head's thresholds are calibrated and how ordinary non-English
prompts weigh in training, on the val split only.

    nice -n 19 .venv/bin/python scripts/exp_guard_calibration.py [--shares none,0.25,0.5]

Training (both models, as scripts/train_guard.py trains them: train split, epoch chosen on val):
`none` is the shipped weighting (every benign prompt by count, so the ordinary non-English train
prompts of data/guard/ordinary.jsonl carry ~2% of the benign weight); a number is the share of
the benign weight they carry (train_guard.sample_weights).

Calibrations, their shares fixed before any result was seen (the sidecar's thresholds: full
model from the embedded ordinary prompts, n-gram model from all of them):
- `pooled`: the share `rate` of all ordinary val prompts (as shipped: the English paraphrase
  prompts are ~96% of them);
- `each`: the rate must hold on the paraphrase prompts and on the ordinary non-English prompts
  each: the higher of the two thresholds;
- `mix`: a weighted share, the paraphrase prompts half the weight and the ordinary non-English
  prompts half, split equally between their languages.

A threshold set on a prompt cannot measure whether that prompt is flagged, so the ordinary val
prompts are cut in two halves (paraphrase prompts by paraphrase group, the others by text within
each language): thresholds set on one half judge the other half's ordinary prompts, and each
ordinary prompt is counted once; attacks and look-alikes are judged at both halves' thresholds
and averaged. Against the shipped pair (`none`, `pooled`): the differences in detection,
look-alikes flagged and ordinary non-English prompts flagged, with 95% intervals from a paired
bootstrap that resamples attacks, look-alikes and each half's ordinary prompts. The test split
and the held-out file are not read. Writes reports/guard_calibration.json.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench.guard import _threshold_for  # noqa: E402
from bench.guard_data import _paraphrase_texts, embed_all, injection_examples  # noqa: E402
from bench.stats import interval, resamples  # noqa: E402
from sidecar.guard.injection import InjectionHead  # noqa: E402
from train_guard import Ngrams, sample_weights, train, train_text_head  # noqa: E402

RATES = (0.001, 0.01)
CALIBRATIONS = ("pooled", "each", "mix")


def weighted_threshold(scores: np.ndarray, weights: np.ndarray, rate: float) -> float:
    """The lowest threshold flagging prompts of at most `rate` of the total weight (flagged:
    score >= it); with equal weights, _threshold_for."""
    order = np.argsort(-scores, kind="stable")
    ordered, share = scores[order], np.cumsum(weights[order]) / weights.sum()
    allowed = int(np.searchsorted(share, rate * (1 + 1e-9), side="right"))
    return float(ordered[allowed]) + 1e-9 if allowed < len(ordered) else 0.0


def threshold(kind: str, scores: np.ndarray, english: np.ndarray, langs: np.ndarray, rate: float) -> float:
    """`kind`'s threshold from these ordinary prompts' scores (english: a paraphrase prompt)."""
    if kind == "pooled" or english.all() or not (~english).any():
        return _threshold_for(scores, rate)
    if kind == "each":
        return max(_threshold_for(scores[english], rate), _threshold_for(scores[~english], rate))
    weights = np.where(english, 0.5 / english.sum(), 0.0)
    others = sorted(set(langs[~english]))
    for lang in others:
        mine = ~english & (langs == lang)
        weights[mine] = 0.5 / len(others) / mine.sum()
    return weighted_threshold(scores, weights, rate)


def halves(examples) -> np.ndarray:
    """0 or 1 per ordinary prompt: paraphrase prompts by a hash of their group, the others by a
    hash of their text, alternating within each language."""
    group = dict(_paraphrase_texts())
    out = np.full(len(examples), -1)
    by_lang: dict[str, list[tuple[bytes, int]]] = {}
    for i, e in enumerate(examples):
        if e.source == "paraphrase":
            out[i] = hashlib.sha256(("half\x00" + group[e.text]).encode()).digest()[0] % 2
        elif e.source == "ordinary":
            by_lang.setdefault(e.lang, []).append((hashlib.sha256(e.text.encode()).digest(), i))
    for rows in by_lang.values():
        for n, (_, i) in enumerate(sorted(rows)):
            out[i] = n % 2
    return out


def heads(share: float | None, examples) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Trains both models with `share` and scores the val rows as the sidecar does (float16
    weights): whether each is embedded, the full model's score, the n-gram model's."""
    vectors = embed_all([e.text for e in examples])
    usable = ~np.isnan(vectors).any(axis=1)
    text_head = train_text_head(examples, share)
    kept = [e for e, ok in zip(examples, usable) if ok]
    y = np.array([e.label for e in kept], np.float64)
    is_train = np.array([e.split == "train" for e in kept])
    params, epoch, _ = train(vectors[usable].astype(np.float64), Ngrams([e.text for e in kept]), y, is_train, ~is_train,
                             sample_weights(kept, y, is_train, share))
    print(f"  share {share}: full model epoch {epoch}", flush=True)
    path = ROOT / "build" / "guard" / f"calibration_{share}.npz"
    path.parent.mkdir(parents=True, exist_ok=True)
    InjectionHead(params["embedding"].astype(np.float32), params["lexical"].astype(np.float32),
                  float(params["bias"]), np.zeros(1, np.float32), text_head).save(path)
    head = InjectionHead.load(path)
    val = [(v, e, ok) for v, e, ok in zip(vectors, examples, usable) if e.split == "val"]
    full = np.array([head.score(v, e.text) if ok else np.nan for v, e, ok in val])
    return np.array([ok for _, _, ok in val]), full, np.array([head.score(None, e.text) for _, e, _ in val])


KEYS = ("detection", "lookalikes", "non_english", "paraphrase")


def val_rows(val, rounds: int) -> dict:
    """The val rows' masks and index sets: `english` (paraphrase prompts) and `langs` per row,
    `everything` (attacks, look-alikes, each half's ordinary prompts) and `draws`, as many
    bootstrap resamples of them."""
    y = np.array([e.label for e in val])
    ordinary = np.array([e.source in ("paraphrase", "ordinary") for e in val])
    half = halves(val)
    attack, hard = np.flatnonzero(y == 1), np.flatnonzero((y == 0) & ~ordinary)
    split = [np.flatnonzero(ordinary & (half == h)) for h in (0, 1)]
    english = np.array([e.source == "paraphrase" for e in val])
    langs = np.array([e.lang for e in val])
    everything = {"attack": attack, "hard": hard, "ordinary": split}
    return {"english": english, "langs": langs, "everything": everything, "draws": resamples(everything, rounds),
            "counts": {"attacks": len(attack), "lookalikes": len(hard), "paraphrase": int(english.sum()),
                       "non_english": {str(lang): int((langs[ordinary & ~english] == lang).sum())
                                       for lang in sorted(set(langs[ordinary & ~english]))}}}


def paired(judge: "Judge", base: "Judge", rate: float, d: dict) -> dict:
    """`judge` minus `base` at `rate` for each of KEYS: [difference, 95% interval low, high]
    over d's bootstrap draws."""
    diffs = []
    for pick in d["draws"]:
        a, b = judge.figures(rate, pick), base.figures(rate, pick)
        diffs.append([a[k] - b[k] for k in KEYS])
    low, high = interval(np.array(diffs))
    mine, theirs = judge.figures(rate, d["everything"]), base.figures(rate, d["everything"])
    return {k: [round(float(mine[k] - theirs[k]), 4), round(float(low[i]), 4), round(float(high[i]), 4)]
            for i, k in enumerate(KEYS)}


def row(figures: dict, attacks: int) -> dict:
    return {"detection": round(figures["detection"], 4), "attacks_caught": round(figures["detection"] * attacks, 1),
            "lookalikes_flagged": figures["lookalikes"], "paraphrase_flagged": figures["paraphrase"],
            "non_english_flagged": figures["non_english"], "non_english_by_language": figures["by_language"]}


class Judge:
    """Flags of val rows under one head and one calibration, thresholds from one half."""

    def __init__(self, scored, d: dict, kind: str):
        self.embedded, self.full, self.text = scored
        self.d, self.kind = d, kind

    def flagged(self, rate: float, calibrating: np.ndarray) -> np.ndarray:
        d, e = self.d, self.embedded
        t_full = threshold(self.kind, self.full[calibrating[e[calibrating]]], d["english"][calibrating[e[calibrating]]],
                           d["langs"][calibrating[e[calibrating]]], rate)
        t_text = threshold(self.kind, self.text[calibrating], d["english"][calibrating], d["langs"][calibrating], rate)
        return np.where(e, self.full >= t_full, self.text >= t_text)

    def figures(self, rate: float, pick: dict) -> dict:
        """Detection, look-alikes flagged (each the mean over the two halves' thresholds) and
        ordinary prompts flagged (each judged at the other half's thresholds), over the rows
        drawn in `pick`."""
        out = {"detection": 0.0, "lookalikes": 0.0, "paraphrase": 0, "non_english": 0, "by_language": {}}
        for half in (0, 1):
            flags = self.flagged(rate, pick["ordinary"][half])
            other = pick["ordinary"][1 - half]
            out["detection"] += flags[pick["attack"]].mean() / 2
            out["lookalikes"] += flags[pick["hard"]].sum() / 2
            english = self.d["english"][other]
            out["paraphrase"] += int(flags[other][english].sum())
            out["non_english"] += int(flags[other][~english].sum())
            for lang, hit in zip(self.d["langs"][other][~english], flags[other][~english]):
                out["by_language"][str(lang)] = out["by_language"].get(str(lang), 0) + int(hit)
        return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shares", default="none,0.25,0.5")
    parser.add_argument("--rounds", type=int, default=1000)
    parser.add_argument("--out", type=Path, default=ROOT / "reports" / "guard_calibration.json")
    args = parser.parse_args()
    started = time.monotonic()
    examples = [e for e in injection_examples() if e.split != "test"]
    d = val_rows([e for e in examples if e.split == "val"], args.rounds)
    print(f"val: {d['counts']}", flush=True)
    shares = [None if s == "none" else float(s) for s in args.shares.split(",")]
    scored = {share: heads(share, examples) for share in shares}
    judges = {(share, kind): Judge(scored[share], d, kind) for share in shares for kind in CALIBRATIONS}
    base = (shares[0], "pooled")
    report = {"val": d["counts"], "variants": {}}
    for rate in RATES:
        for key, judge in judges.items():
            name = f"{key[0] if key[0] is not None else 'none'}/{key[1]}"
            out = row(judge.figures(rate, d["everything"]), d["counts"]["attacks"])
            if key != base:
                out["against_shipped"] = paired(judge, judges[base], rate, d)
            report["variants"].setdefault(name, {})[f"{rate:g}"] = out
            print(rate, name, json.dumps(out), flush=True)
    report["seconds"] = round(time.monotonic() - started)
    args.out.parent.mkdir(exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
