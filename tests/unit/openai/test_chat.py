import json

import pytest

from sidecar.openai.chat import MAX_NESTING, BadRequest, message_text, parse_chat_request


def body(**fields) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}).encode()


def test_parses_settings_that_change_the_answer():
    chat = parse_chat_request(body(stream=True, stream_options={"include_usage": True}, user="u1",
                                   temperature=0.2, max_tokens=64, seed=7, stop=["\n"], n=1,
                                   tools=[{"type": "function", "function": {"name": "f"}}]))
    assert chat.model == "m" and chat.stream and chat.include_usage and chat.user == "u1"
    assert chat.sampling == {"temperature": 0.2, "max_tokens": 64, "seed": 7, "stop": ["\n"], "n": 1}
    assert chat.max_tokens == 64 and len(chat.tools) == 1


def test_max_completion_tokens_wins_over_max_tokens():
    assert parse_chat_request(body(max_tokens=10, max_completion_tokens=20)).max_tokens == 20


def test_multipart_content_text():
    chat = parse_chat_request(json.dumps({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}},
        {"type": "text", "text": "b"}]}]}).encode())
    assert message_text(chat.messages[0]) == "a\nb"


@pytest.mark.parametrize("raw, param", [
    (b"", None),
    (b"not json", None),
    (b"\xff\xfe{}", None),
    (b"[1, 2]", None),
    (b'{"messages": [{"role": "user", "content": "x"}]}', "model"),
    (b'{"model": 5, "messages": [{"role": "user", "content": "x"}]}', "model"),
    (b'{"model": "m"}', "messages"),
    (b'{"model": "m", "messages": []}', "messages"),
    (b'{"model": "m", "messages": "hi"}', "messages"),
    (b'{"model": "m", "messages": [1]}', "messages[0]"),
    (b'{"model": "m", "messages": [{"role": "wizard", "content": "x"}]}', "messages[0].role"),
    (b'{"model": "m", "messages": [{"role": "user", "content": 3}]}', "messages[0].content"),
    # Of any JSON type where a string is expected: a list or object once escaped as a TypeError.
    (b'{"model": "m", "messages": [{"role": ["user"], "content": "hi"}]}', "messages[0].role"),
    (b'{"model": "m", "messages": [{"role": {"user": 1}, "content": "hi"}]}', "messages[0].role"),
    (b'{"model": "m", "messages": [{"role": null, "content": "hi"}]}', "messages[0].role"),
    (b'{"model": "m", "messages": [{"role": 1, "content": "hi"}]}', "messages[0].role"),
    (b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]}',
     "messages[0].content[0].text"),
    (body(stream="yes"), "stream"),
    (body(temperature="hot"), "temperature"),
    (body(temperature=True), "temperature"),
    (body(max_tokens=1.5), "max_tokens"),
    (body(max_tokens=10 ** 400), "max_tokens"),              # no float holds it: the timeout maths broke
    (body(max_completion_tokens=2 ** 63), "max_completion_tokens"),
    (body(max_tokens=-5), "max_tokens"),                     # OpenAI's minimum is 1
    (body(max_completion_tokens=0), "max_completion_tokens"),
    (body(n=0), "n"),
    (body(seed=-2 ** 64), "seed"),
    (body(stop=[1]), "stop"),
    (body(tools="all"), "tools"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}', None),
    (body(temperature=10 ** 400), "temperature"),                       # no float holds it
    (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "top_k": 1e999}', None),  # inf
    (body(top_p=-10 ** 400), "top_p"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": ' + b"9" * 5000 + b"}", None),
    (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "metadata": '
     + b"[" * 100_000 + b"]" * 100_000 + b"}", None),                  # past the decoder's recursion
    (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "response_format": '
     + b'{"a":' * MAX_NESTING + b"1" + b"}" * MAX_NESTING + b"}", None),   # parses, one level past MAX_NESTING
])
def test_rejects_bad_bodies_naming_the_field(raw, param):
    with pytest.raises(BadRequest) as err:
        parse_chat_request(raw)
    assert err.value.param == param
    assert str(err.value)


@pytest.mark.parametrize("raw, key", [
    (b'{"model": "a", "messages": [{"role": "user", "content": "x"}], "model": "b"}', '"model"'),
    (b'{"model": "m", "messages": [{"role": "user", "content": "x", "content": "y"}]}', '"content"'),
    (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "metadata": {"k": 1, "k": 2}}', '"k"'),
])
def test_a_key_repeated_in_one_object_is_refused_by_name(raw, key):
    """Parsers differ on which value a repeated key has (Python's the last, others the first),
    so the sidecar could key an answer by one question while the upstream answers another."""
    with pytest.raises(BadRequest, match=f"repeats the key {key}"):
        parse_chat_request(raw)


def test_64_bit_integers_are_accepted():
    assert parse_chat_request(body(seed=2 ** 63 - 1, max_tokens=2 ** 63 - 1)).sampling["seed"] == 2 ** 63 - 1


def test_nesting_up_to_the_limit_is_accepted():
    schema = b'{"a":' * (MAX_NESTING - 1) + b"1" + b"}" * (MAX_NESTING - 1)   # inside the body's object
    raw = b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "response_format": ' + schema + b"}"
    assert parse_chat_request(raw).sampling["response_format"]
