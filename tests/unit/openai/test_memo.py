"""Bounded memos: the generic one, and its uses on the request path (parsing, stored answers)."""
import json

import pytest

from sidecar.cache.answer import DECODED_MAX_BYTES, CachedAnswer, decode_answer
from sidecar.openai.chat import PARSE_MEMO_MAX_BODY, PARSE_MEMO_MAX_CONTAINERS, BadRequest, parse_chat_request
from sidecar.memo import BoundedMemo
from tests.support.ext_proc_stream import chat_body


def test_a_key_is_worked_out_once_and_the_oldest_goes_when_full():
    memo, calls = BoundedMemo(2), []

    def get(key):
        return memo.get(key, lambda: calls.append(key) or f"result {key}")

    assert [get("a"), get("a"), get("b")] == ["result a", "result a", "result b"]
    get("c")                                   # full: "a" goes
    assert list(memo) == ["b", "c"] and len(memo) == 2
    get("a")
    assert calls == ["a", "b", "c", "a"]


def test_a_result_of_none_is_remembered_too():
    memo, calls = BoundedMemo(2), []
    for _ in range(2):
        assert memo.get("k", lambda: calls.append(1)) is None
    assert calls == [1]


def test_a_failure_is_raised_every_time_and_not_remembered():
    memo = BoundedMemo(4)

    def fail():
        raise ValueError("bad")

    for _ in range(2):
        with pytest.raises(ValueError):
            memo.get("k", fail)
    assert len(memo) == 0


def test_a_memo_needs_room():
    with pytest.raises(ValueError):
        BoundedMemo(0)


def test_identical_small_bodies_share_one_parse():
    body = chat_body("How do I reset my password?")
    assert parse_chat_request(body) is parse_chat_request(bytes(bytearray(body)))
    assert parse_chat_request(body) is not parse_chat_request(chat_body("How do I reset my PIN?"))


@pytest.mark.parametrize("body", [
    chat_body("x" * PARSE_MEMO_MAX_BODY),                                       # large
    json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                "tools": [{}] * (PARSE_MEMO_MAX_CONTAINERS + 1)}).encode(),  # small but heavy once parsed
])
def test_large_or_heavy_bodies_are_parsed_each_time(body):
    first, again = parse_chat_request(body), parse_chat_request(bytes(bytearray(body)))
    assert first == again and first is not again


def test_a_body_the_client_said_no_store_for_is_not_kept():
    body = chat_body("A private question")
    first = parse_chat_request(body, remember=False)
    assert parse_chat_request(body) is not first        # nothing was remembered


def test_a_shared_parse_cannot_have_its_settings_changed():
    request = parse_chat_request(json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                             "temperature": 0.5}).encode())
    with pytest.raises(TypeError):
        request.sampling["temperature"] = 2.0


@pytest.mark.parametrize("body", [b"{not json", b'{"model": "m", "messages": []}', b""])
def test_a_bad_body_is_refused_every_time(body):
    for _ in range(2):
        with pytest.raises(BadRequest):
            parse_chat_request(body)


def test_a_stored_answer_is_decoded_once_and_a_corrupt_one_refused_every_time():
    data = CachedAnswer("Use the link.", "stop", "m", 5, 3, 1.0).to_bytes()
    assert decode_answer(data) is decode_answer(bytes(bytearray(data)))
    assert decode_answer(data).content == "Use the link."
    big = CachedAnswer("x" * DECODED_MAX_BYTES, "stop", "m", 5, 3, 1.0).to_bytes()
    assert decode_answer(big) == decode_answer(big) and decode_answer(big) is not decode_answer(big)
    for _ in range(2):
        with pytest.raises(ValueError):
            decode_answer(b'{"v": 1, "content": 3}')
