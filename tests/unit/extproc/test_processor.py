"""The sans-IO processor, driven by lists of events: no server, no Envoy."""
import asyncio
import json
import random

import pytest

from sidecar.openai.chat import parse_chat_request
from sidecar.request.context import Outcome, RequestContext
from sidecar.pipeline.route_stage import RouteStage, rewrite_model
from sidecar.scheduling import Scheduler
from sidecar.extproc.events import (BodyMode, Continue, Decide, ImmediateReply, ModeOverride, Phase, Plan,
                            ProtocolError, RequestBody, RequestHeaders, ResponseBody,
                            ResponseHeaders)
from sidecar.extproc.processor import RequestProcessor, State
from sidecar.route_settings import RouteSettingsError, parse_route_settings
from tests.support.pipeline_driver import Stages

CHAT = {":method": "POST", ":path": "/v1/chat/completions", "content-type": "application/json"}
BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
TWO = parse_route_settings({"name": "chat", "candidates": [{"cluster": "a", "weight": 1},
                                                          {"cluster": "b", "weight": 1}]})


def new_director(seed=0):
    return RouteStage(Scheduler(rng=random.Random(seed)), clock=lambda: 100.0, scrape_interval_s=None)


def run(events, route=TWO, director=None):
    """Feed events like the server does, answering Decide with the director's plan."""
    director = director or new_director()
    processor = RequestProcessor()
    replies = []
    for event in events:
        if isinstance(event, RequestHeaders) and event.route is None:
            event = RequestHeaders(event.headers, event.end_of_stream, route=route, route_name="r")
        reply = processor.handle(event)
        if isinstance(reply, Decide):
            assert reply.context is processor.context
            reply = processor.apply(asyncio.run(Stages(director).decide(reply.context)))
        replies.append(reply)
    return processor, replies


def chat_flow(body=BODY, status="200"):
    return [RequestHeaders(CHAT, False), RequestBody(body, True),
            ResponseHeaders({":status": status}, False)]


def test_chat_request_is_steered_and_route_cache_cleared():
    processor, (headers, body, response) = run(chat_flow())
    assert headers == Continue(Phase.REQUEST_HEADERS)
    assert body.clear_route_cache and body.set_headers[0][0] == "x-sluice-cluster"
    cluster = body.set_headers[0][1]
    assert cluster in ("a", "b")
    assert response.set_headers == (("x-sluice-cluster", cluster),)
    ctx = processor.context
    assert (ctx.route_name, ctx.outcome, ctx.cluster, ctx.status, ctx.chat.model) == (
        "chat", Outcome.ROUTED, cluster, 200, "m")
    assert processor.state is State.AWAIT_RESPONSE_BODY


def test_body_parse_asks_for_a_decision():
    processor = RequestProcessor()
    processor.handle(RequestHeaders(CHAT, False))
    decide = processor.handle(RequestBody(BODY, True))
    assert isinstance(decide, Decide) and processor.state is State.AWAIT_PLAN
    with pytest.raises(ProtocolError):       # nothing else may arrive before the plan
        processor.handle(ResponseHeaders({":status": "200"}, False))


@pytest.mark.parametrize("plan, expected", [
    (Plan(), Continue(Phase.REQUEST_BODY)),
    (Plan(cluster="b", request_headers=(("x-envoy-upstream-rq-timeout-ms", "9000"),)),
     Continue(Phase.REQUEST_BODY, set_headers=(("x-sluice-cluster", "b"),
                                               ("x-envoy-upstream-rq-timeout-ms", "9000")),
              clear_route_cache=True)),
    (Plan(body=b"{}"), Continue(Phase.REQUEST_BODY, body=b"{}")),
    (Plan(reply=ImmediateReply(200, b"cached")), ImmediateReply(200, b"cached")),
])
def test_plans_become_replies(plan, expected):
    processor = RequestProcessor()
    processor.handle(RequestHeaders(CHAT, False))
    processor.handle(RequestBody(BODY, True))
    assert processor.apply(plan) == expected


def test_plan_can_ask_for_the_response_body():
    processor = RequestProcessor()
    processor.handle(RequestHeaders(CHAT, False))
    processor.handle(RequestBody(BODY, True))
    processor.apply(Plan(response_body=BodyMode.STREAMED, response_headers=(("x-sluice-cache", "miss"),)))
    reply = processor.handle(ResponseHeaders({":status": "200"}, False))
    assert reply.mode == ModeOverride(response_body=BodyMode.STREAMED)
    assert reply.set_headers == (("x-sluice-cache", "miss"),)


@pytest.mark.parametrize("mode, chunks, read_to_end", [
    (BodyMode.BUFFERED, [(b"{}", True)], True),                  # whole: its end is seen
    (BodyMode.BUFFERED, [], True),                               # cut before any body came
    (BodyMode.BUFFERED, [(b"{" * 10, False)], False),            # outgrew the buffer: end unseen
    (BodyMode.STREAMED, [(b"data: 1", False)], True),            # a stream's chunks: end still due
])
def test_whether_an_answer_is_read_to_its_end(mode, chunks, read_to_end):
    """What decides if an answer that did not reach its end was cut (a breaker failure)."""
    processor = RequestProcessor()
    processor.handle(RequestHeaders(CHAT, False))
    processor.handle(RequestBody(BODY, True))
    processor.apply(Plan(response_body=mode))
    processor.handle(ResponseHeaders({":status": "200"}, False))
    for body, end in chunks:
        processor.handle(ResponseBody(body, end))
    assert processor.context.response_body_read is read_to_end


@pytest.mark.parametrize("weights, expected", [
    ([1, 0], {"a"}), ([0, 5], {"b"}), ([1, 1], {"a", "b"}),
])
def test_weights_decide_the_cluster(weights, expected):
    route = parse_route_settings({"candidates": [{"cluster": "a", "weight": weights[0]},
                                                 {"cluster": "b", "weight": weights[1]}]})
    director = new_director(1)
    chosen = {run(chat_flow()[:2], route=route, director=director)[0].context.cluster
              for _ in range(50)}
    assert chosen == expected


@pytest.mark.parametrize("route, outcome", [
    (parse_route_settings({}), Outcome.DEFAULT),
    (RouteSettingsError("sluice.candidates[0].weight must be >= 0"), Outcome.INVALID_ROUTE),
])
def test_without_usable_candidates_the_route_default_applies(route, outcome):
    processor, (_, body, response) = run(chat_flow(), route=route)
    assert body == Continue(Phase.REQUEST_BODY)          # no header set: Envoy's default cluster
    assert response.set_headers == ()
    assert processor.context.outcome is outcome


def test_no_available_candidate_gets_fast_503_with_retry_after():
    route = parse_route_settings({"candidates": [{"cluster": "a", "weight": 0}]})
    processor, (_, reply) = run(chat_flow()[:2], route=route)
    assert isinstance(reply, ImmediateReply) and reply.status == 503
    assert ("retry-after", "1") in reply.headers
    assert json.loads(reply.body)["error"]["code"] == "upstream_unavailable"
    assert processor.context.outcome is Outcome.REFUSED


@pytest.mark.parametrize("headers", [
    {":method": "GET", ":path": "/v1/models"},
    {":method": "POST", ":path": "/v1/embeddings"},
    {":method": "GET", ":path": "/v1/chat/completions"},
])
def test_other_requests_pass_through_and_ask_for_nothing_more(headers):
    processor, (reply,) = run([RequestHeaders(headers, True)])
    assert reply == Continue(Phase.REQUEST_HEADERS, mode=ModeOverride(
        request_body=BodyMode.NONE, response_headers=False))
    assert processor.context.outcome is Outcome.PASSTHROUGH
    # If Envoy still sends more (mode override refused), everything continues untouched.
    assert processor.handle(ResponseHeaders({":status": "404"}, True)) == Continue(Phase.RESPONSE_HEADERS)
    assert processor.context.status == 404


def test_chat_post_without_body_gets_400():
    processor, (reply,) = run([RequestHeaders(CHAT, True)])
    assert isinstance(reply, ImmediateReply) and reply.status == 400
    assert processor.context.outcome is Outcome.BAD_REQUEST


_USER = b'{"model": "m", "messages": [{"role": "user", "content": "x"}]'


@pytest.mark.parametrize("body", [
    b"", b"{", b"\xff\xff", b'{"model": "m"}', b"[]",
    _USER + b', "temperature": 1' + b"0" * 400 + b"}",              # an int no float holds
    _USER + b', "max_tokens": ' + b"9" * 5000 + b"}",               # past Python's int digits
    _USER + b', "metadata": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",   # past the recursion limit
])
def test_bad_chat_bodies_get_openai_400(body):
    processor, (_, reply) = run(chat_flow(body)[:2])
    assert isinstance(reply, ImmediateReply) and reply.status == 400
    assert set(json.loads(reply.body)["error"]) == {"message", "type", "param", "code"}
    assert processor.context.outcome is Outcome.BAD_REQUEST and processor.state is State.DONE


@pytest.mark.parametrize("path", ["/v1/chat/completions?api-version=1", "/v1/chat/%63ompletions",
                                  "/v1/chat/completion%73?x=1", "/v1/chat//completions"])
def test_neither_a_query_string_nor_encoding_hides_the_chat_path(path):
    """The upstream decodes "%63" to "c": passed through, such a request would skip routing,
    limits and cache (Envoy normalises paths too; this holds behind one that does not)."""
    _, (reply,) = run([RequestHeaders({**CHAT, ":path": path}, False)])
    assert reply == Continue(Phase.REQUEST_HEADERS)


def test_a_body_followed_by_trailers_is_decided_on():
    """BUFFERED: the one body message says end_of_stream False when request trailers follow;
    the request must still be routed (else it skips routing, admission, limits and cache)."""
    processor, replies = run([RequestHeaders(CHAT, False), RequestBody(BODY, False)])
    assert replies[1].clear_route_cache and processor.context.outcome is Outcome.ROUTED


@pytest.mark.parametrize("before", [[], [RequestHeaders(CHAT, False)]])
def test_envoys_own_reply_is_recorded_not_a_protocol_error(before):
    """A 429 of the rate limit before ext_proc (no request headers seen), a 413 while buffering."""
    status = "429" if not before else "413"
    processor, replies = run([*before, ResponseHeaders({":status": status}, False)])
    assert replies[-1] == Continue(Phase.RESPONSE_HEADERS) and processor.finished
    assert (processor.context.outcome, processor.context.status) == (Outcome.ENVOY_REPLY, int(status))


@pytest.mark.parametrize("events", [
    [RequestBody(BODY, True)],
    [RequestHeaders(CHAT, False), RequestHeaders(CHAT, False)],
    [RequestHeaders(CHAT, False), RequestBody(BODY[:10], False), RequestBody(BODY[10:], True)],   # STREAMED: not ours
    [RequestHeaders(CHAT, False), ResponseBody(b"x", True)],
    [*chat_flow(b"{")[:2], ResponseHeaders({":status": "400"}, True)],
])
def test_out_of_order_events_are_protocol_errors(events):
    with pytest.raises(ProtocolError):
        run(events)


def test_response_body_end_finishes_the_request():
    processor, _ = run([*chat_flow(), ResponseBody(b"{}", True)])
    assert processor.state is State.DONE and processor.context.response_complete


def test_default_cluster_already_set_by_the_edge_needs_no_reroute():
    processor = RequestProcessor()
    processor.handle(RequestHeaders({**CHAT, "x-sluice-cluster": "a"}, False))
    processor.handle(RequestBody(BODY, True))
    reply = processor.apply(Plan(cluster="a", request_headers=(("x-envoy-upstream-rq-timeout-ms", "9000"),)))
    assert reply == Continue(Phase.REQUEST_BODY, set_headers=(("x-envoy-upstream-rq-timeout-ms", "9000"),))


def test_the_model_rewrite_keeps_a_body_with_a_lone_surrogate_valid():
    body = json.dumps({"model": "big", "messages": [{"role": "user", "content": "odd \ud800 text, café"}]}).encode()
    rewritten = json.loads(rewrite_model(body, "small-model"))
    assert rewritten == {"model": "small-model", "messages": [{"role": "user", "content": "odd \ud800 text, café"}]}
    assert rewrite_model(json.dumps({"model": "big", "x": "café"}).encode(), "s") == '{"model":"s","x":"café"}'.encode()


def test_the_upstream_timeout_never_runs_past_the_clients_deadline():
    """x-request-deadline-ms is the client's budget for the whole request, not only for
    admission: Envoy is told to wait for the upstream no longer than what is left of it."""
    def timeout_ms(deadline_ms=None, elapsed_s=0.0):
        headers = {} if deadline_ms is None else {"x-request-deadline-ms": deadline_ms}
        ctx = RequestContext(headers=headers, route=TWO, route_name="chat", started=100.0 - elapsed_s)
        ctx.body, ctx.chat = BODY, parse_chat_request(BODY)
        plan = asyncio.run(Stages(new_director()).decide(ctx))
        return int(dict(plan.request_headers)["x-envoy-upstream-rq-timeout-ms"])
    unbounded = timeout_ms()
    assert unbounded > 1500
    assert timeout_ms("2500", elapsed_s=1.0) == 1500
    assert timeout_ms(str(10**9)) == unbounded
    assert timeout_ms("100", elapsed_s=5.0) == 1         # spent: Envoy times out at once
    assert timeout_ms("junk") == unbounded
