import dataclasses
import math

import pytest

from sidecar.scheduling import scorers
from sidecar.scheduling.model import CandidateSpec, ClusterSnapshot, Endpoint, GpuLoad, UpstreamLoad
from sidecar.scheduling.scorers import (
    ScoringConfig,
    WeightedScorers,
    errors_score,
    gpu_score,
    latency_score,
    load_score,
    queue_score,
)

CONFIG = ScoringConfig(latency_reference_s=2.0, queue_reference=1.0)


def ep(cluster="a", max_in_flight=None, **signals):
    return Endpoint(CandidateSpec(cluster, max_in_flight=max_in_flight), ClusterSnapshot(cluster, **signals))


@pytest.mark.parametrize(
    "endpoint, pool_in_flight, expected",
    [
        (ep(in_flight=0, max_in_flight=10), [], 1.0),
        (ep(in_flight=5, max_in_flight=10), [], 0.5),
        (ep(in_flight=10, max_in_flight=10), [], 0.0),
        (ep(in_flight=0), [0, 0], 1.0),  # nobody busy
        (ep(in_flight=8), [8, 0], 0.5),  # 1 / (1 + 8 / load_reference 8), whoever else is busy
        (ep(in_flight=0), [3, 0], 1.0),
        (ep(in_flight=24), [24, 24], 0.25),  # 1 / (1 + 24 / 8)
    ],
)
def test_load(endpoint, pool_in_flight, expected):
    pool = [endpoint] + [ep(f"p{i}", in_flight=n) for i, n in enumerate(pool_in_flight)]
    assert load_score(endpoint, pool, CONFIG) == pytest.approx(expected)


@pytest.mark.parametrize(
    "p95, expected",
    [(None, None), (0.0, 1.0), (0.5, 0.75), (1.0, 0.5), (2.0, 0.0), (10.0, 0.0)],
)
def test_latency(p95, expected):
    assert latency_score(ep(ttfb_p95_s=p95), [], CONFIG) == expected


@pytest.mark.parametrize("rate, requests, expected", [
    (None, 0, None), (0.0, 20, 1.0),
    (0.25, 1000, pytest.approx(0.75, abs=0.01)), (1.0, 1000, pytest.approx(0.0, abs=0.01)),
    (1.0, 1, pytest.approx(1 - 1 / 6)),       # one failure of one request: damped by the prior
    (1.0, 5, pytest.approx(0.5)),
])
def test_errors(rate, requests, expected):
    assert errors_score(ep(error_rate=rate, requests_in_window=requests), [], CONFIG) == expected


@pytest.mark.parametrize(
    "load, expected",
    [
        (None, None),
        (UpstreamLoad(), None),
        (UpstreamLoad(waiting=0, running=8), 1.0),
        (UpstreamLoad(waiting=4, running=8), 0.5),
        (UpstreamLoad(waiting=16, running=8), 0.0),
        (UpstreamLoad(waiting=1, running=0), 0.0),  # queued with nothing running
        (UpstreamLoad(kv_cache_usage=0.8), pytest.approx(0.2)),
        (UpstreamLoad(waiting=0, running=8, kv_cache_usage=0.5), 0.75),  # mean of the two
        (UpstreamLoad(kv_cache_usage=1.7), 0.0),  # out of range is clamped
    ],
)
def test_queue(load, expected):
    assert queue_score(ep(upstream=load), [], CONFIG) == expected


@pytest.mark.parametrize(
    "gpu, expected",
    [
        (None, None),  # absent: no opinion
        (GpuLoad(), None),
        (GpuLoad(utilisation=0.25), 0.75),
        (GpuLoad(memory_used=1.0), 0.0),
        (GpuLoad(utilisation=0.2, memory_used=0.6), pytest.approx(0.6)),
    ],
)
def test_gpu(gpu, expected):
    assert gpu_score(ep(gpu=gpu), [], CONFIG) == expected


@pytest.mark.parametrize(
    "weights, signals, expected_total",
    [
        # the seed formula: a*(1-cpu) + b*(1-gpu) + c*(1-latency), normalised by the weights
        ({"gpu": 1, "latency": 3}, dict(gpu=GpuLoad(utilisation=0.5), ttfb_p95_s=1.0), (0.5 + 3 * 0.5) / 4),
        ({"gpu": 1, "latency": 3}, dict(gpu=GpuLoad(utilisation=0.0), ttfb_p95_s=2.0), 0.25),
        ({"gpu": 1, "latency": 3}, dict(ttfb_p95_s=1.0), 0.5),  # gpu unknown: only latency counts
        ({"gpu": 1, "latency": 3}, dict(), 0.5),  # nothing known: the no-opinion score
        ({"errors": 1, "latency": 0}, dict(error_rate=0.1, requests_in_window=95, ttfb_p95_s=2.0),
         0.905),  # weight 0 ignored
    ],
)
def test_weighted_total(weights, signals, expected_total):
    endpoint = ep(**signals)
    arithmetic = dataclasses.replace(CONFIG, combine="arithmetic")
    breakdown = WeightedScorers(weights, arithmetic).score([endpoint])["a"]
    assert breakdown.total == pytest.approx(expected_total)
    assert set(breakdown.parts) == set(weights)


@pytest.mark.parametrize(
    "weights, signals, expected_total",
    [
        ({"gpu": 1, "latency": 3}, dict(gpu=GpuLoad(utilisation=0.5), ttfb_p95_s=1.0), 0.5),
        # fine on errors, far too slow: the geometric mean keeps it low (arithmetic would give 0.5)
        ({"errors": 1, "latency": 1}, dict(error_rate=0.0, ttfb_p95_s=1.9), pytest.approx(0.2236, abs=1e-3)),
        ({"errors": 1, "latency": 1}, dict(error_rate=0.0, ttfb_p95_s=2.0), pytest.approx(0.0316, abs=1e-3)),
    ],
)
def test_geometric_total_keeps_one_bad_axis_bad(weights, signals, expected_total):
    assert WeightedScorers(weights, CONFIG).score([ep(**signals)])["a"].total == expected_total


def test_every_part_is_clamped_to_the_unit_interval(monkeypatch):
    monkeypatch.setitem(scorers.SCORERS, "wild", lambda e, pool, cfg: {"a": 7.0, "b": -3.0, "c": math.nan}[e.cluster])
    pool = [ep("a"), ep("b"), ep("c")]
    result = WeightedScorers({"wild": 1}).score(pool)
    assert [result[c].parts["wild"] for c in "abc"] == [1.0, 0.0, 0.0]


def test_registry_assembles_a_custom_scorer(monkeypatch):
    monkeypatch.setattr(scorers, "SCORERS", dict(scorers.SCORERS))
    scorers.register_scorer("prefers_b", lambda e, pool, cfg: 1.0 if e.cluster == "b" else 0.0)
    result = WeightedScorers({"prefers_b": 1}).score([ep("a"), ep("b")])
    assert (result["a"].total, result["b"].total) == (pytest.approx(0.001), 1.0)  # floored, not erased
    with pytest.raises(ValueError, match="already registered"):
        scorers.register_scorer("prefers_b", lambda e, pool, cfg: 0.0)


@pytest.mark.parametrize(
    "weights, message",
    [
        ({"cpu": 1}, "scorers.cpu is not a known scorer"),
        ({"latency": -1}, "scorers.latency must be >= 0"),
        ({"latency": 0}, "scorers need one weight > 0"),
        ({}, "scorers need one weight > 0"),
    ],
)
def test_bad_scorer_config_names_the_field(weights, message):
    with pytest.raises(ValueError, match=message):
        WeightedScorers(weights)
