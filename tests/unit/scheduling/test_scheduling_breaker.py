import json
import random

import pytest

from sidecar.admission import Gate, GateConfig
from sidecar.pipeline.admission_stage import Admission
from sidecar.openai.chat import parse_chat_request
from sidecar.request.context import RequestContext
from sidecar.route_settings import parse_route_settings
from sidecar.pipeline.route_stage import RouteStage
from sidecar.scheduling import Decision, Scheduler
from sidecar.scheduling.breaker import TRANSITIONS, BreakerConfig, CircuitBreaker
from sidecar.scheduling.model import BreakerState
from tests.support.pipeline_driver import Stages

CLOSED, OPEN, HALF_OPEN = BreakerState.CLOSED, BreakerState.OPEN, BreakerState.HALF_OPEN
CONFIG = BreakerConfig(
    window_s=10.0, min_requests=4, max_error_ratio=0.5, max_p95_latency_s=2.0,
    cooldown_s=5.0, probe_share=0.5, close_after_successes=2,
)

# event -> (ok, latency_s, probe)
OUTCOMES = {
    "ok": (True, 0.1, False),
    "slow": (True, 3.0, False),
    "fail": (False, 0.01, False),
    "probe_ok": (True, 0.1, True),
    "probe_slow": (True, 3.0, True),
    "probe_fail": (False, 0.01, True),
}


def drive(events, config=CONFIG):
    """Run (time, event) pairs through a breaker; return it and the triggers of its transitions."""
    breaker = CircuitBreaker("a", config)
    triggers = []
    for now, event in events:
        if event == "poll":
            transition = breaker.poll(now)
        else:
            ok, latency, probe = OUTCOMES[event]
            transition = breaker.record(ok, latency, now, probe=probe)
        if transition is not None:
            triggers.append(transition.trigger)
    return breaker, triggers


def at(t, *events):
    return [(t, e) for e in events]


OPENED = at(0.0, "fail", "fail", "fail", "fail")

TABLE = [
    ("stays closed below the minimum request count", at(0, "fail", "fail", "fail"), CLOSED, []),
    ("trips when the error ratio exceeds the threshold", at(0, "ok", "fail", "fail", "fail"), OPEN, ["tripped"]),
    ("does not trip at exactly the threshold", at(0, "ok", "ok", "fail", "fail"), CLOSED, []),
    ("failures that left the window do not count",
     at(0, "fail", "fail", "fail") + at(11, "ok", "ok", "ok", "fail"), CLOSED, []),
    ("trips when P95 latency exceeds the limit", at(0, "slow", "slow", "slow", "slow"), OPEN, ["tripped"]),
    ("a few slow requests stay under P95",
     at(0, *["ok"] * 19, "slow"), CLOSED, []),
    ("stays open during the cool-down", OPENED + at(4.9, "poll"), OPEN, ["tripped"]),
    ("goes half-open after the cool-down", OPENED + at(5.0, "poll"), HALF_OPEN, ["tripped", "cooled_down"]),
    ("ignores outcomes while open", OPENED + at(1, "ok", "ok", "ok") + at(2, "poll"), OPEN, ["tripped"]),
    ("closes after N consecutive probe successes",
     OPENED + at(5, "poll", "probe_ok", "probe_ok"), CLOSED, ["tripped", "cooled_down", "recovered"]),
    ("one probe success is not enough", OPENED + at(5, "poll", "probe_ok"), HALF_OPEN, ["tripped", "cooled_down"]),
    ("a failed probe re-opens", OPENED + at(5, "poll", "probe_ok", "probe_fail"), OPEN,
     ["tripped", "cooled_down", "probe_failed"]),
    ("a probe slower than the limit counts as failed", OPENED + at(5, "poll", "probe_slow"), OPEN,
     ["tripped", "cooled_down", "probe_failed"]),
    ("non-probe outcomes do not decide a half-open breaker",
     OPENED + at(5, "poll", "fail", "ok", "ok"), HALF_OPEN, ["tripped", "cooled_down"]),
    ("the cool-down restarts after a failed probe",
     OPENED + at(5, "poll", "probe_fail") + at(9.9, "poll"), OPEN, ["tripped", "cooled_down", "probe_failed"]),
    ("and ends again after it",
     OPENED + at(5, "poll", "probe_fail") + at(10, "poll"), HALF_OPEN,
     ["tripped", "cooled_down", "probe_failed", "cooled_down"]),
    ("a recovered breaker starts with an empty window",
     OPENED + at(5, "poll", "probe_ok", "probe_ok", "fail", "fail", "fail"), CLOSED,
     ["tripped", "cooled_down", "recovered"]),
]


@pytest.mark.parametrize("events, state, triggers", [row[1:] for row in TABLE], ids=[row[0] for row in TABLE])
def test_transitions(events, state, triggers):
    breaker, seen = drive(events)
    assert breaker.state is state
    assert seen == triggers


def test_failures_in_a_row_trip_a_breaker_whose_window_is_healthy():
    # 100 healthy requests keep the ratio far below 0.5; five failures in a row trip it anyway.
    healthy = at(0, *["ok"] * 100)
    breaker, triggers = drive(healthy + at(1, *["fail"] * 4))
    assert breaker.state is CLOSED
    breaker, triggers = drive(healthy + at(1, *["fail"] * 5))
    assert (breaker.state, triggers) == (OPEN, ["tripped"])
    # A success between them starts the count again; 0 turns the count off.
    assert drive(healthy + at(1, "fail", "fail", "fail", "ok", "fail", "fail"))[0].state is CLOSED
    off = BreakerConfig(window_s=10.0, min_requests=4, consecutive_failures=0)
    assert drive(healthy + at(1, *["fail"] * 20), off)[0].state is CLOSED


def test_five_failures_in_a_row_is_the_default():
    breaker = CircuitBreaker("a")
    for i in range(50):
        breaker.record(True, 0.1, now=i / 10)
    transitions = [breaker.record(False, 0.01, now=5.0) for _ in range(5)]
    assert transitions[:4] == [None] * 4
    assert transitions[4].state is OPEN and transitions[4].detail == "5 failures in a row"


def test_a_transition_says_what_changed_when_and_why():
    breaker = CircuitBreaker("a", CONFIG)
    for _ in range(3):
        assert breaker.record(False, 0.01, now=1.0) is None
    transition = breaker.record(False, 0.01, now=2.0)
    assert (transition.cluster, transition.previous, transition.state, transition.at) == ("a", CLOSED, OPEN, 2.0)
    assert "error ratio 1.00 > 0.5 over 4 requests" in transition.detail


def test_every_transition_is_in_the_table():
    assert TRANSITIONS == {
        (CLOSED, "tripped"): OPEN,
        (OPEN, "cooled_down"): HALF_OPEN,
        (HALF_OPEN, "probe_failed"): OPEN,
        (HALF_OPEN, "recovered"): CLOSED,
    }


def test_half_open_lets_a_share_of_requests_through_as_probes():
    breaker, _ = drive(OPENED + at(5, "poll"), BreakerConfig(min_requests=4, cooldown_s=5, probe_share=0.25))
    due = []
    for _ in range(12):
        due.append(breaker.offer_probe())
        if due[-1]:
            breaker.start_probe()
    assert due == [True, False, False, False] * 3  # the first request after the cool-down, then 1 in 4


def test_a_due_probe_waits_until_it_is_taken():
    breaker, _ = drive(OPENED + at(5, "poll"))
    assert [breaker.offer_probe(), breaker.offer_probe()] == [True, True]
    breaker.start_probe()
    assert breaker.offer_probe() is False


def test_closed_and_open_breakers_offer_no_probes():
    assert CircuitBreaker("a", CONFIG).offer_probe() is False
    assert drive(OPENED)[0].offer_probe() is False


def test_retry_after_is_the_rest_of_the_cool_down():
    breaker, _ = drive(OPENED)
    assert breaker.retry_after_s(3.0) == 2.0
    assert CircuitBreaker("b", CONFIG).retry_after_s(3.0) is None


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("window_s", 0, "BreakerConfig.window_s must be > 0"),
        ("min_requests", 0, "BreakerConfig.min_requests must be an integer >= 1"),
        ("consecutive_failures", -1, "BreakerConfig.consecutive_failures must be an integer >= 0"),
        ("min_requests", 2.5, "BreakerConfig.min_requests must be an integer >= 1"),
        ("max_error_ratio", 1.5, r"BreakerConfig.max_error_ratio must be within \[0, 1\]"),
        ("max_p95_latency_s", -1.0, "BreakerConfig.max_p95_latency_s must be > 0"),
        ("cooldown_s", float("nan"), "BreakerConfig.cooldown_s must be > 0"),
        ("probe_share", 0.0, "BreakerConfig.probe_share must be > 0"),
        ("probe_share", 2.0, r"BreakerConfig.probe_share must be within \[0, 1\]"),
        ("close_after_successes", 0, "BreakerConfig.close_after_successes must be an integer >= 1"),
    ],
)
def test_bad_config_names_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        BreakerConfig(**{field: value})


# -- a probe through admission ------------------------------------------------------------

async def test_a_probe_admission_sends_elsewhere_or_refuses_is_no_probe_and_the_turn_passes_on():
    route = parse_route_settings({
        "name": "chat", "admission": {"enabled": True},
        "scheduling": {"breaker": {"min_requests": 1, "cooldown_s": 1}},
        "candidates": [{"cluster": "a", "max_in_flight": 1}, {"cluster": "b", "max_in_flight": 4}]})
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()

    def request(**headers):
        return RequestContext(headers={"authorization": "Bearer k1", **headers}, route=route, route_name="chat",
                              body=body, chat=parse_chat_request(body))
    clock = [100.0]
    d = RouteStage(Scheduler(rng=random.Random(0)), clock=lambda: clock[0], scrape_interval_s=None)
    gate = Gate(GateConfig())
    d.admission = Admission(gate, None, b"a test secret of 32 bytes, fixed")
    d.schedule.config(request())                                    # the route's breaker settings
    d.admit.settings(request())                                     # a's gate cap of 1
    held = await gate.acquire(["a"], "standard", "other")           # and its one slot is busy
    d.scheduler.on_complete(Decision(cluster="a"), 0.1, False, clock[0])     # a trips
    clock[0] += 2                                                   # cool-down over: half-open
    assert d.scheduler.breaker_states(clock[0])["a"] is HALF_OPEN
    breaker = d.scheduler._breaker("a")
    stages = Stages(d)
    for ctx in (request(), request(**{"x-request-deadline-ms": "0"})):   # moved to b; refused
        breaker.void_probe()                                        # a probe is due now
        await stages.decide(ctx)
        decision = stages.routed(ctx).decision
        assert decision is None or (decision.cluster, decision.probe) == ("b", False)
        assert breaker.offer_probe()                                # a's turn was not spent
    held.release()


# -- a 5xx is judged at its headers ----------------------------------------------------------

def test_a_5xx_counts_when_its_headers_come_not_when_its_stream_closes():
    """The client has its answer before the sidecar's stream closes; on a loaded sidecar its
    next request was decided before the last failure counted (one or two more to a bad cluster)."""
    route = parse_route_settings({"name": "chat", "candidates": [{"cluster": "b"}]})
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
    clock = [100.0]
    d = RouteStage(Scheduler(rng=random.Random(0)), clock=lambda: clock[0], scrape_interval_s=None)
    stages = Stages(d)
    open_streams = []
    for _ in range(5):                      # 5 in a row trip the breaker
        ctx = RequestContext(headers={}, route=route, route_name="chat", body=body, chat=parse_chat_request(body))
        stages.decide_now(ctx)
        clock[0] += 0.05
        ctx.status, ctx.response_headers = 500, {":status": "500"}
        stages.on_response_headers(ctx)
        open_streams.append(ctx)             # their streams have not closed yet
    assert d.scheduler.breaker_states(clock[0])["b"] is BreakerState.OPEN
    for ctx in open_streams:                 # closing them judges nothing twice
        stages.on_finish(ctx)
    assert d.scheduler.signals.in_flight("b") == 0
    assert d.scheduler._breaker("b")._outcomes.counts(clock[0]) == (5, 5)
