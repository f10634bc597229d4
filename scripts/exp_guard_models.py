"""Experiment: variants of the injection classifier, compared on the val split only.

    nice -n 19 .venv/bin/python scripts/exp_guard_models.py [VARIANT ...]

Each variant is trained as scripts/train_guard.py trains the packaged head (same data, splits,
optimizer, epoch chosen on val) and scored on val prompts: detection at the thresholds that
flag 0.1% and 1% of ordinary (paraphrase) val prompts and 1% of the hard look-alikes, and the
hard look-alikes flagged at the 0.1% threshold. Variants: class weights, L2, word 1- and
2-grams beside the character n-grams, the n-grams alone. The test split is not read; the variant that
ships is chosen from these figures. Writes reports/guard_variants.json.
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

from bench.guard_data import ORDINARY_SOURCES, embed_all, injection_examples  # noqa: E402
from sidecar.guard import lexical  # noqa: E402
from sidecar.guard.normalize import fold  # noqa: E402
from train_guard import Ngrams, class_weights, logits, train  # noqa: E402


def recall_at(scores, attacks, benign, rate) -> tuple[float, float]:
    """Detection at the threshold flagging `rate` of `benign`, and that threshold."""
    ordered = np.sort(scores[benign])[::-1]
    threshold = ordered[int(np.floor(rate * len(ordered)))] + 1e-9
    return float((scores[attacks] >= threshold).mean()), threshold


def source_weights(examples, y, train_rows, hard_share) -> np.ndarray:
    """Class-balanced, and within benign prompts the hard look-alikes get `hard_share` of the
    weight (by count they are ~4%)."""
    weight = class_weights(y, train_rows)
    hard = np.array([e.label == 0 and e.source not in ORDINARY_SOURCES for e in examples]) & train_rows
    ordinary = np.array([e.source in ORDINARY_SOURCES for e in examples]) & train_rows
    benign_total = weight[hard | ordinary].sum()
    weight[hard] = benign_total * hard_share / hard.sum()
    weight[ordinary] = benign_total * (1 - hard_share) / ordinary.sum()
    return weight


_WORD = re.compile(r"\w+")


def with_words(text: str) -> np.ndarray:
    """Character n-grams and word 1- and 2-grams (salted, into the same buckets)."""
    words = _WORD.findall(fold(text))
    grams = words + [a + " " + b for a, b in zip(words, words[1:])]
    hashed = [int.from_bytes(hashlib.blake2b(("w\x00" + g).encode(), digest_size=8).digest(), "little")
              >> (64 - lexical.DIM_BITS) for g in grams]
    return np.concatenate([lexical.buckets(text), np.array(hashed, np.int64)])


def main() -> int:
    examples = [e for e in injection_examples() if e.split != "test"]
    vectors = embed_all([e.text for e in examples])
    usable = ~np.isnan(vectors).any(axis=1)
    examples = [e for e, ok in zip(examples, usable) if ok]
    vectors = vectors[usable].astype(np.float64)
    ngrams = Ngrams([e.text for e in examples])
    y = np.array([e.label for e in examples], np.float64)
    is_train = np.array([e.split == "train" for e in examples])
    val = ~is_train
    attacks = val & (y == 1)
    ordinary = val & np.array([e.source in ORDINARY_SOURCES for e in examples])
    hard = val & (y == 0) & ~ordinary
    only = sys.argv[1:]
    variants = {
        "baseline": {},
        "word_ngrams": {"ngrams": Ngrams([e.text for e in examples], with_words)},
        "hard_share_0.25": {"weight": source_weights(examples, y, is_train, 0.25)},
        "hard_share_0.5": {"weight": source_weights(examples, y, is_train, 0.5)},
        "l2_x10": {"l2_embedding": 1e-3, "l2_lexical": 1e-4},
        "l2_div10": {"l2_embedding": 1e-5, "l2_lexical": 1e-6},
        "no_embedding": {"vectors": np.zeros((len(examples), 0))},
    }
    results = {}
    for name, options in variants.items():
        if only and name not in only:
            continue
        v = options.pop("vectors", vectors)
        features = options.pop("ngrams", ngrams)
        params, epoch, _ = train(v, features, y, is_train, val, **options)
        z = logits(params, v, features)
        d001, t001 = recall_at(z, attacks, ordinary, 0.001)
        d01, _ = recall_at(z, attacks, ordinary, 0.01)
        dh, _ = recall_at(z, attacks, hard, 0.01)
        results[name] = {"epoch": epoch, "detection_at_0.1%_paraphrase": round(d001, 3),
                         "hard_fa_at_0.1%_paraphrase": round(float((z[hard] >= t001).mean()), 3),
                         "detection_at_1%_paraphrase": round(d01, 3), "detection_at_1%_hard": round(dh, 3)}
        print(name, results[name], flush=True)
    print(f"val: {int(attacks.sum())} attacks, {int(hard.sum())} hard look-alikes, {int(ordinary.sum())} ordinary")
    out = ROOT / "reports" / "guard_variants.json"
    out.parent.mkdir(exist_ok=True)
    earlier = json.loads(out.read_text()) if only and out.exists() else {}
    out.write_text(json.dumps({**earlier, **results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
