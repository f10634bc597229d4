"""The admission queue: who waits for an upstream slot, and who goes next. Pure: no asyncio, no
clock (time comes in as `now`, seconds on a monotonic clock).

Order, when a slot frees (`pop`):

1. Class -- the highest class that has not used up its share, shares kept by the credits of
   smooth weighted round robin (nginx's SWRR): each pick adds every contending class's weight to
   that class's credit (a class contends when it has an entry that may take the slot), takes the
   highest class whose credit is then positive (the one with the most credit if none is) and
   takes the sum of the contenders' weights off its credit. A class that empties loses its
   credit; no credit exceeds the sum of all weights. A waiting vip therefore takes the next
   freed slot unless vip has had more than its share lately: while every class stays
   backlogged, each run of sum(weights) picks gives each class exactly its weight (vip 8,
   standard 4, batch 1: 8 vip, 4 standard and 1 batch in every 13, as vip vip standard vip vip
   standard vip standard vip vip standard vip batch), but a lone vip never waits behind a
   standard backlog. (Plain SWRR picks the most credit, which spreads the classes evenly but
   lets a standard entry take every other freed slot while a vip waits.)
2. Tenant -- weighted fair shares among the tenants that have an entry in the picked class,
   by the same smooth weighted round robin over the tenants' weights (given at push; 1 unless
   configured): while tenants stay backlogged each gets its weight's share of the class's
   admissions, so one tenant's burst cannot take the class's whole share. With equal weights
   this is round robin in order of arrival. A tenant that empties loses its credit.
3. Entry -- within that tenant's entries in the class, the earliest deadline first (then arrival).

Bounds (`push`): the whole queue holds at most `max_queued`, each class at most its `max_queued`,
each tenant at most `max_queued_per_tenant` across classes. A push over a class or tenant bound is
refused; a push into a full queue evicts the entry that would be served last in the lowest class
below the newcomer's (the latest deadline of that class's busiest tenant), or is refused when no
class below has any.

Expiry: `expire(now)` removes and returns every entry whose deadline has passed.
"""
from __future__ import annotations

import bisect
import heapq
import itertools
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from sidecar.scheduling._validate import count, positive, require


@dataclass(frozen=True)
class PriorityClass:
    name: str
    weight: int = 1  # share of admissions while every class is backlogged
    max_queued: int | None = None  # entries of this class; None: only the queue's bound

    def __post_init__(self) -> None:
        require(bool(self.name), "PriorityClass.name", "must be a non-empty name", self.name)
        count("PriorityClass.weight", self.weight)
        if self.max_queued is not None:
            count("PriorityClass.max_queued", self.max_queued)


DEFAULT_CLASSES = (PriorityClass("vip", 8), PriorityClass("standard", 4), PriorityClass("batch", 1))


@dataclass(frozen=True)
class QueueConfig:
    classes: tuple[PriorityClass, ...] = DEFAULT_CLASSES  # highest priority first
    default_class: str = "standard"  # for a request naming no class, or an unknown one
    max_queued: int = 1024
    max_queued_per_tenant: int = 64

    def __post_init__(self) -> None:
        object.__setattr__(self, "classes", tuple(self.classes))
        names = [c.name for c in self.classes]
        require(bool(names), "QueueConfig.classes", "must name at least one class", names)
        require(len(set(names)) == len(names), "QueueConfig.classes", "must name each class once", names)
        require(self.default_class in names, "QueueConfig.default_class", f"must be one of {names}", self.default_class)
        count("QueueConfig.max_queued", self.max_queued)
        count("QueueConfig.max_queued_per_tenant", self.max_queued_per_tenant)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.classes)

    def resolve(self, priority: str | None, default: str | None = None) -> str:
        """The class a request goes in: its own when configured, else `default` (a route's),
        else default_class."""
        return priority if priority in self.names else default or self.default_class


@dataclass(frozen=True, eq=False)
class Entry:
    """One queued request. Compared by identity; `item` is the caller's (the gate's waiter)."""

    priority: str
    tenant: str
    deadline: float  # absolute, on the caller's monotonic clock; math.inf for none
    arrival: float
    seq: int
    item: Any = None
    cost: float = 1.0  # what it counts for in the shares: 1, or its expected tokens in slots

    @property
    def order(self) -> tuple[float, int]:
        return (self.deadline, self.seq)


@dataclass(frozen=True)
class Pushed:
    """The result of `push`: the queued entry, or the refusal reason; and any entry evicted."""

    entry: Entry | None
    refused: str | None = None  # "queue_full" | "class_full" | "tenant_full"
    evicted: Entry | None = None


@dataclass
class _Class:
    spec: PriorityClass
    tenants: OrderedDict[str, list[Entry]] = field(default_factory=OrderedDict)  # rotation order
    size: int = 0
    credit: float = 0
    tenant_weight: dict[str, int] = field(default_factory=dict)  # of the tenants with entries
    tenant_credit: dict[str, float] = field(default_factory=dict)


class AdmissionQueue:
    def __init__(self, config: QueueConfig | None = None) -> None:
        self.config = config or QueueConfig()
        self._classes = {c.name: _Class(c) for c in self.config.classes}
        self._rank = {name: i for i, name in enumerate(self.config.names)}
        self._max_credit = sum(c.weight for c in self.config.classes)
        self._per_tenant: dict[str, int] = {}
        self._by_deadline: list[tuple[float, int, Entry]] = []  # lazy: may hold removed entries
        self._live: set[int] = set()  # seq of the entries in the queue
        self._seq = itertools.count()

    # -- reading -----------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._live)

    def depth(self, priority: str | None = None) -> int:
        """Entries of one class, or of all classes with None."""
        return len(self) if priority is None else self._classes[self.config.resolve(priority)].size

    def depths(self) -> Mapping[str, int]:
        return {name: c.size for name, c in self._classes.items()}

    def tenant_depth(self, tenant: str) -> int:
        return self._per_tenant.get(tenant, 0)

    def __contains__(self, entry: Entry) -> bool:
        return entry.seq in self._live

    def position(self, priority: str | None, tenant: str, weight: int = 1) -> int:
        """How many admissions a new entry of this class and tenant (of this weight) would
        wait for, its own included, if every queued entry could take the same slots and
        nothing else arrived."""
        cls = self._classes[self.config.resolve(priority)]
        own = len(cls.tenants.get(tenant, ()))
        others = [(len(entries), cls.tenant_weight[t]) for t, entries in cls.tenants.items() if t != tenant]
        other_classes = [(c.size, c.spec.weight) for c in self._classes.values() if c is not cls]
        return estimate_position(own, [n for n, _ in others], cls.spec.weight, other_classes,
                                 own_weight=cls.tenant_weight.get(tenant, weight),
                                 tenant_weights=[w for _, w in others])

    # -- changing ----------------------------------------------------------------------------

    def push(self, priority: str | None, tenant: str, deadline: float, arrival: float, item: Any = None,
             weight: int = 1, cost: float = 1.0) -> Pushed:
        """Queue an entry; `weight`: its tenant's share among the class's tenants (the latest
        push's weight counts); `cost`: what serving it takes off its class's and tenant's
        credit, in units of one average request (shares then count tokens, not requests)."""
        name = self.config.resolve(priority)
        cls = self._classes[name]
        if self.tenant_depth(tenant) >= self.config.max_queued_per_tenant:
            return Pushed(None, "tenant_full")
        if cls.spec.max_queued is not None and cls.size >= cls.spec.max_queued:
            return Pushed(None, "class_full")
        evicted = None
        if len(self) >= self.config.max_queued:
            evicted = self._evict_below(name)
            if evicted is None:
                return Pushed(None, "queue_full")
        entry = Entry(name, tenant, deadline, arrival, next(self._seq), item, max(0.0, float(cost)))
        entries = cls.tenants.setdefault(tenant, [])
        cls.tenant_weight[tenant] = max(1, int(weight))
        cls.tenant_credit.setdefault(tenant, 0)
        bisect.insort(entries, entry, key=lambda e: e.order)
        cls.size += 1
        self._per_tenant[tenant] = self.tenant_depth(tenant) + 1
        self._live.add(entry.seq)
        heapq.heappush(self._by_deadline, (deadline, entry.seq, entry))
        return Pushed(entry, evicted=evicted)

    def pop(self, eligible: Callable[[Entry], bool] | None = None) -> Entry | None:
        """Remove and return the next entry (see the module's docstring) among those `eligible`
        says may take the slot (all with None); None when there is none."""
        heads = {}
        for name, cls in self._classes.items():
            head = _heads(cls, eligible)
            if head:
                heads[name] = head
        if not heads:
            return None
        contenders = [self._classes[name] for name in heads]  # highest class first
        total = sum(c.spec.weight for c in contenders)
        for cls in contenders:
            cls.credit = min(cls.credit + cls.spec.weight, self._max_credit)
        best = next((c for c in contenders if c.credit > 0), None)
        if best is None:
            best = max(contenders, key=lambda c: c.credit)  # the first of the most on a tie
        entry = _pick_tenant(best, heads[best.spec.name])
        best.credit -= total * entry.cost
        self._unlink(entry, rotate=True)
        return entry

    def remove(self, entry: Entry) -> bool:
        """Take an entry out (its request was cancelled); False when it is no longer queued."""
        if entry.seq not in self._live:
            return False
        self._unlink(entry, rotate=False)
        return True

    def expire(self, now: float) -> list[Entry]:
        """Remove and return the entries whose deadline is at or before now, earliest first."""
        expired = []
        while self._by_deadline and self._by_deadline[0][0] <= now:
            _, seq, entry = heapq.heappop(self._by_deadline)
            if seq in self._live:
                self._unlink(entry, rotate=False)
                expired.append(entry)
        return expired

    def _evict_below(self, name: str) -> Entry | None:
        for cls in reversed(self._classes.values()):
            if self._rank[cls.spec.name] <= self._rank[name]:
                return None
            if cls.size:
                busiest = max(cls.tenants.values(), key=len)
                victim = busiest[-1]
                self._unlink(victim, rotate=False)
                return victim
        return None

    def _unlink(self, entry: Entry, rotate: bool) -> None:
        cls = self._classes[entry.priority]
        entries = cls.tenants[entry.tenant]
        entries.remove(entry)
        if not entries:
            del cls.tenants[entry.tenant]
            del cls.tenant_weight[entry.tenant], cls.tenant_credit[entry.tenant]
        elif rotate:
            cls.tenants.move_to_end(entry.tenant)
        cls.size -= 1
        if cls.size == 0:
            cls.credit = 0
        left = self._per_tenant[entry.tenant] - 1
        if left:
            self._per_tenant[entry.tenant] = left
        else:
            del self._per_tenant[entry.tenant]
        self._live.discard(entry.seq)
        if not self._live:
            self._by_deadline.clear()


def _heads(cls: _Class, eligible: Callable[[Entry], bool] | None) -> dict[str, Entry]:
    """Each tenant's entry this class would give up next, in rotation order: its
    earliest-deadline eligible entry (tenants without one left out). With no filter only the
    first entry of each tenant is looked at."""
    heads = {}
    for tenant, entries in cls.tenants.items():
        for entry in entries:
            if eligible is None or eligible(entry):
                heads[tenant] = entry
                break
    return heads


def _pick_tenant(cls: _Class, heads: Mapping[str, Entry]) -> Entry:
    """Smooth weighted round robin over the contending tenants' weights (see the module's
    docstring): the most credit wins, the first in rotation on a tie."""
    total = 0
    for tenant in heads:
        weight = cls.tenant_weight[tenant]
        cls.tenant_credit[tenant] += weight
        total += weight
    best = max(heads, key=lambda t: cls.tenant_credit[t])
    cls.tenant_credit[best] -= total * heads[best].cost
    return heads[best]


def estimate_position(own: int, other_tenants: Iterable[int], weight: int, other_classes: Iterable[tuple[int, int]],
                      own_weight: int = 1, tenant_weights: Iterable[int] | None = None) -> int:
    """Admissions until a new entry is served, its own included.

    own: entries its tenant has queued in its class; other_tenants: the other tenants' counts in
    that class (tenant_weights: their weights, 1 each when None; own_weight: its tenant's);
    weight: the class's weight; other_classes: (entries, weight) of every other class.
    Within the class, the tenants' shares serve own + 1 entries of its tenant in
    ceil((own + 1) / own_weight) rounds, and up to that many rounds x weight of each other
    tenant; while those are served, another class gets floor(served x its weight / class
    weight) admissions, no more than it has queued.
    """
    counts = list(other_tenants)
    weights = [1] * len(counts) if tenant_weights is None else list(tenant_weights)
    rounds = -(-(own + 1) // max(1, own_weight))
    in_class = own + 1 + sum(min(n, rounds * w) for n, w in zip(counts, weights))
    return in_class + sum(min(n, in_class * w // weight) for n, w in other_classes)


def admit_or_refuse(remaining_deadline_s: float, expected_wait_s: float, expected_ttft_s: float) -> Literal["admit", "refuse"]:
    """Refuse at once when what is left of the deadline cannot cover the expected wait in the
    queue plus the cluster's expected time to first token; waiting would only waste the wait."""
    if remaining_deadline_s <= 0 or remaining_deadline_s < expected_wait_s + expected_ttft_s:
        return "refuse"
    return "admit"


def retry_after_s(queued: int, drain_rate_per_s: float | None, min_s: float, max_s: float) -> float:
    """When a refused client should come back: the time the queue takes to drain at the observed
    rate, within [min_s, max_s]; min_s when the rate is unknown."""
    if not drain_rate_per_s or drain_rate_per_s <= 0:
        return min_s
    return max(min_s, min(max_s, queued / drain_rate_per_s))


class DrainMeter:
    """Slots freed per second over the last `window_s` seconds (at most `max_events` remembered)."""

    def __init__(self, window_s: float = 10.0, max_events: int = 4096) -> None:
        positive("DrainMeter.window_s", window_s)
        self._window_s = window_s
        self._events: deque[float] = deque(maxlen=max_events)
        self._first: float | None = None

    def add(self, now: float) -> None:
        if self._first is None:
            self._first = now
        self._events.append(now)

    def rate(self, now: float) -> float | None:
        """Events per second; None (unknown) when the window holds none. Taken over the time
        since the first event ever while that is shorter than the window, so that a young meter
        is not diluted."""
        horizon = now - self._window_s
        while self._events and self._events[0] <= horizon:
            self._events.popleft()
        span = min(self._window_s, now - self._first) if self._first is not None else 0.0
        if not self._events or span <= 0:
            return None
        return len(self._events) / span

