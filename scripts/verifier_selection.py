"""The verifier on its selection sets: what chooses between training data and model variants.

    nice -n 19 .venv/bin/python scripts/verifier_selection.py [--no-align] [--handwritten PATH ...]
        [--weight W] [--old N] [--monotone] [--out reports/verifier_selection.json]

Trains as scripts/train_verifier.py does (same pairs, weights, calibration) and reports precision
and recall of the score alone (no veto, candidates from the model's floor) at the thresholds
calibrated for 0.02 and 0.05:
- the calibration sets: the generator's held-out frames and the public tune halves;
- out of fold: each training pair scored by trees trained without its fold (5 folds, by a hash
  of the generator frame, or of the hand-written pair's file and line), split into generated
  pairs and each hand-written file (handwritten.jsonl's first --old lines apart from the rest).
Never reads the held-out chat suites or the public held-out halves (scripts/eval_semantic.py
reports those).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import train_verifier as tv  # noqa: E402
from sidecar.cache.verifier import Verifier  # noqa: E402

FOLDS = 5
RATES = (0.02, 0.05)


def figures(score, cos, labels, floor, threshold) -> dict:
    hit = (score >= threshold) & (cos >= floor)
    tp, fp = int((hit & (labels == 1)).sum()), int((hit & (labels == 0)).sum())
    return {"precision": round(tp / max(1, tp + fp), 3), "recall": round(tp / max(1, int((labels == 1).sum())), 3),
            "hits": tp + fp, "false_hits": fp}


def served_by(pairs: list[dict], passed: np.ndarray, candidate: np.ndarray) -> dict:
    """"served/candidates" for each label and kind, and each label and language (candidates:
    pairs past the floor): where the verifier misses rewordings or serves near-misses."""
    counts: dict[str, list[int]] = {}
    for p, hit, seen in zip(pairs, passed, candidate):
        if not seen:
            continue
        for key in (f"{p['label']} {p.get('kind', '?')}", f"{p['label']} lang {p.get('lang', 'en')}"):
            counts.setdefault(key, [0, 0])
            counts[key][0] += bool(hit)
            counts[key][1] += 1
    return {key: f"{a}/{b}" for key, (a, b) in sorted(counts.items())}


def fold_of(pair: dict, line: int) -> int:
    """`line`: the pair's line in its hand-written file (a file appended to moves no pair)."""
    key = pair["frame"] if "frame" in pair else f"{Path(pair.get('file', 'handwritten.jsonl')).stem}-{line}"
    return hashlib.sha256(key.encode()).digest()[0] % FOLDS


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-align", action="store_true")
    parser.add_argument("--handwritten", type=Path, nargs="+", default=list(tv.HANDWRITTEN))
    parser.add_argument("--weight", type=float, default=tv.HANDWRITTEN_WEIGHT)
    parser.add_argument("--old", type=int, default=0, help="handwritten.jsonl's lines reported apart from the rest")
    parser.add_argument("--monotone", action="store_true", help="trees monotone in every feature but FREE")
    parser.add_argument("--out", type=Path, default=ROOT / "reports" / "verifier_selection.json")
    args = parser.parse_args(argv)
    align = not args.no_align
    data = tv.rows(align=align, handwritten=tuple(args.handwritten))
    model, stats = tv.fit(data, weight=args.weight, monotone=args.monotone)
    train, cos, x, labels = data.train, data.cos, data.x, data.labels
    thresholds = dict(zip(model["calibration"]["rates"], model["calibration"]["thresholds"]))
    floor = model["floor"]
    out = {"handwritten": [str(p) for p in args.handwritten], "weight": args.weight, "align": align,
           "monotone": args.monotone, "train": stats}
    verifier = Verifier(model)
    for (name, pairs), (xs, cs, ys) in zip(data.calibration.items(), data.sets().values()):
        scores = verifier.probabilities(xs)
        out[name] = {r: figures(scores, cs, ys, floor, thresholds[r]) for r in RATES}
        if name == "generated-valid":
            out[name]["served at 0.05, by label, kind and language"] = served_by(
                pairs, scores >= thresholds[0.05], cs >= floor)
    n = len(train)
    keep = cos[:n] >= tv.TRAIN_COSINE
    weight = tv.training_weights(train, args.weight)
    source = [p.get("file", "") for p in train]
    lines: dict[str, int] = {}
    line = np.zeros(n, int)
    for i, name in enumerate(source):
        line[i] = lines.get(name, 0)
        lines[name] = line[i] + 1
    fold = np.array([fold_of(p, int(k)) for p, k in zip(train, line)])
    direction = tv.directions(model["features"]) if args.monotone else None
    scores = np.zeros(n)
    for k in range(FOLDS):
        fit = keep & (fold != k)
        trees = tv.train_trees(x[:n][fit], labels[:n][fit], weight[fit], direction)
        trees.update({key: model[key] for key in ("features", "floor", "calibration", "states_layers") if key in model})
        scores[fold == k] = Verifier(trees).probabilities(x[:n][fold == k])
    generated = np.array(["frame" in p for p in train])
    old = np.array([name == "handwritten.jsonl" for name in source]) & (line < args.old)
    parts = {"out-of-fold generated": generated, "out-of-fold handwritten.jsonl (old)": old}
    for name in dict.fromkeys(s for s in source if s):
        parts[f"out-of-fold {name}"] = np.array([s == name for s in source]) & ~old
    for name, mask in parts.items():
        if mask.any():
            out[name] = {r: figures(scores[mask], cos[:n][mask], labels[:n][mask], floor, thresholds[r])
                         for r in RATES}
            out[name]["served at 0.05, by label, kind and language"] = served_by(
                [p for p, m in zip(train, mask) if m], scores[mask] >= thresholds[0.05], cos[:n][mask] >= floor)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    for name, cells in out.items():
        if isinstance(cells, dict) and 0.02 in cells:
            print(f"{name:40s}" + "  ".join(f"{r}: P {cells[r]['precision']:.3f} R {cells[r]['recall']:.3f} "
                                              f"({cells[r]['hits']} hits)" for r in RATES))
    print(f"thresholds {model['calibration']['thresholds']}, {stats['train_pairs']} training pairs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
