import asyncio
import time

import pytest

from sidecar.admission import (
    Degrade,
    Gate,
    GateConfig,
    LimiterConfig,
    Permit,
    QueueConfig,
    Refusal,
)
from sidecar.admission.queue import PriorityClass


def fixed(n):
    return LimiterConfig(initial_limit=n, min_limit=n, max_limit=n)


class Clock:
    def __init__(self, t=1000.0):
        self.t = t

    def __call__(self):
        return self.t


class Recorder:
    """A fake AdmissionMetrics: every call, in order."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return lambda *args: self.calls.append((name, *args))

    def of(self, name):
        return [call[1:] for call in self.calls if call[0] == name]


async def settle():
    for _ in range(5):
        await asyncio.sleep(0)


async def cancel_all(tasks):
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def gate_with(**kwargs):
    clock = kwargs.pop("clock", None)
    extra = {k: kwargs.pop(k) for k in ("expected_ttft", "chooser") if k in kwargs}
    metrics = Recorder()
    gate = Gate(GateConfig(**kwargs), metrics=metrics, **({"clock": clock} if clock else {}), **extra)
    return gate, metrics


async def test_a_free_slot_is_granted_at_once_on_the_first_candidate_with_room():
    gate, metrics = gate_with(limiter=fixed(1))
    first = await gate.acquire(["a", "b"], "standard", "t")
    second = await gate.acquire(["a", "b"], "standard", "t")
    assert (first.cluster, second.cluster) == ("a", "b")
    assert (gate.in_flight("a"), gate.in_flight("b")) == (1, 1)
    assert metrics.of("admitted") == [("standard", 0.0, False)] * 2


async def test_a_chooser_picks_among_the_free_candidates():
    gate, _ = gate_with(chooser=lambda free: free[-1])
    assert (await gate.acquire(["a", "b", "c"], "standard", "t")).cluster == "c"
    per_call = await gate.acquire(["a", "b"], "standard", "t", chooser=lambda free: "b")
    assert per_call.cluster == "b"
    ignored = await gate.acquire(["a", "b"], "standard", "t", chooser=lambda free: "elsewhere")
    assert ignored.cluster == "a"


async def test_vip_requests_arriving_later_overtake_queued_standard_ones():
    gate, _ = gate_with(limiter=fixed(2), queue=QueueConfig(max_queued_per_tenant=100))
    order = []

    async def request(name, priority):
        permit = await gate.acquire(["a"], priority, "tenant")
        order.append(name)
        permit.release(0.1, True)

    burst = [await gate.acquire(["a"], "standard", "tenant") for _ in range(2)]  # the 2 slots
    tasks = [asyncio.create_task(request(f"s{i}", "standard")) for i in range(8)]
    await settle()
    tasks += [asyncio.create_task(request(f"v{i}", "vip")) for i in range(3)]
    await settle()
    assert (gate.queue_depth("standard"), gate.queue_depth("vip")) == (8, 3)

    for permit in burst:
        permit.release(0.1, True)
    await asyncio.gather(*tasks)
    # vip first while it has credit, vip 8 : standard 4, then standard alone (see queue.py)
    assert order == ["v0", "v1", "s0", "v2", "s1", "s2", "s3", "s4", "s5", "s6", "s7"]
    assert gate.in_flight("a") == 0 and gate.queue_depth() == 0


async def test_reserved_slots_keep_room_for_the_highest_class():
    gate, _ = gate_with(limiter=fixed(3), reserved_top_slots=1, queue=QueueConfig(max_queued_per_tenant=100))
    standard = [await gate.acquire(["a"], "standard", "t") for _ in range(2)]
    assert [p.cluster for p in standard] == ["a", "a"]
    waiting = asyncio.create_task(gate.acquire(["a"], "standard", "t"))   # the third slot is reserved
    await settle()
    assert gate.queue_depth("standard") == 1
    vip = await gate.acquire(["a"], "vip", "t")                              # takes it at once
    assert vip.cluster == "a" and gate.in_flight("a") == 3
    vip.release(0.1, True)                    # a freed reserved slot still waits for a VIP ...
    await settle()
    assert not waiting.done()
    standard[0].release(0.1, True)            # ... a freed ordinary one goes to the queue
    assert (await waiting).cluster == "a"


async def test_the_last_slot_of_a_cluster_is_never_reserved():
    gate, _ = gate_with(limiter=fixed(1), reserved_top_slots=2)
    assert (await gate.acquire(["a"], "batch", "t")).cluster == "a"


async def test_an_impossible_deadline_is_refused_at_once():
    gate, metrics = gate_with(expected_ttft=lambda cluster: 2.0)
    started = time.perf_counter()
    result = await gate.acquire(["a"], "vip", "t", deadline=time.monotonic() + 1.0)
    elapsed = time.perf_counter() - started
    assert isinstance(result, Refusal) and (result.status, result.reason) == (503, "deadline")
    assert elapsed < 0.02  # well under 50 ms: nothing waited for
    assert gate.in_flight("a") == 0 and metrics.of("refused") == [("vip", "deadline")]


async def drained_at_one_per_second(gate, clock, cluster="a"):
    """Four requests done at t=0..3 of the fake clock: the drain rate is 1/s at t=4."""
    start = clock.t
    for i in range(4):
        clock.t = start + i
        (await gate.acquire([cluster], "standard", "warmup")).release()
    clock.t = start + 4
    assert gate.drain_rate() == 1.0


async def test_a_deadline_the_queue_ahead_cannot_meet_is_refused_at_once():
    clock = Clock()
    gate, _ = gate_with(limiter=fixed(1), clock=clock, expected_ttft=lambda cluster: 0.5)
    await drained_at_one_per_second(gate, clock)
    held = await gate.acquire(["a"], "standard", "holder")
    waiting = [asyncio.create_task(gate.acquire(["a"], "standard", f"t{i}")) for i in range(5)]
    await settle()
    # 5 tenants ahead + itself = 6 admissions at 1/s, plus 0.5 s to first token
    refused = await gate.acquire(["a"], "standard", "late", deadline=clock.t + 6.4)
    assert isinstance(refused, Refusal) and refused.reason == "deadline"
    assert refused.retry_after_s == 5.0  # 5 queued at 1/s
    accepted = asyncio.create_task(gate.acquire(["a"], "standard", "late", deadline=clock.t + 6.6))
    await settle()
    assert gate.queue_depth() == 6
    await cancel_all(waiting + [accepted])
    held.release()


async def test_after_a_quiet_spell_a_burst_waits_at_the_clusters_service_rate():
    clock = Clock()
    gate, _ = gate_with(limiter=fixed(2), clock=clock, expected_ttft=lambda cluster: 0.5, retry_after_min_s=0.1)
    await drained_at_one_per_second(gate, clock)  # a trickle, then 20 s of nothing
    clock.t += 20.0
    for _ in range(2):  # then the burst: each answer held its slot 0.5 s
        permit = await gate.acquire(["a"], "standard", "first")
        clock.t += 0.5
        permit.release(0.2, True)
    assert gate.service_rate(["a"]) == 4.0 and gate.drain_rate() < 0.3  # 2 slots / 0.5 s; 6 in 24 s
    held = [await gate.acquire(["a"], "standard", "holder") for _ in range(2)]
    waiting = [asyncio.create_task(gate.acquire(["a"], "standard", f"t{i}")) for i in range(3)]
    await settle()
    # 3 ahead and itself: 4 admissions at 4/s plus 0.5 s to first token fit in 2 s (at the
    # drain rate, under 0.3/s, they would take over 13 s)
    accepted = asyncio.create_task(gate.acquire(["a"], "standard", "late", deadline=clock.t + 2.0))
    await settle()
    assert gate.queue_depth() == 4 and not accepted.done()
    refused = await gate.acquire(["a"], "standard", "later", deadline=clock.t + 1.6)
    assert refused.reason == "deadline" and refused.retry_after_s == 1.0  # 4 queued at 4/s
    await cancel_all(waiting + [accepted])
    for permit in held:
        permit.release()


HIGHER_CLASS_SHARE = [
    # vip admissions before, the standard request's deadline (s from now) -> admitted to the queue?
    ("no vip traffic: 3 admissions at 2/s + 0.5 s to first token = 2.0 s", 0, 2.1, True),
    ("no vip traffic, a deadline too short", 0, 1.9, False),
    ("vip had 54% of recent admissions: standard gets 46% of the rate (3.8 s)", 40, 3.6, False),
    ("... and fits in 4 s", 40, 4.0, True),
    ("vip had nearly all: standard still gets the 4/12 its weight guarantees (5.0 s)", 400, 4.8, False),
    ("... and fits in 5.2 s", 400, 5.2, True),
]


@pytest.mark.parametrize("vips, deadline_s, queued", [r[1:] for r in HIGHER_CLASS_SHARE],
                         ids=[r[0] for r in HIGHER_CLASS_SHARE])
async def test_a_wait_estimate_leaves_higher_classes_their_recent_share(vips, deadline_s, queued):
    clock = Clock()
    gate, _ = gate_with(limiter=fixed(1), clock=clock, expected_ttft=lambda cluster: 0.5)
    for _ in range(vips or 1):  # each answer holds the slot 0.5 s: 2 admissions per second
        permit = await gate.acquire(["a"], "vip" if vips else "standard", "v")
        clock.t += 0.5
        permit.release(0.2, True)
    held = await gate.acquire(["a"], "standard", "holder")
    waiting = [asyncio.create_task(gate.acquire(["a"], "standard", f"t{i}")) for i in range(2)]
    await settle()
    request = asyncio.create_task(gate.acquire(["a"], "standard", "new", deadline=clock.t + deadline_s))
    vip = asyncio.create_task(gate.acquire(["a"], "vip", "w", deadline=clock.t + 1.1))  # never slowed by itself
    await settle()
    assert (not request.done()) == queued and not vip.done()
    await cancel_all(waiting + [request, vip])
    held.release()


async def test_a_cancelled_waiter_leaves_the_queue_at_once_and_never_gets_a_slot():
    gate, metrics = gate_with(limiter=fixed(1))
    held = await gate.acquire(["a"], "standard", "t")
    waiter = asyncio.create_task(gate.acquire(["a"], "vip", "gone"))
    await settle()
    assert gate.queue_depth("vip") == 1
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert gate.queue_depth() == 0 and gate._queue.tenant_depth("gone") == 0
    held.release()
    assert gate.in_flight("a") == 0
    assert len(metrics.of("admitted")) == 1  # only the holder's
    assert metrics.of("queue_depth")[-1] == ("batch", 0)


async def test_a_waiter_cancelled_between_its_grant_and_its_wakeup_gives_the_slot_back():
    gate, _ = gate_with(limiter=fixed(1))
    held = await gate.acquire(["a"], "standard", "t")
    waiter = asyncio.create_task(gate.acquire(["a"], "standard", "gone"))
    await settle()
    held.release()  # hands the slot to the waiter's future ...
    assert gate.in_flight("a") == 1
    waiter.cancel()  # ... but its task is cancelled before it runs
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert gate.in_flight("a") == 0 and gate.queue_depth() == 0
    assert isinstance(await gate.acquire(["a"], "standard", "next"), Permit)


async def test_a_tenant_over_its_queue_cap_gets_429_with_retry_after_from_queue_length_and_drain_rate():
    clock = Clock()
    gate, metrics = gate_with(limiter=fixed(1), clock=clock, queue=QueueConfig(max_queued_per_tenant=2))
    await drained_at_one_per_second(gate, clock)
    held = await gate.acquire(["a"], "standard", "holder")
    waiting = [asyncio.create_task(gate.acquire(["a"], "standard", "greedy")) for _ in range(2)]
    waiting += [asyncio.create_task(gate.acquire(["a"], "batch", "modest"))]
    await settle()
    refused = await gate.acquire(["a"], "vip", "greedy")
    assert isinstance(refused, Refusal)
    assert (refused.status, refused.reason, refused.retry_after_s) == (429, "tenant_full", 3.0)  # 3 queued / 1 per s
    assert isinstance(await gate.acquire(["b"], "vip", "greedy"), Permit)  # a free cluster needs no queue
    await cancel_all(waiting)
    held.release()
    assert ("vip", "tenant_full") in metrics.of("refused")


async def test_a_full_queue_refuses_503_and_a_higher_class_evicts_a_lower_one():
    gate, _ = gate_with(limiter=fixed(1), queue=QueueConfig(max_queued=2))
    held = await gate.acquire(["a"], "standard", "t")
    batch = asyncio.create_task(gate.acquire(["a"], "batch", "b"))
    standard = asyncio.create_task(gate.acquire(["a"], "standard", "s"))
    await settle()
    full = await gate.acquire(["a"], "batch", "late")
    assert (full.status, full.reason) == (503, "queue_full")
    vip = asyncio.create_task(gate.acquire(["a"], "vip", "v"))
    evicted = await batch
    assert (evicted.status, evicted.reason) == (503, "evicted")
    held.release()
    granted = await vip
    assert granted.priority == "vip"
    granted.release()
    (await standard).release()
    assert gate.in_flight("a") == 0


async def test_a_waiter_past_its_deadline_is_refused_as_expired():
    gate, _ = gate_with(limiter=fixed(1))
    held = await gate.acquire(["a"], "standard", "t")
    result = await gate.acquire(["a"], "standard", "u", deadline=time.monotonic() + 0.03)
    assert (result.status, result.reason) == (503, "expired")
    assert gate.queue_depth() == 0
    held.release()
    assert gate.in_flight("a") == 0


async def test_a_freed_slot_never_goes_to_a_waiter_too_late_to_be_answered_in_time():
    clock = Clock()
    gate, metrics = gate_with(limiter=fixed(1), clock=clock, expected_ttft=lambda cluster: 0.5)
    held = await gate.acquire(["a"], "standard", "t")
    late = asyncio.create_task(gate.acquire(["a"], "standard", "late", deadline=clock.t + 1.0))
    on_time = asyncio.create_task(gate.acquire(["a"], "standard", "on-time", deadline=clock.t + 10.0))
    await settle()
    clock.t += 0.7  # 0.3 s left to late: less than the 0.5 s its first token takes
    held.release()
    refused = await late
    assert (refused.status, refused.reason) == (503, "expired")
    assert (await on_time).tenant == "on-time" and gate.in_flight("a") == 1
    assert ("standard", "expired") in metrics.of("refused")


async def test_a_waiter_is_refused_once_a_slot_could_no_longer_answer_it_in_time():
    gate, _ = gate_with(limiter=fixed(1), expected_ttft=lambda cluster: 0.2)
    held = await gate.acquire(["a"], "standard", "t")
    started = time.monotonic()
    result = await gate.acquire(["a"], "standard", "u", deadline=started + 0.3)
    assert (result.status, result.reason) == (503, "expired")
    assert time.monotonic() - started < 0.25  # at the deadline less the first token's 0.2 s
    assert gate.queue_depth() == 0
    held.release()


async def test_a_waiter_only_takes_slots_of_its_own_candidates():
    gate, _ = gate_with(limiter=fixed(1))
    on_a = await gate.acquire(["a"], "standard", "t")
    on_b = await gate.acquire(["b"], "standard", "t")
    wants_b = asyncio.create_task(gate.acquire(["b"], "vip", "u"))
    await settle()
    on_a.release()
    await settle()
    assert not wants_b.done() and gate.in_flight("a") == 0
    on_b.release()
    assert (await wants_b).cluster == "b"


async def test_a_high_priority_waiter_degrades_after_degrade_after_s():
    gate, metrics = gate_with(limiter=fixed(1), degrade_after_s=0.02, default_deadline_s=0.2)
    held = await gate.acquire(["a"], "standard", "t")
    vip = await gate.acquire(["a"], "vip", "u", allow_degrade=True)
    assert isinstance(vip, Degrade) and vip.waited_s >= 0.02
    assert len(metrics.of("degraded")) == 1
    no_fallback = asyncio.create_task(gate.acquire(["a"], "vip", "u"))
    standard = asyncio.create_task(gate.acquire(["a"], "standard", "u", allow_degrade=True))
    await asyncio.sleep(0.05)
    assert not no_fallback.done() and not standard.done()  # only degrade_classes, only when allowed
    held.release()
    (await no_fallback).release()
    (await standard).release()


async def test_release_feeds_the_limiter_and_a_grown_limit_admits_more_waiters():
    aimd = LimiterConfig(algorithm="aimd", initial_limit=2, min_limit=1, max_limit=3, latency_target_s=1.0)
    gate, metrics = gate_with(limiter=aimd, queue=QueueConfig(max_queued_per_tenant=10))
    first, second = [await gate.acquire(["a"], "standard", "t") for _ in range(2)]
    waiters = [asyncio.create_task(gate.acquire(["a"], "standard", "t")) for _ in range(2)]
    await settle()
    first.release(0.2, True)  # fast and busy: limit 3, and two slots free
    await settle()
    assert gate.limit("a") == 3 and all(w.done() for w in waiters)
    second.release(None, ok=False)  # a failure: limit x 0.9
    assert gate.limit("a") == 2
    assert ("a", 3, 3) in metrics.of("concurrency")
    second.release(None, ok=False)  # idempotent
    assert gate.limit("a") == 2 and gate.in_flight("a") == 2


async def test_wait_stats_and_unknown_classes():
    clock = Clock()
    gate, _ = gate_with(limiter=fixed(1), clock=clock)
    held = await gate.acquire(["a"], "platinum", "t")  # unknown: the default class
    assert held.priority == "standard"
    waiter = asyncio.create_task(gate.acquire(["a"], "vip", "u"))
    await settle()
    clock.t += 2.5
    held.release()
    (await waiter).release()
    assert gate.wait_stats("vip").count == 1 and gate.wait_stats("vip").p95_s == 2.5
    assert gate.wait_stats("standard").p50_s == 0.0


@pytest.mark.parametrize("kwargs, field", [
    ({"default_deadline_s": 0}, "GateConfig.default_deadline_s"),
    ({"degrade_after_s": -1}, "GateConfig.degrade_after_s"),
    ({"degrade_classes": ("gold",)}, "GateConfig.degrade_classes"),
    ({"drain_window_s": 0}, "GateConfig.drain_window_s"),
    ({"retry_after_min_s": 0}, "GateConfig.retry_after_min_s"),
    ({"retry_after_min_s": 5, "retry_after_max_s": 1}, "GateConfig.retry_after_max_s"),
])
def test_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        GateConfig(**kwargs)


def test_degrade_classes_default_to_the_highest_class():
    config = GateConfig(queue=QueueConfig(classes=(PriorityClass("gold", 5), PriorityClass("std", 1)), default_class="std"))
    assert config.degrade_classes == ("gold",)


def test_refusal_status_follows_the_reason():
    assert Refusal("tpm", 2.0).status == 429 and Refusal("expired", 1.0).status == 503
    with pytest.raises(ValueError, match="Refusal.reason"):
        Refusal("bored", 1.0)


async def test_a_request_without_a_deadline_waits_at_most_default_deadline_s():
    gate, _ = gate_with(limiter=fixed(1), default_deadline_s=0.03)
    held = await gate.acquire(["a"], "standard", "t")
    assert (await gate.acquire(["a"], "standard", "u", deadline=float("inf"))).reason == "expired"
    assert (await gate.acquire(["a"], "standard", "u")).reason == "expired"
    held.release()


async def test_routes_sharing_a_cluster_get_the_strictest_cap_whichever_comes_last():
    for order in (("strict", 1), ("loose", 8)), (("loose", 8), ("strict", 1)):
        gate, _ = gate_with()
        for route, cap in order:
            gate.cap_route(route, {"a": cap})
        held = await gate.acquire(["a"], "standard", "t")
        waiting = asyncio.create_task(gate.acquire(["a"], "standard", "u"))
        await settle()
        assert not waiting.done() and gate.queue_depth() == 1          # one slot, whichever came last
        held.release()
        (await waiting).release()


async def test_a_raised_cap_lets_a_queued_waiter_in_before_any_newcomer():
    gate, _ = gate_with()
    gate.cap_route("r", {"a": 1})
    held = await gate.acquire(["a"], "standard", "t")
    waiting = asyncio.create_task(gate.acquire(["a"], "standard", "u"))
    await settle()
    gate.cap_route("r", {"a": 2})                                     # the route now allows two
    await settle()
    assert waiting.done() and isinstance(waiting.result(), Permit)
    held.release()
    waiting.result().release()


async def test_a_cap_the_route_no_longer_sets_is_lifted():
    gate, _ = gate_with(limiter=fixed(4))
    gate.cap_route("r", {"a": 1, "b": 1})
    gate.cap_route("other", {"b": 2})
    assert (gate.limit("a"), gate.limit("b")) == (1, 1)
    gate.cap_route("r", {"b": 3})                       # reloaded: no cap on a, a looser one on b
    assert (gate.limit("a"), gate.limit("b")) == (4, 2)
    gate.cap_route("other", {})                         # admission off on the other route
    assert gate.limit("b") == 3


async def test_hold_until_bounds_the_wait_whatever_the_deadline():
    clock = Clock()
    gate, _ = gate_with(limiter=fixed(1), clock=clock, expected_ttft=lambda cluster: 20.0)
    held = await gate.acquire(["a"], "standard", "t")
    far = clock.t + 600.0                                   # a ten-minute budget
    waiting = asyncio.create_task(gate.acquire(["a"], "standard", "u", deadline=far, hold_until=clock.t + 0.05))
    result = await asyncio.wait_for(waiting, timeout=5)     # out at hold_until, not at 600 - 20 s
    assert (result.status, result.reason) == (503, "expired") and gate.queue_depth() == 0
    held.release()


# -- engines that preempt by priority, and degrading -------------------------------------------

async def test_on_a_preempting_cluster_a_request_counts_only_its_class_and_higher():
    gate, _ = gate_with(limiter=fixed(2), queue=QueueConfig(max_queued_per_tenant=100))
    gate.cap_route("r", {}, preempting={"a"})
    standard = [await gate.acquire(["a"], "standard", "t") for _ in range(2)]
    assert all(isinstance(p, Permit) for p in standard)
    vips = [await gate.acquire(["a"], "vip", "u") for _ in range(2)]      # the engine preempts for them
    assert all(isinstance(p, Permit) for p in vips) and gate.in_flight("a") == 4
    third_vip = asyncio.create_task(gate.acquire(["a"], "vip", "u"))
    more_standard = asyncio.create_task(gate.acquire(["a"], "standard", "t"))
    await settle()
    assert not third_vip.done() and not more_standard.done()             # vip itself is at the limit
    vips[0].release()
    assert isinstance(await third_vip, Permit) and not more_standard.done()
    vips[1].release()                                                    # one vip of 2 in flight
    gate.cap_route("r", {}, preempting=())                               # a plain engine: all 3 count
    plain_vip = asyncio.create_task(gate.acquire(["a"], "vip", "u"))
    await settle()
    assert not plain_vip.done()
    await cancel_all([plain_vip, more_standard])
    for p in [*standard, third_vip.result()]:
        p.release()


async def test_an_overload_refusal_is_a_degrade_when_a_fallback_is_healthy():
    clock = Clock()
    gate, metrics = gate_with(limiter=fixed(1), clock=clock, expected_ttft=lambda c: 1.0)
    held = await gate.acquire(["a"], "standard", "t", deadline=clock.t + 10)
    clock.t += 1.0
    held.release(1.0, True)                                              # holds last 1 s: a known rate
    held = await gate.acquire(["a"], "standard", "t", deadline=clock.t + 10)
    refused = await gate.acquire(["a"], "standard", "u", deadline=clock.t + 1.5)
    degraded = await gate.acquire(["a"], "standard", "u", deadline=clock.t + 1.5, allow_degrade=True)
    assert isinstance(refused, Refusal) and refused.reason == "deadline"
    assert isinstance(degraded, Degrade)
    assert len(metrics.of("degraded")) == 1
    held.release()


async def test_an_expected_wait_over_the_routes_degrade_after_s_degrades_at_once():
    clock = Clock()
    gate, _ = gate_with(limiter=fixed(1), clock=clock, queue=QueueConfig(max_queued_per_tenant=100))
    first = await gate.acquire(["a"], "standard", "t")
    clock.t += 2.0
    first.release(2.0, True)                                             # 0.5 slots/s
    held = await gate.acquire(["a"], "standard", "t")
    quick = await gate.acquire(["a"], "standard", "u", allow_degrade=True, degrade_after_s=1.0)
    assert isinstance(quick, Degrade) and quick.waited_s == 0.0           # would wait ~2 s
    patient = asyncio.create_task(gate.acquire(["a"], "standard", "u", allow_degrade=True, degrade_after_s=5.0))
    await settle()
    assert not patient.done()
    held.release()
    assert isinstance(await patient, Permit)


async def test_a_tenant_full_refusal_is_never_degraded():
    gate, _ = gate_with(limiter=fixed(1), queue=QueueConfig(max_queued_per_tenant=1))
    held = await gate.acquire(["a"], "standard", "t")
    queued = asyncio.create_task(gate.acquire(["a"], "standard", "t", allow_degrade=True))
    await settle()
    over = await gate.acquire(["a"], "standard", "t", allow_degrade=True)
    assert isinstance(over, Refusal) and over.reason == "tenant_full"
    held.release()
    (await queued).release()


async def test_a_preempted_class_keeps_its_own_first_token_tail_on_a_preempting_cluster():
    clock = Clock()
    gate, _ = gate_with(limiter=fixed(4), clock=clock, expected_ttft=lambda c: 0.4,
                        queue=QueueConfig(max_queued_per_tenant=100))
    gate.cap_route("r", {}, preempting={"a"})
    for _ in range(20):                      # standard requests there wait behind preempting vips
        (await gate.acquire(["a"], "standard", "t", deadline=clock.t + 10)).release(1.0, True)
    late = await gate.acquire(["a"], "standard", "t", deadline=clock.t + 0.8)
    assert isinstance(late, Refusal) and late.reason == "deadline"
    vip = await gate.acquire(["a"], "vip", "u", deadline=clock.t + 0.8)   # the cluster's 0.4 s for vip
    assert isinstance(vip, Permit)
    gate.cap_route("r", {}, preempting=())   # first come first served: the cluster's estimate
    assert isinstance(await gate.acquire(["a"], "standard", "t", deadline=clock.t + 0.8), Permit)


async def test_on_a_preempting_cluster_only_the_top_class_latency_moves_the_limit():
    aimd = LimiterConfig(algorithm="aimd", initial_limit=4, min_limit=1, max_limit=8, latency_target_s=1.0,
                         backoff_interval_s=0)
    gate, _ = gate_with(limiter=aimd, queue=QueueConfig(max_queued_per_tenant=100))
    gate.cap_route("r", {}, preempting={"a"})
    slow = [await gate.acquire(["a"], "standard", "t") for _ in range(4)]
    for p in slow:
        p.release(3.0, True)                 # preempted on the way: slow, but not overload
    assert gate.limit("a") == 4
    (await gate.acquire(["a"], "vip", "u")).release(3.0, True)
    assert gate.limit("a") < 4               # the top class slow: the engine is overloaded
