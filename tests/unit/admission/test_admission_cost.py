"""Cost-aware admission: expected tokens per request, slots and shares counted in them."""
import asyncio
import time

import pytest

from sidecar.admission import Gate, GateConfig, LimiterConfig, Permit
from sidecar.admission.cost import AnswerLengths, ClusterCosts, CostConfig
from sidecar.admission.metrics import NullMetrics
from sidecar.admission.queue import AdmissionQueue, QueueConfig


def test_expected_tokens_start_at_the_bound_then_follow_measured_answers():
    lengths = AnswerLengths(CostConfig(alpha=0.5, default_answer_tokens=256))
    assert lengths.expected_tokens("r", 100, 1000) == 1100          # nothing measured: max_tokens counts
    assert lengths.expected_tokens("r", 100, None) == 356           # no max_tokens: the default
    lengths.observe("r", 1000, 100)                                  # answers stop at a tenth of the bound
    assert lengths.expected_tokens("r", 100, 1000) == pytest.approx(200)
    assert lengths.expected_tokens("r", 100, 8000) == pytest.approx(900)
    lengths.observe("r", None, 40)
    assert lengths.expected_tokens("r", 100, None) == pytest.approx(140)
    assert lengths.expected_tokens("other", 100, 1000) == 1100      # per route


def test_answer_lengths_remember_a_bounded_number_of_routes():
    lengths = AnswerLengths(CostConfig(max_routes=2))
    for route in ("a", "b", "c"):
        lengths.observe(route, 100, 10)
    assert lengths.expected_tokens("a", 0, 100) == 100               # forgotten: the bound again
    assert lengths.expected_tokens("c", 0, 100) == pytest.approx(10)


def test_slots_count_in_units_of_the_clusters_mean_cost():
    costs = ClusterCosts(CostConfig(cluster_alpha=1.0, min_slots=0.05))
    assert costs.slots("a", 8000, limit=4) == 1.0                    # no mean yet
    costs.offered("a", 500, limit=4)
    assert costs.slots("a", None, limit=4) == 1.0
    assert costs.slots("a", 1000, limit=4) == 2.0
    assert costs.slots("a", 8000, limit=4) == 4.0                    # never more than the whole limit
    assert costs.slots("a", 1, limit=4) == 0.05


def test_one_huge_or_negative_request_does_not_shrink_every_other_one():
    costs = ClusterCosts(CostConfig(cluster_alpha=0.02, default_answer_tokens=256))
    costs.offered("a", 1e18, limit=4)                                # the first: at most 4 default answers
    assert costs.slots("a", 1024, limit=4) == pytest.approx(1.0)
    for _ in range(50):
        costs.offered("a", 1000, limit=4)
    before = costs.slots("a", 1000, limit=4)
    for tokens in (1e18, float("inf"), float("nan"), -1e18, 0):      # client numbers (max_tokens)
        costs.offered("a", tokens, limit=4)
    # A sample counts for at most the limit times the mean (a request never takes more than
    # the whole limit); the others are ignored.
    assert costs.slots("a", 1000, limit=4) == pytest.approx(before / (1 + 0.02 * 3), rel=0.05)


async def test_a_refused_huge_request_does_not_let_the_cluster_take_more_than_its_limit():
    gate = Gate(GateConfig(limiter=LimiterConfig(initial_limit=4, min_limit=4, max_limit=4),
                           queue=QueueConfig(max_queued_per_tenant=1000)), metrics=NullMetrics())
    held = [await gate.acquire(["a"], "standard", "t", tokens=1000) for _ in range(4)]
    soon = time.monotonic() + 0.01                                  # no time to wait for a slot
    refused = await gate.acquire(["a"], "standard", "x", tokens=2.0**63, deadline=soon)
    assert not isinstance(refused, Permit)
    for permit in held:
        permit.release()
    granted = [await gate.acquire(["a"], "standard", "t", tokens=1000, deadline=time.monotonic() + 0.01)
               for _ in range(40)]
    assert sum(isinstance(p, Permit) for p in granted) == 4


async def test_a_large_request_takes_the_slots_of_many_small_ones():
    gate = Gate(GateConfig(limiter=LimiterConfig(initial_limit=4, min_limit=4, max_limit=4),
                           queue=QueueConfig(max_queued_per_tenant=100)), metrics=NullMetrics())
    small = [await gate.acquire(["a"], "standard", "t", tokens=100) for _ in range(2)]
    assert all(isinstance(p, Permit) and p.slots == 1.0 for p in small)
    large = asyncio.create_task(gate.acquire(["a"], "standard", "t", tokens=300))   # 3 slots: 2 + 3 > 4
    await asyncio.sleep(0)
    assert not large.done()
    small[0].release()                                               # 1 + 3 <= 4
    permit = await asyncio.wait_for(large, 1)
    assert isinstance(permit, Permit) and permit.slots == pytest.approx(3.0, rel=0.1)
    tiny = asyncio.create_task(gate.acquire(["a"], "standard", "u", tokens=100))
    await asyncio.sleep(0)
    assert not tiny.done()                                           # the cluster is full in tokens
    permit.release()
    assert isinstance(await asyncio.wait_for(tiny, 1), Permit)


async def test_the_mean_cost_is_of_the_requests_offered_not_only_of_those_admitted():
    gate = Gate(GateConfig(limiter=LimiterConfig(initial_limit=4, min_limit=4, max_limit=4),
                           queue=QueueConfig(max_queued_per_tenant=100)), metrics=NullMetrics())
    held = [await gate.acquire(["a"], "standard", "t", tokens=100) for _ in range(4)]     # full
    large = [asyncio.create_task(gate.acquire(["a"], "standard", "u", tokens=1000)) for _ in range(40)]
    await asyncio.sleep(0)
    for permit in held[:2]:
        permit.release()
    # Large requests are most of what asks (mean ~540 tokens: each sample moves it by at most
    # the limit times it): one takes under 2 slots and fits in the two freed. A mean of the
    # admitted (small) ones would make it the whole cluster, and while small ones keep running
    # it would never find the cluster empty.
    admitted = await asyncio.wait_for(large[0], 1)
    assert isinstance(admitted, Permit) and 1.0 < admitted.slots <= 2.0
    for task in large[1:]:
        task.cancel()
    await asyncio.gather(*large[1:], return_exceptions=True)


def test_queue_shares_count_costs_not_requests():
    q = AdmissionQueue(QueueConfig(max_queued_per_tenant=100))
    for _ in range(20):
        q.push("standard", "big", float("inf"), 0.0, cost=3.0)
        q.push("standard", "small", float("inf"), 0.0, cost=1.0)
    served = [q.pop().tenant for _ in range(16)]
    # Equal weights, so equal tokens: one big request for every three small ones.
    assert served.count("big") == 4 and served.count("small") == 12
