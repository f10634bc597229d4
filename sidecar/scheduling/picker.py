"""Pickers choose one cluster from pick weights; hysteresis keeps the weights from flapping.

Randomness comes from an injected RNG, so tests are deterministic.
"""
from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Protocol

from sidecar.scheduling._validate import fraction, positive, require


class Rng(Protocol):
    def random(self) -> float: ...  # uniform in [0, 1), as random.Random


Picker = Callable[[Mapping[str, float], Rng], str]


def weighted_random(weights: Mapping[str, float], rng: Rng) -> str:
    """A cluster with probability proportional to its weight; weight 0 is never picked."""
    positive_weights = [(c, w) for c, w in weights.items() if w > 0]
    require(bool(positive_weights), "weights", "need one weight > 0", dict(weights))
    target = rng.random() * sum(w for _, w in positive_weights)
    cumulative = 0.0
    for cluster, weight in positive_weights:
        cumulative += weight
        if target < cumulative:
            return cluster
    return positive_weights[-1][0]  # target rounded up to the total


def power_of_two(weights: Mapping[str, float], rng: Rng) -> str:
    """Draw two distinct clusters by weight and keep the heavier (the first drawn on a tie)."""
    first = weighted_random(weights, rng)
    rest = {c: w for c, w in weights.items() if c != first and w > 0}
    if not rest:
        return first
    second = weighted_random(rest, rng)
    return second if weights[second] > weights[first] else first


PICKERS: dict[str, Picker] = {"weighted_random": weighted_random, "power_of_two": power_of_two}


@dataclass(frozen=True)
class PickerConfig:
    kind: str = "weighted_random"  # a name in PICKERS
    hysteresis: float = 0.15  # keep the held shares until one moves by more than this (absolute)
    exponent: float = 4.0  # pick weight = static weight * score ** exponent; higher favours the best more
    hold_s: float = 1.0  # and for at most this long: then the current shares are taken

    def __post_init__(self) -> None:
        require(self.kind in PICKERS, "PickerConfig.kind", f"must be one of {sorted(PICKERS)}", self.kind)
        fraction("PickerConfig.hysteresis", self.hysteresis)
        positive("PickerConfig.exponent", self.exponent)
        positive("PickerConfig.hold_s", self.hold_s)


class Hysteresis:
    """Holds a weight distribution per key (a route's tier) and keeps returning it until some
    cluster's share of the total moves by more than `threshold`, the set of clusters changes, or
    it is `hold_s` old. Shares are compared against the held distribution, so slow drift still
    gets through.

    The age limit matters because what trips the threshold is often a spike (a moment with
    several requests in flight on one cluster): without it the spike's shares stay for as long
    as later shares are within `threshold` of them, which on a steady route is for good."""

    def __init__(self) -> None:
        self._held: dict[Hashable, tuple[float, Mapping[str, float]]] = {}

    def apply(
        self, key: Hashable, weights: Mapping[str, float], threshold: float, now: float, hold_s: float
    ) -> Mapping[str, float]:
        shares = _shares(weights)
        entry = self._held.get(key)
        if entry is not None:
            held_at, held = entry
            if 0 <= now - held_at < hold_s and held.keys() == shares.keys() and all(
                abs(shares[c] - held[c]) <= threshold for c in shares
            ):
                return held
        self._held[key] = (now, shares)
        return shares


def _shares(weights: Mapping[str, float]) -> Mapping[str, float]:
    total = sum(weights.values())
    require(total > 0, "weights", "need a total > 0", dict(weights))
    return MappingProxyType({c: w / total for c, w in weights.items()})
