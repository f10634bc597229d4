"""Admission control: under a burst, requests wait cheaply in the sidecar, in priority order,
instead of piling up on the GPUs; requests that cannot be served in time are refused at once.

Request path (after routing has chosen the route's candidate clusters):
    decision = await token_limiter.check(tenant, route, estimate_tokens(prompt))   # sidecar/token_estimate.py
    if not decision.allowed: answer decision.refusal()                    # 429 + Retry-After
    result = await gate.acquire(candidates, priority, tenant, deadline)    # may wait in the queue
    Refusal -> answer result.status (429 | 503) + Retry-After: ceil(result.retry_after_s)
    Degrade -> send to the route's fallback cluster
    Permit  -> send to result.cluster; at the end of the response (or when dropped):
               result.release(ttfb_s, ok)                              # feeds the cluster's limiter
               await token_limiter.adjust(tenant, route, used_tokens - estimate)

Pure parts (table-tested, no asyncio or clock inside): limiter.ConcurrencyLimiter, queue.AdmissionQueue
and its decision functions, tokens.gcra. Around them: gate.Gate (asyncio) and the token limiters.
"""
from sidecar.admission.gate import Gate, GateConfig, Permit, WaitStats
from sidecar.admission.limiter import ConcurrencyLimiter, LimiterConfig
from sidecar.admission.metrics import (
    AdmissionMetrics,
    NullMetrics,
    PrometheusAdmissionMetrics,
)
from sidecar.admission.outcomes import REASON_STATUS, Degrade, Refusal
from sidecar.admission.queue import (
    AdmissionQueue,
    PriorityClass,
    QueueConfig,
    admit_or_refuse,
    retry_after_s,
)
from sidecar.admission.tokens import (
    LocalTokenLimiter,
    RateLimitRule,
    RateLimits,
    RedisTokenLimiter,
    TokenDecision,
    TokenLimiter,
    TokenLimitsConfig,
    connect,
)

__all__ = [
    "REASON_STATUS",
    "AdmissionMetrics",
    "AdmissionQueue",
    "ConcurrencyLimiter",
    "Degrade",
    "Gate",
    "GateConfig",
    "LimiterConfig",
    "LocalTokenLimiter",
    "NullMetrics",
    "Permit",
    "PriorityClass",
    "PrometheusAdmissionMetrics",
    "QueueConfig",
    "RateLimitRule",
    "RateLimits",
    "RedisTokenLimiter",
    "Refusal",
    "TokenDecision",
    "TokenLimiter",
    "TokenLimitsConfig",
    "WaitStats",
    "admit_or_refuse",
    "connect",
    "retry_after_s",
]
