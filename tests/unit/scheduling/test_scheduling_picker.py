import random

import pytest

from sidecar.scheduling.model import BreakerState, CandidateSpec, ClusterSnapshot, Endpoint
from sidecar.scheduling.filters import apply_filters
from sidecar.scheduling.picker import Hysteresis, PickerConfig, power_of_two, weighted_random


class Fixed:
    """An RNG that returns the given values in turn."""

    def __init__(self, *values):
        self._values = list(values)

    def random(self):
        return self._values.pop(0)


@pytest.mark.parametrize("picker", [weighted_random, power_of_two])
def test_weights_100_0_always_pick_the_first(picker):
    rng = random.Random(1)
    assert {picker({"a": 100, "b": 0}, rng) for _ in range(500)} == {"a"}
    assert {picker({"a": 100, "b": 0}, Fixed(x, x)) for x in (0.0, 0.5, 0.999999)} == {"a"}


@pytest.mark.parametrize(
    "draw, expected",
    [(0.0, "a"), (0.24, "a"), (0.25, "b"), (0.99, "b")],
)
def test_weighted_random_splits_the_unit_interval_by_weight(draw, expected):
    assert weighted_random({"a": 1, "b": 3}, Fixed(draw)) == expected


def test_weighted_random_follows_the_weights_over_many_picks():
    rng = random.Random(3)
    picks = [weighted_random({"a": 3, "b": 1}, rng) for _ in range(4000)]
    assert picks.count("a") / len(picks) == pytest.approx(0.75, abs=0.03)


@pytest.mark.parametrize(
    "draws, expected",
    [
        ((0.0, 0.99), "c"),  # draws a, then c: c is heavier
        ((0.99, 0.0), "c"),  # draws c, then a
        ((0.0, 0.0), "b"),  # draws a, then b (a removed): b is heavier
    ],
)
def test_power_of_two_keeps_the_heavier_of_two_draws(draws, expected):
    assert power_of_two({"a": 1, "b": 2, "c": 3}, Fixed(*draws)) == expected


def test_no_positive_weight_is_an_error():
    with pytest.raises(ValueError, match="weights need one weight > 0"):
        weighted_random({"a": 0}, Fixed(0.5))


HYSTERESIS = [
    # (previous weights, new weights, shares returned)
    ("small changes keep the held shares", {"a": 50, "b": 50}, {"a": 55, "b": 45}, {"a": 0.5, "b": 0.5}),
    ("a move just under the threshold is small", {"a": 50, "b": 50}, {"a": 64, "b": 36}, {"a": 0.5, "b": 0.5}),
    ("a large change replaces them", {"a": 50, "b": 50}, {"a": 70, "b": 30}, {"a": 0.7, "b": 0.3}),
    ("scale alone is no change", {"a": 1, "b": 3}, {"a": 10, "b": 30}, {"a": 0.25, "b": 0.75}),
    ("a new cluster set replaces them", {"a": 50, "b": 50}, {"a": 50, "c": 50}, {"a": 0.5, "c": 0.5}),
]


@pytest.mark.parametrize("before, after, expected", [r[1:] for r in HYSTERESIS], ids=[r[0] for r in HYSTERESIS])
def test_hysteresis(before, after, expected):
    hysteresis = Hysteresis()
    hysteresis.apply("route", before, 0.15, now=0.0, hold_s=1.0)
    assert dict(hysteresis.apply("route", after, 0.15, now=0.5, hold_s=1.0)) == pytest.approx(expected)


def test_hysteresis_keeps_the_choice_under_small_changes():
    """The same RNG draw keeps picking the same cluster while the scores wobble."""
    hysteresis = Hysteresis()
    wobbling = [{"a": 0.52, "b": 0.48}, {"a": 0.47, "b": 0.53}, {"a": 0.5, "b": 0.5}, {"a": 0.45, "b": 0.55}]
    held = [hysteresis.apply("route", w, 0.15, now=0.1 * i, hold_s=1.0) for i, w in enumerate(wobbling)]
    assert [weighted_random(h, Fixed(0.49)) for h in held] == ["a"] * 4
    assert [weighted_random(w, Fixed(0.49)) for w in wobbling] == ["a", "b", "a", "b"]  # without it: flapping


def test_slow_drift_eventually_gets_through():
    hysteresis = Hysteresis()
    shares = [hysteresis.apply("route", {"a": 50 + step, "b": 50 - step}, 0.15, now=step / 100, hold_s=1.0)["a"]
              for step in range(0, 21, 2)]
    assert shares[0] == 0.5 and shares[-1] > 0.6


def test_keys_hold_separate_distributions():
    hysteresis = Hysteresis()
    hysteresis.apply("r1", {"a": 1, "b": 1}, 0.15, now=0.0, hold_s=1.0)
    assert dict(hysteresis.apply("r2", {"a": 3, "b": 1}, 0.15, now=0.0, hold_s=1.0)) == {"a": 0.75, "b": 0.25}


def test_held_shares_lapse_after_hold_s():
    """A spike that trips the threshold is held while later shares stay within it of the spike;
    once hold_s has passed, the shares of now are taken."""
    hysteresis = Hysteresis()
    hysteresis.apply("route", {"a": 50, "b": 50}, 0.15, now=0.0, hold_s=1.0)
    assert hysteresis.apply("route", {"a": 27, "b": 73}, 0.15, now=0.1, hold_s=1.0)["a"] == 0.27     # the spike
    assert hysteresis.apply("route", {"a": 14, "b": 86}, 0.15, now=1.0, hold_s=1.0)["a"] == 0.27     # held
    assert hysteresis.apply("route", {"a": 14, "b": 86}, 0.15, now=1.1, hold_s=1.0)["a"] == 0.14     # lapsed


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("kind", "round_robin", "PickerConfig.kind must be one of"),
        ("hysteresis", 1.5, r"PickerConfig.hysteresis must be within \[0, 1\]"),
        ("exponent", 0, "PickerConfig.exponent must be > 0"),
        ("hold_s", 0, "PickerConfig.hold_s must be > 0"),
    ],
)
def test_bad_picker_config_names_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        PickerConfig(**{field: value})


def endpoint(cluster, breaker=BreakerState.CLOSED, probe_due=False, in_flight=0, max_in_flight=None, weight=1.0):
    spec = CandidateSpec(cluster, weight=weight, max_in_flight=max_in_flight)
    return Endpoint(spec, ClusterSnapshot(cluster, in_flight=in_flight), breaker, probe_due)


FILTERS = [
    ("closed is kept", endpoint("a"), None),
    ("open is dropped", endpoint("a", BreakerState.OPEN), "breaker open"),
    ("half-open with a probe due is kept", endpoint("a", BreakerState.HALF_OPEN, probe_due=True), None),
    ("half-open without one is dropped", endpoint("a", BreakerState.HALF_OPEN), "breaker half-open, no probe due"),
    ("below max in flight is kept", endpoint("a", in_flight=3, max_in_flight=4), None),
    ("at max in flight is dropped", endpoint("a", in_flight=4, max_in_flight=4), "saturated (4/4 in flight)"),
    ("no max: never saturated", endpoint("a", in_flight=10_000), None),
    ("weight 0 is dropped", endpoint("a", weight=0), "weight 0"),
]


@pytest.mark.parametrize("ep, reason", [r[1:] for r in FILTERS], ids=[r[0] for r in FILTERS])
def test_filters(ep, reason):
    kept, dropped = apply_filters([ep])
    assert (kept, dropped) == (([ep], {}) if reason is None else ([], {"a": reason}))
