import json

from sidecar.pipeline.usage import UsageMeter
from tests.unit.cache.test_cache_capture import chunk, sse


def test_json_answer_usage_is_read():
    body = json.dumps({"id": "x", "object": "chat.completion", "model": "m", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "hi there"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 11, "completion_tokens": 3, "total_tokens": 14}}).encode()
    meter = UsageMeter(stream=False)
    assert meter.feed(body[:10], False) is None
    assert meter.feed(body[10:], True) == (11, 3)
    assert meter.feed(b"", True) is None            # once


def test_stream_without_usage_is_estimated_from_the_text():
    chunk = {"id": "x", "object": "chat.completion.chunk", "model": "m",
             "choices": [{"index": 0, "delta": {"content": "twelve chars"}, "finish_reason": None}]}
    done = {**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
    stream = f"data: {json.dumps(chunk)}\n\ndata: {json.dumps(done)}\n\ndata: [DONE]\n\n".encode()
    prompt_tokens, completion_tokens = UsageMeter(stream=True, prompt_text="x" * 40).feed(stream, False)
    assert prompt_tokens == 10 and completion_tokens >= 3


def test_an_error_body_gives_no_usage():
    assert UsageMeter(stream=False).feed(b'{"error": {"message": "boom"}}', True) is None


USAGE_CHUNK = {"object": "chat.completion.chunk", "choices": [],
               "usage": {"prompt_tokens": 11, "completion_tokens": 500, "total_tokens": 511}}


def test_answers_the_cache_refuses_still_have_their_usage_read():
    """Tool calls, n > 1, a content filter's stop: not stored, but the tokens were spent."""
    tool_call = {"tool_calls": [{"index": 0, "id": "c", "type": "function",
                                 "function": {"name": "f", "arguments": "{}"}}]}
    for chunks in ([chunk(**tool_call), chunk(finish_reason="tool_calls"), USAGE_CHUNK],
                   [chunk("a"), chunk("b", index=1), USAGE_CHUNK],
                   [chunk("a", "content_filter"), USAGE_CHUNK]):
        assert UsageMeter(stream=True).feed(sse(*chunks), True) == (11, 500)
    body = json.dumps({"choices": [
        {"index": i, "message": {"role": "assistant", "content": "x"}, "finish_reason": "stop"} for i in range(2)],
        "usage": {"prompt_tokens": 11, "completion_tokens": 500}}).encode()
    assert UsageMeter(stream=False).feed(body, True) == (11, 500)


def test_a_stream_longer_than_any_buffer_keeps_only_counters():
    piece = sse(chunk("x" * 1000), done=False)
    meter = UsageMeter(stream=True, max_bytes=4096)
    for _ in range(3000):                                    # ~3 MB, past the old 1 MiB cut-off
        assert meter.feed(piece, False) is None
    assert meter.feed(sse(USAGE_CHUNK), True) == (11, 500)
    estimated = UsageMeter(stream=True, max_bytes=4096)
    for _ in range(3000):
        estimated.feed(piece, False)
    assert estimated.feed(b"", True) == (0, 750_000)         # 3,000,000 characters at 4 a token


def test_without_usage_tool_arguments_and_every_choice_count():
    call = {"tool_calls": [{"index": 0, "function": {"name": "lookup", "arguments": '{"q": "weather"}'}}]}
    chunks = [chunk(**call), chunk("abcd" * 5, index=1), chunk(finish_reason="stop")]
    prompt, completion = UsageMeter(stream=True, prompt_text="y" * 8).feed(sse(*chunks), True)
    assert (prompt, completion) == (2, 11)                   # 6 + 16 + 20 characters, 4 a token


def test_an_error_event_or_a_body_without_choices_gives_no_usage():
    assert UsageMeter(stream=True).feed(b"event: error\ndata: {}\n\n", True) is None
    assert UsageMeter(stream=True).feed(b"data: {\"object\": \"x\"}\n\n", True) is None
    assert UsageMeter(stream=False).feed(b"not json", True) is None


def test_an_answer_cut_short_is_charged_what_it_carried():
    """A client gone mid-stream, or a JSON body past Envoy's buffer (its first part only):
    the tokens were generated, so the budget is charged for them, not the prompt alone."""
    stream = UsageMeter(stream=True, prompt_text="x" * 40)
    assert stream.feed(sse(chunk("y" * 400), done=False), False) is None
    assert stream.cut_short() == (10, 100)
    big_json = UsageMeter(stream=False)
    assert big_json.feed(b'{"choices": [{"message": {"content": "' + b"z" * 4000, False) is None
    prompt, completion = big_json.cut_short()
    assert completion >= 1000
    assert big_json.cut_short() is None                                 # once
    assert UsageMeter(stream=True).cut_short() is None                   # nothing came: the estimate stands


def test_counts_past_any_model_and_undecodable_answers_are_estimated_never_raised():
    from tests.unit.cache.test_cache_capture import DEEP, HUGE
    body = json.dumps({"choices": [{"index": 0, "message": {"content": "a" * 40}, "finish_reason": "stop"}],
                       "usage": {"prompt_tokens": HUGE, "completion_tokens": 1}}).encode()
    assert UsageMeter(stream=False, prompt_text="x" * 8).feed(body, True) == (2, 10)
    assert UsageMeter(stream=False).feed(DEEP, True) is None              # nothing read: admission's estimate
    stream = UsageMeter(stream=True, prompt_text="x" * 8)
    assert stream.feed(b"data: " + DEEP + b"\n\n" + sse(chunk("a" * 40, finish_reason="stop",
                                                                usage={"prompt_tokens": HUGE, "completion_tokens": 1})),
                       True) == (2, 10)
