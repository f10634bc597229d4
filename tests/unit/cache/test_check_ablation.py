"""scripts/ablate_checks.py: each check switched off alone, the verdicts it changes, and the
retirement rule read from them (docs/semantic-check-ablation.md)."""
import numpy as np

from scripts import ablate_checks

PAIRS = [
    {"a": "What is 15% of 200?", "b": "What is 20% of 200?", "label": 0},            # numbers stop it
    {"a": "Who is the CEO of Twitter?", "b": "Who was the CEO of Twitter?", "label": 0},  # tense stops it
    {"a": "how do i make pancakes", "b": "how can i make pancakes", "label": 1},
    {"a": "what is machine learning", "b": "what is machine learning?", "label": 1},
]
COSINES = np.array([0.99, 0.99, 0.99, 0.99])


def test_each_check_off_changes_only_its_own_verdicts():
    results = ablate_checks.ablate({"qqp": PAIRS}, {"qqp": COSINES})["qqp"]
    assert results["today"]["hits"] == 2 and results["today"]["precision"] == 1.0
    assert (results["numbers"]["stops_wrong"], results["numbers"]["stops_right"]) == (1, 0)
    assert (results["tense"]["stops_wrong"], results["tense"]["stops_right"]) == (1, 0)
    assert results["numbers"]["precision"] == round(2 / 3, 4) and results["numbers"]["gain"] > 0
    for check in ("negation", "symbols", "quantifiers", "word order"):
        assert results[check]["hits"] == 2 and results[check]["gain"] == 0


def test_the_retirement_rule_lists_only_checks_that_earn_nothing():
    results = ablate_checks.ablate({"qqp": PAIRS}, {"qqp": COSINES})
    rule = ablate_checks.retirable(results)
    assert "numbers" not in rule["changes_nothing"] and "tense" not in rule["lowers_no_precision"]
    assert "symbols" in rule["changes_nothing"] and "symbols" in rule["lowers_no_precision"]
    said = ablate_checks.verdicts(results)
    assert said["numbers"].startswith("stops 1 wrong / 0 right")
