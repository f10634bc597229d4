"""Experiment: where the n-gram model's threshold should come from, compared on the val split only.

    nice -n 19 .venv/bin/python scripts/exp_guard_text_calibration.py [HEAD.npz]

The n-gram model (sidecar/guard/injection.py `TextHead`) judges the prompts without an
embedding, most of them Chinese and Japanese. Its threshold for a route's false-alarm rate can be
set on all ordinary val prompts (English paraphrases and ordinary CJK requests: what ships) or on
the ordinary val prompts it actually judges (those without an embedding). Both are scored on the
val prompts without an embedding: attacks caught, look-alikes and ordinary prompts flagged, by
language; and, for a full embedding queue (when English prompts reach it too), the share of
ordinary English val prompts flagged. The ordinary prompts that set a threshold are also among
those it is scored on: that false-alarm figure is in-sample. The test splits are not read.
Writes reports/guard_text_calibration.json.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.guard import _scores, wilson  # noqa: E402
from bench.guard_data import ORDINARY_SOURCES, injection_examples  # noqa: E402
from sidecar.guard.injection import InjectionHead, _quantile  # noqa: E402


def main() -> int:
    head = InjectionHead.load(Path(sys.argv[1])) if len(sys.argv) > 1 else InjectionHead.load()
    val = [e for e in injection_examples() if e.split == "val"]
    embedded, _, text = _scores(head, val)
    ordinary = np.array([e.source in ORDINARY_SOURCES for e in val])
    label = np.array([e.label for e in val])
    lang = np.array([e.lang for e in val])
    english = np.array([e.source == "paraphrase" for e in val])
    calibrations = {"all ordinary val prompts": text[ordinary],
                    "ordinary val prompts without an embedding": text[ordinary & ~embedded]}
    out = {"ordinary_without_embedding": int((ordinary & ~embedded).sum()), "variants": {}}
    for name, benign in calibrations.items():
        for rate in (0.01, 0.001):
            threshold = _quantile(benign, rate)
            flagged = text >= threshold
            row = {"threshold": round(threshold, 4), "by_language": {}}
            judged = ~embedded
            for key, mask in (("attacks", judged & (label == 1)), ("lookalikes", judged & (label == 0) & ~ordinary),
                              ("ordinary", judged & ordinary)):
                row[key] = wilson(int(flagged[mask].sum()), int(mask.sum()))
            row["english_ordinary_if_queue_full"] = wilson(int(flagged[english].sum()), int(english.sum()))
            for code in sorted(set(lang[judged])):
                m = judged & (lang == code)
                row["by_language"][code] = {
                    "attacks": f"{int(flagged[m & (label == 1)].sum())}/{int((m & (label == 1)).sum())}",
                    "lookalikes": f"{int(flagged[m & (label == 0) & ~ordinary].sum())}/{int((m & (label == 0) & ~ordinary).sum())}",
                    "ordinary": f"{int(flagged[m & ordinary].sum())}/{int((m & ordinary).sum())}"}
            out["variants"][f"{name} @ {rate}"] = row
            print(f"{name} @ {rate}: threshold {threshold:.3f}; without an embedding: attacks "
                  f"{row['attacks']['hits']}/{row['attacks']['n']}, look-alikes {row['lookalikes']['hits']}/{row['lookalikes']['n']}, "
                  f"ordinary {row['ordinary']['hits']}/{row['ordinary']['n']}; English ordinary if the queue is full "
                  f"{row['english_ordinary_if_queue_full']['rate']:.4f}; {row['by_language']}")
    path = ROOT / "reports" / ("guard_text_calibration.json" if len(sys.argv) == 1 else "guard_text_calibration_other.json")
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(out, indent=1, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
