"""What each hand-written check of today's decision earns: the decision with that one check off.

    make ablate-checks                                   # prints, writes the report and the doc
    .venv/bin/python scripts/ablate_checks.py --no-write  # prints only

Today's decision is cosine >= τ and every check of sidecar/cache/equivalence.py (the verifier
off: `max_false_hit_rate: 0`).  For each check, the same decision with only that check switched off, on:
- the held-out half of ../shared/data/paraphrase (QQP, MRPC, STS-B, each on its own; split by
  a hash of each pair's id as scripts/tune_semantic.py splits it: the checks' knobs were tuned
  on the other half);
- the generator's held-out frames (scripts/gen_semantic_pairs.py; frames no training saw);
- the hand-written chat suite (data/semantic/chat-test) and scripts/tune_semantic.py's prompt
  suite (which today's knobs were tuned to pass): reported, never used to choose.

Switching a check off can only add hits, so each row says which verdicts changed: label-0
pairs it stopped (wrong answers avoided) and label-1 pairs it stopped (right answers lost),
and the precision it buys, today's minus without it, with a 95% paired bootstrap interval.
Precision, recall and false-hit rate carry 95% Wilson intervals.  Cosines are the serving
engine's (int8 MiniLM), cached under build/semantic/ by scripts/semantic_vectors.py.
Writes reports/semantic_check_ablation.json and docs/semantic-check-ablation.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from docs_page import markdown_table  # noqa: E402
from eval_semantic import TODAY, load_sets, score  # noqa: E402
from sidecar.cache.equivalence import forget_profiles  # noqa: E402
from sidecar.cache.same_question import same_question  # noqa: E402

REPORT = ROOT / "reports" / "semantic_check_ablation.json"
DOC = ROOT / "docs" / "semantic-check-ablation.md"
COMMAND = "make ablate-checks"

# (name in the tables, EquivalenceSettings switch)
CHECKS = (("numbers", "check_numbers"), ("negation", "check_negation"),
          ("question words", "check_question_words"), ("comparisons", "check_comparisons"),
          ("entities", "check_entities"), ("word order", "check_word_order"), ("symbols", "check_symbols"),
          ("tense", "check_tense"), ("quantifiers", "check_quantifiers"), ("content words", "check_content_words"))
HELD_OUT = ("qqp", "mrpc-train", "stsb-train", "generated")     # may decide what is retired
REPORTED = ("chat", "prompt suite")                             # reported, never used to choose
BOOTSTRAP = 2000
SEED = 17


def precision_gain(labels: np.ndarray, today: np.ndarray, off: np.ndarray, rng) -> dict:
    """Today's precision minus the precision with the check off, and its 95% paired bootstrap
    interval (the same resampled pairs for both)."""
    def precision(idx):
        hits_t, hits_o = today[idx], off[idx]
        right = labels[idx] == 1
        p_t = (hits_t & right).sum() / max(hits_t.sum(), 1)
        p_o = (hits_o & right).sum() / max(hits_o.sum(), 1)
        return p_t - p_o
    n = len(labels)
    point = float(precision(np.arange(n)))
    draws = np.array([precision(rng.integers(0, n, n)) for _ in range(BOOTSTRAP)])
    lo, hi = np.percentile(draws, [2.5, 97.5])
    return {"gain": round(point, 4), "gain_ci": [round(float(lo), 4), round(float(hi), 4)]}


def _hits(pairs: list[dict], cosines: np.ndarray, settings) -> np.ndarray:
    return np.array([same_question(p["a"], p["b"], float(c), settings).hit for p, c in zip(pairs, cosines)])


def ablate(sets: dict[str, list[dict]], cosines: dict[str, np.ndarray]) -> dict:
    rng = np.random.default_rng(SEED)
    out: dict[str, dict] = {}
    for name in (*HELD_OUT, *REPORTED):
        if name not in sets:
            continue
        pairs, cos = sets[name], cosines[name]
        labels = np.array([p["label"] for p in pairs])
        today = _hits(pairs, cos, TODAY)
        rows = {"today": score(labels, today)}
        for check, switch in CHECKS:
            off = _hits(pairs, cos, dataclasses.replace(TODAY, **{switch: False}))
            assert not (today & ~off).any(), f"{check}: switching a check off removed a hit"
            added = off & ~today
            rows[check] = {**score(labels, off),
                           "stops_wrong": int((added & (labels == 0)).sum()),
                           "stops_right": int((added & (labels == 1)).sum()),
                           **precision_gain(labels, today, off, rng)}
        out[name] = rows
    return out


def verdicts(results: dict) -> dict[str, str]:
    """Per check, what the held-out sets say: the verdicts it changes there, and where its
    precision gain is beyond noise (the interval excludes 0), either way."""
    out = {}
    held = [s for s in HELD_OUT if s in results]
    for check, _ in CHECKS:
        wrong = sum(results[s][check]["stops_wrong"] for s in held)
        right = sum(results[s][check]["stops_right"] for s in held)
        beyond = [s for s in held if results[s][check]["gain_ci"][0] > 0]
        worse = [s for s in held if results[s][check]["gain_ci"][1] < 0]
        said = [f"stops {wrong} wrong / {right} right hits"]      # "lowers": the check costs precision
        if beyond:
            said.append("raises precision beyond noise on " + ", ".join(beyond))
        if worse:
            said.append("lowers it beyond noise on " + ", ".join(worse))
        if not beyond and not worse:
            said.append("its precision gain is within noise on every one")
        out[check] = "; ".join(said)
    return out


def retirable(results: dict) -> dict[str, list[str]]:
    """The retirement rule's two lists: checks whose removal changes no verdict on any held-out
    set, and checks whose removal lowers no held-out set's precision (point estimate)."""
    held = [s for s in HELD_OUT if s in results]
    return {
        "changes_nothing": [c for c, _ in CHECKS
                            if all(results[s][c]["stops_wrong"] + results[s][c]["stops_right"] == 0 for s in held)],
        "lowers_no_precision": [c for c, _ in CHECKS if all(results[s][c]["gain"] <= 0 for s in held)],
    }


def _ci(r: dict, name: str) -> str:
    v, (lo, hi) = r[name], r[name + "_ci"]
    return "–" if v is None else f"{v:.3f} [{lo:.3f}, {hi:.3f}]"


def markdown(report: dict) -> str:
    results = report["results"]
    lines = [
        "# Same-question checks, each measured",
        "",
        "Generated by `scripts/ablate_checks.py`; edit that, not this. Reproduce with",
        "",
        f"    {COMMAND}",
        "",
        "Today's decision (cosine ≥ τ 0.93 and every check of `sidecar/cache/equivalence.py`, "
        "[the checks](semantic-checks.md); the verifier off: `max_false_hit_rate: 0`) against the same decision with "
        "one check switched off. Sets: the held-out half of the public paraphrase pairs (QQP, MRPC, STS-B "
        "separately; the checks' knobs were tuned on the other half), the generator's held-out frames "
        "(`generated`); reported, never used to choose: the hand-written chat suite (`chat`) and the prompt "
        "suite of `scripts/tune_semantic.py` (`prompt suite`; today's knobs were tuned to pass it). "
        "Cells: value [95% Wilson interval]. *Stops* counts the verdicts the check changes: label-0 pairs "
        "it turns into misses (wrong answers avoided) / label-1 pairs (right answers lost). *Precision "
        f"gain*: today's precision minus the precision without the check, with a 95% paired bootstrap "
        f"interval ({BOOTSTRAP} resamples of the set's pairs).",
        "",
        "## What each check earns on the held-out sets",
        "",
        *markdown_table(["check", "on the held-out sets (" + ", ".join(s for s in HELD_OUT if s in results) + ")"],
                [[f"`{c}`", v] for c, v in report["verdicts"].items()]),
        "",
        "A check may be retired when switching it off changes no verdict on any held-out set, or lowers "
        "no held-out set's precision (point estimate: the default's precision must not go down). "
        "Switching off changes no verdict: " + (", ".join(f"`{c}`" for c in report["retirable"]["changes_nothing"])
                                                 or "none")
        + ". Switching off lowers no precision: " + (
            ", ".join(f"`{c}`" for c in report["retirable"]["lowers_no_precision"]) or "none") + ". "
        + ("So every check stays." if not any(report["retirable"].values()) else
           "Those are the candidates to retire."),
        "",
        *markdown_table(["check", *(f"{s}: stops wrong / right, precision gain" for s in HELD_OUT if s in results)],
                [[f"`{c}`", *(f"{results[s][c]['stops_wrong']} / {results[s][c]['stops_right']}, "
                              f"{results[s][c]['gain']:+.3f} [{results[s][c]['gain_ci'][0]:+.3f}, "
                              f"{results[s][c]['gain_ci'][1]:+.3f}]"
                              for s in HELD_OUT if s in results)] for c, _ in CHECKS]),
        "",
    ]
    for name, rows in results.items():
        title = f"{name} (reported, never used to choose)" if name in REPORTED else f"{name} (held out)"
        lines += [f"## {title}", "",
                  f"{report['sets'][name]} pairs: {rows['today']['label1']} label 1, {rows['today']['label0']} "
                  "label 0.", "",
                  *markdown_table(["switched off", "precision", "recall", "false-hit rate", "hits",
                           "stops wrong / right", "precision gain"],
                          [["(none: today)", _ci(rows["today"], "precision"), _ci(rows["today"], "recall"),
                            _ci(rows["today"], "false_hit_rate"), str(rows["today"]["hits"]), "", ""]]
                          + [[f"`{c}`", _ci(rows[c], "precision"), _ci(rows[c], "recall"),
                              _ci(rows[c], "false_hit_rate"), str(rows[c]["hits"]),
                              f"{rows[c]['stops_wrong']} / {rows[c]['stops_right']}",
                              f"{rows[c]['gain']:+.3f} [{rows[c]['gain_ci'][0]:+.3f}, {rows[c]['gain_ci'][1]:+.3f}]"]
                             for c, _ in CHECKS]),
                  ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    from semantic_vectors import cosines as cosines_of
    from tune_semantic import DEFAULT_PAIRS
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=Path, default=Path(os.environ.get("SLUICE_PARAPHRASE", DEFAULT_PAIRS)))
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    forget_profiles(max_bytes=None)
    sets = load_sets(args.pairs)
    cosines = {name: cosines_of([(p["a"], p["b"]) for p in pairs]) for name, pairs in sets.items()
               if name in HELD_OUT + REPORTED}
    results = ablate(sets, cosines)
    report = {"settings": dataclasses.asdict(TODAY), "sets": {s: len(sets[s]) for s in results},
              "results": results, "verdicts": verdicts(results), "retirable": retirable(results)}
    for name, rows in results.items():
        print(f"\n{name} ({report['sets'][name]} pairs)")
        for check, r in rows.items():
            extra = "" if check == "today" else (f"  stops {r['stops_wrong']}/{r['stops_right']}  gain "
                                                 f"{r['gain']:+.3f} {r['gain_ci']}")
            print(f"  {check:14s} P {_ci(r, 'precision')}  R {_ci(r, 'recall')}  "
                  f"FHR {_ci(r, 'false_hit_rate')}  ({r['hits']} hits){extra}")
    print()
    for check, verdict in report["verdicts"].items():
        print(f"{check:14s} {verdict}")
    print("retirable:", json.dumps(report["retirable"]))
    if not args.no_write:
        REPORT.parent.mkdir(parents=True, exist_ok=True)
        REPORT.write_text(json.dumps(report, indent=1) + "\n")
        DOC.write_text(markdown(report))
        print(f"wrote {os.path.relpath(REPORT, ROOT)} and {os.path.relpath(DOC, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
