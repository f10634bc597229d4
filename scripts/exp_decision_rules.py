"""Experiment: decision rules around the trees + token-alignment verifier, chosen on selection sets only.

    nice -n 19 .venv/bin/python scripts/exp_decision_rules.py [--split 4]    # reports/decision_rules.json

The verifier is scripts/exp_align_features.py's "trees+align" model (same training pairs, same
features). Around it, a grid of rules:
- vetoes: none; `symbols`; numbers and units (`numbers`) with `symbols`; those and exchanged
  words (`order`); those and `negation`, `comparison`; every check of today's decision;
- the candidate floor: the measured one (a share of the calibration sets' rewordings) and 0.7,
  0.75, 0.8, 0.85, 0.9;
- the target false-hit rate: 0.005, 0.01, 0.02, 0.05, its threshold calibrated for each veto
  set and floor (the least score whose false-hit rate, after the vetoes and the floor, is at or
  under the target on every calibration set);
- and today's decision combined with the verifier: today's hits whose verifier score is at
  least `keep` (0: all of them), plus the verifier's own hits under the rule above.

Selection sets: the generator's held-out frames and the public tune halves (the calibration
sets). The rule chosen is the one with the most recall on the generator's held-out frames among
those whose precision is not below today's decision on any selection set. Every rule is then
reported on every held-out set (chat, the public held-out halves, the prompt suite) with Wilson
95% intervals; those never choose.
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
from exp_align_features import _unit_content, align_features  # noqa: E402

REPORT = ROOT / "reports" / "decision_rules.json"
RATES = (0.002, 0.005, 0.01, 0.02, 0.05)
KEEP = (0.0, 0.05, 0.1, 0.2, 0.3, 0.5)
FLOORS = (0.7, 0.75, 0.8, 0.85, 0.9)
VETOES = {
    "none": (),
    "symbols": ("symbols",),
    "numbers+symbols": ("numbers", "symbols"),
    "numbers+symbols+order": ("numbers", "symbols", "order"),
    "numbers+symbols+order+negation+comparison": ("numbers", "symbols", "order", "negation", "comparison"),
    "every check": ("numbers", "negation", "question_word", "comparison", "entities", "order", "symbols",
                    "tense", "quantifiers"),
}


def threshold_for(rate, sets, floor, vetoed_key) -> float:
    """The least score threshold (0.001 steps) whose false-hit rate is at or under `rate` on
    every calibration set, counting only pairs past the floor and not vetoed."""
    need = 0.0
    for s, c, y, vetoed in ((s, c, y, v[vetoed_key]) for s, c, y, v in sets.values()):
        wrong = np.sort(s[(y == 0) & (c >= floor) & ~vetoed])[::-1]
        allowed = int(np.floor(rate * (y == 0).sum()))     # wrong hits allowed on this set
        if allowed < len(wrong):
            # Strictly above the (allowed+1)-th highest wrong score.
            need = max(need, float(np.floor(wrong[allowed] * 1000) / 1000 + 0.001))
    return round(min(need, 1.0), 3)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--split", type=int, default=4)
    args = parser.parse_args(argv)
    from eval_semantic import TODAY, decide, score
    from train_verifier import TRAIN_COSINE, choose_floor, cosines, feature_rows, train_trees

    from sidecar.cache.equivalence import disagreements
    from sidecar.cache.verifier import FEATURES, Verifier
    started = time.perf_counter()
    train, calibration, held, states = experiment_sets(args.split)
    units = {t: _unit_content(s) for t, s in states.items()}

    def rows(pairs):
        cos = cosines(pairs)
        x = np.hstack([feature_rows(pairs, cos),
                       np.stack([align_features(units[p["a"]], units[p["b"]]) for p in pairs])])
        found = [disagreements(p["a"], p["b"]) for p in pairs]
        vetoed = {name: np.array([any(getattr(f, field) for field in fields) for f in found])
                  for name, fields in VETOES.items()}
        today = decide(pairs, cos, TODAY)[0]
        return cos, x, np.array([p["label"] for p in pairs]), vetoed, today

    c_tr, x_tr, y_tr, _, _ = rows(train)
    trained = c_tr >= TRAIN_COSINE
    weight = np.array([3.0 if "frame" not in p else 1.0 for p in train])[trained]
    model = train_trees(x_tr[trained], y_tr[trained].astype(float), weight)
    model.update(features=list(FEATURES), floor=0.0, calibration={"rates": [1.0], "thresholds": [0.5]})
    verifier = Verifier(model)           # indexes columns by number: the four extra ones work as well
    selection = {}
    for name, ps in calibration.items():
        c, x, y, vetoed, today = rows(ps)
        selection[name] = (verifier.probabilities(x), c, y, vetoed, today)
    measured_floor = choose_floor(np.concatenate([c[y == 1] for _, c, y, _, _ in selection.values()]))
    floors = (measured_floor,) + tuple(f for f in FLOORS if f > measured_floor)
    calib = {name: (s, c, y, v) for name, (s, c, y, v, _) in selection.items()}
    rules = {}
    for veto in VETOES:
        for floor in floors:
            for rate in RATES:
                t = threshold_for(rate, calib, floor, veto)
                rule = {"veto": veto, "floor": floor, "rate": rate, "threshold": t, "keep": None}
                rules[f"{veto} | floor {floor:g} | rate {rate:g}"] = rule
                for keep in KEEP:
                    rules[f"today (score >= {keep:g}) or ({veto} | floor {floor:g} | rate {rate:g})"] = \
                        {**rule, "keep": keep}

    def hits(rule, s, c, vetoed, today):
        mine = (c >= rule["floor"]) & (s >= rule["threshold"]) & ~vetoed[rule["veto"]]
        return mine if rule["keep"] is None else mine | (today & (s >= rule["keep"]))

    def evaluate(sets):
        out = {}
        for name, (s, c, y, vetoed, today) in sets.items():
            out[name] = {"today": score(y, today)}
            for key, rule in rules.items():
                out[name][key] = score(y, hits(rule, s, c, vetoed, today))
        return out

    on_selection = evaluate(selection)
    eligible = [k for k in rules if all(on_selection[n][k]["precision"] is not None
                                        and on_selection[n][k]["precision"] >= on_selection[n]["today"]["precision"]
                                        for n in selection)]
    chosen = max(eligible, key=lambda k: (on_selection["generated-valid"][k]["recall"],
                                          min(on_selection[n][k]["precision"] for n in selection))) \
        if eligible else None
    held_scored = {}
    for name, ps in held.items():
        c, x, y, vetoed, today = rows(ps)
        held_scored[name] = (verifier.probabilities(x), c, y, vetoed, today)
    on_held = evaluate(held_scored)
    report = {"measured_floor": measured_floor, "rules": rules, "selection": on_selection, "held_out": on_held,
              "eligible": eligible, "chosen": chosen,
              "train_pairs": int(trained.sum()), "train_handwritten": int(sum(1 for p, k in zip(train, trained)
                                                                            if k and "frame" not in p)),
              "seconds": round(time.perf_counter() - started, 1)}
    REPORT.parent.mkdir(parents=True, exist_ok=True)
    REPORT.write_text(json.dumps(report, indent=1) + "\n")
    print(f"floor {measured_floor}; {len(eligible)} of {len(rules)} rules not below today's precision on "
          f"every selection set; chosen: {chosen}")
    runners_up = sorted(eligible, key=lambda k: -on_selection["generated-valid"][k]["recall"])[1:5]
    show = ["today"] + ([chosen] if chosen else []) + runners_up + \
        [k for k in rules if k.startswith("symbols | floor") and f"floor {measured_floor:g} " in k]
    for name, res in list(on_selection.items()) + list(on_held.items()):
        print(f"\n{name}")
        for k in show:
            r = res[k]
            print(f"  {k:70s} P {r['precision']} {r['precision_ci']}  R {r['recall']}  hits {r['hits']}")
    print(f"wrote {REPORT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
