"""Experiment: two injection head files compared on the val split, as the sidecar judges.

    nice -n 19 .venv/bin/python scripts/exp_guard_heads.py OLD.npz NEW.npz [--rows all|before]

Each val prompt is scored as the sidecar scores it: by the full model where the embedding
model embeds it, else by the n-gram model. Each head's thresholds are set on ordinary val
prompts as its file says (pooled, or the rate holding in each calibration group: English
paraphrase prompts, ordinary prompts in other languages; each model's own scores, as
scripts/train_guard.py calibrates) or as `--calibration` says for both, at 0.1% and 1%. The ordinary prompts are cut in two halves
(scripts/exp_guard_calibration.py `halves`): thresholds set on one half judge the other half's
ordinary prompts, so each is counted once by thresholds it did not set; attacks and look-alikes
are judged at both halves' thresholds and averaged. Then val attacks caught, look-alikes and
ordinary prompts flagged, and the differences (NEW minus OLD) with 95% intervals from a paired
bootstrap of attacks, look-alikes and each half's ordinary prompts. `--rows before`: only the
rows of data/guard/ whose ids are below bench/guard_data.py's LATER_BATCH (with deepset and the
paraphrase prompts). For
a retrained head: the val rows chose its epoch as they chose the old one's; the test split is
not read. Writes reports/guard_heads.json (guard_heads_before.json, ..._pooled.json, ...).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench.guard import _scores  # noqa: E402
from bench.guard_data import injection_examples  # noqa: E402
from exp_guard_calibration import Judge, paired, row, val_rows  # noqa: E402
from sidecar.guard.injection import InjectionHead  # noqa: E402

RATES = (0.001, 0.01)
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old", type=Path)
    parser.add_argument("new", type=Path)
    parser.add_argument("--rows", choices=("all", "before"), default="all")
    parser.add_argument("--rounds", type=int, default=1000)
    parser.add_argument("--calibration", choices=("file", "pooled", "each"), default="file",
                        help="both heads' calibration: as each file says, or this one for both")
    args = parser.parse_args()
    examples = [e for e in injection_examples() if e.split == "val"]
    if args.rows == "before":
        examples = [e for e in examples if e.earlier]
    d = val_rows(examples, args.rounds)
    judges = {}
    for name, path in (("old", args.old), ("new", args.new)):
        head = InjectionHead.load(path)
        kind = args.calibration if args.calibration != "file" else "pooled" if head.benign_groups is None else "each"
        judges[name] = Judge(_scores(head, examples), d, kind)
    report = {"rows": args.rows, "calibration": {n: j.kind for n, j in judges.items()}, "val": d["counts"]}
    print(json.dumps(report), flush=True)
    attack, first_half = d["everything"]["attack"], d["everything"]["ordinary"][0]
    for rate in RATES:
        out = {n: row(j.figures(rate, d["everything"]), len(attack)) for n, j in judges.items()}
        out["new_minus_old"] = paired(judges["new"], judges["old"], rate, d)
        # Attacks caught per language at the first half's thresholds: old, new, attacks.
        flags = {n: j.flagged(rate, first_half) for n, j in judges.items()}
        out["attacks_by_language"] = {}
        for lang in sorted({examples[i].lang for i in attack}):
            mine = [i for i in attack if examples[i].lang == lang]
            out["attacks_by_language"][lang] = [int(flags["old"][mine].sum()), int(flags["new"][mine].sum()), len(mine)]
        report[f"{rate:g}"] = out
        print(rate, json.dumps(out), flush=True)
    name = f"guard_heads{'' if args.rows == 'all' else '_before'}{'' if args.calibration == 'file' else '_' + args.calibration}.json"
    out_path = ROOT / "reports" / name
    out_path.parent.mkdir(exist_ok=True)
    out_path.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
