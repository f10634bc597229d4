"""Experiment: token-alignment features (BERTScore-style greedy matching) added to the verifier's trees.

    nice -n 19 .venv/bin/python scripts/exp_align_features.py [--split 4]

The features are sidecar/cache/alignment.py's `align_features` (served since: scripts/train_verifier.py
trains the shipped model with them). Each text's token states after MiniLM's first `split` layers (scripts/crossenc_states.py; the
embedder computes them on its way to the vector) are matched greedily: each token's best cosine
in the other text. Features (symmetric): the two directions' mean best match (min, max), and the
worst-matched token's best match (min, max of the two directions: one entity or number changed
leaves one token without a partner). The trees are trained exactly as scripts/train_verifier.py
trains them (same pairs, weights, calibration), once with the 23 features and once with these
added, and reported on the held-out sets of scripts/eval_semantic.py. Writes reports/align.json.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from crossenc_states import experiment_sets  # noqa: E402
from sidecar.cache.alignment import ALIGN_FEATURES as ALIGN  # noqa: E402
from sidecar.cache.alignment import align_features, unit_tokens  # noqa: E402

REPORT = ROOT / "reports" / "align.json"
# scripts/exp_decision_rules.py imports the helper by its experiment name.
_unit_content = unit_tokens



def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--split", type=int, default=4)
    args = parser.parse_args(argv)
    from eval_semantic import TODAY, decide, score
    from train_verifier import TRAIN_COSINE, calibrate, choose_floor, cosines, feature_rows, train_trees

    from sidecar.cache.equivalence import disagreements
    from sidecar.cache.verifier import FEATURES, Verifier
    train, calibration, held, states = experiment_sets(args.split)
    units = {t: unit_tokens(s) for t, s in states.items()}

    def rows(pairs):
        cos = cosines(pairs)
        base = feature_rows(pairs, cos)
        start = time.perf_counter()
        extra = np.stack([align_features(units[p["a"]], units[p["b"]]) for p in pairs])
        return cos, base, extra, (time.perf_counter() - start) / max(1, len(pairs))

    c_tr, x_tr, a_tr, _ = rows(train)
    y_tr = np.array([p["label"] for p in train], float)
    keep = c_tr >= TRAIN_COSINE
    weight = np.array([3.0 if "frame" not in p else 1.0 for p in train])[keep]
    cal = {name: rows(ps) + (np.array([p["label"] for p in ps]),) for name, ps in calibration.items()}
    floor = choose_floor(np.concatenate([c[y == 1] for c, _, _, _, y in cal.values()]))
    out = {"floor": floor, "features": list(ALIGN), "models": {}, "results": {}}
    models = {}
    for variant, join in (("trees", lambda x, a: x), ("trees+align", lambda x, a: np.hstack([x, a]))):
        start = time.perf_counter()
        model = train_trees(join(x_tr, a_tr)[keep], y_tr[keep], weight)
        model.update(features=list(FEATURES), floor=floor, calibration={"rates": [1.0], "thresholds": [0.5]})
        verifier = Verifier(model)       # indexes columns by number: the extra ones work as well
        scored = {name: (verifier.probabilities(join(x, a)), c, y) for name, (c, x, a, _, y) in cal.items()}
        table = calibrate(scored, floor)
        models[variant] = (verifier, join, dict(zip(table["rates"], table["thresholds"])))
        out["models"][variant] = {"seconds": round(time.perf_counter() - start, 1), "calibration": table}
    for name, ps in held.items():
        c, x, a, per_pair, y = rows(ps) + (np.array([p["label"] for p in ps]),)
        symbols = np.array([bool(disagreements(p["a"], p["b"]).symbols) for p in ps])
        res = {"today": score(y, decide(ps, c, TODAY)[0])}
        for variant, (verifier, join, thresholds) in models.items():
            s = verifier.probabilities(join(x, a))
            for rate in (0.01, 0.02, 0.05):
                res[f"{variant} {rate:g}"] = score(y, (c >= floor) & (s >= thresholds[rate]) & ~symbols)
        out["results"][name] = res
        out.setdefault("align_us_per_pair", {})[name] = round(per_pair * 1e6, 1)
        print(f"\n{name} ({len(ps)} pairs)")
        for k, r in res.items():
            print(f"  {k:20s} P {r['precision']} {r['precision_ci']}  R {r['recall']}  hits {r['hits']}")
    REPORT.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {REPORT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
