"""scripts/exp_decision_rules.py's calibration: for each target false-hit rate, the least score
threshold that keeps every calibration set at or under it, counting only pairs past the floor
and not vetoed."""
import numpy as np

from scripts.exp_decision_rules import threshold_for


def _set(scores, cos, labels, vetoed):
    return (np.array(scores), np.array(cos), np.array(labels), {"v": np.array(vetoed)})


def test_threshold_keeps_each_set_under_the_rate():
    # Ten label-0 pairs: a 0.1 rate allows one wrong hit, so the threshold sits above the
    # second-highest wrong score.
    one = _set([0.95, 0.9, 0.5, 0.4, 0.3, 0.2, 0.1, 0.1, 0.1, 0.1, 0.99],
               [0.9] * 11, [0] * 10 + [1], [False] * 11)
    assert threshold_for(0.1, {"one": one}, 0.6, "v") == 0.901
    assert threshold_for(0.0, {"one": one}, 0.6, "v") == 0.951
    # The strictest set decides.
    other = _set([0.97] + [0.0] * 9, [0.9] * 10, [0] * 10, [False] * 10)
    assert threshold_for(0.05, {"one": one, "other": other}, 0.6, "v") == 0.971


def test_floor_and_vetoes_remove_wrong_hits_before_calibrating():
    pairs = _set([0.95, 0.9, 0.5] + [0.0] * 7, [0.5, 0.9, 0.9] + [0.9] * 7, [0] * 10,
                 [False, True, False] + [False] * 7)
    # 0.95 is under the floor, 0.9 is vetoed: the highest wrong score left is 0.5.
    assert threshold_for(0.0, {"s": pairs}, 0.6, "v") == 0.501
    assert threshold_for(0.0, {"s": pairs}, 0.4, "v") == 0.951
