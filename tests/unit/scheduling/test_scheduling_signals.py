import dataclasses
import math

import pytest

from sidecar.scheduling.model import GpuLoad, UpstreamLoad
from sidecar.scheduling.signals import SignalConfig, SignalTracker
from sidecar.scheduling.windows import OutcomeWindow, SampleWindow


def tracker(**config):
    return SignalTracker(SignalConfig(**config))


def test_unknown_cluster_has_an_empty_snapshot():
    snap = tracker().cluster_snapshot("a", now=0.0)
    assert (snap.cluster, snap.in_flight, snap.ttfb_p95_s, snap.error_rate, snap.upstream) == ("a", 0, None, None, None)


def test_in_flight_counts_sends_minus_completions_and_never_goes_negative():
    t = tracker()
    t.on_send("a", 0.0)
    t.on_send("a", 0.0)
    t.on_complete("a", 1.0, True, 1.0)
    assert t.cluster_snapshot("a", 1.0).in_flight == 1
    t.on_complete("a", 1.0, True, 1.0)
    t.on_complete("a", 1.0, True, 1.0)  # a completion the tracker never saw sent
    assert t.cluster_snapshot("a", 1.0).in_flight == 0


def test_ttfb_p95_is_the_nearest_rank_over_the_window():
    t = tracker()
    for i in range(1, 101):
        t.on_first_byte("a", i / 100, now=1.0)
    assert t.cluster_snapshot("a", 1.0).ttfb_p95_s == pytest.approx(0.95)


def test_ewma_starts_at_the_first_sample_then_moves_by_alpha():
    t = tracker(ewma_alpha=0.5)
    t.on_first_byte("a", 1.0, 0.0)
    assert t.cluster_snapshot("a", 0.0).ttfb_ewma_s == 1.0
    t.on_first_byte("a", 3.0, 0.0)
    assert t.cluster_snapshot("a", 0.0).ttfb_ewma_s == 2.0


def test_samples_leave_the_window_as_time_passes():
    t = tracker(latency_window_s=10.0)
    t.on_first_byte("a", 5.0, now=0.0)
    t.on_first_byte("a", 1.0, now=8.0)
    assert t.cluster_snapshot("a", 9.0).ttfb_p95_s == 5.0
    assert t.cluster_snapshot("a", 10.0).ttfb_p95_s == 1.0
    assert t.cluster_snapshot("a", 18.0).ttfb_p95_s is None


def test_memory_is_bounded_to_the_newest_samples():
    window = SampleWindow(window_s=100.0, max_samples=3)
    for value in [9.0, 9.0, 1.0, 2.0, 3.0]:
        window.add(0.0, value)
    assert window.count(0.0) == 3
    assert window.quantile(1.0, 0.0) == 3.0


def test_error_rate_counts_failures_over_the_error_window():
    t = tracker(error_window_s=10.0)
    for ok in [True, True, True, False]:
        t.on_complete("a", 0.5, ok, now=1.0)
    snap = t.cluster_snapshot("a", 2.0)
    assert (snap.error_rate, snap.requests_in_window) == (0.25, 4)
    assert t.cluster_snapshot("a", 12.0).error_rate is None


def test_outcome_window_keeps_a_bounded_number_of_buckets():
    window = OutcomeWindow(window_s=10.0, buckets=10)
    for i in range(10_000):
        window.add(i * 0.01, ok=i % 2 == 0)
    assert len(window._buckets) <= 11
    total, failed = window.counts(100.0)
    assert total == pytest.approx(1000, abs=10) and failed == pytest.approx(total / 2, abs=1)


def test_outcome_totals_match_the_buckets_as_outcomes_age_out():
    import random
    rng = random.Random(7)
    window = OutcomeWindow(window_s=5.0, buckets=5)
    now = 0.0
    for _ in range(2_000):
        now += rng.expovariate(20.0)
        window.add(now, ok=rng.random() < 0.7)
        if rng.random() < 0.1:
            now += rng.uniform(0, 3)       # idle gaps let whole buckets expire
        total, failed = window.counts(now)
        assert (total, failed) == (sum(b[1] + b[2] for b in window._buckets), sum(b[2] for b in window._buckets))
    assert window.counts(now + 60.0) == (0, 0)


def test_only_successes_feed_latency_and_tokens_per_second():
    t = tracker()
    t.on_complete("a", 0.01, False, 1.0, completion_tokens=5)
    t.on_complete("a", 3.0, True, 1.0, completion_tokens=100, ttfb_s=1.0)
    snap = t.cluster_snapshot("a", 1.0)
    assert snap.latency_p95_s == 3.0 and snap.latency_ewma_s == 3.0
    assert snap.tokens_per_s == 50.0  # 100 tokens over 2 s of decoding


def test_tokens_per_second_uses_total_latency_without_ttfb():
    t = tracker()
    t.on_complete("a", 4.0, True, 1.0, completion_tokens=100)
    assert t.cluster_snapshot("a", 1.0).tokens_per_s == 25.0


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf])
def test_bad_samples_are_ignored(bad):
    t = tracker()
    t.on_first_byte("a", bad, 0.0)
    t.on_complete("a", bad, True, 0.0)
    snap = t.cluster_snapshot("a", 0.0)
    assert (snap.ttfb_p95_s, snap.latency_p95_s, snap.error_rate) == (None, None, 0.0)


def test_reported_load_goes_stale():
    t = tracker(load_stale_after_s=15.0)
    load, gpu = UpstreamLoad(waiting=2, running=4), GpuLoad(utilisation=0.5)
    t.on_upstream_load("a", load, now=0.0)
    t.on_gpu_load("a", gpu, now=0.0)
    assert (t.cluster_snapshot("a", 15.0).upstream, t.cluster_snapshot("a", 15.0).gpu) == (load, gpu)
    assert (t.cluster_snapshot("a", 15.1).upstream, t.cluster_snapshot("a", 15.1).gpu) == (None, None)


def test_snapshots_are_immutable():
    t = tracker()
    t.on_send("a", 0.0)
    snaps = t.snapshot(0.0)
    assert list(snaps) == ["a"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        snaps["a"].in_flight = 5
    with pytest.raises(TypeError):
        snaps["b"] = snaps["a"]
    t.on_send("a", 0.0)
    assert snaps["a"].in_flight == 1  # a snapshot does not follow later events


def test_recent_snapshot_is_reused_for_a_tenth_of_a_second_then_refreshed():
    t = tracker()
    t.on_first_byte("a", 0.5, 1.0)
    first = t.recent_snapshot("a", 1.0)
    t.on_first_byte("a", 9.0, 1.05)
    assert t.recent_snapshot("a", 1.05) is first                 # slow signals: 50 ms old is fine
    refreshed = t.recent_snapshot("a", 1.11)
    assert refreshed is not first and refreshed.ttfb_ewma_s > first.ttfb_ewma_s
    assert t.recent_snapshot("a", 0.5) is not refreshed           # a clock that went back: fresh


def test_the_ttfb_estimate_for_admission_lapses_without_new_measurements():
    """Admission refuses a request whose deadline the expected time to first byte exceeds. An
    estimate left by one slow answer would refuse every later request, and no request would
    ever measure the cluster again: it lapses after max_age_s."""
    t = tracker()
    assert t.expected_ttfb("a", 0.0, max_age_s=10) is None            # never measured
    t.on_first_byte("a", 4.0, now=100.0)
    assert t.expected_ttfb("a", 105.0, max_age_s=10) == pytest.approx(4.0)
    assert t.expected_ttfb("a", 111.0, max_age_s=10) is None           # nothing new for 11 s
    t.on_first_byte("a", 0.01, now=112.0)                              # one got through
    assert t.expected_ttfb("a", 112.0, max_age_s=10) < 4.0
