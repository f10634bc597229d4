import math
from collections import Counter

import pytest

from sidecar.admission.queue import (
    AdmissionQueue,
    DrainMeter,
    PriorityClass,
    QueueConfig,
    admit_or_refuse,
    estimate_position,
    retry_after_s,
)

INF = math.inf


def queue(**kwargs):
    return AdmissionQueue(QueueConfig(**kwargs))


def fill(q, spec, deadline=INF):
    """spec: "class:tenant*count ..." pushed in order; returns the entries."""
    entries = []
    for item in spec.split():
        head, _, times = item.partition("*")
        cls, _, tenant = head.partition(":")
        for _ in range(int(times or 1)):
            entries.append(q.push(cls, tenant or "t", deadline, 0.0).entry)
    return entries


def drain(q, n=None, eligible=None):
    out = []
    while (n is None or len(out) < n) and (entry := q.pop(eligible)) is not None:
        out.append(entry)
    return out


def classes(entries):
    return " ".join(e.priority[0] for e in entries)


# -- order -------------------------------------------------------------------------------------

ORDER = [
    ("one class is first in, first out without deadlines", "standard*3", "s s s"),
    ("all backlogged: 8 vip, 4 standard, 1 batch in every 13, vip first while it has credit",
     "vip*20 standard*20 batch*20", "v v s v v s v s v v s v b"),
    ("a lone vip goes before a standard backlog", "standard*5 vip", "v s s s s s"),
    ("vip and standard alone share 2:1 until vip empties", "standard*6 vip*6", "v v s v v s v v s s s s"),
    ("batch alone is served", "batch*2", "b b"),
]


@pytest.mark.parametrize("spec, expected", [r[1:] for r in ORDER], ids=[r[0] for r in ORDER])
def test_class_order(spec, expected):
    q = queue(max_queued_per_tenant=100)
    fill(q, spec)
    assert classes(drain(q, n=len(expected.split()))) == expected


def test_fairness_ratio_when_all_classes_stay_backlogged():
    q = queue(max_queued=10_000, max_queued_per_tenant=10_000)
    fill(q, "vip*1300 standard*1300 batch*1300")
    counts = Counter(e.priority for e in drain(q, n=1300))
    assert counts == {"vip": 800, "standard": 400, "batch": 100}  # batch gets exactly 1/13


def test_custom_weights_are_shares():
    config = {"classes": (PriorityClass("hi", 3), PriorityClass("lo", 1)), "default_class": "lo",
                  "max_queued_per_tenant": 100}
    q = queue(**config)
    fill(q, "hi*40 lo*40")
    assert Counter(e.priority for e in drain(q, n=40)) == {"hi": 30, "lo": 10}


def test_earliest_deadline_first_within_a_tenant():
    q = queue()
    late = q.push("standard", "a", 50.0, 0.0).entry
    early = q.push("standard", "a", 10.0, 1.0).entry
    none = q.push("standard", "a", INF, 2.0).entry
    same = q.push("standard", "a", 10.0, 3.0).entry
    assert drain(q) == [early, same, late, none]


def test_tenants_take_turns_within_a_class():
    q = queue()
    fill(q, "standard:a*4 standard:b*2 standard:c")
    assert "".join(e.tenant for e in drain(q)) == "abcabaa"


def test_unknown_class_goes_to_the_default():
    q = queue()
    entry = q.push("platinum", "a", INF, 0.0).entry
    assert entry.priority == "standard" and q.depth("standard") == 1


def test_pop_takes_the_next_eligible_entry_in_order():
    q = queue()
    vip_a = q.push("vip", "t", INF, 0.0, item="a").entry
    std_b = q.push("standard", "t", INF, 0.0, item="b").entry
    assert q.pop(lambda e: e.item == "b") is std_b
    assert q.pop(lambda e: e.item == "b") is None
    assert q.pop() is vip_a


# -- bounds, eviction, removal, expiry ------------------------------------------------------------

BOUNDS = [
    ("tenant cap across classes", {"max_queued_per_tenant": 2}, "vip:a standard:a", ("batch", "a"), "tenant_full"),
    ("another tenant is still welcome", {"max_queued_per_tenant": 2}, "vip:a standard:a", ("batch", "b"), None),
    ("class bound", {"classes": (PriorityClass("vip", 8, max_queued=1), PriorityClass("standard", 4)),
                         "default_class": "standard"}, "vip:a", ("vip", "b"), "class_full"),
    ("full queue, nothing lower to evict", {"max_queued": 2}, "vip:a batch:b", ("batch", "c"), "queue_full"),
    ("full queue of the same class", {"max_queued": 2}, "standard:a standard:b", ("standard", "c"), "queue_full"),
]


@pytest.mark.parametrize("config, spec, push, refused", [r[1:] for r in BOUNDS], ids=[r[0] for r in BOUNDS])
def test_bounds(config, spec, push, refused):
    q = queue(**config)
    fill(q, spec)
    before = len(q)
    pushed = q.push(*push, INF, 1.0)
    assert pushed.refused == refused
    assert (pushed.entry is None) == (refused is not None)
    assert len(q) == before + (refused is None)


def test_a_full_queue_evicts_the_last_entry_of_the_lowest_class_below():
    q = queue(max_queued=4)
    q.push("standard", "x", 5.0, 0.0)
    busy_early, busy_late = q.push("batch", "a", 5.0, 0.0).entry, q.push("batch", "a", 9.0, 0.0).entry
    q.push("batch", "b", 9.0, 0.0)
    pushed = q.push("vip", "v", INF, 1.0)
    assert pushed.entry is not None and pushed.evicted is busy_late
    assert busy_late not in q and busy_early in q and len(q) == 4


def test_remove_and_expire():
    q = queue()
    a = q.push("standard", "a", 1.0, 0.0).entry
    b = q.push("vip", "b", 2.0, 0.0).entry
    c = q.push("batch", "c", 3.0, 0.0).entry
    assert q.remove(b) is True and q.remove(b) is False
    assert q.expire(0.5) == []
    assert q.expire(3.0) == [a, c]
    assert len(q) == 0 and q.depths() == {"vip": 0, "standard": 0, "batch": 0}
    assert q.tenant_depth("a") == 0 and q.pop() is None


def test_a_class_that_empties_loses_its_credit():
    q = queue(max_queued_per_tenant=100)
    fill(q, "vip*2 standard*5")
    assert classes(drain(q, n=3)) == "v v s"  # vip ran up a debt, then emptied
    fill(q, "vip*2")
    assert classes(drain(q, n=3)) == "v v s"  # the debt is gone: vip goes first again


def test_a_waiting_vip_takes_every_freed_slot_before_a_standard_backlog():
    # Plain SWRR gave every other lone vip's slot to standard: pops until served 1, 2, 1, 2, ...
    q = queue(max_queued_per_tenant=1000)
    fill(q, "standard*50")
    pops_until_served = []
    for _ in range(20):
        fill(q, "vip")
        served = drain(q, n=1)
        fill(q, "standard")
        while served[-1].priority != "vip":
            served += drain(q, n=1)
        pops_until_served.append(len(served))
    assert pops_until_served == [1] * 20


def test_credit_won_while_a_higher_class_is_served_is_bounded():
    # Standard and batch gain credit at every lone vip's pick; without a bound, standard would
    # then keep batch out for as many picks as there were vips.
    q = queue(max_queued=10_000, max_queued_per_tenant=10_000)
    fill(q, "standard*300 batch*300")
    for _ in range(100):
        fill(q, "vip")
        assert drain(q, n=1)[0].priority == "vip"
        fill(q, "standard")
    order = classes(drain(q, n=40))
    assert order.index("b") <= 2 * 13   # within two rounds of the weights (8 + 4 + 1)
    assert Counter(order.split()[14:]) == {"s": 21, "b": 5}   # then 4:1


# -- decisions ---------------------------------------------------------------------------------

POSITIONS = [
    # own, other tenants, weight, other classes (depth, weight) -> admissions until served
    ("empty queue", 0, [], 8, [(0, 4), (0, 1)], 1),
    ("behind two of its own tenant", 2, [], 4, [], 3),
    ("round robin: other tenants count up to own + 1 each", 1, [5, 1], 4, [], 2 + 2 + 1),
    ("a vip before a standard backlog", 0, [], 8, [(100, 4)], 1),
    ("a batch behind full rounds of the others", 0, [], 1, [(100, 8), (100, 4)], 1 + 8 + 4),
    ("other classes count no more than they hold", 0, [], 1, [(2, 8), (0, 4)], 1 + 2),
]


@pytest.mark.parametrize("own, others, weight, other_classes, expected", [r[1:] for r in POSITIONS],
                         ids=[r[0] for r in POSITIONS])
def test_estimate_position(own, others, weight, other_classes, expected):
    assert estimate_position(own, others, weight, other_classes) == expected


def test_queue_position_reads_its_own_counts():
    q = queue()
    fill(q, "vip:x*10 standard:a*2 standard:b*5")
    # a's 2 queued + itself, b's first 3; meanwhile vip gets 6 x 8 // 4 = 12 turns but holds only 10
    assert q.position("standard", "a") == 3 + 3 + 10


DEADLINES = [
    ("plenty of time", 10.0, 2.0, 1.0, "admit"),
    ("exactly enough", 3.0, 2.0, 1.0, "admit"),
    ("wait plus first token too long", 2.9, 2.0, 1.0, "refuse"),
    ("first token alone too long", 0.5, 0.0, 1.0, "refuse"),
    ("already past", 0.0, 0.0, 0.0, "refuse"),
    ("negative", -1.0, 0.0, 0.0, "refuse"),
]


@pytest.mark.parametrize("remaining, wait, ttft, expected", [r[1:] for r in DEADLINES], ids=[r[0] for r in DEADLINES])
def test_admit_or_refuse(remaining, wait, ttft, expected):
    assert admit_or_refuse(remaining, wait, ttft) == expected


RETRY_AFTER = [
    ("queue length over drain rate", 20, 4.0, 5.0),
    ("at least the minimum", 1, 10.0, 1.0),
    ("at most the maximum", 10_000, 1.0, 60.0),
    ("unknown rate: the minimum", 50, None, 1.0),
    ("zero rate: the minimum", 50, 0.0, 1.0),
]


@pytest.mark.parametrize("queued, rate, expected", [r[1:] for r in RETRY_AFTER], ids=[r[0] for r in RETRY_AFTER])
def test_retry_after(queued, rate, expected):
    assert retry_after_s(queued, rate, 1.0, 60.0) == expected


DRAIN = [
    ("unknown before any event", [], 5.0, None),
    ("young meter: over the time since the first event", [0.0, 1.0, 2.0, 3.0], 4.0, 1.0),
    ("over the window once it is full", [t + 0.5 for t in range(20)], 20.0, 10 / 10.0),  # 10.5 .. 19.5
    ("unknown again once the window is empty", [0.0], 30.0, None),
]


@pytest.mark.parametrize("events, now, expected", [r[1:] for r in DRAIN], ids=[r[0] for r in DRAIN])
def test_drain_meter(events, now, expected):
    meter = DrainMeter(window_s=10.0)
    for t in events:
        meter.add(t)
    assert meter.rate(now) == expected


CONFIG_ERRORS = [
    ({"classes": ()}, "QueueConfig.classes"),
    ({"classes": (PriorityClass("a"), PriorityClass("a"))}, "QueueConfig.classes"),
    ({"default_class": "gold"}, "QueueConfig.default_class"),
    ({"max_queued": 0}, "QueueConfig.max_queued"),
    ({"max_queued_per_tenant": 0}, "QueueConfig.max_queued_per_tenant"),
]


@pytest.mark.parametrize("kwargs, field", CONFIG_ERRORS, ids=[f"{f}-{i}" for i, (_, f) in enumerate(CONFIG_ERRORS)])
def test_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        QueueConfig(**kwargs)


@pytest.mark.parametrize("kwargs, field", [
    ({"name": ""}, "PriorityClass.name"),
    ({"name": "a", "weight": 0}, "PriorityClass.weight"),
    ({"name": "a", "max_queued": 0}, "PriorityClass.max_queued"),
])
def test_priority_class_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        PriorityClass(**kwargs)


# -- tenant shares -----------------------------------------------------------------------------

def test_tenant_weights_share_a_class_while_both_stay_backlogged():
    q = queue(max_queued_per_tenant=100)
    for _ in range(40):
        q.push("standard", "big", INF, 0.0, weight=3)
        q.push("standard", "small", INF, 0.0)
    served = Counter(e.tenant for e in drain(q, n=40))
    assert served == {"big": 30, "small": 10}


def test_a_burst_of_one_tenant_gets_one_share_of_its_class():
    q = queue(max_queued_per_tenant=100)
    fill(q, "standard:burst*50 standard:a*5 standard:b*5")
    first = [e.tenant for e in drain(q, n=15)]
    assert Counter(first) == {"burst": 5, "a": 5, "b": 5}


def test_position_counts_a_heavier_tenant_in_fewer_rounds():
    q = queue(max_queued_per_tenant=100)
    for _ in range(6):
        q.push("standard", "other", INF, 0.0)
    # weight 1: own + 1 = 1 round, one of the other's; weight 1 with 2 queued: 3 rounds, 3 of the other's
    assert q.position("standard", "new") == 1 + 1
    fill(q, "standard:mine*2")
    assert q.position("standard", "mine") == 3 + 3
    for _ in range(2):
        q.push("standard", "heavy", INF, 0.0, weight=3)
    # its 2 and itself in one round of 3, meanwhile one each of the others
    assert q.position("standard", "heavy", weight=3) == 3 + 1 + 1


@pytest.mark.parametrize("own, own_weight, others, weights, expected", [
    (2, 1, [10], [1], 3 + 3),
    (2, 3, [10], [1], 3 + 1),      # one round of 3 serves all its own
    (0, 1, [10], [4], 1 + 4),      # the other gets its weight per round
])
def test_estimate_position_with_tenant_weights(own, own_weight, others, weights, expected):
    assert estimate_position(own, others, 4, [], own_weight=own_weight, tenant_weights=weights) == expected
