"""The injection head's calibration scores are the scores the sidecar computes live, so that a
route's false_alarm_rate holds: a threshold flags at most floor(rate * n) of each group's n
ordinary validation prompts as the sidecar scores them."""
import numpy as np
import pytest

from sidecar.guard.injection import InjectionHead, TextHead, threshold_for


@pytest.mark.parametrize("seed", range(30))
def test_a_threshold_flags_at_most_the_rate_of_each_group_of_float64_scores(seed):
    # Live scores are float64, the stored ones their float32 roundings; ties, groups of any size,
    # rates whose product with n is a whole number.
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 3000))
    live = rng.choice(rng.random(int(rng.integers(1, n + 1))), n)        # many ties
    groups = rng.integers(0, int(rng.integers(1, 4)), n).astype(np.int8)
    rate = float(rng.choice([0.001, 0.005, 0.01, 0.02, 0.29, 0.5, 1 / n if n > 1 else 0.5]))
    threshold = threshold_for(live.astype(np.float32), rate, groups)
    for g in np.unique(groups):
        k = int((groups == g).sum())
        assert int((live[groups == g] >= threshold).sum()) <= int(np.floor(rate * k + 1e-9))


def test_a_head_without_calibration_scores_has_no_threshold_and_says_why():
    # The route's guard is then refused (GuardStage answers 503), with this reason in the log.
    empty = np.zeros(0, np.float32)
    head = InjectionHead(np.zeros(4, np.float32), np.zeros(8, np.float32), 0.0, empty, TextHead(np.zeros(8, np.float32), 0.0, empty))
    with pytest.raises(ValueError, match="no calibration scores"):
        head.threshold(0.01)
    with pytest.raises(ValueError, match="no calibration scores"):
        head.threshold(0.01, embedded=False)
