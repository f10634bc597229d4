"""Experiment: a second opinion on long prompts from the n-gram model, on the val split only.

    nice -n 19 .venv/bin/python scripts/exp_guard_tail.py [HEAD.npz]

HEAD.npz: the weights to score with (default the packaged head), its last-paragraph rule left
off: `shipped` below is the head without it.

An order appended to (or hidden in) a pasted document is caught far less often than one sent
alone: the full model's score adds the embedding of the whole text, which reads mostly the
document. The n-gram model (the head's `TextHead`, trained on every prompt) judges a text
longer than lexical.WINDOW by its most suspect stretch as well, and needs no second model run.
Variants, fixed before any result was seen; each changes only how an embedded prompt is
scored (the weights stay; prompts without an embedding are judged by the n-gram model as
shipped):
- `long`: a prompt longer than lexical.WINDOW characters scores the higher of the full
  model's score and the n-gram model's score of the whole text;
- `last_paragraph`: a prompt of more than one paragraph (parts split by a blank line) scores
  the higher of the full model's score and the n-gram model's score of its last paragraph.
Each variant's thresholds are set on its own scores of the ordinary val prompts, the rate
holding in each group (as the sidecar calibrates), cross-fitted by halves as
scripts/exp_guard_calibration.py does; against the head as shipped: val attacks caught,
look-alikes, paraphrase and ordinary non-English prompts flagged, with 95% intervals from a
paired bootstrap. Then val attacks appended to val paraphrase prompts run together to 500 and
2,000 characters, and such documents alone, at thresholds set on all ordinary val prompts.
The test split and the held-out files are not read. Writes reports/guard_tail.json.
"""
from __future__ import annotations

import json
import random
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench.guard import _scores, appended_documents, wilson  # noqa: E402
from bench.guard_data import ORDINARY_SOURCES, embed_all, injection_examples  # noqa: E402
from exp_guard_calibration import Judge, paired, row, val_rows  # noqa: E402
from sidecar.guard import lexical  # noqa: E402
from sidecar.guard.injection import WEIGHTS, InjectionHead, last_paragraph, threshold_for  # noqa: E402

RATES = (0.001, 0.01)


def variant(name: str, head: InjectionHead, texts: list[str], full: np.ndarray) -> np.ndarray:
    out = full.copy()
    for i, text in enumerate(texts):
        if np.isnan(full[i]):
            continue
        if name == "long" and len(text) > lexical.WINDOW:
            out[i] = max(full[i], head.text.score(text))
        elif name == "last_paragraph" and (tail := last_paragraph(text)) is not None:
            out[i] = max(full[i], head.text.score(tail))
    return out


def appended(head: InjectionHead, examples, names) -> dict:
    ordinary = [e for e in examples if e.source in ORDINARY_SOURCES]
    paraphrase = [e.text for e in ordinary if e.source == "paraphrase"]
    attacks = [e.text for e in examples if e.label == 1]
    rng = random.Random(22)
    cal_embedded, cal_full, cal_text = _scores(head, ordinary)
    groups = np.array([e.source == "paraphrase" for e in ordinary], np.int8)
    out = {}
    for size in (500, 2000):
        texts = appended_documents(attacks, paraphrase, size, rng)
        vectors = embed_all(texts)
        embedded = ~np.isnan(vectors).any(axis=1)
        full = np.array([head.score(v, t) if ok else np.nan for v, t, ok in zip(vectors, texts, embedded)])
        text = np.array([head.score(None, t) for t in texts])
        flags = {}
        for name in names:
            mine = variant(name, head, texts, full)
            cal = variant(name, head, [e.text for e in ordinary], cal_full)
            for rate in RATES:
                t_full = threshold_for(cal[cal_embedded], rate, groups[cal_embedded])
                t_text = threshold_for(cal_text, rate, groups)
                flagged = np.where(embedded, np.nan_to_num(mine, nan=-1.0) >= t_full, text >= t_text)
                flags[name, rate] = flagged
                out[f"{size}/{name}/{rate:g}"] = {
                    "detection": wilson(int(flagged[:len(attacks)].sum()), len(attacks)),
                    "false_alarms": wilson(int(flagged[len(attacks):].sum()), 200)}
        rng_b = np.random.default_rng(22)
        for name in names[1:]:
            for rate in RATES:
                a, b = flags[name, rate][:len(attacks)], flags[names[0], rate][:len(attacks)]
                draws = [rng_b.integers(0, len(attacks), len(attacks)) for _ in range(1000)]
                diffs = [float(a[d].mean() - b[d].mean()) for d in draws]
                out[f"{size}/{name}/{rate:g}"]["detection_minus_shipped"] = [
                    round(float(a.mean() - b.mean()), 4), *np.round(np.quantile(diffs, [0.025, 0.975]), 4).tolist()]
        print(size, json.dumps({k: v for k, v in out.items() if k.startswith(str(size))}), flush=True)
    return out


def main() -> int:
    # The variants are scored here: the head's own last-paragraph rule is left off.
    head = replace(InjectionHead.load(Path(sys.argv[1]) if len(sys.argv) > 1 else WEIGHTS), last_paragraph=False)
    examples = [e for e in injection_examples() if e.split == "val"]
    d = val_rows(examples, 1000)
    embedded, full, text = _scores(head, examples)
    texts = [e.text for e in examples]
    names = ("shipped", "long", "last_paragraph")
    judges = {name: Judge((embedded, full if name == "shipped" else variant(name, head, texts, full), text), d, "each")
              for name in names}
    report = {"val": d["counts"], "variants": {}}
    for rate in RATES:
        for name, judge in judges.items():
            out = row(judge.figures(rate, d["everything"]), d["counts"]["attacks"])
            if name != "shipped":
                out["against_shipped"] = paired(judge, judges["shipped"], rate, d)
            report["variants"].setdefault(name, {})[f"{rate:g}"] = out
            print(rate, name, json.dumps(out), flush=True)
    report["appended"] = appended(head, examples, names)
    path = ROOT / "reports" / "guard_tail.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
