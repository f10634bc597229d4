"""The answer cache through the real Envoy, sidecar (in-memory store, real embedding model) and
demo upstreams, with the real `openai` SDK as the client.

Every test uses its own API key, so its entries live in a scope of their own (the tenant is a
keyed hash of Authorization) and no test can hit another's answers, exact or semantic.
"""
import asyncio
import threading
import time
from collections import Counter

import httpx
import openai
import pytest

from devtools.stack import http_get
from sidecar.cache.policy import CachePolicy
from tests.support.e2e import chat_route, metric, post, wait_for_metric

FAST = {"ttft_ms": 20, "tokens": 8, "tokens_per_s": 1000, "error_rate": 0.0, "error_mode": "500"}
# No breaker verdicts here: the failure tests fail on purpose and each route has one cluster.
SCHEDULING = {"breaker": {"min_requests": 100000}}


def cached_route(name, prefix, cluster, cache=None, scheduling=SCHEDULING):
    route = chat_route(name, prefix, [{"cluster": cluster}], rewrite=None if prefix == "/" else "/")
    sluice = route["metadata"]["filter_metadata"]["sluice"]
    sluice["scheduling"] = scheduling
    if cache is not None:
        sluice["cache"] = cache
    return route


ROUTES = [
    # Its answers are never read (feedback sampled out): Envoy adds x-sluice-cache from metadata.
    cached_route("nocache", "/nocache/", "upstream_a", {"enabled": False},
                 {**SCHEDULING, "feedback": {"read_all_per_s": 0, "then_one_in": 1000000}}),
    cached_route("nosemantic", "/nosemantic/", "upstream_a", {"semantic": False}),
    cached_route("slow", "/slow/", "upstream_b"),           # dedup tests tune upstream b
    cached_route("flaky", "/flaky/", "upstream_c"),         # failure tests tune upstream c
    # The learned verifier decides semantic hits, with token alignment (docs/semantic-verifier-experiments.md).
    cached_route("verified", "/verified/", "upstream_a", {"max_false_hit_rate": 0.02}),
    # The lexical decision: τ and the checks, without the verifier.
    cached_route("lexical", "/lexical/", "upstream_a", {"max_false_hit_rate": 0}),
    cached_route("chat", "/", "upstream_a"),                # the default settings
]


@pytest.fixture(scope="module")
def stack(make_module_stack):
    args = ["--ttft-ms", "20", "--tokens", "8", "--tokens-per-s", "1000"]
    return make_module_stack(routes=ROUTES, extra_upstreams=("c",), sidecar_env={"SLUICE_CACHE": "true"},
                             upstream_args={"a": args, "b": args, "c": args})


@pytest.fixture(autouse=True)
def fast_upstreams(stack):
    yield
    for name in ("a", "b", "c"):
        configure(stack, name, **FAST)


# Today's checks serve the exchanged one (cosine 0.987); the verifier scores it 0.17 and the
# rewording 0.99.
VERIFIED_STORED = "Can you explain how a star becomes a black hole?"
VERIFIED_REWORDING = "Explain how a star becomes a black hole."
VERIFIED_EXCHANGED = "Can you explain how a black hole becomes a star?"


# --- helpers ------------------------------------------------------------------------------

def configure(stack, name, **options):
    port = stack.upstream_port(name)
    httpx.post(f"http://127.0.0.1:{port}/admin/config", json=options).raise_for_status()


def stats(stack, name) -> dict:
    return httpx.get(f"http://127.0.0.1:{stack.upstream_port(name)}/admin/stats").json()


def requests_of(stack, *names) -> int:
    return sum(stats(stack, name)["requests"] for name in names)


def sdk(stack, key, path="/v1", **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{stack.ports.http}{path}", api_key=key,
                         max_retries=0, timeout=30, **kwargs)


def ask(c, content, model="demo-model", system=None, **kwargs):
    """Non-streamed: (content, completion, headers)."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
    raw = c.chat.completions.with_raw_response.create(model=model, messages=messages, **kwargs)
    completion = raw.parse()
    return completion.choices[0].message.content, completion, raw.headers


def ask_stream(c, content, model="demo-model", **kwargs):
    """Streamed with include_usage: (content, usage, finish_reason, chunks, headers)."""
    raw = c.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": content}], stream=True,
        stream_options={"include_usage": True}, **kwargs)
    text, usage, finish, chunks = "", None, None, 0
    for chunk in raw.parse():
        chunks += 1
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            assert not chunk.choices          # the usage chunk has no choices, as OpenAI's
            usage = chunk.usage
    return text, usage, finish, chunks, raw.headers


def status(headers) -> str | None:
    return headers.get("x-sluice-cache")


def wait_stored(stack, route, count) -> None:
    """Until the sidecar stored `count` answers of the route. A streamed answer is stored when
    the upstream's body ends, which may come after the client has [DONE]
    (test_streamed_answer_is_stored_by_the_time_the_client_has_it)."""
    assert wait_for_metric(stack, "sluice_cache_stored_total", count, route=route) == count


# --- exact tier ---------------------------------------------------------------------------

def test_exact_hit_json(stack):
    c = sdk(stack, "key-exact-json")
    before = requests_of(stack, "a")
    first, completion, headers = ask(c, "Name three uses of copper in electrical wiring.")
    assert status(headers) == "miss" and "age" not in headers
    second, hit, headers = ask(c, "Name three uses of copper in electrical wiring.")
    assert status(headers) == "exact"
    assert int(headers["age"]) >= 0
    assert second == first and second
    assert hit.id != completion.id and hit.id.startswith("chatcmpl-")
    assert hit.choices[0].finish_reason == completion.choices[0].finish_reason == "stop"
    assert hit.usage.completion_tokens == completion.usage.completion_tokens == 8
    assert hit.model == completion.model
    assert requests_of(stack, "a") - before == 1


def test_exact_hit_sse_with_usage_and_the_stream_served_as_json(stack):
    c = sdk(stack, "key-exact-sse")
    before = requests_of(stack, "a")
    stored = metric(stack, "sluice_cache_stored_total", route="chat")
    first, usage, finish, _, headers = ask_stream(c, "Explain how a lighthouse lens focuses light.")
    assert status(headers) == "miss"
    wait_stored(stack, "chat", stored + 1)
    assert usage is not None and usage.completion_tokens == 8 and finish == "stop"
    second, hit_usage, hit_finish, chunks, headers = ask_stream(c, "Explain how a lighthouse lens focuses light.")
    assert status(headers) == "exact"
    assert headers["content-type"].startswith("text/event-stream")
    assert int(headers["age"]) >= 0
    assert second == first
    assert hit_finish == "stop" and chunks >= 4        # role, content..., finish, usage
    assert (hit_usage.prompt_tokens, hit_usage.completion_tokens) == (usage.prompt_tokens, usage.completion_tokens)
    # The answer captured from the stream serves a non-streaming client too.
    content, completion, headers = ask(c, "Explain how a lighthouse lens focuses light.")
    assert status(headers) == "exact" and headers["content-type"].startswith("application/json")
    assert content == first and completion.choices[0].finish_reason == "stop"
    assert completion.usage.completion_tokens == 8
    assert requests_of(stack, "a") - before == 1


def test_age_grows_with_the_entry(stack):
    c = sdk(stack, "key-age")
    ask(c, "Describe the migration route of arctic terns.")
    time.sleep(1.2)
    _, _, headers = ask(c, "Describe the migration route of arctic terns.")
    assert status(headers) == "exact" and int(headers["age"]) >= 1


def test_json_answer_served_as_sse(stack):
    c = sdk(stack, "key-json-to-sse")
    before = requests_of(stack, "a")
    original, completion, headers = ask(c, "What does a sommelier do in a restaurant?")
    assert status(headers) == "miss"
    text, usage, finish, _, headers = ask_stream(c, "What does a sommelier do in a restaurant?")
    assert status(headers) == "exact" and headers["content-type"].startswith("text/event-stream")
    assert text == original and finish == "stop"
    assert usage.completion_tokens == completion.usage.completion_tokens == 8
    assert requests_of(stack, "a") - before == 1


def test_streamed_answer_is_stored_by_the_time_the_client_has_it(stack):
    """A client that asks again right after `data: [DONE]` gets the stored answer. The upstream
    sends [DONE] and then ends its chunked body in a second write, so Envoy passes the
    end_of_stream to the sidecar only after the client already has the whole answer."""
    c = sdk(stack, "key-sse-race")
    statuses = []
    for i in range(50):
        prompt = f"Name a famous bridge in city number {i} of my list."
        ask_stream(c, prompt)
        statuses.append(status(ask(c, prompt)[2]))
    assert statuses == ["exact"] * 50


# --- semantic tier ------------------------------------------------------------------------

def test_semantic_hit_for_a_paraphrase(stack):
    c = sdk(stack, "key-semantic", "/lexical/v1")
    before = requests_of(stack, "a")
    original, _, headers = ask(c, "How do I reset my password?")
    assert status(headers) == "miss"
    content, _, headers = ask(c, "how can I reset my password?")
    assert status(headers) == "semantic", dict(headers)
    assert float(headers["x-sluice-similarity"]) >= CachePolicy().semantic_threshold
    assert float(headers["x-sluice-similarity"]) < 1.0
    assert int(headers["age"]) >= 0
    assert content == original
    assert requests_of(stack, "a") - before == 1


def test_a_client_reports_a_false_hit_and_that_answer_stops_serving_its_prompt(stack):
    """The repeat with x-cache-false-hit goes upstream; the pair never serves again; another
    rewording of the stored prompt, and another tenant, are unaffected."""
    c = sdk(stack, "key-false-hit", "/lexical/v1")
    ask(c, "How do I reset my password?")
    assert status(ask(c, "how can I reset my password?")[2]) == "semantic"
    before, stored = requests_of(stack, "a"), metric(stack, "sluice_cache_stored_total", route="lexical")
    _, _, headers = ask(c, "how can I reset my password?", extra_headers={"x-cache-false-hit": "1"})
    assert status(headers) == "miss" and requests_of(stack, "a") - before == 1
    assert metric(stack, "sluice_cache_false_hit_reports_total", route="lexical", tier="semantic",
                  source="client") == 1
    wait_stored(stack, "lexical", stored + 1)
    # The fresh answer now serves the reported prompt as its own (exact), never the old one.
    assert status(ask(c, "how can I reset my password?")[2]) == "exact"
    assert status(ask(c, "How can I reset my password")[2]) == "semantic"
    other = sdk(stack, "key-false-hit-2", "/lexical/v1")
    ask(other, "How do I reset my password?")
    assert status(ask(other, "how can I reset my password?")[2]) == "semantic"


def test_the_default_route_serves_what_the_verifier_passes(stack):
    """No cache settings: the verifier at the default false-hit rate decides, with both prompts'
    token states (the stored one's kept with its entry)."""
    c = sdk(stack, "key-default")
    checks = "sluice_cache_semantic_checks_total"
    served, missing = metric(stack, checks, reason="ok"), metric(stack, checks, reason="verifier_no_states")
    stored = metric(stack, "sluice_cache_stored_total", route="chat")
    original, _, headers = ask(c, "How do I reset my password?")
    assert status(headers) == "miss"
    wait_stored(stack, "chat", stored + 1)
    content, _, headers = ask(c, "Please explain how I can reset my password.")
    assert status(headers) == "semantic", dict(headers)
    # Under τ, where the lexical decision says below_threshold: the verifier served it.
    assert float(headers["x-sluice-similarity"]) < CachePolicy().semantic_threshold
    assert content == original
    assert metric(stack, checks, reason="ok") == served + 1
    assert metric(stack, checks, reason="verifier_no_states") == missing
    _, _, headers = ask(c, "How do I reset my email address?")
    assert status(headers) == "miss"


def test_near_question_with_other_numbers_is_not_a_hit(stack):
    c = sdk(stack, "key-numbers")
    before = requests_of(stack, "a")
    eighty, _, headers = ask(c, "What is 15% of 80?")
    assert status(headers) == "miss"
    ninety, _, headers = ask(c, "What is 15% of 90?")
    assert status(headers) == "miss" and "x-sluice-similarity" not in headers
    assert ninety != eighty
    assert requests_of(stack, "a") - before == 2
    # Each is still an exact hit for itself.
    assert status(ask(c, "What is 15% of 90?")[2]) == "exact"


def test_a_route_with_a_false_hit_rate_serves_a_rewording_and_not_two_things_exchanged(stack):
    """The verifier reads both prompts' token states: the new one's from its embedding run, the
    stored one's kept with its entry. None may be missing on one replica."""
    c = sdk(stack, "key-verified", "/verified/v1")
    before, stored = requests_of(stack, "a"), metric(stack, "sluice_cache_stored_total", route="verified")
    checks = "sluice_cache_semantic_checks_total"
    rejected, missing = metric(stack, checks, reason="verifier_rejected"), metric(stack, checks, reason="verifier_no_states")
    original, _, headers = ask(c, VERIFIED_STORED)
    assert status(headers) == "miss"
    wait_stored(stack, "verified", stored + 1)
    content, _, headers = ask(c, VERIFIED_REWORDING)
    assert status(headers) == "semantic", dict(headers)
    assert content == original
    _, _, headers = ask(c, VERIFIED_EXCHANGED)
    assert status(headers) == "miss"
    assert metric(stack, checks, reason="verifier_rejected") == rejected + 1
    assert metric(stack, checks, reason="verifier_no_states") == missing
    assert requests_of(stack, "a") - before == 2


def test_semantic_tier_off_on_route(stack):
    c = sdk(stack, "key-nosemantic", "/nosemantic/v1")
    before = requests_of(stack, "a")
    ask(c, "How do I change the oil in my car?")
    assert status(ask(c, "How do I change the oil in my car?")[2]) == "exact"
    content, _, headers = ask(c, "how can I change the oil in my car?")
    assert status(headers) == "miss"
    assert requests_of(stack, "a") - before == 2


# --- scopes and bypass rules --------------------------------------------------------------

@pytest.mark.parametrize("variants", [
    pytest.param([{"key": "key-tenant-1"}, {"key": "key-tenant-2"}], id="tenants"),
    pytest.param([{"model": "demo-model"}, {"model": "other-model"}], id="models"),
    pytest.param([{"system": "You are a pirate."}, {"system": "You are a marine biologist."}, {}],
                 id="system-prompts"),
    # One route, several endpoints: Azure-style deployments in the path, an api-version in the query.
    pytest.param([{}, {"path": "/openai/deployments/gpt-4o"}, {"path": "/openai/deployments/gpt-4o-mini"},
                  {"query": {"api-version": "2024-10-21"}}], id="endpoints"),
])
def test_no_hit_across_scopes(stack, request, variants):
    """The same prompt from another tenant, for another model, after another system prompt or
    at another endpoint of the route is a miss; each variant is then a hit for itself."""
    prompt = f"Summarise the plot of Moby Dick in one sentence ({request.node.callspec.id})."
    before = requests_of(stack, "a")

    def ask_as(key="key-scopes", model="demo-model", system=None, query=None, path="/v1"):
        client = sdk(stack, key, path=path, default_query=query)
        content, completion, headers = ask(client, prompt, model=model, system=system)
        assert completion.model == model
        return status(headers)

    assert [ask_as(**v) for v in variants] == ["miss"] * len(variants)
    assert [ask_as(**v) for v in variants] == ["exact"] * len(variants)
    assert requests_of(stack, "a") - before == len(variants)


def test_anonymous_request_is_bypassed(stack):
    body = b'{"model": "demo-model", "messages": [{"role": "user", "content": "Who wrote Hamlet?"}]}'
    before = requests_of(stack, "a")
    for _ in range(2):
        code, headers, _ = post(stack, "/v1/chat/completions", body)
        assert code == 200 and headers["x-sluice-cache"] == "bypass"
    assert requests_of(stack, "a") - before == 2


def test_no_store_is_bypassed_and_not_stored(stack):
    c = sdk(stack, "key-no-store")
    prompt = "What is the boiling point of water at sea level?"
    before = requests_of(stack, "a")
    _, _, headers = ask(c, prompt, extra_headers={"Cache-Control": "no-store"})
    assert status(headers) == "bypass"
    assert status(ask(c, prompt)[2]) == "miss"                 # the no-store answer was not kept
    assert status(ask(c, prompt, extra_headers={"Cache-Control": "no-store"})[2]) == "bypass"   # nor served
    assert status(ask(c, prompt)[2]) == "exact"
    assert requests_of(stack, "a") - before == 3


@pytest.mark.parametrize("path, prompt, options", [
    ("/v1", "What's the weather today?", {}),
    ("/v1", "Suggest a name for a cat.", {"n": 2}),
    ("/nocache/v1", "How many legs does a spider have?", {}),       # route cache: {enabled: false}
], ids=["time-sensitive", "n=2", "route-cache-disabled"])
def test_bypassed_requests_always_go_upstream(stack, path, prompt, options):
    c = sdk(stack, "key-bypass", path)
    before = requests_of(stack, "a")
    for _ in range(2):
        assert status(ask(c, prompt, **options)[2]) == "bypass"
    assert requests_of(stack, "a") - before == 2


# --- what is not stored -------------------------------------------------------------------

def answer(c, prompt, stream):
    """(content, x-sluice-cache, finish_reason, completion_tokens), streamed or not."""
    if stream:
        text, usage, finish, _, headers = ask_stream(c, prompt)
        return text, status(headers), finish, usage.completion_tokens
    content, completion, headers = ask(c, prompt)
    return content, status(headers), completion.choices[0].finish_reason, completion.usage.completion_tokens


@pytest.mark.parametrize("error_mode, stream", [("500", False), ("500", True), ("midstream", False),
                                                ("midstream", True)])
def test_failed_answer_is_not_stored(stack, error_mode, stream):
    """An upstream 500, or an answer cut off midway (JSON body or SSE stream), is not stored:
    the same question goes upstream again, and then its full answer is stored."""
    c = sdk(stack, f"key-fail-{error_mode}-{stream}", "/flaky/v1")
    prompt = "Which gas do plants absorb from the air?"
    configure(stack, "c", error_rate=1.0, error_mode=error_mode, tokens=16)
    before = requests_of(stack, "c")
    refused = metric(stack, "sluice_cache_not_stored_total", route="flaky")
    with pytest.raises((openai.APIError, httpx.HTTPError)) as err:
        answer(c, prompt, stream)
    if error_mode == "500":
        assert isinstance(err.value, openai.InternalServerError)
        assert err.value.response.headers.get("x-sluice-cache") == "miss"
    assert wait_for_metric(stack, "sluice_cache_not_stored_total", refused + 1, route="flaky") == refused + 1
    configure(stack, "c", error_rate=0.0)
    stored = metric(stack, "sluice_cache_stored_total", route="flaky")
    content, result, finish, tokens = answer(c, prompt, stream)
    assert (result, finish, tokens) == ("miss", "stop", 16)          # not a truncated hit
    wait_stored(stack, "flaky", stored + 1)
    assert answer(c, prompt, stream) == (content, "exact", "stop", 16)
    assert requests_of(stack, "c") - before == 2


# --- in-flight dedup ----------------------------------------------------------------------

async def _burst(stack, key, path, prompt, n):
    """n concurrent identical non-streamed requests: [(content, x-sluice-cache) | exception]."""
    return await _together(stack, key, path, [prompt] * n)


async def _together(stack, key, path, prompts):
    """The prompts as concurrent non-streamed requests: [(content, x-sluice-cache) | exception]."""
    c = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{stack.ports.http}{path}", api_key=key,
                           max_retries=0, timeout=60)

    async def one(prompt):
        raw = await c.chat.completions.with_raw_response.create(
            model="demo-model", messages=[{"role": "user", "content": prompt}])
        completion = raw.parse()
        return completion.choices[0].message.content, raw.headers.get("x-sluice-cache")

    try:
        return await asyncio.gather(*(one(prompt) for prompt in prompts), return_exceptions=True)
    finally:
        await c.close()


def test_100_concurrent_identical_requests_go_upstream_once(stack):
    configure(stack, "b", ttft_ms=500, tokens=8, tokens_per_s=1000)
    before = requests_of(stack, "a", "b")
    results = asyncio.run(_burst(stack, "key-burst", "/slow/v1", "Write a haiku about autumn rain.", 100))
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    contents = {content for content, _ in results}
    statuses = Counter(s for _, s in results)
    assert len(contents) == 1 and contents != {""}, contents
    assert statuses["miss"] == 1, statuses
    # Late ones find the stored answer: exact, or semantic (similarity 1) when the answer was
    # stored between their exact lookup and their semantic one (a busy CPU embeds slowly).
    assert set(statuses) <= {"miss", "coalesced", "exact", "semantic"}, statuses
    assert statuses["coalesced"] >= 10, statuses       # they overlapped the 500 ms leader
    assert requests_of(stack, "a", "b") - before == 1


def test_near_twins_in_flight_on_the_default_route_go_upstream_once(stack):
    """The default route's verifier decides near twins in flight as it decides stored ones: the
    rewording waits for the leader's answer, with both prompts' token states."""
    configure(stack, "b", ttft_ms=1500, tokens=8, tokens_per_s=1000)
    before = requests_of(stack, "a", "b")
    results = asyncio.run(_together(stack, "key-near-twins", "/slow/v1", [VERIFIED_STORED, VERIFIED_REWORDING]))
    assert not [r for r in results if isinstance(r, BaseException)], results
    assert sorted(s for _, s in results) == ["coalesced", "miss"], results
    assert len({content for content, _ in results}) == 1
    assert requests_of(stack, "a", "b") - before == 1


def test_followers_may_wait_longer_than_the_ext_proc_message_timeout(stack):
    # Envoy's message_timeout is 2 s: a follower waiting 3 s must not fail open.
    configure(stack, "b", ttft_ms=3000, tokens=8, tokens_per_s=1000)
    before = requests_of(stack, "a", "b")
    results = asyncio.run(_burst(stack, "key-long-wait", "/slow/v1", "Explain the rules of chess castling.", 5))
    assert not [r for r in results if isinstance(r, BaseException)], results
    assert sorted(s for _, s in results) == ["coalesced"] * 4 + ["miss"], results
    assert len({content for content, _ in results}) == 1
    assert requests_of(stack, "a", "b") - before == 1


def test_failed_leader_hands_over_to_one_follower(stack):
    """The leader's upstream answer breaks off; one follower is promoted and goes upstream, the
    others get its answer. Only the leader sees an error."""
    prompt = "Give me a recipe for lentil soup."
    key, path = "key-handover", "/slow/v1"
    # error_rate is drawn when a request arrives, midstream fails after ttft: the leader fails
    # ~1 s after it reached the upstream, with followers queued behind it by then.
    configure(stack, "b", ttft_ms=1000, tokens=8, tokens_per_s=1000, error_rate=1.0, error_mode="midstream")
    stats_before = stats(stack, "b")
    before_a = requests_of(stack, "a")
    leader_result = {}

    def leader():
        try:
            leader_result["ok"] = ask(sdk(stack, key, path), prompt)
        except Exception as exc:     # noqa: BLE001  (what the leader's client sees)
            leader_result["error"] = exc

    thread = threading.Thread(target=leader)
    thread.start()
    deadline = time.monotonic() + 5
    while stats(stack, "b")["requests"] == stats_before["requests"] and time.monotonic() < deadline:
        time.sleep(0.01)
    configure(stack, "b", error_rate=0.0)
    results = asyncio.run(_burst(stack, key, path, prompt, 9))
    thread.join(30)

    assert "error" in leader_result, leader_result
    assert isinstance(leader_result["error"], (openai.APIError, httpx.HTTPError))
    assert not [r for r in results if isinstance(r, BaseException)], results
    statuses = sorted(s for _, s in results)
    assert statuses == ["coalesced"] * 8 + ["miss"], statuses    # one promoted, went upstream
    assert len({content for content, _ in results}) == 1
    after = stats(stack, "b")
    assert after["requests"] - stats_before["requests"] == 2
    assert after["errors"] - stats_before["errors"] == 1
    assert requests_of(stack, "a") == before_a                   # nobody failed open elsewhere
    # And the promoted follower's answer was stored.
    assert status(ask(sdk(stack, key, path), prompt)[2]) == "exact"


# --- health -------------------------------------------------------------------------------

def test_an_upstream_reset_before_its_headers_is_an_openai_shaped_error(stack):
    """Envoy answers a reset itself (flags UC/UPE): in OpenAI's error shape, as its other local
    replies are, so SDKs read a message instead of Envoy's plain text."""
    configure(stack, "c", error_rate=1.0, error_mode="reset")
    body = {"model": "demo-model", "messages": [{"role": "user", "content": "reset me"}]}
    response = httpx.post(f"http://127.0.0.1:{stack.ports.http}/flaky/v1/chat/completions", json=body,
                          headers={"authorization": "Bearer key-reset"}, timeout=30)
    assert response.status_code in (502, 503)
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("server_error", "upstream_error")


def test_zz_sidecar_alive_and_streams_closed(stack):
    """Runs last in this module (file order): nothing above crashed or leaked a stream."""
    assert stack.procs["sidecar"].poll() is None
    assert http_get(f"http://127.0.0.1:{stack.ports.metrics}/metrics")[0] == 200
    assert wait_for_metric(stack, "sluice_open_streams", 0, timeout=10) == 0
    assert metric(stack, "sluice_protocol_errors_total") == 0
    log = (stack.workdir / "sidecar.log").read_text()
    assert "Traceback" not in log, log[-3000:]

