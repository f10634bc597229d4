import pytest

from sidecar.cache.policy import (
    TIME_SENSITIVE_WORDS,
    Bypass,
    CachePolicy,
    cache_decision,
    cache_directives,
    time_sensitive_word,
)
from sidecar.openai.chat import ChatRequest

AUTH = {"authorization": "Bearer sk-aaa"}
TOOL = {"type": "function", "function": {"name": "f"}}


def chat(text="What is the capital of France?", tools=(), other=None, **sampling) -> ChatRequest:
    return ChatRequest(model="m", messages=({"role": "user", "content": text},),
                       sampling=sampling, tools=tuple(tools), other=other or {})


# ---------------------------------------------------------------- CachePolicy

def test_defaults():
    policy = CachePolicy()
    assert policy.enabled and policy.dedup and not policy.shared and not policy.allow_tools
    assert (policy.semantic_threshold, policy.ttl_s, policy.max_temperature,
            policy.max_dedup_wait_s) == (0.93, 86400, 1.0, 30)
    assert policy.time_sensitive_words == TIME_SENSITIVE_WORDS


@pytest.mark.parametrize("kwargs, field", [
    ({"enabled": "yes"}, "enabled"),
    ({"shared": 1}, "shared"),
    ({"semantic_threshold": 0}, "semantic_threshold"),
    ({"semantic_threshold": 1.5}, "semantic_threshold"),
    ({"semantic_threshold": float("nan")}, "semantic_threshold"),
    ({"ttl_s": 0}, "ttl_s"),
    ({"ttl_s": "1"}, "ttl_s"),
    ({"max_temperature": -0.1}, "max_temperature"),
    ({"max_dedup_wait_s": -1}, "max_dedup_wait_s"),
    ({"max_dedup_wait_s": float("inf")}, "max_dedup_wait_s"),
    ({"tenant_header": "X-Tenant"}, "tenant_header"),
    ({"tenant_header": "x tenant"}, "tenant_header"),
    ({"time_sensitive_words": ("today", "")}, "time_sensitive_words"),
    ({"time_sensitive_words": "today"}, "time_sensitive_words"),
])
def test_invalid_policy_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        CachePolicy(**kwargs)


def test_words_list_becomes_tuple():
    assert CachePolicy(time_sensitive_words=["today"]).time_sensitive_words == ("today",)


# ---------------------------------------------------------------- cache_decision

@pytest.mark.parametrize("request_, headers, policy, reason, may_store", [
    (chat(), AUTH, CachePolicy(enabled=False), "disabled", False),
    (chat(), {**AUTH, "cache-control": "no-store"}, CachePolicy(), "no_store", False),
    (chat(), {**AUTH, "cache-control": "No-Cache, No-Store"}, CachePolicy(), "no_store", False),
    (chat(), {}, CachePolicy(), "anonymous", False),
    (chat(), AUTH, CachePolicy(tenant_header="x-sluice-tenant"), "anonymous", False),
    (chat(n=2), AUTH, CachePolicy(), "n_gt_1", False),
    (chat(logprobs=True), AUTH, CachePolicy(), "logprobs", False),
    (chat(top_logprobs=3), AUTH, CachePolicy(), "logprobs", False),
    (chat(tools=[TOOL]), AUTH, CachePolicy(), "tools", False),
    (chat(other={"functions": [{"name": "f"}]}), AUTH, CachePolicy(), "tools", False),   # the legacy spelling
    (chat(temperature=1.2), AUTH, CachePolicy(), "temperature", False),
    (chat(), AUTH, CachePolicy(max_temperature=0.5), "temperature", False),  # absent is 1.0
    (chat(temperature=0.6), AUTH, CachePolicy(max_temperature=0.5), "temperature", False),
    (chat(""), AUTH, CachePolicy(), "not_text", False),
    (chat("\u200b \u2060"), AUTH, CachePolicy(), "not_text", False),
    (chat([{"type": "image_url", "image_url": {"url": "x"}}]), AUTH, CachePolicy(), "not_text", False),
    (chat("What's the weather today?"), AUTH, CachePolicy(), "time_sensitive", False),
    (chat(), {**AUTH, "cache-control": "no-cache"}, CachePolicy(), "no_cache", True),
    (chat(), {**AUTH, "cache-control": "max-age=0"}, CachePolicy(), "no_cache", True),
    (chat(), {**AUTH, "pragma": "no-cache"}, CachePolicy(), "no_cache", True),
    # a rule that forbids storing wins over no-cache
    (chat(n=2), {**AUTH, "cache-control": "no-cache"}, CachePolicy(), "n_gt_1", False),
])
def test_bypass_table(request_, headers, policy, reason, may_store):
    decision = cache_decision(request_, headers, policy)
    assert decision == Bypass(reason, may_store=may_store)
    assert decision.may_serve is False


@pytest.mark.parametrize("request_, headers, policy", [
    (chat(), AUTH, CachePolicy()),
    (chat(), {}, CachePolicy(shared=True)),
    (chat(), {"x-sluice-tenant": "acme"}, CachePolicy(tenant_header="x-sluice-tenant")),
    (chat(tools=[TOOL]), AUTH, CachePolicy(allow_tools=True)),
    (chat(temperature=1.5), AUTH, CachePolicy(max_temperature=2.0)),
    (chat(n=1, logprobs=False, temperature=0), AUTH, CachePolicy()),
    (chat("What's the weather today?"), AUTH, CachePolicy(time_sensitive_words=())),
    (chat(), {**AUTH, "cache-control": "max-age=60"}, CachePolicy()),
    (chat(), {**AUTH, "cache-control": "no-transform", "pragma": "no-cache"}, CachePolicy()),
])
def test_cacheable(request_, headers, policy):
    assert cache_decision(request_, headers, policy) is None


@pytest.mark.parametrize("value, expected", [
    ("", {}),
    ("no-cache", {"no-cache": None}),
    ("NO-STORE , max-age=10", {"no-store": None, "max-age": "10"}),
    ('max-age="0", private', {"max-age": "0", "private": None}),
])
def test_cache_directives(value, expected):
    assert cache_directives({"cache-control": value}) == expected


# ---------------------------------------------------------------- time-sensitive words

@pytest.mark.parametrize("text, word", [
    ("What is the weather today?", "today"),
    ("TODAY's news", "TODAY"),
    ("Who won the game right now", "right now"),
    ("who is winning right\n now", "right\n now"),
    ("What is the latest iPhone?", "latest"),
    ("Any news this  week?", "this  week"),
    ("ｔｏｄａｙ's headlines", "today"),              # full-width, NFKC
    ("to\u200bday's headlines", "today"),            # zero-width space hidden inside
    ("Wie ist das Wetter heute?", "heute"),
    ("Quel temps fait-il aujourd'hui ?", "aujourd'hui"),
    ("Quel temps fait-il aujourd\u2019hui ?", "aujourd\u2019hui"),
    ("¿Qué tiempo hace hoy?", "hoy"),
    ("Qual é a cotação agora?", "agora"),
    ("Какая погода сегодня?", "сегодня"),
    ("今天天气怎么样", "今天"),
    ("北京现在几点", "现在"),
    ("今日の天気は？", "今日"),
    ("오늘은 날씨가 어때요?", "오늘"),
])
def test_time_sensitive_matches(text, word):
    assert time_sensitive_word(text) == word


@pytest.mark.parametrize("text", [
    "What is the capital of France?",
    "What is known about nowhere towns?",        # "now" only as a whole word
    "Explain the Todayan calendar",
    "What is the actual difference between TCP and UDP?",
    "Ich bin hier",                                # German "here"
    "日本語を話しています",                          # "いま" inside "います"
    "What is the last chapter of Dune?",
])
def test_time_sensitive_does_not_match(text):
    assert time_sensitive_word(text) is None
