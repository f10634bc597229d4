import asyncio
import logging
import shutil
import socket
import subprocess
import time

import pytest

from devtools.stack import free_port
from sidecar.admission import Gate, GateConfig, LimiterConfig
from sidecar.admission.tokens import (
    LocalTokenLimiter,
    RateLimitRule,
    RateLimits,
    RedisTokenLimiter,
    TokenDecision,
    TokenLimitsConfig,
    connect,
    decide,
    gcra,
    gcra_adjust,
    redis_keys,
)
from sidecar.pipeline.admission_stage import Admission, AdmissionState, RouteAdmission
from sidecar.openai.chat import parse_chat_request
from sidecar.request.context import RequestContext
from sidecar.deadlines import HOLD_LIMIT_S
from sidecar.token_estimate import estimate_tokens
from sidecar.route_settings import parse_route_settings
from sidecar.pipeline.route_stage import RouteStage
from tests.support.pipeline_driver import Stages
from tests.unit.extproc.test_processor import BODY, new_director


def admitting_director(gate: Gate | None = None) -> Stages:
    """The route stage with admission: a gate and a local token limiter (asked per request)."""
    director: RouteStage = new_director()
    director.admission = Admission(gate or Gate(GateConfig()), LocalTokenLimiter(), b"a test secret of 32 bytes, fixed")
    return Stages(director)


class Clock:
    def __init__(self, t=1000.0):
        self.t = t

    def __call__(self):
        return self.t


# -- the rule ------------------------------------------------------------------------------------

GCRA = [
    # tat, now, cost_s, period -> allowed, new tat, retry_after
    ("a fresh budget allows", 0.0, 100.0, 6.0, 60.0, (True, 106.0, 0.0)),
    ("spends up to the full period at once", 100.0, 100.0, 60.0, 60.0, (True, 160.0, 0.0)),
    ("within the burst", 150.0, 100.0, 6.0, 60.0, (True, 156.0, 0.0)),
    ("over the burst: retry when enough has leaked", 156.0, 100.0, 6.0, 60.0, (False, 156.0, 2.0)),
    ("larger than the whole budget: allowed when the bucket is full", 90.0, 100.0, 90.0, 60.0, (True, 190.0, 0.0)),
    ("larger than the whole budget: retry when the bucket is full", 130.0, 100.0, 90.0, 60.0, (False, 130.0, 30.0)),
]


@pytest.mark.parametrize("tat, now, cost, period, expected", [r[1:] for r in GCRA], ids=[r[0] for r in GCRA])
def test_gcra(tat, now, cost, period, expected):
    assert gcra(tat, now, cost, period) == expected


ADJUST = [
    ("more tokens used than estimated", 110.0, 100.0, 5.0, 115.0),
    ("a correction on a full bucket starts from now", 90.0, 100.0, 5.0, 105.0),
    ("a refund", 130.0, 100.0, -10.0, 120.0),
    ("a refund never fills beyond a full bucket", 105.0, 100.0, -10.0, 100.0),
]


@pytest.mark.parametrize("tat, now, delta, expected", [r[1:] for r in ADJUST], ids=[r[0] for r in ADJUST])
def test_gcra_adjust(tat, now, delta, expected):
    assert gcra_adjust(tat, now, delta) == expected


def test_decide_needs_both_budgets_and_reports_the_longer_wait():
    period = 60.0
    decision, new = decide({"rpm": 100.0, "tpm": 155.0}, 100.0, {"rpm": 1.0, "tpm": 10.0}, period)
    assert decision == TokenDecision(False, 5.0, "tpm") and new == {}
    decision, new = decide({"rpm": 100.0, "tpm": 100.0}, 100.0, {"rpm": 1.0, "tpm": 10.0}, period)
    assert decision.allowed and new == {"rpm": 101.0, "tpm": 110.0}


def test_estimate_prompt_tokens():
    assert [estimate_tokens("x" * n) for n in (0, 1, 4, 5)] == [0, 1, 1, 2]


RULES = TokenLimitsConfig(
    default=RateLimits(requests_per_minute=100),
    rules=(
        RateLimitRule(RateLimits(tokens_per_minute=1), tenant="acme", route="chat"),
        RateLimitRule(RateLimits(tokens_per_minute=2), tenant="acme"),
        RateLimitRule(RateLimits(tokens_per_minute=3), route="chat"),
    ),
)
LIMITS_FOR = [
    ("tenant and route", "acme", "chat", 1),
    ("tenant on any route", "acme", "embed", 2),
    ("any tenant on the route", "other", "chat", 3),
    ("the default", "other", "embed", None),
]


@pytest.mark.parametrize("tenant, route, tpm", [r[1:] for r in LIMITS_FOR], ids=[r[0] for r in LIMITS_FOR])
def test_the_most_specific_rule_wins(tenant, route, tpm):
    assert RULES.limits_for(tenant, route).tokens_per_minute == tpm


@pytest.mark.parametrize("kwargs, field", [
    ({"rules": (RateLimitRule(RateLimits(), tenant="a"),) * 2}, "TokenLimitsConfig.rules"),
    ({"period_s": 0}, "TokenLimitsConfig.period_s"),
    ({"redis_timeout_s": 0}, "TokenLimitsConfig.redis_timeout_s"),
    ({"fallback_share": 1.5}, "TokenLimitsConfig.fallback_share"),
    ({"key_prefix": ""}, "TokenLimitsConfig.key_prefix"),
])
def test_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        TokenLimitsConfig(**kwargs)


def test_rate_limits_must_be_positive():
    with pytest.raises(ValueError, match=r"RateLimits\.tokens_per_minute"):
        RateLimits(tokens_per_minute=0)


def test_redis_keys_share_one_hash_tag_and_escape_names():
    rpm, tpm = redis_keys("sluice:rl", "acme", "chat")
    assert (rpm, tpm) == ("sluice:rl:{acme:chat}:rpm", "sluice:rl:{acme:chat}:tpm")
    assert redis_keys("p", "a:b", "c")[0] != redis_keys("p", "a", "b:c")[0]
    assert redis_keys("p", "x}y{", "r")[0] == "p:{x%7Dy%7B:r}:rpm"


# -- in memory ---------------------------------------------------------------------------------

LIMITS = TokenLimitsConfig(default=RateLimits(requests_per_minute=3, tokens_per_minute=600))


async def test_a_tenant_over_its_requests_per_minute_gets_429_with_an_exact_retry_after():
    clock = Clock()
    limiter = LocalTokenLimiter(LIMITS, clock=clock)
    assert all([(await limiter.check("acme", "chat", 10)).allowed for _ in range(3)])
    refused = await limiter.check("acme", "chat", 10)
    assert (refused.allowed, refused.limited_by, refused.retry_after_s) == (False, "rpm", 20.0)  # one in 60/3 s
    assert refused.refusal().status == 429 and refused.refusal().reason == "rpm"
    assert (await limiter.check("other", "chat", 10)).allowed  # each tenant has its own budget
    assert (await limiter.check("acme", "embed", 10)).allowed  # and each route
    clock.t += 20.0
    assert (await limiter.check("acme", "chat", 10)).allowed


async def test_tokens_per_minute_with_the_estimate_corrected_by_real_usage():
    clock = Clock()
    limiter = LocalTokenLimiter(LIMITS, clock=clock)
    assert (await limiter.check("acme", "chat", 500)).allowed
    refused = await limiter.check("acme", "chat", 200)
    assert (refused.limited_by, refused.retry_after_s) == ("tpm", pytest.approx(10.0))  # 100 tokens at 10/s
    await limiter.adjust("acme", "chat", -300)  # it used 200, not 500
    assert (await limiter.check("acme", "chat", 200)).allowed
    await limiter.adjust("acme", "chat", +400)  # that one used 600: the budget is in debt
    refused = await limiter.check("acme", "chat", 1)
    # TAT is 80 s ahead: 20 s of debt beyond a full minute, plus the token asked for
    assert refused.limited_by == "tpm" and refused.retry_after_s == pytest.approx(20.1)


async def test_no_limits_configured_allows_everything():
    limiter = LocalTokenLimiter(TokenLimitsConfig())
    assert all([(await limiter.check("t", "r", 10**9)).allowed for _ in range(100)])


async def test_the_fallback_share_scales_the_limits():
    config = TokenLimitsConfig(default=RateLimits(tokens_per_minute=600))
    limiter = LocalTokenLimiter(config, clock=Clock(), share=0.5)
    assert (await limiter.check("a", "r", 300)).allowed
    assert (await limiter.check("a", "r", 1)).limited_by == "tpm"


# -- in Redis ----------------------------------------------------------------------------------




@pytest.fixture(scope="module")
def redis_url():
    binary = shutil.which("redis-server") or "/usr/bin/redis-server"
    if not shutil.which(binary):
        pytest.skip("redis-server is not installed")
    port = free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 5
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.1) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    break
        except OSError:
            pass
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            pytest.fail("redis-server did not start")
        time.sleep(0.02)
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(timeout=5)


@pytest.fixture
async def clients(redis_url):
    made = []

    def make():
        client = connect(redis_url, timeout_s=0.5)
        made.append(client)
        return client

    yield make
    await made[0].flushdb()
    for client in made:
        await client.aclose()


async def test_two_replicas_share_one_tenant_budget(clients):
    config = TokenLimitsConfig(default=RateLimits(requests_per_minute=100, tokens_per_minute=1000))
    replica_a, replica_b = RedisTokenLimiter(clients(), config), RedisTokenLimiter(clients(), config)
    first = await replica_a.check("acme", "chat", 600)
    assert first.allowed and first.shared
    refused = await replica_b.check("acme", "chat", 600)
    assert (refused.allowed, refused.limited_by, refused.shared) == (False, "tpm", True)
    # 600 tokens spent 36 s of TAT; 600 more fit once 600 + 600 - 1000 = 200 tokens (12 s) leaked
    assert refused.retry_after_s == pytest.approx(12.0, abs=0.5)
    assert (await replica_b.check("other", "chat", 600)).allowed
    await replica_a.adjust("acme", "chat", -300)  # a refund seen by both replicas
    assert (await replica_b.check("acme", "chat", 600)).allowed
    ttl = await clients().pttl("sluice:rl:{acme:chat}:tpm")
    assert 0 < ttl <= 61_000 + 36_000 * 2


async def test_redis_requests_per_minute_and_python_rule_agree(clients):
    config = TokenLimitsConfig(default=RateLimits(requests_per_minute=2))
    shared = RedisTokenLimiter(clients(), config)
    local = LocalTokenLimiter(config)
    for _ in range(2):
        assert (await shared.check("t", "r", 0)).allowed and (await local.check("t", "r", 0)).allowed
    remote, mine = await shared.check("t", "r", 0), await local.check("t", "r", 0)
    assert (remote.allowed, remote.limited_by) == (mine.allowed, mine.limited_by) == (False, "rpm")
    assert remote.retry_after_s == pytest.approx(mine.retry_after_s, abs=0.2)


async def test_redis_a_refund_gives_back_the_request_and_its_tokens(clients):
    config = TokenLimitsConfig(default=RateLimits(requests_per_minute=2, tokens_per_minute=1000))
    shared = RedisTokenLimiter(clients(), config)
    for _ in range(3):
        assert (await shared.check("t", "r", 600)).allowed
        await shared.refund("t", "r", 600)
    assert (await shared.check("t", "r", 600)).allowed and shared.shared


@pytest.fixture
def captured():
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("sluice.admission")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    yield records
    logger.removeHandler(handler)
    logger.setLevel(old_level)


async def test_redis_refusing_connections_falls_back_at_once_and_logs_once(captured):
    config = TokenLimitsConfig(default=RateLimits(requests_per_minute=2))
    client = connect(f"redis://127.0.0.1:{free_port()}/0")
    limiter = RedisTokenLimiter(client, config)
    started = time.perf_counter()
    decisions = [await limiter.check("t", "r", 0) for _ in range(3)]
    assert time.perf_counter() - started < 0.2
    assert [d.allowed for d in decisions] == [True, True, False] and not any(d.shared for d in decisions)
    assert not limiter.shared
    assert [r.levelname for r in captured] == ["WARNING"]
    await client.aclose()


async def test_redis_that_never_answers_costs_one_timeout_then_none(captured):
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # accepts connections, never answers
    clock = Clock()
    config = TokenLimitsConfig(default=RateLimits(requests_per_minute=5), redis_timeout_s=0.05, redis_retry_s=1.0)
    client = connect(f"redis://127.0.0.1:{silent.getsockname()[1]}/0", timeout_s=5.0)  # only the limiter's timeout
    limiter = RedisTokenLimiter(client, config, clock=clock)
    started = time.perf_counter()
    assert (await limiter.check("t", "r", 0)).allowed
    first = time.perf_counter() - started
    assert 0.04 < first < 0.2
    started = time.perf_counter()
    for _ in range(3):
        assert (await limiter.check("t", "r", 0)).allowed
    assert time.perf_counter() - started < 0.03  # within redis_retry_s Redis is not asked
    clock.t += 1.0
    started = time.perf_counter()
    await limiter.check("t", "r", 0)  # one more try, one more timeout, no second log line
    assert time.perf_counter() - started < 0.2
    assert [r.levelname for r in captured] == ["WARNING"]
    await client.aclose()
    silent.close()


class FlakyScript:
    def __init__(self, reply):
        self.reply, self.fail = reply, True

    async def __call__(self, keys, args):
        if self.fail:
            raise ConnectionError("down")
        return self.reply


class FlakyClient:
    def __init__(self, script):
        self.script = script

    def register_script(self, source):
        return self.script


async def test_redis_coming_back_is_used_again_and_logged_once(captured):
    clock = Clock()
    script = FlakyScript([1, b"0", 0])
    limiter = RedisTokenLimiter(FlakyClient(script), TokenLimitsConfig(default=RateLimits(tokens_per_minute=10)),
                                clock=clock)
    assert not (await limiter.check("t", "r", 5)).shared
    script.fail = False
    assert not (await limiter.check("t", "r", 5)).shared  # not asked again before redis_retry_s
    clock.t += 1.0
    assert (await limiter.check("t", "r", 5)).shared and limiter.shared
    assert [r.levelname for r in captured] == ["WARNING", "INFO"]


async def test_a_refund_gives_back_the_request_and_its_tokens():
    clock = Clock()
    limiter = LocalTokenLimiter(LIMITS, clock=clock)
    for _ in range(3):
        assert (await limiter.check("acme", "chat", 200)).allowed
        await limiter.refund("acme", "chat", 200)                     # never served
    assert all([(await limiter.check("acme", "chat", 200)).allowed for _ in range(3)])
    assert not (await limiter.check("acme", "chat", 1)).allowed


async def test_requests_the_gate_refuses_do_not_spend_the_tenants_budget():
    route = parse_route_settings({"name": "chat", "candidates": [{"cluster": "a", "max_in_flight": 1}],
                                  "admission": {"enabled": True, "requests_per_minute": 2}})
    director = admitting_director()

    async def status(**headers) -> int:
        ctx = RequestContext(headers={"authorization": "Bearer k1", **headers}, route=route, route_name="chat",
                             body=BODY, chat=parse_chat_request(BODY))
        plan = await director.decide(ctx)
        await asyncio.sleep(0)                                          # the refund runs
        director.on_finish(ctx)
        return plan.reply.status if plan.reply is not None else 200
    assert [await status(**{"x-request-deadline-ms": "0"}) for _ in range(3)] == [503] * 3   # hopeless
    assert [await status(), await status(), await status()] == [200, 200, 429]


async def test_a_reloaded_route_without_max_in_flight_no_longer_caps_its_cluster():
    capped, reloaded = (parse_route_settings({"name": "chat", "candidates": [{"cluster": "a", **cap}],
                                              "admission": {"enabled": True}})
                        for cap in ({"max_in_flight": 1}, {}))
    director = admitting_director()

    def request(route):
        return RequestContext(headers={"authorization": "Bearer k1", "x-request-deadline-ms": "50"}, route=route,
                              route_name="chat", body=BODY, chat=parse_chat_request(BODY))
    first = request(capped)
    assert (await director.decide(first)).reply is None
    assert (await director.decide(request(capped))).reply.status == 503        # the one slot is taken
    second = request(reloaded)
    assert (await director.decide(second)).reply is None                        # the cap went with the reload
    director.on_finish(first)
    director.on_finish(second)


async def test_bad_admission_settings_turn_admission_off_and_are_logged_once(caplog):
    route = parse_route_settings({"name": "chat", "candidates": [{"cluster": "a"}],
                                  "admission": {"enabled": True, "default_deadline_s": -1}})
    director = admitting_director()
    for _ in range(3):
        ctx = RequestContext(headers={"authorization": "Bearer k1"}, route=route, route_name="chat",
                             body=BODY, chat=parse_chat_request(BODY))
        plan = await director.decide(ctx)
        assert plan.reply is None and plan.cluster == "a"
        director.on_finish(ctx)
    assert [r.getMessage() for r in caplog.records].count(
        "invalid admission settings of route chat, admission off: admission.default_deadline_s must be > 0, got -1.0") == 1


async def test_a_request_degraded_to_no_fallback_gets_its_budget_back():
    route = parse_route_settings({"name": "chat", "candidates": [{"cluster": "a", "max_in_flight": 1}],
                                  "admission": {"enabled": True, "requests_per_minute": 2}})
    director = admitting_director(Gate(GateConfig(degrade_after_s=0.02, degrade_classes=("standard",))))

    def request():
        return RequestContext(headers={"authorization": "Bearer k1"}, route=route, route_name="chat",
                              body=BODY, chat=parse_chat_request(BODY))
    first = request()
    assert (await director.decide(first)).reply is None                     # holds a's one slot
    degraded = await director.decide(request())                             # waits, degrades: no fallback
    assert degraded.reply is not None and degraded.reply.status == 503
    await asyncio.sleep(0)                                                  # the refund runs
    director.on_finish(first)
    assert (await director.decide(request())).reply is None                 # the 2 a minute are not spent


async def test_admission_holds_a_request_no_longer_than_the_sidecar_may_whatever_its_deadline():
    gate = Gate(GateConfig(limiter=LimiterConfig(initial_limit=1, min_limit=1, max_limit=1)))
    admission = Admission(gate, None, b"a test secret of 32 bytes, fixed")
    held = await gate.acquire(["a"], "standard", "other")
    # Ten minutes of budget, but it arrived HOLD_LIMIT_S - 0.05 s ago: 0.05 s of hold left.
    ctx = RequestContext(headers={"authorization": "Bearer k1", "x-request-deadline-ms": "600000"},
                         route_name="chat", started=time.monotonic() - HOLD_LIMIT_S + 0.05)
    settings = RouteAdmission("", "standard", 600.0, RateLimits())
    result = await asyncio.wait_for(admission.admit(ctx, AdmissionState(), settings, ["a"]), timeout=5)
    assert (result.status, result.reason) == (503, "expired")
    held.release()


async def test_per_tenant_limits_name_the_tenant_as_the_route_does():
    """A route whose tenant comes from a header Envoy sets: two tenants behind one API key get
    a budget each, and callers without Authorization are not all one 'anonymous' tenant."""
    route = parse_route_settings({"name": "chat", "candidates": [{"cluster": "a"}],
                                  "cache": {"tenant_header": "x-sluice-tenant"},
                                  "admission": {"enabled": True, "requests_per_minute": 1}})
    director = admitting_director()

    async def status(**headers) -> int:
        ctx = RequestContext(headers=headers, route=route, route_name="chat", body=BODY, chat=parse_chat_request(BODY))
        plan = await director.decide(ctx)
        director.on_finish(ctx)
        return plan.reply.status if plan.reply is not None else 200
    shared_key = {"authorization": "Bearer one-key-for-the-whole-app"}
    assert [await status(**shared_key, **{"x-sluice-tenant": t}) for t in ("acme", "globex", "acme")] == [200, 200, 429]
    assert [await status(**{"x-sluice-tenant": t}) for t in ("initech", "umbrella")] == [200, 200]


def test_a_priority_header_envoy_does_not_strip_is_warned_about(caplog):
    """A client that can send the route's priority header picks its own class (vip)."""
    admission = Admission(Gate(GateConfig()), None, b"a test secret of 32 bytes, fixed")
    for header, warned in (("x-sluice-priority", False), ("x-priority", True)):
        route = parse_route_settings({"name": "chat", "candidates": [{"cluster": "a"}],
                                      "admission": {"enabled": True, "priority_header": header}})
        caplog.clear()
        assert admission.settings(route, "chat").priority_header == header
        assert any("can choose its priority class" in r.getMessage() for r in caplog.records) is warned, header


@pytest.mark.parametrize("sent, admitted_as", [
    ("vip", "vip"), ("VIP", "vip"), (" Batch ", "batch"),    # any case, blanks around
    ("gold", "batch"), ("", "batch"), (None, "batch"),         # no such class: the route's default
])
def test_the_priority_header_names_a_class_else_the_route_default_holds(sent, admitted_as):
    admission = Admission(Gate(GateConfig()), None, b"a test secret of 32 bytes, fixed")
    route = parse_route_settings({"name": "chat", "candidates": [{"cluster": "a"}], "admission": {
        "enabled": True, "priority_header": "x-sluice-priority", "default_priority": "batch"}})
    settings = admission.settings(route, "chat")
    ctx = RequestContext(headers={} if sent is None else {"x-sluice-priority": sent}, route_name="chat")
    assert admission._priority(ctx, settings) == admitted_as


def test_a_default_priority_no_class_has_turns_the_routes_admission_off(caplog):
    admission = Admission(Gate(GateConfig()), None, b"a test secret of 32 bytes, fixed")
    route = parse_route_settings({"name": "chat", "candidates": [{"cluster": "a"}],
                                  "admission": {"enabled": True, "default_priority": "gold"}})
    assert admission.settings(route, "chat") is None
    assert any("default_priority" in r.getMessage() for r in caplog.records)
