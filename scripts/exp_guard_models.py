"""Experiment: variants of the injection classifier, compared on the val split only.

    nice -n 19 .venv/bin/python scripts/exp_guard_models.py [VARIANT ...]

Each variant is trained as scripts/train_guard.py trains the packaged head (same data, splits,
optimizer, epoch chosen on val) and scored on val prompts: detection at the thresholds that
flag 0.1% and 1% of ordinary (paraphrase) val prompts and 1% of the hard look-alikes, and the
hard look-alikes flagged at the 0.1% threshold. Variants: class weights, L2, word 1- and
2-grams beside the character n-grams, the n-grams alone, a ReLU layer over the embedding, the
nearest train attack's and look-alike's similarity as features, more ordinary training prompts
(with and without the look-alikes' share of the weight kept), generated training rows (train
attacks and look-alikes inside train documents) and their mixes, and (`states_*`) the prompt's
token states from the same model run, pooled (bench/guard_data.py `pooled_states`: layer 4's,
the graph's second output, max- or mean-pooled, and the last layer's max-pooled) beside the
embedding; `token_max_*`: learned directions of each layer-4 token state, each read at the
token where it is highest (`train_token_max`). Each `states_*` and `token_max_*` variant is compared with the baseline on the same val rows
(`against_baseline`: the attacks only one of them catches, a bootstrap interval of the
difference, the look-alikes each flags); `fold1_*`, `fold2_*` repeat the comparison on other
draws of the val attacks and look-alikes (`refold`). The test split is not read; the variant that ships is
chosen from these figures. Writes reports/guard_variants.json.
"""
from __future__ import annotations

import hashlib
import json
import re
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench.guard import _threshold_for  # noqa: E402
from bench.guard_data import (ORDINARY_SOURCES, embed_all, generated_examples, injection_examples,  # noqa: E402
                              pooled_states, token_states)
from bench.stats import interval, resamples  # noqa: E402
from sidecar.guard import lexical  # noqa: E402
from sidecar.guard.normalize import fold  # noqa: E402
import train_guard  # noqa: E402
from train_guard import Ngrams, class_weights, logits, train  # noqa: E402


def recall_at(scores, attacks, benign, rate) -> tuple[float, float]:
    """Detection at the threshold flagging `rate` of `benign`, and that threshold."""
    threshold = _threshold_for(scores[benign], rate)
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


def hardest_unused(n: int) -> list:
    """The `n` paraphrase prompts of no split that the packaged head scores highest: ordinary
    prompts that look most like attacks (hard negatives), as train rows."""
    from sidecar.guard.injection import InjectionHead
    used = {e.text for e in injection_examples()}
    unused = [e for e in injection_examples(extra_ordinary=True) if e.split == "train" and e.text not in used]
    vectors = embed_all([e.text for e in unused])
    head = InjectionHead.load()
    scores = np.array([head.score(v, e.text) if not np.isnan(v).any() else -1.0 for v, e in zip(vectors, unused)])
    return [unused[i] for i in np.argsort(-scores)[:n]]


def refold(examples: list, fold: int) -> list:
    """Another draw of the val split of the attacks and look-alikes (deepset and Sluice rows):
    a third of their train and val rows, by a hash of the text and `fold`; the ordinary
    prompts keep theirs (their val split is large). How much a comparison moves with the draw
    of the 150 val attacks; the test split stays out."""
    out = []
    for e in examples:
        if e.source in ("deepset", "sluice"):
            key = hashlib.sha256(f"{fold}\x00{e.text}".encode()).digest()
            e = replace(e, split="val" if int.from_bytes(key[:4], "little") % 3 == 0 else "train")
        out.append(e)
    return out


def data(extra_ordinary: bool = False, augment: bool = False, hardest: int = 0, fold: int = 0) -> dict:
    """Train and val rows the model can embed, their features and the val masks."""
    examples = [e for e in injection_examples(extra_ordinary=extra_ordinary) if e.split != "test"]
    if fold:
        examples = refold(examples, fold)
    if hardest:
        examples += hardest_unused(hardest)
    if augment:
        examples += generated_examples(examples)
    vectors = embed_all([e.text for e in examples])
    usable = ~np.isnan(vectors).any(axis=1)
    examples = [e for e, ok in zip(examples, usable) if ok]
    y = np.array([e.label for e in examples], np.float64)
    is_train = np.array([e.split == "train" for e in examples])
    val = ~is_train
    ordinary = val & np.array([e.source in ORDINARY_SOURCES for e in examples])
    return {"examples": examples, "vectors": vectors[usable].astype(np.float64),
            "ngrams": Ngrams([e.text for e in examples]), "y": y, "is_train": is_train, "val": val,
            "attacks": val & (y == 1), "ordinary": ordinary, "hard": val & (y == 0) & ~ordinary}


def with_states(*poolings: str, scale: float = 1.0):
    """The embedding and, beside it, the prompt's pooled token states from the same model run
    (bench.guard_data.POOLINGS: layer 4's max or mean, the last layer's max), each a unit row
    times `scale` (the L2 and the optimizer's steps act on the weights of that scale)."""
    def features(d: dict) -> np.ndarray:
        pooled = pooled_states([e.text for e in d["examples"]])
        return np.column_stack([d["vectors"]] + [pooled[p].astype(np.float64) * scale for p in poolings])
    return features


def train_token_max(d: dict, units: int, token=None) -> tuple[np.ndarray, int]:
    """The baseline's logistic plus `units` learned directions of layer 4's token states, each
    read at the token where it is highest: z += out . max_t(states_t @ proj + proj_bias). Trained
    by train_guard.fit (full-batch Adam, train_guard's L2 and class weights, epoch chosen on val);
    the gradient of each maximum goes to its highest token. Returns every row's logit and the
    epoch. `token`: token_states of d's examples, when already read (they take minutes)."""
    states, offsets = token or token_states([e.text for e in d["examples"]])
    states = states.astype(np.float32)
    row_of = np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))
    starts = offsets[:-1]
    v, ngrams, y = d["vectors"], d["ngrams"], d["y"]
    rng = np.random.default_rng(22)
    params = {"embedding": np.zeros(v.shape[1]), "lexical": np.zeros(ngrams.dim), "bias": np.zeros(()),
              "proj": rng.normal(0, 1 / np.sqrt(states.shape[1]), (states.shape[1], units)).astype(np.float32),
              "proj_bias": np.zeros(units, np.float32), "out": np.zeros(units)}
    l2 = {"embedding": train_guard.L2_EMBEDDING, "lexical": train_guard.L2_LEXICAL, "bias": 0.0,
          "proj": train_guard.L2_EMBEDDING, "proj_bias": 0.0, "out": train_guard.L2_EMBEDDING}

    def forward(p):
        a = states @ p["proj"] + p["proj_bias"]
        top = np.maximum.reduceat(a, starts, axis=0)

        def gradients(g):
            dtop = np.outer(g, p["out"])
            da = ((a == top[row_of]) * dtop[row_of]).astype(np.float32)
            return {"embedding": v.T @ g, "lexical": ngrams.grad(g), "bias": g.sum(), "out": top.T @ g,
                    "proj": states.T @ da, "proj_bias": da.sum(axis=0)}
        return v @ p["embedding"] + ngrams.dot(p["lexical"]) + p["bias"] + top @ p["out"], gradients

    _, best_z, best_epoch, _ = train_guard.fit(params, l2, forward, y, class_weights(y, d["is_train"]), d["val"])
    return best_z, best_epoch


def variants() -> dict:
    """name -> (data options, train options); built lazily, the slow ones last."""
    def shares(share):
        return lambda d: source_weights(d["examples"], d["y"], d["is_train"], share)

    return {
        "baseline": ({}, {}),
        "states_l4_max": ({}, {"vectors": with_states("l4_max")}),
        "states_l4_mean": ({}, {"vectors": with_states("l4_mean")}),
        "states_l4_max_mean": ({}, {"vectors": with_states("l4_max", "l4_mean")}),
        "states_last_max": ({}, {"vectors": with_states("last_max")}),
        "states_l4_max_last_max": ({}, {"vectors": with_states("l4_max", "last_max")}),
        "states_l4_max_x2": ({}, {"vectors": with_states("l4_max", scale=2.0)}),
        "states_l4_max_mean_x0.5": ({}, {"vectors": with_states("l4_max", "l4_mean", scale=0.5)}),
        # Two other draws of the val attacks and look-alikes: the baseline and layer 4's mean.
        **{f"fold{k}_{name}": ({"fold": k}, options) for k in (1, 2)
           for name, options in (("baseline", {}), ("states_l4_mean", {"vectors": with_states("l4_mean")}))},
        # A learned projection of each layer-4 token state, its maximum over the tokens.
        "token_max_8": ({}, {"token_max": 8}),
        "token_max_32": ({}, {"token_max": 32}),
        "states_l4_max_no_embedding": ({}, {"vectors": lambda d: with_states("l4_max")(d)[:, d["vectors"].shape[1]:]}),
        "word_ngrams": ({}, {"ngrams": lambda d: Ngrams([e.text for e in d["examples"]], with_words)}),
        "hard_share_0.25": ({}, {"weight": shares(0.25)}),
        "hard_share_0.5": ({}, {"weight": shares(0.5)}),
        "l2_x10": ({}, {"l2_embedding": 1e-3, "l2_lexical": 1e-4}),
        "l2_div10": ({}, {"l2_embedding": 1e-5, "l2_lexical": 1e-6}),
        "no_embedding": ({}, {"vectors": lambda d: np.zeros((len(d["examples"]), 0))}),
        "mlp_16": ({}, {"hidden": 16}),
        "mlp_64": ({}, {"hidden": 64}),
        "nearest_attack": ({}, {"vectors": nearest_features}),
        "more_ordinary": ({"extra_ordinary": True}, {}),
        # The look-alikes' share of the benign weight kept as without the extra prompts (~6%).
        "more_ordinary_hard_share_0.063": ({"extra_ordinary": True}, {"weight": shares(0.063)}),
        "hardest_ordinary_1000": ({"hardest": 1000}, {"weight": shares(0.063)}),
        "hardest_ordinary_3000": ({"hardest": 3000}, {"weight": shares(0.063)}),
        "augment": ({"augment": True}, {}),
        "more_ordinary_augment": ({"extra_ordinary": True, "augment": True}, {}),
        "more_ordinary_augment_mlp_64": ({"extra_ordinary": True, "augment": True}, {"hidden": 64}),
    }


def nearest_features(d: dict) -> np.ndarray:
    """The embedding and, beside it, each prompt's highest cosine similarity to a train attack
    and to a train benign look-alike (a train row leaves itself out)."""
    v, e = d["vectors"], d["examples"]
    columns = []
    for label in (1, 0):
        ref = np.flatnonzero(d["is_train"] & (d["y"] == label) & np.array([x.source in ("deepset", "sluice") for x in e]))
        sims = v @ v[ref].T
        sims[ref, np.arange(len(ref))] = -1.0
        columns.append(sims.max(axis=1))
    return np.column_stack([v] + [np.asarray(c) * 4 for c in columns])


def paired_difference(z, base, attacks, ordinary, rate, rounds: int = 1000) -> dict:
    """Detection at `rate` of ordinary prompts, this variant minus the baseline, on the same val
    rows: the attacks only one of them catches, and a 95% interval of the difference from a
    bootstrap that resamples the attacks and the ordinary prompts (both thresholds move with
    the ordinary prompts drawn, which at 0.1% is most of the noise)."""
    a, o = np.flatnonzero(attacks), np.flatnonzero(ordinary)

    def caught(scores, oi, ai):
        return scores[ai] >= _threshold_for(scores[oi], rate)

    mine, theirs = caught(z, o, a), caught(base, o, a)
    diffs = [caught(z, pick["ordinary"], pick["attack"]).mean() - caught(base, pick["ordinary"], pick["attack"]).mean()
             for pick in resamples({"attack": a, "ordinary": o}, rounds)]
    low, high = interval(diffs)
    return {"only_this": int((mine & ~theirs).sum()), "only_baseline": int((theirs & ~mine).sum()),
            "difference": round(float(mine.mean() - theirs.mean()), 3),
            "interval": [round(float(low), 3), round(float(high), 3)]}


def main() -> int:
    only = sys.argv[1:]
    cached: dict = {}

    def get(options: dict) -> dict:
        key = tuple(sorted(options.items()))
        if key not in cached:
            cached[key] = data(**options)
        return cached[key]

    results = {}
    baseline = {}     # data options -> the baseline's val logits, for the paired comparison
    for name, (data_options, options) in variants().items():
        if only and name not in only and not (name == "baseline" and any(n.startswith(("states_", "token_max")) for n in only)):
            continue
        d = get(data_options)
        options = {k: (v(d) if callable(v) else v) for k, v in options.items()}
        v = options.pop("vectors", d["vectors"])
        features = options.pop("ngrams", d["ngrams"])
        if "token_max" in options:
            z, epoch = train_token_max(d, options.pop("token_max"))
        else:
            params, epoch, _ = train(v, features, d["y"], d["is_train"], d["val"], **options)
            z = logits(params, v, features)
        attacks, ordinary, hard = d["attacks"], d["ordinary"], d["hard"]
        d001, t001 = recall_at(z, attacks, ordinary, 0.001)
        d002, _ = recall_at(z, attacks, ordinary, 0.002)
        d005, _ = recall_at(z, attacks, ordinary, 0.005)
        d01, t01 = recall_at(z, attacks, ordinary, 0.01)
        dh, _ = recall_at(z, attacks, hard, 0.01)
        results[name] = {"epoch": epoch, "detection_at_0.1%_paraphrase": round(d001, 3),
                         "hard_fa_at_0.1%_paraphrase": round(float((z[hard] >= t001).mean()), 3),
                         "detection_at_0.2%_paraphrase": round(d002, 3), "detection_at_0.5%_paraphrase": round(d005, 3),
                         "detection_at_1%_paraphrase": round(d01, 3),
                         "hard_fa_at_1%_paraphrase": round(float((z[hard] >= t01).mean()), 3),
                         "detection_at_1%_hard": round(dh, 3),
                         "train_rows": int(d["is_train"].sum()), "features": int(v.shape[1])}
        key = tuple(sorted(data_options.items()))
        if name.endswith("baseline"):
            baseline[key] = z
        elif key in baseline and ("states_" in name or name.startswith("token_max")):
            results[name]["against_baseline"] = {
                f"{rate:g}": paired_difference(z, baseline[key], attacks, ordinary, rate) for rate in (0.001, 0.01)}
            # Look-alikes flagged at each one's own 0.1% threshold: by this variant only, by the baseline only.
            _, b001 = recall_at(baseline[key], attacks, ordinary, 0.001)
            mine, theirs = z[hard] >= t001, baseline[key][hard] >= b001
            results[name]["against_baseline"]["hard_flagged_0.001"] = {
                "only_this": int((mine & ~theirs).sum()), "only_baseline": int((theirs & ~mine).sum())}
            # At the threshold that flags as many look-alikes as the baseline does at its 0.1%
            # threshold: the attacks caught and the ordinary prompts flagged there.
            same = np.sort(z[hard])[::-1][max(0, int(theirs.sum()) - 1)] if theirs.any() else np.inf
            results[name]["against_baseline"]["at_baseline_hard_fa"] = {
                "detection": round(float((z[attacks] >= same).mean()), 3),
                "ordinary_fa": round(float((z[ordinary] >= same).mean()), 4),
                "baseline_detection": round(float((baseline[key][attacks] >= b001).mean()), 3)}
        print(name, results[name], flush=True)
        print(f"val: {int(attacks.sum())} attacks, {int(hard.sum())} hard look-alikes, {int(ordinary.sum())} ordinary", flush=True)
    out = ROOT / "reports" / "guard_variants.json"
    out.parent.mkdir(exist_ok=True)
    earlier = json.loads(out.read_text()) if only and out.exists() else {}
    out.write_text(json.dumps({**earlier, **results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
