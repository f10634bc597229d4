from prometheus_client import REGISTRY

from sidecar.admission import (
    Gate,
    GateConfig,
    LimiterConfig,
    LocalTokenLimiter,
    RateLimits,
    TokenLimitsConfig,
)
from sidecar.admission.metrics import (
    OTHER_TENANTS,
    PrometheusAdmissionMetrics,
    TenantLabels,
)


def value(name, **labels):
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_tenant_labels_are_capped():
    labels = TenantLabels(max_tenants=2)
    assert [labels(t) for t in ("a", "b", "c", "a", "d")] == ["a", "b", OTHER_TENANTS, "a", OTHER_TENANTS]


async def test_the_gate_and_the_token_limiter_export_sluice_admission_metrics():
    metrics = PrometheusAdmissionMetrics(max_tenant_labels=1)
    gate = Gate(GateConfig(limiter=LimiterConfig(initial_limit=3)), metrics=metrics)
    admitted = value("sluice_admission_admitted_total", **{"class": "batch", "queued": "false"})
    permit = await gate.acquire(["metrics-test"], "batch", "t")
    assert value("sluice_admission_admitted_total", **{"class": "batch", "queued": "false"}) == admitted + 1
    assert value("sluice_admission_concurrency_limit", cluster="metrics-test") == 3
    assert value("sluice_admission_in_flight", cluster="metrics-test") == 1
    permit.release()
    assert value("sluice_admission_in_flight", cluster="metrics-test") == 0
    assert value("sluice_admission_wait_seconds_count", **{"class": "batch"}) >= 1

    tokens = LocalTokenLimiter(TokenLimitsConfig(default=RateLimits(tokens_per_minute=100)), metrics=metrics)
    await tokens.check("first-tenant", "metrics-route", 40)
    await tokens.check("second-tenant", "metrics-route", 7)
    await tokens.adjust("first-tenant", "metrics-route", -10)
    assert value("sluice_admission_tokens_total", tenant="first-tenant", route="metrics-route", kind="estimated") == 40
    assert value("sluice_admission_tokens_total", tenant=OTHER_TENANTS, route="metrics-route", kind="estimated") == 7
    assert value("sluice_admission_tokens_total", tenant="first-tenant", route="metrics-route", kind="refunded") == 10
    refusals = value("sluice_admission_refused_total", **{"class": "", "reason": "tpm"})
    refused = await tokens.check("first-tenant", "metrics-route", 100)
    assert not refused.allowed
    assert value("sluice_admission_refused_total", **{"class": "", "reason": "tpm"}) == refusals + 1
