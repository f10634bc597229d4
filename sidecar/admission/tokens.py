"""Token and request rate limits per tenant and route: tokens per minute (TPM) and requests per
minute (RPM).

Request path:
    estimate = estimate_tokens(prompt_text)                       # sidecar/token_estimate.py
    decision = await limiter.check(tenant, route, estimate)       # before the admission gate
    if not decision.allowed: answer decision.refusal() (429, Retry-After)
    ... when the response ends, with the upstream's usage:
    await limiter.adjust(tenant, route, usage.total_tokens - estimate)

The rule is GCRA (the generic cell rate algorithm, a leaky bucket kept as one timestamp per
budget): a budget of L per period P spends I = P / L seconds of "theoretical arrival time" (TAT)
per unit. A request costing c units, C = c x I:
    allowed when TAT <= now (the bucket is full, whatever c) or max(TAT, now) + C - now <= P
    then     TAT = max(TAT, now) + C
    else     retry_after = TAT - now + min(0, C - P)    (the earliest time it would be allowed)
The RPM budget costs 1 a request, the TPM budget the estimated tokens; a request is allowed only
when both allow it, and then both are charged. A correction moves TPM's TAT by delta x I (a refund
never below now: unused budget does not pile up beyond a full bucket).

`LocalTokenLimiter` keeps the TATs in memory (one replica); `RedisTokenLimiter` keeps them in Redis,
shared by every replica, with one Lua script per check or correction (keys share the hash tag
{tenant:route}, so the script works on Redis Cluster), and falls back to a local limiter while
Redis fails or is slower than its timeout.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import quote

import redis.asyncio as redis
from redis.asyncio.cluster import RedisCluster
from redis.backoff import NoBackoff
from redis.retry import Retry

from sidecar.admission.metrics import AdmissionMetrics, NullMetrics
from sidecar.admission.outcomes import Refusal
from sidecar.redis_retry import once_more_on_a_closed_connection
from sidecar.scheduling._validate import count, fraction, positive, require

log = logging.getLogger("sluice.admission")

KINDS = ("rpm", "tpm")
NO_CLASS = ""  # the class label of token refusals: the limiter is asked before any class is known


@dataclass(frozen=True)
class RateLimits:
    requests_per_minute: int | None = None  # None: no limit
    tokens_per_minute: int | None = None

    def __post_init__(self) -> None:
        if self.requests_per_minute is not None:
            count("RateLimits.requests_per_minute", self.requests_per_minute)
        if self.tokens_per_minute is not None:
            count("RateLimits.tokens_per_minute", self.tokens_per_minute)

    def per_period(self, kind: str) -> int | None:
        return self.requests_per_minute if kind == "rpm" else self.tokens_per_minute


@dataclass(frozen=True)
class RateLimitRule:
    """Limits for one tenant on one route, for one tenant on every route (route None), or for
    every tenant on one route (tenant None); each tenant has its own budget either way."""

    limits: RateLimits
    tenant: str | None = None
    route: str | None = None

    @property
    def specificity(self) -> int:
        return 2 * (self.tenant is not None) + (self.route is not None)


@dataclass(frozen=True)
class TokenLimitsConfig:
    default: RateLimits = RateLimits()  # for a tenant and route no rule names: unlimited
    rules: tuple[RateLimitRule, ...] = ()  # the most specific match wins: tenant+route > tenant > route
    period_s: float = 60.0  # the "minute" of the per-minute limits (shorter in tests)
    redis_timeout_s: float = 0.05  # a Redis call slower than this fails over to the local limiter
    redis_retry_s: float = 1.0  # after a failure, Redis is not asked again for this long
    fallback_share: float = 1.0  # share of each limit the local fallback grants (1 / replicas is strict)
    key_prefix: str = "sluice:rl"
    max_local_budgets: int = 100_000  # the local limiter forgets full buckets beyond this many

    def __post_init__(self) -> None:
        object.__setattr__(self, "rules", tuple(self.rules))
        seen = [(r.tenant, r.route) for r in self.rules]
        require(len(set(seen)) == len(seen), "TokenLimitsConfig.rules", "must name each (tenant, route) once", seen)
        positive("TokenLimitsConfig.period_s", self.period_s)
        positive("TokenLimitsConfig.redis_timeout_s", self.redis_timeout_s)
        positive("TokenLimitsConfig.redis_retry_s", self.redis_retry_s)
        positive("TokenLimitsConfig.fallback_share", self.fallback_share)
        fraction("TokenLimitsConfig.fallback_share", self.fallback_share)
        require(bool(self.key_prefix), "TokenLimitsConfig.key_prefix", "must not be empty", self.key_prefix)
        count("TokenLimitsConfig.max_local_budgets", self.max_local_budgets)

    def limits_for(self, tenant: str, route: str) -> RateLimits:
        best: RateLimitRule | None = None
        for rule in self.rules:
            matches = rule.tenant in (None, tenant) and rule.route in (None, route)
            if matches and (best is None or rule.specificity > best.specificity):
                best = rule
        return best.limits if best is not None else self.default


@dataclass(frozen=True)
class TokenDecision:
    allowed: bool
    retry_after_s: float = 0.0
    limited_by: str | None = None  # "rpm" or "tpm" when refused
    shared: bool = False  # decided by the shared (Redis) store

    def refusal(self) -> Refusal | None:
        return None if self.allowed else Refusal(self.limited_by or "tpm", self.retry_after_s)


ALLOWED = TokenDecision(True)


class TokenLimiter(Protocol):
    async def check(self, tenant: str, route: str, tokens: int) -> TokenDecision: ...
    async def adjust(self, tenant: str, route: str, delta_tokens: int, delta_requests: int = 0) -> None: ...
    async def refund(self, tenant: str, route: str, tokens: int) -> None: ...


# -- the rule, pure ---------------------------------------------------------------------------


def gcra(tat: float, now: float, cost_s: float, period_s: float) -> tuple[bool, float, float]:
    """(allowed, new TAT, retry_after_s) for a request costing cost_s seconds of TAT."""
    new_tat = max(tat, now) + cost_s
    if tat <= now or new_tat - now <= period_s:
        return True, new_tat, 0.0
    return False, tat, max(0.0, tat - now + min(0.0, cost_s - period_s))


def gcra_adjust(tat: float, now: float, delta_s: float) -> float:
    """The TAT after a correction of delta_s seconds (negative: a refund, never below now)."""
    return max(tat, now) + delta_s if delta_s >= 0 else max(tat + delta_s, now)


def costs(limits: RateLimits, tokens: int, period_s: float) -> dict[str, float]:
    """Seconds of TAT a request with `tokens` estimated tokens costs, per limited kind."""
    units = {"rpm": 1, "tpm": max(0, tokens)}
    return {kind: units[kind] * period_s / n for kind in KINDS if (n := limits.per_period(kind))}


def decide(tats: dict[str, float], now: float, cost: dict[str, float], period_s: float) -> tuple[TokenDecision, dict[str, float]]:
    """Both budgets' verdicts together: (decision, the TATs to store when allowed)."""
    new: dict[str, float] = {}
    refused: dict[str, float] = {}
    for kind, cost_s in cost.items():
        ok, tat, retry = gcra(tats.get(kind, 0.0), now, cost_s, period_s)
        if ok:
            new[kind] = tat
        else:
            refused[kind] = retry
    if refused:
        kind = max(refused, key=refused.__getitem__)
        return TokenDecision(False, refused[kind], kind), {}
    return ALLOWED, new


# -- in memory ---------------------------------------------------------------------------------


class LocalTokenLimiter:
    """Budgets of this replica alone. `share` scales every limit (the Redis fallback's share)."""

    def __init__(
        self,
        config: TokenLimitsConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        share: float = 1.0,
        metrics: AdmissionMetrics | None = None,
    ) -> None:
        self.config = config or TokenLimitsConfig()
        self._clock = clock
        self._share = share
        self._metrics = metrics or NullMetrics()
        self._tats: dict[tuple[str, str, str], float] = {}

    async def check(self, tenant: str, route: str, tokens: int) -> TokenDecision:
        return self.check_now(tenant, route, tokens)

    async def adjust(self, tenant: str, route: str, delta_tokens: int, delta_requests: int = 0) -> None:
        self.adjust_now(tenant, route, delta_tokens, delta_requests)

    def check_now(self, tenant: str, route: str, tokens: int) -> TokenDecision:
        cost = costs(self._limits(tenant, route), tokens, self.config.period_s)
        if not cost:
            return ALLOWED
        now = self._clock()
        tats = {kind: self._tats.get((tenant, route, kind), 0.0) for kind in cost}
        decision, new = decide(tats, now, cost, self.config.period_s)
        if decision.allowed:
            self._forget_full(now)
            self._tats.update({(tenant, route, kind): tat for kind, tat in new.items()})
            self._metrics.tokens(tenant, route, "estimated", tokens)
        else:
            self._metrics.refused(NO_CLASS, decision.limited_by or "tpm")
        return decision

    async def refund(self, tenant: str, route: str, tokens: int) -> None:
        """Give back what `check` took for a request that was then not served."""
        self.adjust_now(tenant, route, -max(0, tokens), delta_requests=-1)

    def adjust_now(self, tenant: str, route: str, delta_tokens: int, delta_requests: int = 0) -> None:
        if delta_tokens:
            self._metrics.tokens(tenant, route, "added" if delta_tokens > 0 else "refunded", abs(delta_tokens))
        now, limits = self._clock(), self._limits(tenant, route)
        for kind, units in (("rpm", delta_requests), ("tpm", delta_tokens)):
            limit = limits.per_period(kind)
            if limit and units:
                key = (tenant, route, kind)
                self._tats[key] = gcra_adjust(self._tats.get(key, 0.0), now, units * self.config.period_s / limit)

    def _limits(self, tenant: str, route: str) -> RateLimits:
        limits = self.config.limits_for(tenant, route)
        if self._share >= 1:
            return limits
        return RateLimits(*(None if n is None else max(1, math.floor(n * self._share))
                            for n in (limits.requests_per_minute, limits.tokens_per_minute)))

    def _forget_full(self, now: float) -> None:
        """Keep memory bounded: past max_local_budgets, drop the budgets that are full again."""
        if len(self._tats) >= self.config.max_local_budgets:
            self._tats = {key: tat for key, tat in self._tats.items() if tat > now}


# -- in Redis ----------------------------------------------------------------------------------

# KEYS: the RPM and TPM TAT keys. ARGV: mode ("check" | "adjust"), period_s, then per key its limit
# (0: unlimited) and its units (check: 1 request / the estimated tokens; adjust: 0 / the delta).
# Returns {allowed (1|0), retry_after_s as a string, the refusing key's index (0: none)}.
# Time is the server's, so replicas with skewed clocks agree.
GCRA_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local mode = ARGV[1]
local period = tonumber(ARGV[2])
local new, retry, which = {}, 0, 0
for i = 1, 2 do
  local limit = tonumber(ARGV[1 + 2 * i])
  local units = tonumber(ARGV[2 + 2 * i])
  if limit > 0 and (mode == 'check' or units ~= 0) then
    local tat = tonumber(redis.call('GET', KEYS[i]) or '0')
    local cost = units * period / limit
    if mode == 'adjust' then
      if cost >= 0 then new[i] = math.max(tat, now) + cost else new[i] = math.max(tat + cost, now) end
    else
      local next_tat = math.max(tat, now) + cost
      if tat <= now or next_tat - now <= period then
        new[i] = next_tat
      else
        local wait = math.max(0, tat - now + math.min(0, cost - period))
        if wait > retry or which == 0 then retry, which = wait, i end
      end
    end
  end
end
if which ~= 0 then
  return {0, string.format('%.6f', retry), which}
end
for i = 1, 2 do
  if new[i] then
    local ttl = math.max(1, math.ceil((new[i] - now) * 1000) + 1000)
    redis.call('SET', KEYS[i], string.format('%.6f', new[i]), 'PX', ttl)
  end
end
return {1, '0', 0}
"""


def redis_keys(prefix: str, tenant: str, route: str) -> list[str]:
    """The RPM and TPM keys of one budget; both carry the hash tag {tenant:route} (escaped, so a
    ':' or a brace in a name cannot merge two budgets or break the tag)."""
    tag = f"{quote(tenant, safe='')}:{quote(route, safe='')}"
    return [f"{prefix}:{{{tag}}}:{kind}" for kind in KINDS]


def connect(url: str, timeout_s: float = 0.05, cluster: bool = False) -> Any:
    """A redis.asyncio client that fails fast: short timeouts and no retries (the limiter falls
    back instead). cluster: `url` names one node of a Redis Cluster (each budget's keys and each
    dedup key's share a hash tag, so a script or a pipeline stays on one node)."""
    options = dict(socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0))
    if cluster:
        return RedisCluster.from_url(url, **options)
    return redis.from_url(url, health_check_interval=0, **options)


class RedisTokenLimiter:
    """Budgets shared by every replica through Redis. While Redis fails (an error, or no answer
    within redis_timeout_s) the local fallback decides, and Redis is asked again after
    redis_retry_s; each change between the two is logged once."""

    def __init__(
        self,
        client: Any,
        config: TokenLimitsConfig | None = None,
        *,
        fallback: LocalTokenLimiter | None = None,
        clock: Callable[[], float] = time.monotonic,
        metrics: AdmissionMetrics | None = None,
    ) -> None:
        self.config = config or TokenLimitsConfig()
        self._metrics = metrics or NullMetrics()
        self._script = client.register_script(GCRA_LUA)
        self._clock = clock
        self.fallback = fallback or LocalTokenLimiter(
            self.config, clock=clock, share=self.config.fallback_share, metrics=self._metrics)
        self._down_since: float | None = None
        self._next_try = -math.inf
        self._metrics.token_store(True)

    @property
    def shared(self) -> bool:
        """False while the local fallback is in use."""
        return self._down_since is None

    async def check(self, tenant: str, route: str, tokens: int) -> TokenDecision:
        limits = self.config.limits_for(tenant, route)
        if limits.requests_per_minute is None and limits.tokens_per_minute is None:
            return ALLOWED
        tokens = max(0, tokens)
        reply = await self._call("check", tenant, route, limits, 1, tokens)
        if reply is None:
            return self.fallback.check_now(tenant, route, tokens)
        allowed, retry, which = int(reply[0]), float(reply[1]), int(reply[2])
        if allowed:
            self._metrics.tokens(tenant, route, "estimated", tokens)
            return TokenDecision(True, shared=True)
        self._metrics.refused(NO_CLASS, KINDS[which - 1])
        return TokenDecision(False, retry, KINDS[which - 1], shared=True)

    async def adjust(self, tenant: str, route: str, delta_tokens: int, delta_requests: int = 0) -> None:
        limits = self.config.limits_for(tenant, route)
        if not (delta_tokens or delta_requests):
            return
        if not ((limits.tokens_per_minute and delta_tokens) or (limits.requests_per_minute and delta_requests)):
            self.fallback.adjust_now(tenant, route, delta_tokens)  # counts the metric, changes nothing
            return
        if await self._call("adjust", tenant, route, limits, delta_requests, delta_tokens) is None:
            self.fallback.adjust_now(tenant, route, delta_tokens, delta_requests)
        elif delta_tokens:
            self._metrics.tokens(tenant, route, "added" if delta_tokens > 0 else "refunded", abs(delta_tokens))

    async def refund(self, tenant: str, route: str, tokens: int) -> None:
        """Give back what `check` took for a request that was then not served."""
        await self.adjust(tenant, route, -max(0, tokens), delta_requests=-1)

    async def _call(self, mode: str, tenant: str, route: str, limits: RateLimits, requests: int, tokens: int) -> list | None:
        """The script's reply, or None when Redis is (or has just been found) unusable."""
        now = self._clock()
        if now < self._next_try:
            return None
        args = [mode, repr(self.config.period_s),
                limits.requests_per_minute or 0, requests, limits.tokens_per_minute or 0, tokens]
        try:
            keys = redis_keys(self.config.key_prefix, tenant, route)
            reply = await asyncio.wait_for(
                once_more_on_a_closed_connection(lambda: self._script(keys=keys, args=args)),
                self.config.redis_timeout_s)
        except Exception as error:  # noqa: BLE001 - any failure of the store means: decide locally
            self._next_try = now + self.config.redis_retry_s
            if self._down_since is None:
                self._down_since = now
                self._metrics.token_store(False)
                log.warning("token limits: Redis unusable, using the local limiter (%s: %s)",
                            type(error).__name__, error)
            return None
        if self._down_since is not None:
            log.info("token limits: Redis back after %.1fs, sharing budgets again", now - self._down_since)
            self._down_since = None
            self._metrics.token_store(True)
        return reply
