import heapq
import random

import pytest

from sidecar.scheduling import (
    BreakerConfig,
    BreakerState,
    CandidateSpec,
    Decision,
    GpuLoad,
    PickerConfig,
    RoutePolicy,
    Scheduler,
    SchedulerConfig,
    ScoringConfig,
    SignalConfig,
    TimeoutConfig,
    UpstreamLoad,
)

BREAKER = BreakerConfig(window_s=10.0, min_requests=4, max_error_ratio=0.5, cooldown_s=5.0,
                        probe_share=0.5, close_after_successes=2)
A, B = CandidateSpec("a"), CandidateSpec("b")
FALLBACK = CandidateSpec("small", role="fallback", model="llama-3-8b")


def scheduler(seed=0, transitions=None, **config):
    config.setdefault("breaker", BREAKER)
    return Scheduler(SchedulerConfig(**config), rng=random.Random(seed), on_transition=transitions)


def trip(s, cluster, now=0.0):
    for _ in range(BREAKER.min_requests):
        s.on_complete(Decision(cluster), 0.01, False, now)


# -- choosing a tier -------------------------------------------------------------------------

def test_primaries_are_used_while_available():
    d = scheduler().pick([A, FALLBACK], now=0.0)
    assert (d.cluster, d.role, d.degraded, d.model_rewrite, d.probe) == ("a", "primary", False, None, False)


def test_when_every_primary_is_open_the_fallback_serves_degraded():
    s = scheduler()
    trip(s, "a")
    trip(s, "b")
    d = s.pick([A, B, FALLBACK], now=1.0)
    assert (d.cluster, d.role, d.degraded, d.model_rewrite) == ("small", "fallback", True, "llama-3-8b")
    assert d.dropped == {"a": "breaker open", "b": "breaker open"}


def test_one_open_primary_leaves_the_other():
    s = scheduler()
    trip(s, "a")
    assert {s.pick([A, B, FALLBACK], now=1.0).cluster for _ in range(50)} == {"b"}


def test_a_saturated_primary_sends_to_the_fallback():
    s = scheduler()
    primary = CandidateSpec("a", max_in_flight=2)
    for _ in range(2):
        s.on_send(s.pick([primary, FALLBACK], now=0.0), now=0.0)
    d = s.pick([primary, FALLBACK], now=0.0)
    assert (d.cluster, d.dropped) == ("small", {"a": "saturated (2/2 in flight)"})


def test_nothing_available_says_when_to_retry():
    s = scheduler()
    trip(s, "a", now=0.0)
    trip(s, "small", now=2.0)
    d = s.pick([A, FALLBACK], now=3.0)
    assert d == Decision.unavailable(retry_after_s=2.0, dropped={"a": "breaker open", "small": "breaker open"})
    assert not d.available and d.cluster is None


def test_saturation_alone_retries_after_the_configured_delay():
    s = scheduler(retry_after_s=0.5)
    only = CandidateSpec("a", max_in_flight=1)
    s.on_send(s.pick([only], now=0.0), now=0.0)
    assert s.pick([only], now=0.0).retry_after_s == 0.5


def test_weight_zero_gets_no_traffic():
    s = scheduler()
    assert {s.pick([CandidateSpec("a", weight=0), B], now=0.0).cluster for _ in range(50)} == {"b"}


@pytest.mark.parametrize(
    "candidates, message",
    [([], "candidates must not be empty"), ([A, A], "candidates must name each cluster once")],
)
def test_bad_candidates(candidates, message):
    with pytest.raises(ValueError, match=message):
        scheduler().pick(candidates, now=0.0)


# -- scores and weights ----------------------------------------------------------------------

def test_static_weights_100_0_always_pick_the_first():
    s = scheduler()
    picks = {s.pick([CandidateSpec("a", weight=100), CandidateSpec("b", weight=0)], now=0.0).cluster for _ in range(100)}
    assert picks == {"a"}


def test_the_route_policy_chooses_the_scorers():
    s = scheduler()
    s.on_upstream_load("a", UpstreamLoad(waiting=20, running=1), now=0.0)  # a's queue is long
    s.on_gpu_load("b", GpuLoad(utilisation=1.0, memory_used=1.0), now=0.0)  # b's GPU is full
    by_queue = RoutePolicy(name="q", scorers={"queue": 1}, picker=PickerConfig(exponent=1))
    by_gpu = RoutePolicy(name="g", scorers={"gpu": 1}, picker=PickerConfig(exponent=1))
    assert {s.pick([A, B], 1.0, by_queue).cluster for _ in range(30)} == {"b"}
    assert {s.pick([A, B], 1.0, by_gpu).cluster for _ in range(30)} == {"a"}


class Draws:
    """An RNG that always draws the same value: the pick shows which side of it a's share is."""

    def __init__(self, value):
        self.value = value

    def random(self):
        return self.value


def test_a_moment_of_load_does_not_set_the_split_for_good():
    """b had four requests in flight when a's latency became known: a's share jumped from 0.5
    to 0.27 and was held. With b idle again a's share is 0.14, within the hysteresis (0.15) of
    0.27, so only the hold time (1 s) brings the split to what the scores say."""
    s = Scheduler(SchedulerConfig(), rng=Draws(0.2))       # picks a while a's share is over 0.2
    policy = RoutePolicy(name="r", scorers={"latency": 1, "load": 1})
    assert s.pick([A, B], 0.0, policy).cluster == "a"       # nothing known: 0.5 each
    s.signals.on_first_byte("a", 0.1, 0.05)
    s.signals.on_first_byte("b", 0.01, 0.05)
    for _ in range(4):
        s.signals.on_send("b", 0.1)
    assert s.pick([A, B], 0.1, policy).cluster == "a"       # a 0.27 with b busy: replaces 0.5
    for _ in range(4):
        s.signals.on_abandon("b")
    assert s.pick([A, B], 0.5, policy).cluster == "a"       # a 0.14, close to 0.27: held
    assert [s.pick([A, B], t, policy).cluster for t in (1.2, 5.0, 30.0)] == ["b"] * 3


def test_all_zero_scores_fall_back_to_the_static_weights():
    s = scheduler()
    for cluster in "ab":
        s.on_upstream_load(cluster, UpstreamLoad(kv_cache_usage=1.0), now=0.0)
    policy = RoutePolicy(scorers={"queue": 1})
    picks = [s.pick([CandidateSpec("a", weight=3), B], 1.0, policy).cluster for _ in range(400)]
    assert picks.count("a") / len(picks) == pytest.approx(0.75, abs=0.07)


def test_decision_carries_a_score_breakdown_for_the_debug_header():
    s = scheduler()
    trip(s, "small")
    s.on_first_byte(Decision("a"), 1.0, now=0.0)
    d = s.pick([A, B, FALLBACK], now=0.0, policy=RoutePolicy(scorers={"latency": 1, "load": 1}))
    assert d.scores["a"].parts == {"latency": 0.5, "load": 1.0}
    assert d.scores["a"].total == pytest.approx(0.5 ** 0.5)   # geometric mean of 0.5 and 1
    assert d.scores["b"].parts == {"latency": None, "load": 1.0}
    header = d.debug_header()
    assert "a=0.71 latency:0.50,load:1.00" in header and "b=1.00 latency:-,load:1.00" in header
    assert "\n" not in header


def test_unavailable_debug_header():
    s = scheduler()
    trip(s, "a")
    assert s.pick([A], now=1.0).debug_header() == "unavailable(retry_after=4.0s); a=dropped(breaker open)"


# -- breaker integration -----------------------------------------------------------------------

def test_half_open_primary_takes_probes_then_closes_and_every_transition_is_emitted():
    transitions = []
    s = scheduler(transitions=transitions.append)
    trip(s, "a", now=0.0)
    first = s.pick([A, FALLBACK], now=5.0)  # cool-down over: this request probes
    assert (first.cluster, first.probe, first.degraded) == ("a", True, False)
    second = s.pick([A, FALLBACK], now=5.0)  # probe_share 0.5: the next one goes to the fallback
    assert (second.cluster, second.probe) == ("small", False)
    s.on_complete(first, 0.2, True, now=5.5)
    assert s.breaker_states(5.5)["a"] is BreakerState.HALF_OPEN
    probe = s.pick([A, FALLBACK], now=6.0)
    assert probe.probe
    s.on_complete(probe, 0.2, True, now=6.5)
    assert s.breaker_states(6.5)["a"] is BreakerState.CLOSED
    assert [(t.cluster, t.previous.value, t.state.value) for t in transitions] == [
        ("a", "closed", "open"), ("a", "open", "half_open"), ("a", "half_open", "closed"),
    ]


def test_a_probe_without_a_verdict_passes_its_turn_to_the_next_request():
    s = scheduler()
    trip(s, "a", now=0.0)
    probe = s.pick([A, FALLBACK], now=5.0)
    assert probe.probe                                   # the next one is not due yet (probe_share 0.5)
    s.on_abandon(probe)                                  # its client left, or its answer was not read
    again = s.pick([A, FALLBACK], now=5.1)
    assert (again.cluster, again.probe) == ("a", True)
    assert s.breaker_states(5.1)["a"] is BreakerState.HALF_OPEN


def test_breaker_states_move_with_time_for_export():
    transitions = []
    s = scheduler(transitions=transitions.append)
    trip(s, "a")
    assert s.breaker_states(4.0) == {"a": BreakerState.OPEN}
    assert s.breaker_states(5.0) == {"a": BreakerState.HALF_OPEN}
    assert transitions[-1].trigger == "cooled_down"


def test_breaker_overrides_per_cluster():
    strict = BreakerConfig(min_requests=1, max_error_ratio=0.0)
    s = scheduler(breakers={"a": strict})
    s.on_complete(Decision("a"), 0.1, False, 0.0)
    s.on_complete(Decision("b"), 0.1, False, 0.0)
    assert s.breaker_states(0.0) == {"a": BreakerState.OPEN, "b": BreakerState.CLOSED}


def test_timeout_uses_what_the_chosen_cluster_has_shown():
    s = scheduler()
    config = TimeoutConfig()
    d = s.pick([FALLBACK], now=0.0)
    assert s.timeout_ms(d, 0, 100, "llama-3.1-70b", now=0.0, config=config) == 30_000  # seed; 8b model
    s.on_first_byte(d, 0.5, now=1.0)
    s.on_complete(d, 2.5, True, now=1.0, completion_tokens=100, ttfb_s=0.5)
    assert s.timeout_ms(d, 0, 100, None, now=1.0, config=config) == 5_000  # 2 x (0.5 + 2) clamped to min


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: SchedulerConfig(retry_after_s=0), "SchedulerConfig.retry_after_s must be > 0"),
        (lambda: SignalConfig(ewma_alpha=0), "SignalConfig.ewma_alpha must be > 0"),
        (lambda: SignalConfig(max_samples=0), "SignalConfig.max_samples must be an integer >= 1"),
        (lambda: ScoringConfig(latency_reference_s=0), "ScoringConfig.latency_reference_s must be > 0"),
        (lambda: RoutePolicy(scorers={"cpu": 1}), "scorers.cpu is not a known scorer"),
        (lambda: CandidateSpec("a", role="backup"), "CandidateSpec.role must be one of"),
        (lambda: CandidateSpec("a", weight=-1), "CandidateSpec.weight must be >= 0"),
        (lambda: CandidateSpec("a", max_in_flight=0), "CandidateSpec.max_in_flight must be an integer >= 1"),
        (lambda: CandidateSpec(""), "CandidateSpec.cluster must be a non-empty name"),
    ],
)
def test_bad_config_names_the_field(build, message):
    with pytest.raises(ValueError, match=message):
        build()


# -- simulation ------------------------------------------------------------------------------

class Simulation:
    """Requests every `step` seconds; each cluster answers as `behaviour(cluster, now)` says:
    (ttfb_s, latency_s, ok). Feedback arrives when the simulated response would."""

    def __init__(self, sched, behaviour):
        self.sched, self.behaviour = sched, behaviour
        self.pending = []  # (time, seq, kind, decision, ttfb, latency, ok)
        self.seq = 0
        self.picks = []  # (time, decision)

    def run(self, candidates, start, end, step=0.05):
        now = start
        while now < end:
            self._deliver(now)
            decision = self.sched.pick(candidates, now)
            self.picks.append((now, decision))
            if decision.available:
                self.sched.on_send(decision, now)
                ttfb, latency, ok = self.behaviour(decision.cluster, now)
                self._later(now + ttfb, "first_byte", decision, ttfb, latency, ok)
                self._later(now + latency, "complete", decision, ttfb, latency, ok)
            now = round(now + step, 6)
        self._deliver(end)

    def share(self, cluster, start, end):
        chosen = [d.cluster for t, d in self.picks if start <= t < end]
        return chosen.count(cluster) / len(chosen)

    def _later(self, at, kind, decision, ttfb, latency, ok):
        if kind == "first_byte" and not ok:
            return
        self.seq += 1
        heapq.heappush(self.pending, (at, self.seq, kind, decision, ttfb, latency, ok))

    def _deliver(self, now):
        while self.pending and self.pending[0][0] <= now:
            at, _, kind, decision, ttfb, latency, ok = heapq.heappop(self.pending)
            if kind == "first_byte":
                self.sched.on_first_byte(decision, ttfb, at)
            else:
                self.sched.on_complete(decision, latency, ok, at, completion_tokens=100, ttfb_s=ttfb if ok else None)


def test_the_fast_cluster_gets_most_of_the_traffic():
    def behaviour(cluster, now):
        return (0.1, 0.6, True) if cluster == "fast" else (1.5, 4.0, True)

    sim = Simulation(scheduler(seed=11), behaviour)
    sim.run([CandidateSpec("fast"), CandidateSpec("slow")], start=0.0, end=60.0)
    assert sim.share("fast", 30.0, 60.0) > 0.65  # 0.73-0.80 across seeds
    assert sim.share("slow", 30.0, 60.0) > 0.0  # the slow one still gets a trickle to measure


def test_a_failing_cluster_is_cut_off_within_the_window_and_taken_back_after_recovery():
    transitions = []

    def behaviour(cluster, now):
        if cluster == "a" and 20.0 <= now < 50.0:
            return 0.0, 0.05, False  # fast 503s
        return 0.2, 1.0, True

    sched = scheduler(seed=5, transitions=transitions.append, signals=SignalConfig(error_window_s=10.0))
    sim = Simulation(sched, behaviour)
    sim.run([A, B], start=0.0, end=100.0)
    assert sim.share("a", 0.0, 20.0) == pytest.approx(0.5, abs=0.1)

    opened = next(t.at for t in transitions if t.trigger == "tripped")
    assert 20.0 <= opened < 20.0 + BREAKER.window_s
    cut_off = [d for t, d in sim.picks if opened + 0.1 <= t < 50.0 and d.cluster == "a"]
    assert cut_off and all(d.probe for d in cut_off)  # while down: probes only
    assert len(cut_off) < 0.05 * len([t for t, _ in sim.picks if opened <= t < 50.0])

    recovered = [t.at for t in transitions if t.trigger == "recovered"]
    assert recovered and 50.0 <= recovered[0] < 50.0 + BREAKER.cooldown_s + 5.0
    assert sim.share("a", 70.0, 100.0) > 0.3  # taken back
    assert sched.breaker_states(100.0)["a"] is BreakerState.CLOSED


def test_closing_a_breaker_forgets_the_clusters_old_errors():
    s = Scheduler(SchedulerConfig(breaker=BreakerConfig(window_s=10, min_requests=2, cooldown_s=1,
                                                        close_after_successes=1)))
    a = Decision("a")
    for t in (0.0, 0.1, 0.2, 0.3):
        s.on_complete(a, 0.1, ok=False, now=t)
    assert s.breaker_states(0.5)["a"] is BreakerState.OPEN
    assert s.snapshot(0.5)["a"].error_rate == 1.0
    assert s.breaker_states(2.0)["a"] is BreakerState.HALF_OPEN   # cooled down
    probe = s.pick([CandidateSpec("a")], now=2.0)
    assert probe.probe
    s.on_complete(probe, 0.1, ok=True, now=2.1)
    assert s.breaker_states(2.2)["a"] is BreakerState.CLOSED
    assert s.snapshot(2.2)["a"].error_rate in (None, 0.0)
