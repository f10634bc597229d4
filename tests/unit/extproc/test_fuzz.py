"""Everything from outside is input: property tests over arbitrary JSON and event sequences.

The fast slice of the fuzzing (`make fuzz` runs the long one, bench/fuzz.py): the chat parser
and what reads a parsed request, the processor under any order of Envoy's events, and the
answer capture and usage meter under any upstream body. Each property allows only the
outcomes the code promises (a ChatRequest or a BadRequest; a reply or a ProtocolError; an
answer or a NotCaptured), so any other exception fails the test with the input that raised it.
"""
import asyncio
import json
import math
import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from devtools import fuzzing
from sidecar.extproc import codec
from sidecar.token_estimate import estimate_tokens
from sidecar.cache.answer import MAX_TOKENS, CachedAnswer
from sidecar.cache.capture import SseCapture, capture_json
from sidecar.cache.policy import CachePolicy, cache_decision
from sidecar.cache.replay import json_body, sse_body
from sidecar.cache.scope import exact_key, prompt_text, scope_for
from sidecar.openai.chat import BadRequest, ChatRequest, parse_chat_request
from sidecar.extproc.events import (BodyMode, Continue, Decide, ImmediateReply, Phase, Plan, ProtocolError,
                            RequestBody, RequestHeaders, ResponseBody, ResponseHeaders, SkipResponse)
from sidecar.extproc.processor import RequestProcessor
from sidecar.route_settings import parse_route_settings
from sidecar.pipeline.usage import UsageMeter

# A few seconds in all (make test); `make fuzz` is the long run. No example database: a failure
# prints its input, and the runs leave no files behind.
FAST = settings(max_examples=40, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# --- arbitrary JSON, leaning on the names and values a chat body and an answer hold -------------

NAMES = st.sampled_from(fuzzing._KEYS + ("choices", "message", "delta", "usage", "prompt_tokens",
                                         "completion_tokens", "finish_reason", "index", "error")) | st.text(max_size=4)
SCALARS = (st.none() | st.booleans() | st.sampled_from(fuzzing._NUMBERS) | st.integers()
           | st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from(fuzzing._STRINGS)
           | st.text(max_size=20))
ANY_JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                        | st.dictionaries(NAMES, inner, max_size=4), max_leaves=8)


def _json_or(strategy):
    """A field's usual value, or any JSON in its place."""
    return strategy | ANY_JSON


MESSAGE = st.fixed_dictionaries(
    {"role": _json_or(st.sampled_from(("user", "system", "assistant", "tool"))),
     "content": _json_or(st.text(max_size=30) | st.lists(st.fixed_dictionaries(
         {"type": _json_or(st.just("text")), "text": _json_or(st.text(max_size=20))}), max_size=3))},
    optional={"name": ANY_JSON, "tool_calls": ANY_JSON})
CHAT = st.fixed_dictionaries(
    {"model": _json_or(st.just("demo-model")), "messages": _json_or(st.lists(MESSAGE, min_size=1, max_size=4))},
    optional={name: ANY_JSON for name in ("stream", "stream_options", "temperature", "max_tokens",
                                          "n", "stop", "logprobs", "response_format", "tools", "tool_choice",
                                          "user", "x")})


def _bytes(value) -> bytes:
    return fuzzing.encode(value, ascii_only=False)


# --- the client's body --------------------------------------------------------------------------

POLICY = CachePolicy(enabled=True, shared=False)
HEADERS = {"authorization": "Bearer k", ":authority": "llm", ":path": "/v1/chat/completions"}


def _read_as_the_request_path_does(chat: ChatRequest) -> None:
    """What the cache, admission and routing read of an accepted request."""
    estimate_tokens(chat.text)
    bypass = cache_decision(chat, HEADERS, POLICY)
    if bypass is None or bypass.may_store:
        scope = scope_for(chat, HEADERS, POLICY, b"a test secret of 32 bytes, fixed")
        exact_key(scope, prompt_text(chat))
    assert chat.max_tokens is None or abs(chat.max_tokens) < 2 ** 63


@FAST
@given(CHAT)
def test_any_chat_body_is_accepted_or_a_400_naming_why(body):
    try:
        chat = parse_chat_request(_bytes(body), remember=False)
    except BadRequest as error:
        assert str(error)
        return
    _read_as_the_request_path_does(chat)


@FAST
@given(st.binary(max_size=200) | ANY_JSON.map(_bytes))
def test_any_bytes_are_accepted_or_a_400(raw):
    try:
        _read_as_the_request_path_does(parse_chat_request(raw, remember=False))
    except BadRequest:
        pass


def test_seeded_hostile_bodies_through_the_real_request_path():
    """A few hundred of make fuzz's inputs through the servicer (codec, processor, directors with
    admission and the cache): no exception reaches the server's last resort."""
    tally = fuzzing.run(fuzzing.run_client_inputs, 150, random.randrange(1 << 30))
    assert tally.unexpected_count == 0, tally.unexpected[:3]
    assert tally.outcomes["answered_400"] and tally.outcomes["upstream"]


def test_seeded_hostile_answers_through_the_real_request_path():
    tally = fuzzing.run(fuzzing.run_upstream_answers, 50, random.randrange(1 << 30))
    assert tally.unexpected_count == 0, tally.unexpected[:3]
    assert tally.outcomes["answered_200"]                          # some were stored and replayed


# --- the processor under any order of Envoy's events -------------------------------------------

ROUTE = parse_route_settings({"name": "chat", "candidates": [{"cluster": "a"}]})
HEADER_MAPS = st.dictionaries(st.sampled_from((":method", ":path", ":status", "content-type", "x")),
                              st.sampled_from(("POST", "GET", "/v1/chat/completions", "/v1/%63hat/completions",
                                               "//v1/chat/completions", "200", "500", "abc", "")), max_size=4)
EVENTS = st.one_of(
    st.builds(RequestHeaders, HEADER_MAPS, st.booleans(), st.sampled_from((None, ROUTE)), st.text(max_size=5)),
    st.builds(RequestBody, CHAT.map(_bytes) | st.binary(max_size=50), st.booleans()),
    st.builds(ResponseHeaders, HEADER_MAPS, st.booleans()),
    st.builds(ResponseBody, st.binary(max_size=50), st.booleans()),
    st.builds(Plan, st.sampled_from((None, "a", "b")),
              st.sampled_from((None, ImmediateReply(429, b"{}"))), st.sampled_from((None, b"{}")),
              response_body=st.sampled_from((None, BodyMode.BUFFERED, BodyMode.STREAMED))),
)


@FAST
@given(st.lists(EVENTS, max_size=8), st.booleans())
def test_the_processor_answers_any_event_sequence_or_refuses_it_as_a_protocol_error(events, reads):
    processor = RequestProcessor()
    for event in events:
        try:
            reply = processor.handle(event)
            if isinstance(event, RequestHeaders) and processor.awaits_body and not reads:
                reply = processor.apply(SkipResponse())    # as the servicer asks it
        except ProtocolError:
            continue
        if not isinstance(reply, Decide):
            codec.encode(reply)                    # every reply has a wire form


@FAST
@given(st.lists(EVENTS, max_size=6), st.booleans())
def test_a_failed_message_always_has_a_reply_the_wire_accepts(events, refuse):
    processor = RequestProcessor()
    for event in events:
        if isinstance(event, Plan):
            continue
        codec.encode(processor.fail(event, refuse))


# --- the upstream's answer ----------------------------------------------------------------------

ANSWER_OBJECT = st.fixed_dictionaries(
    {"choices": _json_or(st.lists(st.fixed_dictionaries(
        {"index": _json_or(st.just(0)), "finish_reason": _json_or(st.sampled_from(("stop", "length"))),
         "message": _json_or(st.fixed_dictionaries({"role": _json_or(st.just("assistant")),
                                                    "content": _json_or(st.text(max_size=20))})),
         "delta": _json_or(st.fixed_dictionaries({"content": _json_or(st.text(max_size=10))}))}),
        max_size=2)),
     "usage": _json_or(st.fixed_dictionaries({"prompt_tokens": _json_or(st.integers(min_value=0)),
                                              "completion_tokens": _json_or(st.integers(min_value=0))}))},
    optional={"model": ANY_JSON, "error": ANY_JSON})


def _check_answer(answer) -> None:
    if isinstance(answer, CachedAnswer):
        assert CachedAnswer.from_bytes(answer.to_bytes()) == answer
        json_body(answer, "m", 1.0, "chatcmpl-x")
        sse_body(answer, "m", 1.0, "chatcmpl-x", include_usage=True)


def _check_usage(usage) -> None:
    if usage is not None:
        assert all(0 <= n <= MAX_TOKENS for n in usage)
        codec.encode(Continue(Phase.RESPONSE_BODY, dynamic_metadata=(("prompt_tokens", usage[0]),
                                                                       ("total_tokens", sum(usage)))))


@FAST
@given(ANSWER_OBJECT.map(_bytes) | ANY_JSON.map(_bytes) | st.binary(max_size=100))
def test_any_json_answer_is_stored_or_refused_and_metered_or_estimated(body):
    _check_answer(capture_json(body, 1.0, prompt_text="hi"))
    _check_usage(UsageMeter(stream=False, prompt_text="hi").feed(body, True))


@FAST
@given(st.lists(ANSWER_OBJECT.map(_bytes) | ANY_JSON.map(_bytes), max_size=4), st.booleans(),
       st.lists(st.integers(min_value=0, max_value=400), max_size=4))
def test_any_event_stream_is_stored_or_refused_and_metered_or_estimated(events, done, cuts):
    stream = b"".join(b"data: " + e + b"\n\n" for e in events) + (b"data: [DONE]\n\n" if done else b"")
    points = sorted(min(c, len(stream)) for c in cuts)
    pieces = [stream[a:b] for a, b in zip([0, *points], [*points, len(stream)])]
    capture, meter = SseCapture(), UsageMeter(stream=True, prompt_text="hi")
    usage = None
    for index, piece in enumerate(pieces):
        capture.feed(piece)
        usage = meter.feed(piece, index == len(pieces) - 1) or usage
    _check_answer(capture.finish(1.0, prompt_text="hi"))
    _check_usage(usage)


def test_nesting_and_numbers_past_every_bound_are_refused_without_raising():
    """The shapes that once escaped: nesting past the decoder's stack, 401-digit counts."""
    for depth in (1000, 3000, 100_000):
        deep = fuzzing.deep_text(depth)
        assert capture_json(deep, 1.0).reason == "invalid_json"
        assert UsageMeter(stream=False).feed(deep, True) is None
    huge = json.dumps({"choices": [{"index": 0, "message": {"content": "x"}, "finish_reason": "stop"}],
                       "usage": {"prompt_tokens": 10 ** 400, "completion_tokens": 1}}).encode()
    answer = capture_json(huge, 1.0)
    assert answer.usage_estimated and math.isfinite(float(answer.total_tokens))


def test_the_fuzz_driver_finds_a_bug_planted_in_the_request_path(monkeypatch):
    """The harness can fail: a stage that raises on some bodies is caught and reported."""
    from sidecar.pipeline import cache_stage as caching

    original = caching.CacheStage.look_now

    def planted(self, ctx):
        if b"tool_choice" in ctx.body:
            raise TypeError("planted")
        return original(self, ctx)

    monkeypatch.setattr(caching.CacheStage, "look_now", planted)
    tally = asyncio.run(_run_some(200))
    assert tally.unexpected_count > 0 and tally.unexpected[0].kind == "TypeError"


async def _run_some(count: int):
    driver = fuzzing.Driver()
    await driver.start()
    try:
        await fuzzing.run_client_inputs(driver, count, 5)
    finally:
        await driver.close()
    return driver.tally
