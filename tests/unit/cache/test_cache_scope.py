import json
import re

import pytest

from sidecar.cache.policy import CachePolicy
from sidecar.cache.scope import (
    CacheScope,
    context_key,
    exact_key,
    exact_text,
    params_key,
    prompt_text,
    scope_for,
    temperature_bucket,
)
from sidecar.openai.chat import ChatRequest, parse_chat_request
from sidecar.tenancy import credential, tenant_of

SECRET = b"s" * 32
AUTH_A = {"authorization": "Bearer sk-aaa"}
AUTH_B = {"authorization": "Bearer sk-bbb"}


def chat(text="What is the capital of France?", *, system="You are terse.", model="m",
         tools=(), tool_choice=None, other=None, **sampling) -> ChatRequest:
    messages = ({"role": "system", "content": system},) if system is not None else ()
    return ChatRequest(model=model, messages=messages + ({"role": "user", "content": text},),
                       sampling=sampling, tools=tuple(tools), tool_choice=tool_choice, other=other or {})


DEFAULT_POLICY = CachePolicy()


def scope(request=None, headers=AUTH_A, policy=DEFAULT_POLICY, route="") -> CacheScope:
    return scope_for(request or chat(), headers, policy, SECRET, route=route)


# ---------------------------------------------------------------- tenant

def test_same_prompt_two_credentials_differ_same_credential_agrees():
    assert scope(headers=AUTH_A).key != scope(headers=AUTH_B).key
    assert scope(headers=AUTH_A).key == scope(headers=dict(AUTH_A)).key
    assert exact_key(scope(headers=AUTH_A), "hi") != exact_key(scope(headers=AUTH_B), "hi")


def test_tenant_is_a_keyed_hash_never_the_credential():
    tenant = tenant_of(AUTH_A, SECRET)
    assert re.fullmatch(r"[0-9a-f]{64}", tenant)
    assert "sk-aaa" not in tenant
    assert tenant_of(AUTH_A, b"t" * 32) != tenant  # depends on the secret


@pytest.mark.parametrize("headers, kwargs, expected", [
    ({}, {}, None),                                                    # anonymous
    ({"authorization": "   "}, {}, None),                              # blank is absent
    ({}, {"shared": True}, "shared"),
    (AUTH_A, {"shared": True}, "shared"),                              # shared wins
    ({"x-sluice-tenant": "acme"}, {"tenant_header": "x-sluice-tenant", "shared": True}, "shared"),
    (AUTH_A, {"tenant_header": "x-sluice-tenant"}, None),              # no fall-back to auth
])
def test_tenant_table(headers, kwargs, expected):
    assert tenant_of(headers, SECRET, **kwargs) == expected


def test_tenant_header_used_when_route_names_it():
    by_header = {"tenant_header": "x-sluice-tenant"}
    acme = tenant_of({"x-sluice-tenant": "acme", **AUTH_A}, SECRET, **by_header)
    assert acme == tenant_of({"x-sluice-tenant": "acme", **AUTH_B}, SECRET, **by_header)
    assert acme != tenant_of({"x-sluice-tenant": "globex", **AUTH_A}, SECRET, **by_header)
    # the same string as a header value and as a credential are different tenants
    assert tenant_of({"x-sluice-tenant": "k"}, SECRET, **by_header) != \
        tenant_of({"authorization": "k"}, SECRET)


def test_credential_sources():
    assert credential(AUTH_A) == ("authorization", "bearer sk-aaa")
    assert credential({"x-t": " acme "}, "x-t") == ("header:x-t", "acme")
    assert credential({}, "x-t") is None


def test_authorization_scheme_spellings_are_one_tenant():
    """The scheme is case-insensitive and any run of blanks may follow it (RFC 9110 11.1): the
    upstream sees one key, so re-spelling it must not buy a new tenant (a new rate limit)."""
    tenants = {tenant_of({"authorization": v}, SECRET)
               for v in ("Bearer sk-aaa", "bearer sk-aaa", "BEARER sk-aaa", "Bearer  sk-aaa", "Bearer\tsk-aaa")}
    assert tenants == {tenant_of(AUTH_A, SECRET)}
    assert tenant_of({"authorization": "Bearer SK-AAA"}, SECRET) not in tenants   # the key is not
    assert tenant_of({"authorization": "sk-aaa"}, SECRET) not in tenants
    # a route's own tenant header is taken as sent: Envoy sets it, no scheme to fold
    assert tenant_of({"x-t": "Acme"}, SECRET, tenant_header="x-t") != tenant_of({"x-t": "acme"}, SECRET, tenant_header="x-t")


@pytest.mark.parametrize("secret", [b"", b"short", "a string secret of 32 characters"])
def test_secret_must_be_long_bytes(secret):
    with pytest.raises(ValueError, match="secret"):
        tenant_of(AUTH_A, secret)


def test_anonymous_has_no_scope_shared_route_has_one():
    assert scope(headers={}) is None
    shared = scope(headers={}, policy=CachePolicy(shared=True))
    assert shared.tenant == "shared"
    assert shared.key == scope(headers=AUTH_B, policy=CachePolicy(shared=True)).key


# ---------------------------------------------------------------- context and parameters

BASE = chat()


@pytest.mark.parametrize("name, other", [
    ("system prompt", chat(system="You are verbose.")),
    ("no system prompt", chat(system=None)),
    ("model", chat(model="m2")),
    ("temperature bucket", chat(temperature=0.5)),
    ("tools", chat(tools=[{"type": "function", "function": {"name": "f"}}])),
    ("tool_choice", chat(tool_choice="none")),
    ("response_format", chat(response_format={"type": "json_object"})),
    ("top_p", chat(top_p=0.5)),
    ("max_tokens", chat(max_tokens=10)),
    ("seed", chat(seed=1)),
    ("stop", chat(stop="\n")),
    ("presence_penalty", chat(presence_penalty=0.5)),
    ("frequency_penalty", chat(frequency_penalty=0.5)),
    ("logit_bias", chat(logit_bias={"50256": -100})),
    ("reasoning_effort", chat(reasoning_effort="high")),
    # Fields Sluice does not read: vLLM's sampling and guided decoding, legacy functions, ...
    ("top_k", chat(other={"top_k": 5})),
    ("guided_choice", chat(other={"guided_choice": ["Berlin"]})),
    ("guided_json", chat(other={"guided_json": {"type": "object"}})),
    ("functions", chat(other={"functions": [{"name": "f"}]})),
    ("verbosity", chat(other={"verbosity": "low"})),
    ("earlier turn", ChatRequest(model="m", messages=(
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "What is the capital of France?"}))),
])
def test_what_changes_the_scope(name, other):
    assert scope(BASE).key != scope(other).key, name


@pytest.mark.parametrize("name, a, b", [
    ("only the question differs", chat("What is 2+2?"), chat("Who wrote Hamlet?")),
    ("temperatures in one bucket", chat(temperature=0.8), chat(temperature=1.0)),
    ("max_completion_tokens spells max_tokens", chat(max_tokens=5), chat(max_completion_tokens=5)),
    ("n absent is 1", chat(), chat(n=1)),
    ("stop string is a one-element list", chat(stop="x"), chat(stop=["x"])),
    ("stop order and repeats", chat(stop=["a", "b"]), chat(stop=["b", "a", "a"])),
    ("1 and 1.0", chat(top_p=1), chat(top_p=1.0)),
    ("logit_bias key order", chat(logit_bias={"1": 1, "2": 2}), chat(logit_bias={"2": 2, "1": 1})),
])
def test_what_keeps_the_scope(name, a, b):
    assert scope(a).key == scope(b).key, name


def test_every_body_field_but_the_known_neutral_ones_reaches_the_scope():
    def parsed(**fields):
        return parse_chat_request(json.dumps({"model": "m", "messages": [
            {"role": "user", "content": "Is the sky blue?"}], **fields}).encode())
    plain = scope(parsed()).key
    for name, value in [("guided_choice", ["yes", "no"]), ("min_p", 0.1), ("repetition_penalty", 1.2),
                        ("chat_template_kwargs", {"enable_thinking": False}), ("function_call", "auto"),
                        ("a_field_not_invented_yet", 1)]:
        assert parsed(**{name: value}).other == {name: value}
        assert scope(parsed(**{name: value})).key != plain, name
    neutral = parsed(user="u1", metadata={"app": "x"}, store=False, stream=False,
                     stream_options=None, prompt_cache_key="k", safety_identifier="s")
    assert neutral.other == {} and scope(neutral).key == plain


def test_context_excludes_the_question_text_but_not_its_images():
    image = {"type": "image_url", "image_url": {"url": "https://x/cat.png"}}
    with_image = chat([{"type": "text", "text": "What is this?"}, image])
    other_image = chat([{"type": "text", "text": "What is this?"},
                        {**image, "image_url": {"url": "https://x/dog.png"}}])
    assert context_key(chat("a")) == context_key(chat("b"))
    assert context_key(with_image) != context_key(other_image)


@pytest.mark.parametrize("temperature, bucket", [
    (None, "default"), (0, "0"), (0.0, "0"), (0.01, "(0,0.3]"), (0.3, "(0,0.3]"),
    (0.31, "(0.3,0.7]"), (0.7, "(0.3,0.7]"), (0.71, "(0.7,1]"), (1.0, "(0.7,1]"),
    (1.01, ">1"), (2, ">1"),
])
def test_temperature_buckets(temperature, bucket):
    assert temperature_bucket(temperature) == bucket


def test_absent_temperature_is_neither_zero_nor_one():
    keys = {params_key(chat()), params_key(chat(temperature=0)), params_key(chat(temperature=1))}
    assert len(keys) == 3


def test_route_separates_scopes():
    assert scope(route="a").key != scope(route="b").key


def test_endpoint_separates_scopes():
    """One route may cover several endpoints: a deployment in the path, an api-version in the
    query or another virtual host may be another model or another answer."""
    def at(path, host="gw.example"):
        return scope(headers={**AUTH_A, ":authority": host, ":path": path}).key
    base = at("/v1/chat/completions")
    assert at("/v1/chat/completions") == base
    assert at("/v1/chat/completions", host="GW.example") == base              # host names have no case
    assert at("/v1/chat/completions?api-version=2024-10-21") != base
    assert at("/openai/deployments/gpt-4o/chat/completions") != at("/openai/deployments/gpt-4o-mini/chat/completions")
    assert at("/v1/chat/completions", host="other.example") != base


# ---------------------------------------------------------------- prompt and exact key

def test_prompt_text_is_the_last_user_turn():
    request = ChatRequest(model="m", messages=(
        {"role": "user", "content": "first"}, {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}))
    assert prompt_text(request) == "a\nb"
    assert prompt_text(ChatRequest(model="m", messages=({"role": "system", "content": "s"},))) == ""


@pytest.mark.parametrize("a, b", [
    ("What is Python?", "  What is Python?\n"),                 # ends stripped
    ("What is Python?", "What  is\tPython?"),                   # inner runs of blanks
    ("What is Python?", "What is Py\u200bthon?"),               # zero-width space
    ("What is Python?", "What is Python\uff1f"),                # full-width question mark
    ("What is Python?", "What\u00a0is Python?"),                # no-break space
    ("line one\nline two", "line one   \r\nline two"),          # trailing blanks, CRLF
    ("if x:\n    y()", "if x:    \n    y()"),
])
def test_exact_text_merges_only_invisible_differences(a, b):
    assert exact_text(a) == exact_text(b)


@pytest.mark.parametrize("a, b", [
    ("Is US the same as us?", "Is us the same as us?"),         # case
    ("Polish my shoes", "polish my shoes"),
    ("if x:\n    y()\nz()", "if x:\n    y()\n    z()"),          # indentation
    ("if x:\n    y()", "if x: y()"),                            # line breaks
    ("a\n\tb", "a\n    b"),                                     # leading tab vs spaces
    ("Let's eat, grandma", "Let's eat grandma"),                # punctuation
    ("What is 2+2?", "What is 2+2"),
    ("What is 2³?", "What is 23?"),                             # a power is not a number
    ("Simplify x²", "Simplify x2"),
    ("Balance H₂O", "Balance H2O"),                             # kept apart: a miss, not a wrong hit
])
def test_exact_text_keeps_what_changes_a_question(a, b):
    assert exact_text(a) != exact_text(b)


def test_exact_key_depends_on_scope_and_normalised_prompt():
    s = scope()
    assert exact_key(s, "What  is Python?") == exact_key(s, "What is Python?")
    assert exact_key(s, "What is Python?") != exact_key(s, "What is Rust?")
    assert exact_key(s, "x") != exact_key(scope(chat(model="m2")), "x")
    assert re.fullmatch(r"[0-9a-f]{64}", exact_key(s, "x"))
    assert exact_key(s, "a\ud800") == exact_key(s, "a")          # lone surrogates removed


def test_exact_text_shortcuts_give_what_the_substitutions_give():
    import random

    from sidecar.cache import scope
    from sidecar.embedding.normalize import normalize_text
    rng = random.Random(5)
    pieces = ["a", "b", "?", " ", "  ", "\t", "\n", " \n", "\t\n", "é", "\u200b", "x y"]
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
        spelled_out = scope._INNER_BLANKS.sub(" ", scope._TRAILING_BLANKS.sub("", normalize_text(text)))
        assert exact_text(text) == spelled_out, repr(text)


def test_time_words_prefilter_never_hides_a_match():
    import random

    from sidecar.cache.policy import TIME_SENSITIVE_WORDS, _time_words
    from sidecar.embedding.normalize import normalize_text
    from sidecar.cache.policy import time_sensitive_word
    rng = random.Random(9)
    filler = ["what", "is", "the", "of", "(", ")", "-", "'", ",", " ", "\n", "¿", "«", "Now", "nowhere",
              "right", "this", "week", "up", "to", "date", "aujourd", "hui", "今天", "日本語"]
    for _ in range(3000):
        text = " ".join(rng.choice(filler) for _ in range(rng.randint(0, 10)))
        match = _time_words(TIME_SENSITIVE_WORDS).pattern.search(normalize_text(text))
        assert time_sensitive_word(text) == (match.group(0) if match else None), repr(text)


def test_digests_are_pinned_across_versions():
    """Replicas share entries through Redis by these keys: a change must be a deliberate
    KEY_VERSION bump, never a side effect (version 2: superscripts kept apart in exact keys;
    3: the endpoint in the scope, the Authorization scheme case-folded)."""
    body = json.dumps({"model": "m", "messages": [
        {"role": "system", "content": "You are terse. ünï ✓"},
        {"role": "user", "content": [{"type": "text", "text": "What is the capital of France?"}]}],
        "temperature": 0.2, "stop": ["\n", "END"], "max_tokens": 64, "seed": 7,
        "response_format": {"type": "json_object"},
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "b": 1, "a": [1e300, -0.0, 12345678901234567890]}}}]}).encode()
    request = parse_chat_request(body)
    headers = {**AUTH_A, ":authority": "gw.example", ":path": "/v1/chat/completions"}
    key = scope_for(request, headers, CachePolicy(allow_tools=True), SECRET, route="chat")
    assert context_key(request) == "640a18227605f48924952f17e9d01401e072716792fa9b5c63db2b60c1cc8700"
    assert params_key(request) == "dc24c366ed37094e0824151a641628fd6ea67fc3d8f57a37ebfcb36967d731e0"
    assert key.key == "6f84fb90f4a585e088a28be862512a771af6c97b558faa892249a0f45a61a7d9"
    assert exact_key(key, "What is the capital of France?") == \
        "87dd53ce02d4c2f6e465b04b1973f7a1ca0c8ca835dbedfd415e51a23c538e31"


def test_a_value_json_cannot_hold_is_refused_not_digested():
    with pytest.raises(TypeError):
        params_key(chat(logit_bias={"1": {1, 2}}))
