"""Experiment: two injection head files compared on the val split, as the sidecar judges.

    nice -n 19 .venv/bin/python scripts/exp_guard_heads.py OLD.npz NEW.npz

Each val prompt is scored as the sidecar scores it: by the full model where the embedding
model embeds it, else by the n-gram model. Both heads' thresholds are set on the same ordinary
val prompts (each model's own scores of them, as scripts/train_guard.py calibrates), at 0.1%
and 1%; then val attacks caught and look-alikes flagged, and the difference (NEW minus OLD)
with a 95% interval from a paired bootstrap of attacks, look-alikes and ordinary prompts. For
a retrained head: the val rows chose its epoch as they chose the old one's; the test split is
not read. Writes reports/guard_heads.json.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.guard import _scores, _threshold_for  # noqa: E402
from bench.guard_data import ORDINARY_SOURCES, injection_examples  # noqa: E402
from sidecar.guard.injection import InjectionHead  # noqa: E402

RATES = (0.001, 0.01)


def flagged(embedded, full, text, ordinary, rate, pick=None) -> np.ndarray:
    """Whether each prompt is flagged at thresholds flagging `rate` of the ordinary prompts in
    `pick` (all of them when None): full-model threshold from those embedded, n-gram threshold
    from all."""
    rows = np.flatnonzero(ordinary) if pick is None else pick
    t_full = _threshold_for(full[rows[embedded[rows]]], rate)
    t_text = _threshold_for(text[rows], rate)
    return np.where(embedded, full >= t_full, text >= t_text)


def main() -> int:
    old_path, new_path = (Path(p) for p in sys.argv[1:3])
    examples = [e for e in injection_examples() if e.split == "val"]
    y = np.array([e.label for e in examples])
    ordinary = np.array([e.source in ORDINARY_SOURCES for e in examples])
    attack, hard = y == 1, (y == 0) & ~ordinary
    heads = {name: _scores(InjectionHead.load(p), examples) for name, p in (("old", old_path), ("new", new_path))}
    rng = np.random.default_rng(22)
    a, h, o = np.flatnonzero(attack), np.flatnonzero(hard), np.flatnonzero(ordinary)
    report = {"val": {"attacks": int(attack.sum()), "lookalikes": int(hard.sum()), "ordinary": int(ordinary.sum())}}
    for rate in RATES:
        f = {n: flagged(*heads[n], ordinary, rate) for n in heads}
        det, look = [], []
        for _ in range(1000):
            ai, hi, oi = rng.choice(a, len(a)), rng.choice(h, len(h)), rng.choice(o, len(o))
            g = {n: flagged(*heads[n], ordinary, rate, oi) for n in heads}
            det.append(g["new"][ai].mean() - g["old"][ai].mean())
            look.append(int(g["new"][hi].sum()) - int(g["old"][hi].sum()))
        langs = sorted({examples[i].lang for i in a})
        report[f"{rate:g}"] = {
            **{n: {"detection": round(float(f[n][attack].mean()), 4), "attacks_caught": int(f[n][attack].sum()),
                   "lookalikes_flagged": int(f[n][hard].sum()), "ordinary_flagged": int(f[n][ordinary].sum())} for n in f},
            "detection_difference": round(float(f["new"][attack].mean() - f["old"][attack].mean()), 4),
            "detection_interval": [round(float(q), 4) for q in np.quantile(det, [0.025, 0.975])],
            "lookalikes_difference": int(f["new"][hard].sum() - f["old"][hard].sum()),
            "lookalikes_interval": [int(q) for q in np.quantile(look, [0.025, 0.975])],
            "attacks_by_language": {lang: [int(f["old"][[i for i in a if examples[i].lang == lang]].sum()),
                                           int(f["new"][[i for i in a if examples[i].lang == lang]].sum()),
                                           sum(examples[i].lang == lang for i in a)] for lang in langs},
        }
        print(rate, json.dumps(report[f"{rate:g}"]), flush=True)
    out = ROOT / "reports" / "guard_heads.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
