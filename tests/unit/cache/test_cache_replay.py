import json

import httpx
import openai
import pytest

from sidecar.cache.answer import CachedAnswer
from sidecar.cache.replay import (
    DONE,
    completion_id,
    content_pieces,
    hit_headers,
    json_body,
    sse_body,
)

ANSWER = CachedAnswer(
    content="Paris is the capital of France. It has been since the tenth century, "
            "give or take a few kings.\n\n```python\nprint('  spaced  ')\n```",
    finish_reason="stop", model="gpt-4o-2024-08-06", prompt_tokens=14, completion_tokens=31,
    created_at=1_700_000_000.5)
ID = "chatcmpl-abc123"
NOW = 1_700_000_100.9


def events(body: bytes) -> list:
    """The SSE body's data payloads, parsed (the last one is [DONE])."""
    assert body.endswith(b"\n\n")
    out = []
    for event in body.decode().split("\n\n")[:-1]:
        assert event.startswith("data: ") and "\n" not in event
        payload = event.removeprefix("data: ")
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


# ---------------------------------------------------------------- CachedAnswer

def test_answer_bytes_round_trip():
    assert ANSWER.to_bytes().startswith(b'{"v":1,"content":"Paris is')   # compact
    assert "日本語".encode() in CachedAnswer("日本語", "stop", "", 0, 0, 0.0).to_bytes()  # UTF-8
    for answer in (ANSWER, CachedAnswer("日本語 \ud800", "length", "", 0, 0, 0.0, usage_estimated=True)):
        assert CachedAnswer.from_bytes(answer.to_bytes()) == answer


@pytest.mark.parametrize("data", [
    b"", b"junk", b"\xff\xfe", b"[]", b"{}", b'{"v": 99}',
    b'{"v":1,"content":"x"}',
    (b'{"v":1,"content":"x","finish_reason":"tool_calls","model":"m","prompt_tokens":1,'
     b'"completion_tokens":1,"created_at":1}'),
    (b'{"v":1,"content":"x","finish_reason":"stop","model":"m","prompt_tokens":-1,'
     b'"completion_tokens":1,"created_at":1}'),
    (b'{"v":1,"content":5,"finish_reason":"stop","model":"m","prompt_tokens":1,'
     b'"completion_tokens":1,"created_at":1}'),
    (b'{"v":1,"content":"x","finish_reason":"stop","model":"m","prompt_tokens":1,'
     b'"completion_tokens":1,"created_at":1,"extra":true}'),
])
def test_answer_from_junk_is_value_error(data):
    with pytest.raises(ValueError):
        CachedAnswer.from_bytes(data)


@pytest.mark.parametrize("kwargs, field", [
    ({"finish_reason": "content_filter"}, "finish_reason"),
    ({"prompt_tokens": 1.5}, "prompt_tokens"),
    ({"completion_tokens": True}, "completion_tokens"),
    ({"created_at": float("nan")}, "created_at"),
    ({"role": "user"}, "role"),
])
def test_answer_validation_names_the_field(kwargs, field):
    fields = {"content": "x", "finish_reason": "stop", "model": "m", "prompt_tokens": 1,
              "completion_tokens": 1, "created_at": 1.0} | kwargs
    with pytest.raises(ValueError, match=f"^{field}:"):
        CachedAnswer(**fields)


# ---------------------------------------------------------------- bodies

def test_json_body_shape():
    body = json.loads(json_body(ANSWER, "gpt-4o", NOW, ID))
    assert body == {
        "id": ID, "object": "chat.completion", "created": 1_700_000_100, "model": ANSWER.model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": ANSWER.content},
                     "finish_reason": "stop", "logprobs": None}],
        "usage": {"prompt_tokens": 14, "completion_tokens": 31, "total_tokens": 45},
    }


def test_request_model_when_upstream_reported_none():
    answer = CachedAnswer("x", "stop", "", 1, 1, 0.0)
    assert json.loads(json_body(answer, "asked", NOW, ID))["model"] == "asked"
    assert events(sse_body(answer, "asked", NOW, ID, False))[0]["model"] == "asked"


@pytest.mark.parametrize("include_usage", [False, True])
def test_sse_body_shape(include_usage):
    parsed = events(sse_body(ANSWER, "gpt-4o", NOW, ID, include_usage))
    assert parsed[-1] == "[DONE]"
    chunks = parsed[:-1]
    for chunk in chunks:
        assert (chunk["id"], chunk["object"], chunk["created"], chunk["model"]) == \
            (ID, "chat.completion.chunk", 1_700_000_100, ANSWER.model)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    if include_usage:
        *chunks, usage = chunks
        assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 45
        assert all(chunk["usage"] is None for chunk in chunks)
    else:
        assert all("usage" not in chunk for chunk in chunks)
    *content, finish = chunks[1:]
    assert finish["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    assert all(c["choices"][0]["finish_reason"] is None for c in content)
    assert "".join(c["choices"][0]["delta"]["content"] for c in content) == ANSWER.content
    assert 3 <= len(content) <= len(ANSWER.content) // 10


@pytest.mark.parametrize("content", [
    "", "word", "a b c", "  leading and trailing  ", "x" * 500, "北京" * 100,
    "many     spaces\n\n\tand tabs", "one two three four five six seven eight nine ten eleven",
])
def test_content_pieces_join_back_and_stay_small(content):
    pieces = content_pieces(content, 20)
    assert "".join(pieces) == content
    assert all(piece and len(piece) <= 60 for piece in pieces)


def test_sse_body_of_empty_content_still_has_role_and_finish():
    answer = CachedAnswer("", "length", "m", 1, 0, 0.0)
    parsed = events(sse_body(answer, "m", NOW, ID, False))
    assert len(parsed) == 3 and parsed[1]["choices"][0]["finish_reason"] == "length"
    assert sse_body(answer, "m", NOW, ID, False).endswith(DONE)


def test_completion_id():
    assert completion_id(bytes(range(4))) == "chatcmpl-00010203"


# ---------------------------------------------------------------- headers

@pytest.mark.parametrize("args, stream, expected", [
    (("exact", None, 12.9), False, (("content-type", "application/json"),
                                    ("x-sluice-cache", "exact"), ("age", "12"))),
    (("semantic", 0.934567, 0.2), False, (("content-type", "application/json"),
                                          ("x-sluice-cache", "semantic"),
                                          ("x-sluice-similarity", "0.9346"), ("age", "0"))),
    (("coalesced", None, -1.0), True, (("content-type", "text/event-stream"),
                                       ("x-sluice-cache", "coalesced"),
                                       ("cache-control", "no-cache"), ("age", "0"))),
    (("exact", 0.99, 3600.0), True, (("content-type", "text/event-stream"),
                                     ("x-sluice-cache", "exact"),
                                     ("cache-control", "no-cache"), ("age", "3600"))),
])
def test_hit_headers(args, stream, expected):
    assert hit_headers(*args, stream=stream) == expected


@pytest.mark.parametrize("args", [("miss", None, 0.0), ("semantic", None, 0.0),
                                  ("semantic", float("nan"), 0.0)])
def test_hit_headers_rejects(args):
    with pytest.raises(ValueError):
        hit_headers(*args, stream=False)


# ---------------------------------------------------------------- the real openai SDK

def client_serving(body: bytes, stream: bool) -> openai.OpenAI:
    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/chat/completions"
        headers = dict(hit_headers("exact", None, 5.0, stream=stream))
        return httpx.Response(200, headers=headers, content=body)
    return openai.OpenAI(base_url="http://sluice.test/v1", api_key="sk-test", max_retries=0,
                         http_client=httpx.Client(transport=httpx.MockTransport(handler)))


MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def test_openai_sdk_parses_json_hit():
    client = client_serving(json_body(ANSWER, "gpt-4o", NOW, ID), stream=False)
    completion = client.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert completion.id == ID and completion.model == ANSWER.model
    assert completion.choices[0].message.content == ANSWER.content
    assert completion.choices[0].message.role == "assistant"
    assert completion.choices[0].finish_reason == "stop"
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens,
            completion.usage.total_tokens) == (14, 31, 45)


@pytest.mark.parametrize("include_usage", [False, True])
def test_openai_sdk_parses_streamed_hit(include_usage):
    client = client_serving(sse_body(ANSWER, "gpt-4o", NOW, ID, include_usage), stream=True)
    stream = client.chat.completions.create(
        model="gpt-4o", messages=MESSAGES, stream=True,
        stream_options={"include_usage": True} if include_usage else None)
    chunks = list(stream)
    assert all(chunk.id == ID and chunk.object == "chat.completion.chunk" for chunk in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ANSWER.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    usages = [c.usage for c in chunks if c.usage is not None]
    if include_usage:
        assert not chunks[-1].choices
        assert [(u.prompt_tokens, u.completion_tokens, u.total_tokens) for u in usages] == [(14, 31, 45)]
    else:
        assert usages == []
