"""Which answers the sidecar reads (Scheduling.feedback): the sampler, the route stage's
choice per request, and what the processor tells Envoy when an answer is not read."""
import asyncio
import json
import random

import pytest

from sidecar.admission import Gate, GateConfig
from sidecar.pipeline.admission_stage import Admission
from sidecar.request.context import RequestContext
from sidecar.extproc.events import Continue, ModeOverride, Phase, RequestBody, RequestHeaders, SkipResponse
from sidecar.extproc.processor import RequestProcessor
from sidecar.pipeline.route_config import build_route_config
from sidecar.openai.chat import parse_chat_request
from sidecar.route_settings import parse_route_settings
from sidecar.pipeline.route_stage import RouteStage
from sidecar.scheduling import Decision, Scheduler
from sidecar.scheduling.sampling import FeedbackSampler
from tests.unit.extproc.test_processor import BODY, CHAT, new_director
from tests.support.pipeline_driver import Stages


def route(**scheduling):
    return parse_route_settings({"name": "chat", "scheduling": scheduling,
                                 "candidates": [{"cluster": "a"}, {"cluster": "b"}]})


# Reads almost no answer of a busy route: what each test below changes shows through.
RARELY = {"read_all_per_s": 0, "then_one_in": 1000}


def headers_event(settings):
    return RequestHeaders(CHAT, False, route=settings, route_name="chat")


# --- the sampler ---------------------------------------------------------------------------

def test_every_answer_is_read_until_the_per_second_floor_then_one_in_n():
    sampler = FeedbackSampler(read_all_per_s=3, then_one_in=4)
    reads = [sampler.read(10.5) for _ in range(15)]
    assert reads[:3] == [True] * 3
    assert [i + 1 for i, r in enumerate(reads) if r][3:] == [4, 8, 12]
    assert sampler.read(11.0)          # a new second: the floor again


def test_one_in_one_reads_every_answer():
    sampler = FeedbackSampler(read_all_per_s=0, then_one_in=1)
    assert all(sampler.read(5.0) for _ in range(100))


def test_route_settings_set_the_sampler_and_a_bad_value_names_the_field():
    config = build_route_config(route(feedback={"read_all_per_s": 7, "then_one_in": 3}), "chat")
    assert (config.feedback.read_all_per_s, config.feedback.then_one_in) == (7, 3)
    assert (build_route_config(route(), "chat").feedback.read_all_per_s,
            build_route_config(route(), "chat").feedback.then_one_in) == (50, 8)
    with pytest.raises(ValueError, match="feedback.then_one_in"):
        build_route_config(route(feedback={"then_one_in": 0}), "chat")


# --- the route stage's choice ---------------------------------------------------------

def reads(d, settings, n=200):
    return sum(d.reads_response(RequestContext(route=settings, route_name="chat")) for _ in range(n))


def test_a_busy_route_reads_a_sample():
    assert reads(new_director(), route(feedback={"read_all_per_s": 10, "then_one_in": 5})) == 10 + 190 // 5


def test_a_route_with_the_debug_header_reads_every_answer():
    assert reads(new_director(), route(feedback=RARELY, debug_header=True)) == 200


def test_admission_routes_read_every_answer():
    settings = parse_route_settings({"name": "chat", "admission": {"enabled": True},
                                     "scheduling": {"feedback": RARELY},
                                     "candidates": [{"cluster": "a"}]})
    d = new_director()
    assert reads(d, settings, 10) == 0            # no admission in this sidecar: sampled
    d.admission = Admission(Gate(GateConfig()), None, b"secret")
    assert reads(d, settings, 10) == 10


def test_a_breaker_that_is_not_closed_makes_every_answer_read():
    d = new_director()
    settings = route(feedback=RARELY,
                     breaker={"min_requests": 2, "window_s": 30})
    assert reads(d, settings, 10) == 0
    d.scheduler.set_breaker_config("a", build_route_config(settings, "chat").breaker)
    for _ in range(3):
        d.scheduler.on_complete(Decision("a"), 0.01, False, 100.0)
    assert reads(d, settings, 10) == 10


def test_a_failure_streak_makes_every_answer_read_until_a_success():
    # A busy route reads one answer in many; a streak counted on that sample would let a
    # cluster failing every request fail many more before the breaker's count is reached.
    d = new_director()
    settings = route(feedback=RARELY)
    d.scheduler.set_breaker_config("a", build_route_config(settings, "chat").breaker)
    assert reads(d, settings, 10) == 0
    d.scheduler.on_complete(Decision("a"), 0.01, False, 100.0)      # one failure: closed still
    assert reads(d, settings, 10) == 10
    d.scheduler.on_complete(Decision("a"), 0.01, True, 100.1)       # the streak ends
    assert reads(d, settings, 10) == 0


def test_routes_that_do_not_steer_read_every_answer():
    no_candidates = parse_route_settings({"name": "plain"})
    assert reads(new_director(), no_candidates, 20) == 20
    assert reads(new_director(), None, 20) == 20


# --- the processor ----------------------------------------------------------------------------

def headers_reply(processor: RequestProcessor, d, event: RequestHeaders):
    """The request headers' reply as the servicer gives it (sidecar/service/server.py): the processor's,
    or its skip of the response when the pipeline reads none of it."""
    reply = processor.handle(event)
    if processor.awaits_body and not d.reads_response(processor.context):
        reply = processor.apply(SkipResponse())
    return reply


def test_an_unread_answer_skips_response_headers_and_its_headers_go_as_metadata():
    settings = route(feedback=RARELY)
    d = new_director()
    processor = RequestProcessor()
    first = headers_reply(processor, d, headers_event(settings))
    assert first == Continue(Phase.REQUEST_HEADERS, mode=ModeOverride(response_headers=False))
    decide = processor.handle(RequestBody(BODY, True))
    reply = processor.apply(asyncio.run(Stages(d).decide(decide.context)))
    cluster = processor.context.cluster
    assert dict(reply.dynamic_metadata) == {"x-sluice-cluster": cluster}
    assert processor.context.response_read is False


def test_a_read_answer_sends_no_metadata():
    d = new_director()
    processor = RequestProcessor()
    assert headers_reply(processor, d, headers_event(route())) == Continue(Phase.REQUEST_HEADERS)
    decide = processor.handle(RequestBody(BODY, True))
    reply = processor.apply(asyncio.run(Stages(d).decide(decide.context)))
    # Metadata in this reply with response headers still to come kept Envoy 1.40's ext_proc
    # stream open past the request's end (measured): only unread answers carry it.
    assert reply.dynamic_metadata == ()
    assert processor.context.response_read is True


def test_cache_routes_read_every_answer_and_the_others_follow_routing():
    from sidecar.cache.inflight import InFlight
    from sidecar.cache.memory_store import MemoryStore
    from sidecar.pipeline.cache_stage import CacheRuntime, CacheStage
    caching = Stages(new_director(), CacheStage(CacheRuntime(store=MemoryStore(), inflight=InFlight())))
    sampled = {"feedback": RARELY}
    cached = route(**sampled)                                      # the cache is on by default
    uncached = parse_route_settings({"name": "chat", "scheduling": sampled, "cache": {"enabled": False},
                                     "candidates": [{"cluster": "a"}]})
    assert reads(caching, cached, 10) == 10
    assert reads(caching, uncached, 10) == 0


def test_response_headers_that_come_anyway_are_handled_as_read():
    """An Envoy without allow_mode_override ignores the skip: the answer is then read as usual."""
    from sidecar.extproc.events import ResponseHeaders
    settings = route(feedback=RARELY)
    d = new_director()
    processor = RequestProcessor()
    headers_reply(processor, d, headers_event(settings))
    decide = processor.handle(RequestBody(BODY, True))
    processor.apply(asyncio.run(Stages(d).decide(decide.context)))
    reply = processor.handle(ResponseHeaders({":status": "200"}, False))
    cluster = processor.context.cluster
    assert reply.phase is Phase.RESPONSE_HEADERS and ("x-sluice-cluster", cluster) in reply.set_headers
    assert processor.context.status == 200


def tokens_per_s_learned(body: bytes) -> float | None:
    """What the cluster's tokens/s becomes after three answers of 50 tokens, each with its
    headers after 0.1 s and its end a second later."""
    clock = [100.0]
    d = RouteStage(Scheduler(rng=random.Random(0)), clock=lambda: clock[0], scrape_interval_s=None)
    settings = route(feedback={"read_all_per_s": 1000, "then_one_in": 1})
    stages = Stages(d)
    for _ in range(3):
        ctx = RequestContext(route=settings, route_name="chat", chat=parse_chat_request(body), body=body)
        asyncio.run(stages.decide(ctx))
        clock[0] += 0.1
        ctx.status = 200
        stages.on_response_headers(ctx)             # first byte after 0.1 s
        clock[0] += 1.0
        ctx.usage, ctx.response_complete = (10, 50), True       # 50 tokens in the next second
        stages.on_finish(ctx)
    return d.scheduler.signals.snapshot(clock[0])[ctx.cluster].tokens_per_s


def test_a_streamed_answer_read_to_its_end_teaches_the_cluster_its_tokens_per_second():
    streamed = json.dumps({**json.loads(BODY), "stream": True}).encode()
    assert tokens_per_s_learned(streamed) == pytest.approx(50, rel=0.05)
    assert tokens_per_s_learned(BODY) is None      # JSON: headers come after the generation
