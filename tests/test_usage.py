import json

from sidecar.usage import UsageMeter


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
