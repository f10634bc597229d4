"""Experiment: where the n-gram model's threshold should come from, compared on the val split only.

    nice -n 19 .venv/bin/python scripts/exp_guard_text_calibration.py [HEAD.npz]
    nice -n 19 .venv/bin/python scripts/exp_guard_text_calibration.py --bigrams

The n-gram model (sidecar/guard/injection.py `TextHead`) judges the prompts without an
embedding, most of them Chinese and Japanese. Its threshold for a route's false-alarm rate can be
set on all ordinary val prompts (English paraphrases and ordinary CJK requests: what ships) or on
the ordinary val prompts it actually judges (those without an embedding). Both are scored on the
val prompts without an embedding: attacks caught, look-alikes and ordinary prompts flagged, by
language; and, for a full embedding queue (when English prompts reach it too), the share of
ordinary English val prompts flagged. The ordinary prompts that set a threshold are also among
those it is scored on: that false-alarm figure is in-sample. The test splits are not read.
Writes reports/guard_text_calibration.json.

--bigrams: the n-gram model retrained (as scripts/train_guard.py trains it) with and without
character 2-grams of Chinese, Japanese and Korean text beside the 3- to 5-grams (their words are
mostly two characters long, which 3- to 5-grams only see with a neighbour), scored on the whole
text, each at the thresholds its ordinary val prompts give. Prints only.
"""
from __future__ import annotations

import hashlib
import json
import re
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(ROOT / "scripts"))

from bench.guard import _scores, wilson  # noqa: E402
from bench.guard_data import ORDINARY_SOURCES, embed_all, injection_examples  # noqa: E402
from sidecar.guard import lexical  # noqa: E402
from sidecar.guard.injection import InjectionHead, threshold_for  # noqa: E402
from sidecar.guard.normalize import fold  # noqa: E402
from train_guard import Ngrams, train  # noqa: E402

_CJK_PAIR = re.compile(r"[\u3040-\u30ff\u3400-\u9fff\uac00-\ud7af]{2}")


def with_cjk_bigrams(text: str) -> np.ndarray:
    """The shipped n-gram buckets and the text's CJK character 2-grams (salted, same buckets)."""
    folded = fold(text)
    pairs = [folded[i:i + 2] for i in range(len(folded) - 1) if _CJK_PAIR.fullmatch(folded[i:i + 2])]
    hashed = [int.from_bytes(hashlib.blake2b(("b\x00" + g).encode(), digest_size=8).digest(), "little")
              >> (64 - lexical.DIM_BITS) for g in pairs]
    return np.concatenate([lexical.buckets(text), np.array(hashed, np.int64)])


def bigrams() -> int:
    examples = [e for e in injection_examples() if e.split != "test"]
    embedded = ~np.isnan(embed_all([e.text for e in examples])).any(axis=1)
    y = np.array([e.label for e in examples], np.float64)
    val = np.array([e.split == "val" for e in examples])
    ordinary = np.array([e.source in ORDINARY_SOURCES for e in examples]) & val
    lang = np.array([e.lang for e in examples])
    for name, buckets in (("3- to 5-grams (shipped)", lexical.buckets), ("and CJK 2-grams", with_cjk_bigrams)):
        ngrams = Ngrams([e.text for e in examples], buckets=buckets)
        params, epoch, _ = train(np.zeros((len(examples), 0)), ngrams, y, ~val, val)
        scores = 1 / (1 + np.exp(-(ngrams.dot(params["lexical"]) + params["bias"])))
        for rate in (0.01, 0.001):
            flagged = scores >= threshold_for(scores[ordinary], rate)
            judged = val & ~embedded

            def share(mask, flagged=flagged) -> str:
                return f"{int(flagged[mask].sum())}/{int(mask.sum())}"
            print(f"{name}, rate {rate}: without an embedding: attacks {share(judged & (y == 1))} "
                  f"(zh {share(judged & (y == 1) & (lang == 'zh'))}, ja {share(judged & (y == 1) & (lang == 'ja'))}), "
                  f"look-alikes {share(judged & (y == 0) & ~ordinary)}, ordinary {share(judged & ordinary)}; "
                  f"every val attack {share(val & (y == 1))}, look-alike {share(val & (y == 0) & ~ordinary)}")
    return 0


def main() -> int:
    if sys.argv[1:] == ["--bigrams"]:
        return bigrams()
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
            threshold = threshold_for(benign, rate)
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
