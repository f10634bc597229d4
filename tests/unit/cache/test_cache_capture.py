import json

import pytest

from sidecar.cache.answer import CachedAnswer
from sidecar.cache.capture import (
    NotCaptured,
    SseCapture,
    capture_json,
    response_refusal,
)
from sidecar.cache.replay import json_body, sse_body
from sidecar.token_estimate import estimate_tokens

NOW = 1_700_000_000.0
ANSWER = CachedAnswer("Paris is the capital of France, and has been for a long while.",
                      "stop", "gpt-4o-2024-08-06", 14, 12, NOW)
USAGE = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}


def completion(*choices, **extra) -> bytes:
    return json.dumps({"id": "chatcmpl-1", "object": "chat.completion", "model": "up",
                       "choices": list(choices), "usage": USAGE, **extra}).encode()


def choice(content="Hello", finish_reason="stop", index=0, **message) -> dict:
    return {"index": index, "finish_reason": finish_reason,
            "message": {"role": "assistant", "content": content, **message}}


def sse(*payloads, done=True) -> bytes:
    body = b"".join(b"data: " + (p if isinstance(p, bytes) else json.dumps(p).encode()) + b"\n\n"
                    for p in payloads)
    return body + (b"data: [DONE]\n\n" if done else b"")


def chunk(content=None, finish_reason=None, index=0, usage=None, **delta) -> dict:
    if content is not None:
        delta["content"] = content
    return {"id": "c", "object": "chat.completion.chunk", "model": "up", "usage": usage,
            "choices": [{"index": index, "delta": delta, "finish_reason": finish_reason}]}


def capture_sse(body: bytes, **kwargs):
    capture = SseCapture(**kwargs)
    capture.feed(body)
    return capture.finish(NOW)


# ---------------------------------------------------------------- round trips

def test_json_round_trip():
    assert capture_json(json_body(ANSWER, "gpt-4o", NOW + 50, "chatcmpl-x"), NOW) == ANSWER


@pytest.mark.parametrize("include_usage", [False, True])
def test_sse_round_trip_split_at_every_byte(include_usage):
    body = sse_body(ANSWER, "gpt-4o", NOW + 50, "chatcmpl-x", include_usage)
    expected = ANSWER if include_usage else CachedAnswer(
        ANSWER.content, "stop", ANSWER.model, 0, estimate_tokens(ANSWER.content), NOW,
        usage_estimated=True)
    for cut in range(len(body) + 1):
        capture = SseCapture()
        capture.feed(body[:cut])
        capture.feed(body[cut:])
        assert capture.finish(NOW) == expected, cut


def test_sse_byte_by_byte_with_crlf_and_comments():
    body = (b": keep-alive\r\n\r\n" + sse(chunk(role="assistant", content=""), chunk("Hel"),
                                           chunk("lo", "stop"), chunk(usage=USAGE) | {"choices": []})
            .replace(b"\n", b"\r\n"))
    capture = SseCapture()
    for i in range(len(body)):
        capture.feed(body[i:i + 1])
    assert capture.finish(NOW) == CachedAnswer("Hello", "stop", "up", 3, 2, NOW)


@pytest.mark.parametrize("framing", ["bom", "cr", "bom+crlf"])
def test_sse_bom_and_lone_cr_line_ends_whole_or_byte_by_byte(framing):
    """EventSource drops one leading BOM (read as part of the first field name, it lost the
    first event's text) and ends lines at a lone CR too."""
    body = sse(chunk("The answer is"), chunk(" 42.", "stop"))
    if "cr" in framing:
        body = body.replace(b"\n", b"\r\n" if "crlf" in framing else b"\r")
    if "bom" in framing:
        body = b"\xef\xbb\xbf" + body
    for pieces in ([body], [body[i:i + 1] for i in range(len(body))]):
        capture = SseCapture()
        for piece in pieces:
            capture.feed(piece)
        assert capture.finish(NOW).content == "The answer is 42.", framing


# ---------------------------------------------------------------- JSON rules

def test_json_captures_length_and_usage():
    answer = capture_json(completion(choice("Hi", "length")), NOW)
    assert answer == CachedAnswer("Hi", "length", "up", 3, 2, NOW)


def test_json_without_usage_is_estimated():
    body = json.dumps({"model": "up", "choices": [choice("x" * 9)]}).encode()
    answer = capture_json(body, NOW, prompt_text="y" * 8)
    assert (answer.prompt_tokens, answer.completion_tokens, answer.usage_estimated) == (2, 3, True)


@pytest.mark.parametrize("body, reason", [
    (b"", "invalid_json"),
    (b"{not json", "invalid_json"),
    (b"\xff\xfe", "invalid_json"),
    (b"[1]", "invalid_json"),
    (json.dumps({"choices": None}).encode(), "invalid_json"),
    (json.dumps({"error": {"message": "overloaded"}}).encode(), "error"),
    (completion(error={"message": "x"}), "error"),
    (completion(), "no_choice"),
    (completion(choice("a"), choice("b", index=1)), "n_gt_1"),
    (completion(choice(None, "tool_calls", tool_calls=[{"id": "t"}])), "tool_calls"),
    (completion(choice("x", "stop", tool_calls=[{"id": "t"}])), "tool_calls"),
    (completion(choice("x", "stop", function_call={"name": "f"})), "tool_calls"),
    (completion(choice("x", "stop", audio={"id": "a"})), "not_text"),
    (completion(choice("x", "stop", reasoning_content="First, ...")), "not_text"),    # a hit would drop them
    (completion(choice("x", "stop", annotations=[{"type": "url_citation"}])), "not_text"),
    (completion(choice("x", "stop", refusal="I can't")), "not_text"),
    (completion(choice("x", "content_filter")), "finish_reason"),
    (completion(choice("x", None)), "finish_reason"),
    (completion(choice(None)), "no_content"),
    (completion(choice("")), "no_content"),
    (completion(choice(5)), "no_content"),
    (completion({"index": 0, "finish_reason": "stop"}), "invalid_json"),
    (completion("not a choice"), "invalid_json"),
    (completion(choice("x", role="user")), "invalid_json"),
])
def test_json_refusals(body, reason):
    assert capture_json(body, NOW) == NotCaptured(reason)


def test_empty_extra_fields_are_plain_text():
    body = completion(choice("x", "stop", refusal=None, annotations=[], reasoning_content=None, tool_calls=[]))
    assert capture_json(body, NOW).content == "x"
    assert capture_sse(sse(chunk("x", reasoning_content=None), chunk(finish_reason="stop"))).content == "x"


def test_json_too_large():
    body = completion(choice("x" * 100))
    assert capture_json(body, NOW, max_bytes=len(body) - 1) == NotCaptured("too_large")
    assert isinstance(capture_json(body, NOW, max_bytes=len(body)), CachedAnswer)


# ---------------------------------------------------------------- SSE rules

@pytest.mark.parametrize("body, reason", [
    (sse(chunk("Hel"), chunk("lo", "stop"), done=False), "partial"),
    (sse(chunk("Hello")), "partial"),                             # no finish_reason
    (b"", "partial"),
    (sse(), "no_choice"),
    (sse(chunk("x", "content_filter")), "finish_reason"),
    (sse(chunk("x"), chunk(finish_reason="tool_calls")), "finish_reason"),
    (sse(chunk(tool_calls=[{"index": 0, "id": "t"}]), chunk(finish_reason="stop")), "tool_calls"),
    (sse(chunk(function_call={"name": "f"}), chunk(finish_reason="stop")), "tool_calls"),
    (sse(chunk(audio={"id": "a"}), chunk(finish_reason="stop")), "not_text"),
    (sse(chunk(reasoning="Hmm"), chunk("x", "stop")), "not_text"),
    (sse(chunk("a"), chunk("b", index=1), chunk(finish_reason="stop")), "n_gt_1"),
    (sse(chunk("a"), {"error": {"message": "upstream died"}}), "error"),
    (sse(chunk("a")).replace(b"data: [DONE]", b"event: error\ndata: {}"), "error"),
    (sse(chunk("a"), b"{truncated", chunk(finish_reason="stop")), "invalid_json"),
    (sse(chunk("a"), b"[1, 2]"), "invalid_json"),
    (sse(chunk(role="assistant", content=""), chunk(finish_reason="stop")), "no_content"),
])
def test_sse_refusals(body, reason):
    assert capture_sse(body) == NotCaptured(reason)


def test_sse_refusal_is_known_early_and_sticks():
    capture = SseCapture()
    capture.feed(sse(chunk("a", "content_filter"), done=False))
    assert capture.refused == NotCaptured("finish_reason")
    capture.feed(sse(chunk("b", "stop")))
    assert capture.finish(NOW) == NotCaptured("finish_reason")


def test_sse_too_large_across_feeds():
    body = sse(chunk("x" * 50), chunk("y", "stop"))
    capture = SseCapture(max_bytes=len(body) - 1)
    capture.feed(body[:40])
    assert capture.refused is None
    capture.feed(body[40:])
    assert capture.finish(NOW) == NotCaptured("too_large")
    assert isinstance(capture_sse(body, max_bytes=len(body)), CachedAnswer)


def test_sse_last_usage_wins_and_multiline_data_joins():
    running = dict(USAGE, completion_tokens=1)
    body = (sse(chunk("a", usage=running), chunk("b", "stop", usage=USAGE), done=False)
            + b'data: {"choices": [],\ndata:  "model": "other"}\n\n' + b"data: [DONE]\n\n")
    assert capture_sse(body) == CachedAnswer("ab", "stop", "up", 3, 2, NOW)


def test_sse_done_without_final_blank_line():
    expected = CachedAnswer("a", "stop", "up", 0, 1, NOW, usage_estimated=True)
    for tail in (b"data: [DONE]\n", b"data: [DONE]", b"data:[DONE]\r\n"):
        assert capture_sse(sse(chunk("a", "stop"), done=False) + tail) == expected


def test_sse_ignores_anything_after_done():
    assert capture_sse(sse(chunk("a", "stop")) + b"data: junk\n\n") == \
        capture_sse(sse(chunk("a", "stop")))


# ---------------------------------------------------------------- response headers

@pytest.mark.parametrize("headers, stream, expected", [
    ({":status": "200", "content-type": "application/json"}, False, None),
    ({":status": "200", "content-type": "application/json; charset=utf-8"}, False, None),
    ({":status": "200", "content-type": "text/event-stream; charset=utf-8"}, True, None),
    ({":status": "200", "content-type": "application/json",
      "content-encoding": "identity"}, False, None),
    ({":status": "500", "content-type": "application/json"}, False, "status"),
    ({":status": "429", "content-type": "application/json"}, False, "status"),
    ({"content-type": "application/json"}, False, "status"),
    ({":status": "200", "content-type": "application/json", "content-encoding": "gzip"},
     False, "encoded"),
    ({":status": "200", "content-type": "application/json"}, True, "content_type"),
    ({":status": "200", "content-type": "text/event-stream"}, False, "content_type"),
    ({":status": "200"}, False, "content_type"),
])
def test_response_refusal(headers, stream, expected):
    assert response_refusal(headers, stream) == (NotCaptured(expected) if expected else None)


JSON_200 = {":status": "200", "content-type": "application/json"}


@pytest.mark.parametrize("cache_control, expected", [
    ("max-age=60", None),
    ("public, max-age=60", None),
    ("no-store", "no_store"),
    ("No-Store, private", "no_store"),
    ("no-cache", None),                                  # what SSE servers send to every client
    ("no-cache, must-revalidate", None),
    ("private", "private"),            # one user's: a scope may hold many (an organisation's key)
    ("private, max-age=60", "private"),
])
def test_the_upstreams_cache_control_is_obeyed(cache_control, expected):
    headers = {**JSON_200, "cache-control": cache_control}
    assert response_refusal(headers, False) == (NotCaptured(expected) if expected else None)


# --- upstream answers are untrusted input ----------------------------------------------------

HUGE = 10 ** 400           # 401 digits: no float holds it (Envoy metadata, Prometheus, budgets)
DEEP = b"[" * 3000 + b"]" * 3000      # past the JSON decoder's recursion limit


@pytest.mark.parametrize("usage", [
    {"prompt_tokens": HUGE, "completion_tokens": 2},
    {"prompt_tokens": 3, "completion_tokens": HUGE},
    {"prompt_tokens": 10 ** 9 + 1, "completion_tokens": 0},
])
def test_token_counts_past_any_model_are_no_usage_and_the_estimate_stands(usage):
    answer = capture_json(completion(choice("Hello"), usage=usage), NOW, prompt_text="x" * 8)
    assert isinstance(answer, CachedAnswer) and answer.usage_estimated
    assert (answer.prompt_tokens, answer.completion_tokens) == (2, estimate_tokens("Hello"))
    stream = SseCapture()
    stream.feed(sse(chunk("Hello"), chunk(finish_reason="stop"), chunk(usage=usage)))
    assert stream.finish(NOW).usage_estimated


@pytest.mark.parametrize("body", [
    DEEP,
    b'{"choices": [], "x": ' + DEEP + b"}",
    b'{"usage": {"prompt_tokens": ' + b"9" * 5000 + b"}}",      # past int()'s digit limit
])
def test_an_answer_that_cannot_be_decoded_is_refused_not_raised(body):
    assert capture_json(body, NOW) == NotCaptured("invalid_json")
    stream = SseCapture()
    stream.feed(b"data: " + body + b"\n\n")
    assert stream.refused == NotCaptured("invalid_json")


def test_a_stored_answer_with_counts_past_the_bound_is_unreadable():
    stored = json.loads(ANSWER.to_bytes())
    stored["prompt_tokens"] = HUGE
    with pytest.raises(ValueError, match="prompt_tokens"):
        CachedAnswer.from_bytes(json.dumps(stored).encode())
    with pytest.raises(ValueError, match="not JSON"):
        CachedAnswer.from_bytes(DEEP)
