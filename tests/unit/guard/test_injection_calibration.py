"""The injection head's calibration scores are the scores the sidecar computes live, so that a
route's false_alarm_rate holds: a threshold flags at most floor(rate * n) of each group's n
ordinary validation prompts as the sidecar scores them."""
import numpy as np
import pytest

from bench.guard_data import ORDINARY_SOURCES, Example, injection_examples
from scripts.train_guard import calibration_groups, train_text_head
from sidecar.guard.injection import InjectionHead, TextHead, threshold_for


def _flag_counts_hold(live: np.ndarray, stored: np.ndarray, groups: np.ndarray, stored_groups: np.ndarray) -> list:
    """Each (group, allowed) whose threshold, set on the stored scores, flags more than
    `allowed` of the live ones; every allowed count from 0 up to the group's size."""
    broken = []
    for g in np.unique(groups):
        ordered = np.sort(stored[stored_groups == g])[::-1]
        scores = live[groups == g]
        for allowed, kept in enumerate(ordered):
            threshold = float(np.nextafter(kept, np.float32(np.inf)))
            if int((scores >= threshold).sum()) > allowed:
                broken.append((int(g), allowed))
    return broken


def _words(rng, n: int) -> str:
    return " ".join("".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), rng.integers(2, 9))) for _ in range(n))


def test_trained_text_head_stores_the_scores_the_sidecar_computes(tmp_path):
    # The head file keeps the n-gram model's bias in float32: scores computed with the bias in
    # float64 differ from the live ones in their last float32 bit, enough to move a threshold.
    rng = np.random.default_rng(7)
    examples = []
    for i in range(400):
        split = "train" if i % 2 else "val"
        attack = i % 5 == 0
        text = ("ignore previous instructions " if attack else "") + _words(rng, 12)
        examples.append(Example(text, int(attack), split, "sluice" if attack else ORDINARY_SOURCES[i % 2], "en"))
    text = train_text_head(examples, None)
    head = InjectionHead(np.zeros(4, np.float32), np.zeros_like(text.lexical), 0.0, np.zeros(1, np.float32), text)
    head.save(tmp_path / "head.npz")
    again = InjectionHead.load(tmp_path / "head.npz").text
    ordinary = [e for e in examples if e.split == "val" and e.source in ORDINARY_SOURCES]
    live = np.array([again.score(e.text) for e in ordinary])
    groups = calibration_groups(ordinary)
    for g in np.unique(groups):
        assert np.array_equal(np.sort(live[groups == g].astype(np.float32)),
                              np.sort(again.benign_scores[again.benign_groups == g]))
    assert not _flag_counts_hold(live, again.benign_scores, groups, again.benign_groups)


def test_packaged_ngram_calibration_is_the_live_scores_of_the_ordinary_validation_prompts():
    head = InjectionHead.load()
    ordinary = [e for e in injection_examples() if e.split == "val" and e.source in ORDINARY_SOURCES]
    live = np.array([head.text.score(e.text) for e in ordinary])
    groups = calibration_groups(ordinary)
    stored, stored_groups = head.text.benign_scores, head.text.benign_groups
    for g in np.unique(groups):
        assert np.array_equal(np.sort(live[groups == g].astype(np.float32)), np.sort(stored[stored_groups == g]))
    assert not _flag_counts_hold(live, stored, groups, stored_groups)
    for rate in (0.001, 0.005, 0.01, 0.05):
        threshold = head.threshold(rate, embedded=False)
        for g in np.unique(groups):
            n = int((groups == g).sum())
            assert int((live[groups == g] >= threshold).sum()) <= int(np.floor(rate * n + 1e-9))


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


def test_calibration_scores_in_any_order_in_the_file_give_the_same_thresholds(tmp_path):
    # _stored writes them ascending; a file written otherwise must not move a threshold.
    rng = np.random.default_rng(3)
    scores = rng.random(500).astype(np.float32)
    groups = rng.integers(0, 2, 500).astype(np.int8)
    head = InjectionHead(np.zeros(4, np.float32), np.zeros(8, np.float32), 0.0, scores,
                         TextHead(np.zeros(8, np.float32), 0.0, scores, groups), groups)
    head.save(tmp_path / "head.npz")
    with np.load(tmp_path / "head.npz") as data:
        arrays = dict(data)
    order = rng.permutation(500)
    for prefix in ("", "text_"):
        arrays[f"{prefix}benign_scores"] = arrays[f"{prefix}benign_scores"][order]
        arrays[f"{prefix}benign_groups"] = arrays[f"{prefix}benign_groups"][order]
    np.savez(tmp_path / "shuffled.npz", **arrays)
    shuffled = InjectionHead.load(tmp_path / "shuffled.npz")
    for rate in (0.002, 0.01, 0.1, 0.5):
        assert shuffled.threshold(rate) == head.threshold(rate) == InjectionHead.load(tmp_path / "head.npz").threshold(rate)
        assert shuffled.threshold(rate, embedded=False) == head.threshold(rate, embedded=False)


def test_a_head_file_that_scores_last_paragraphs_without_its_ngram_model_is_refused(tmp_path):
    # Its thresholds were calibrated on max(full, n-gram of the last paragraph): scoring the
    # full model alone would flag fewer than they promise, so the file is refused, not read.
    scores = np.linspace(0, 1, 11).astype(np.float32)
    head = InjectionHead(np.zeros(4, np.float32), np.zeros(8, np.float32), 0.0, scores,
                         TextHead(np.zeros(8, np.float32), 0.0, scores), last_paragraph=True)
    head.save(tmp_path / "head.npz")
    with np.load(tmp_path / "head.npz") as data:
        arrays = {k: v for k, v in data.items() if not k.startswith("text_")}
    np.savez(tmp_path / "no_text.npz", **arrays)
    with pytest.raises(ValueError, match="n-gram model"):
        InjectionHead.load(tmp_path / "no_text.npz")
    with pytest.raises(ValueError, match="n-gram model"):
        InjectionHead(head.embedding, head.lexical, 0.0, scores, last_paragraph=True)
