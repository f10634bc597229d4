"""Where Envoy retries a request that failed before its first byte, and what the sidecar learns
when the retry answered (sidecar/scheduling/retry.py, sidecar/pipeline/route_stage.py)."""
import json
import random
from types import MappingProxyType

from sidecar.openai.chat import parse_chat_request
from sidecar.request.context import RequestContext
from sidecar.route_settings import parse_route_settings
from sidecar.pipeline.route_stage import RouteStage
from sidecar.scheduling import BreakerState, CandidateSpec, Decision, Scheduler
from sidecar.scheduling.retry import retry_candidate, retry_cluster_name, retry_clusters
from sidecar.scheduling.scorers import ScoreBreakdown
from tests.support.pipeline_driver import Stages

A, B, C = (CandidateSpec(cluster=n) for n in "abc")


def scored(chosen, **totals):
    return Decision(cluster=chosen, scores=MappingProxyType(
        {name: ScoreBreakdown(total=total, parts={}) for name, total in totals.items()}))


def anyone(_spec):
    return True


def test_the_runner_up_by_score_healthy_and_taking_the_same_body():
    decision = scored("a", a=0.9, b=0.2, c=0.7)
    assert retry_candidate(decision, (A, B, C), anyone, anyone) is C
    assert retry_candidate(decision, (A, B, C), lambda s: s.cluster != "c", anyone) is B
    assert retry_candidate(decision, (A, B, C), anyone, lambda s: s.cluster == "b") is B
    assert retry_candidate(decision, (A, B, C), lambda s: s.cluster == "a", anyone) is None


def test_a_dropped_or_weightless_candidate_is_no_retry_target():
    decision = Decision(cluster="a", dropped=MappingProxyType({"b": "breaker open"}))
    assert retry_candidate(decision, (A, B), anyone, anyone) is None
    assert retry_candidate(Decision(cluster="a"), (A, CandidateSpec(cluster="b", weight=0)), anyone, anyone) is None


def test_the_chosen_tier_first_then_the_fallbacks():
    fallback = CandidateSpec(cluster="f", role="fallback")
    chosen = Decision(cluster="a", role="primary")
    assert retry_candidate(chosen, (fallback, A, B), anyone, anyone) is B
    assert retry_candidate(chosen, (fallback, A), anyone, anyone) is fallback


def test_one_composite_cluster_per_ordered_pair():
    assert retry_clusters((A, B, C)) == [retry_cluster_name(x, y) for x, y in
                                         ("ab", "ac", "ba", "bc", "ca", "cb")]
    assert retry_cluster_name("a", "b") == "a__then__b"


BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()


def director_and_route(**scheduling):
    route = parse_route_settings({"name": "chat", "candidates": [{"cluster": "a"}, {"cluster": "b"}],
                                  "scheduling": {"feedback": {"then_one_in": 1}, **scheduling}})
    clock = [100.0]
    director = Stages(RouteStage(Scheduler(rng=random.Random(0)), clock=lambda: clock[0], scrape_interval_s=None))
    return director, route, clock


def request(route):
    return RequestContext(headers={}, route=route, route_name="chat", body=BODY, chat=parse_chat_request(BODY))


def test_the_sidecar_names_the_composite_cluster_and_sets_the_retry_headers():
    director, route, _ = director_and_route(retry_other_cluster=True, timeout={"first_byte_ms": 1500})
    ctx = request(route)
    plan = director.decide_now(ctx)
    state = director.routed(ctx)
    other = "b" if state.decision.cluster == "a" else "a"
    assert plan.cluster == f"{state.decision.cluster}__then__{other}" and state.retry_cluster == other
    headers = dict(plan.request_headers)
    assert headers["x-envoy-retry-on"] == "5xx" and headers["x-envoy-max-retries"] == "1"
    assert headers["x-envoy-upstream-rq-per-try-timeout-ms"] == "1500"
    assert dict(plan.response_headers)["x-sluice-cluster"] == state.decision.cluster


def test_without_the_setting_no_retry_and_no_first_byte_budget():
    director, route, _ = director_and_route()
    ctx = request(route)
    plan = director.decide_now(ctx)
    state = director.routed(ctx)
    assert plan.cluster == state.decision.cluster and state.retry_cluster is None
    assert not {"x-envoy-retry-on", "x-envoy-upstream-rq-per-try-timeout-ms"} & set(dict(plan.request_headers))


def test_an_answer_from_the_retry_counts_against_the_first_cluster_not_for_the_second():
    director, route, clock = director_and_route(retry_other_cluster=True)
    first, failed = None, 0
    for _ in range(200):
        ctx = request(route)
        director.decide_now(ctx)
        state = director.routed(ctx)
        first = first or state.decision.cluster
        if state.decision.cluster == first:    # the first attempt failed (2 s); Envoy's retry answered
            clock[0] += 2.0
            ctx.status, ctx.response_headers = 200, {":status": "200", "x-envoy-attempt-count": "2"}
            director.on_response_headers(ctx)
            assert state.decision.cluster == ctx.cluster != first
            failed += 1
        else:
            clock[0] += 0.1
            ctx.status, ctx.response_headers = 200, {":status": "200"}
            director.on_response_headers(ctx)
        ctx.response_complete = True
        director.on_finish(ctx)
        if failed == 5:                      # 5 failures in a row trip a breaker
            break
    scheduler = director.route.scheduler
    states = scheduler.breaker_states(clock[0])
    assert states[first] is BreakerState.OPEN
    second = "b" if first == "a" else "a"
    assert states[second] is BreakerState.CLOSED
    # The retried answers' time to first byte includes the failed attempt: not a sample of the second.
    assert (scheduler.signals.cluster_snapshot(second, clock[0]).ttfb_p95_s or 0.0) < 0.5
    assert scheduler.signals.in_flight(first) == 0 and scheduler.signals.in_flight(second) == 0
