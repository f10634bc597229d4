"""Experiment: the injection classifier's feature variants compared by k-fold over train + val.

    nice -n 19 .venv/bin/python scripts/exp_guard_kfold.py [--out FILE] [--folds 0,1,2] [--scores DIR] [VARIANT ...]

One validation split of ~150 attacks cannot separate variants whose detection differs by a
few attacks (docs/guard-quality.md). Here every train and val row (bench/guard_data.py; the test split
and the held-out file are not read) is scored once, out of fold:

- Groups: a paraphrase prompt goes with its paraphrase group (as the splits do); an attack,
  look-alike or ordinary CJK prompt goes with every row it is a near copy of (character
  5-gram Jaccard above 0.5, or 80% of the shorter text's 5-grams inside the longer: the same
  document with and without a planted order), joined transitively. Each group falls in one of
  FOLDS folds by a hash of its key.
- Fold k is scored by a model trained on three other folds, its epoch chosen on the fifth (the
  next one): no row that chose anything is scored.
- Fold k's thresholds are set on its own ordinary prompts (paraphrase and ordinary CJK) at
  0.1% and 1%, as a route's are on the ordinary validation prompts; each attack and
  look-alike of fold k is judged at them.

Variants: `shipped` (embedding and character n-grams), `l4_mean` (beside them, layer 4's token
states mean-pooled: exp_guard_models.with_states), `token_max_8` (eight learned directions of
layer 4's token states, each at its highest token: exp_guard_models.train_token_max), `both`.
Each is compared with `shipped` (listed first) on the same rows: pooled detection and look-alikes flagged at
both rates, their differences with a 95% interval from a paired bootstrap that resamples each
fold's attacks, look-alikes and ordinary prompts (the thresholds move with the ordinary
prompts drawn). Writes reports/guard_kfold.json (or FILE). `--folds` scores only those folds
(each still trained on three others and its epoch chosen on the next); `--scores DIR` keeps each
variant's out-of-fold scores there and reads them back instead of training, so variants and
folds can run in separate processes and a last run compares them (`--scores` given more than
once: each folder holds some folds' scores).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench.guard import _threshold_for  # noqa: E402
from bench.guard_data import ORDINARY_SOURCES, Groups, _paraphrase_texts, token_states  # noqa: E402
from bench.stats import interval, resamples  # noqa: E402
from drop_chat_overlap import grams  # noqa: E402
from exp_guard_models import data, train_token_max, with_states  # noqa: E402
from train_guard import logits, train  # noqa: E402

FOLDS = 5
RATES = (0.001, 0.01)
JACCARD, CONTAINED = 0.5, 0.8
VARIANTS = ("shipped", "l4_mean", "token_max_8", "both")


def near_copy_groups(texts: list[str]) -> list[int]:
    """For each text, the index of the first text of its group of near copies (Jaccard of
    character 5-grams above JACCARD, or the shorter's 5-grams CONTAINED in the longer)."""
    sets = [grams(t) for t in texts]
    posting: dict[str, list[int]] = defaultdict(list)
    for i, g in enumerate(sets):
        for gram in g:
            posting[gram].append(i)
    groups = Groups(range(len(texts)))
    for i, g in enumerate(sets):
        shared: dict[int, int] = defaultdict(int)
        for gram in g:
            for j in posting[gram]:
                if j < i:
                    shared[j] += 1
        for j, k in shared.items():
            small = min(len(g), len(sets[j]))
            if k / (len(g) + len(sets[j]) - k) > JACCARD or (small >= 20 and k / small >= CONTAINED):
                groups.join(i, j)
    return [groups.root(i) for i in range(len(texts))]


def fold_of(examples: list) -> np.ndarray:
    """Each row's fold, by a hash of its group's key."""
    paraphrase_group = dict(_paraphrase_texts())
    others = [i for i, e in enumerate(examples) if e.source != "paraphrase"]
    first = near_copy_groups([examples[i].text for i in others])
    keys = {i: "near\x00" + examples[others[r]].text for i, r in zip(others, first)}
    out = np.empty(len(examples), np.int64)
    for i, e in enumerate(examples):
        key = keys.get(i) or "paraphrase\x00" + paraphrase_group[e.text]
        out[i] = int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "little") % FOLDS
    return out


def load() -> dict:
    """exp_guard_models.data's train and val rows (those the model embeds) with each row's fold,
    and the attack, look-alike and ordinary masks over all of them."""
    d = data()
    y, examples = d["y"], d["examples"]
    ordinary = np.array([e.source in ORDINARY_SOURCES for e in examples])
    return {"examples": examples, "vectors": d["vectors"], "ngrams": d["ngrams"], "y": y, "fold": fold_of(examples),
            "attack": y == 1, "ordinary": ordinary, "hard": (y == 0) & ~ordinary}


def out_of_fold(d: dict, variant: str, states=None) -> tuple[np.ndarray, list[int]]:
    """Every row's logit from the model that did not see its fold, and each fold's epoch."""
    z_all = np.full(len(d["y"]), np.nan)
    epochs = []
    extra = with_states("l4_mean")(d) if variant in ("l4_mean", "both") else d["vectors"]
    for k in d["folds"]:
        inner = (k + 1) % FOLDS
        fold = {**d, "vectors": extra, "is_train": (d["fold"] != k) & (d["fold"] != inner), "val": d["fold"] == inner}
        if variant.startswith("token_max") or variant == "both":
            z, epoch = train_token_max(fold, 8, states)
        else:
            params, epoch, _ = train(extra, d["ngrams"], d["y"], fold["is_train"], fold["val"])
            z = logits(params, extra, d["ngrams"])
        z_all[d["fold"] == k] = z[d["fold"] == k]
        epochs.append(epoch)
        print(f"  {variant} fold {k}: epoch {epoch}", flush=True)
    return z_all, epochs


def _thresholds(z, fold, ordinary, rate, folds, pick=None) -> np.ndarray:
    """Per row, its fold's threshold flagging `rate` of the fold's ordinary prompts (those
    drawn in `pick`, indices per fold, when bootstrapping)."""
    out = np.full(len(z), np.inf)
    for n, k in enumerate(folds):
        rows = np.flatnonzero(ordinary & (fold == k)) if pick is None else pick[n]
        out[fold == k] = _threshold_for(z[rows], rate)
    return out


def figures(z, d, rate) -> dict:
    t = _thresholds(z, d["fold"], d["ordinary"], rate, d["folds"])
    flagged = z >= t
    return {"detection": round(float(flagged[d["attack"]].mean()), 4),
            "lookalikes_flagged": int(flagged[d["hard"]].sum()),
            "ordinary_flagged": int(flagged[d["ordinary"]].sum())}


def paired(z, base, d, rate, rounds: int = 1000) -> dict:
    """This variant minus `base` at `rate`: detection and look-alikes flagged, with 95%
    intervals from a bootstrap that resamples, within each fold, its attacks, look-alikes and
    ordinary prompts."""
    fold = d["fold"]
    per = {name: [np.flatnonzero(d[name] & (fold == k)) for k in d["folds"]] for name in ("attack", "hard", "ordinary")}
    det, hard = [], []
    for pick in resamples(per, rounds):
        a, h = np.concatenate(pick["attack"]), np.concatenate(pick["hard"])
        ta, tb = (_thresholds(s, fold, d["ordinary"], rate, d["folds"], pick["ordinary"]) for s in (z, base))
        det.append((z[a] >= ta[a]).mean() - (base[a] >= tb[a]).mean())
        hard.append(int((z[h] >= ta[h]).sum()) - int((base[h] >= tb[h]).sum()))
    mine, theirs = (s >= _thresholds(s, fold, d["ordinary"], rate, d["folds"]) for s in (z, base))
    at = d["attack"]
    return {"attacks_only_this": int((mine & ~theirs & at).sum()), "attacks_only_shipped": int((theirs & ~mine & at).sum()),
            "detection_difference": round(float(mine[at].mean() - theirs[at].mean()), 4),
            "detection_interval": [round(float(q), 4) for q in interval(det)],
            "lookalikes_difference": int(mine[d["hard"]].sum() - theirs[d["hard"]].sum()),
            "lookalikes_interval": [int(q) for q in interval(hard)]}


def kept_scores(paths: list[Path], scored: np.ndarray) -> tuple[np.ndarray, list[int]]:
    """A variant's out-of-fold scores from runs of some folds each (`--scores`), each run filling
    its folds' rows, and their epochs. Every `scored` row must get one: a row without a score
    would count as an attack missed and would make its fold's threshold NaN."""
    z, epochs = np.full(len(scored), np.nan), []
    for path in paths:
        with np.load(path) as saved:
            z = np.where(np.isnan(z), saved["z"], z)
            epochs += saved["epochs"].tolist()
    missing = int(np.isnan(z[scored]).sum())
    if missing:
        raise SystemExit(f"{', '.join(map(str, paths))}: no score for {missing} rows of the folds asked for")
    return z, epochs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("variants", nargs="*", default=list(VARIANTS))
    parser.add_argument("--out", type=Path, default=ROOT / "reports" / "guard_kfold.json")
    parser.add_argument("--folds", default=",".join(map(str, range(FOLDS))))
    parser.add_argument("--scores", type=Path, action="append", default=[])
    args = parser.parse_args()
    started = time.monotonic()
    d = load()
    d["folds"] = [int(k) for k in args.folds.split(",")]
    scored = np.isin(d["fold"], d["folds"])
    for name in ("attack", "hard", "ordinary"):
        d[name] = d[name] & scored
    counts = {name: int(d[name].sum()) for name in ("attack", "hard", "ordinary")}
    per_fold = [{name: int((d[name] & (d["fold"] == k)).sum()) for name in ("attack", "hard", "ordinary")}
                for k in d["folds"]]
    print(f"{counts}; per fold {per_fold}", flush=True)
    states = None
    scores, results = {}, {}
    for variant in args.variants:
        kept = [folder / f"{variant}.npz" for folder in args.scores]
        if kept and all(path.exists() for path in kept):
            scores[variant], epochs = kept_scores(kept, scored)
        else:
            if states is None and (variant.startswith("token_max") or variant == "both"):
                states = token_states([e.text for e in d["examples"]])
            scores[variant], epochs = out_of_fold(d, variant, states)
            if kept:
                kept[0].parent.mkdir(parents=True, exist_ok=True)
                np.savez(kept[0], z=scores[variant], epochs=np.array(epochs))
        results[variant] = {"epochs": epochs, **{f"{r:g}": figures(scores[variant], d, r) for r in RATES}}
        if variant != "shipped" and "shipped" in scores:
            results[variant]["against_shipped"] = {f"{r:g}": paired(scores[variant], scores["shipped"], d, r) for r in RATES}
        print(variant, json.dumps(results[variant]), flush=True)
    args.out.parent.mkdir(exist_ok=True)
    args.out.write_text(json.dumps({"folds_scored": d["folds"], "rows": counts, "per_fold": per_fold, "variants": results,
                                    "seconds": round(time.monotonic() - started)}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
