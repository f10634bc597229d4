"""The admission gate: per-cluster concurrency limits in front of the upstreams, and a priority
queue for the requests that find every candidate cluster at its limit.

Request path:
    result = await gate.acquire(candidates, priority, tenant, deadline)
    Permit:  send to result.cluster; when the response ends (or the request is abandoned)
             result.release(latency_s, ok) -- exactly once; a second call is ignored
    Refusal: answer result.status at once, with Retry-After: ceil(result.retry_after_s)
    Degrade: send to the route's fallback, outside this gate (only with degrade_after_s set)

All decisions are the pure parts' (`ConcurrencyLimiter`, `AdmissionQueue`, `admit_or_refuse`);
this module only parks waiters on futures and wakes them. Single-threaded: call it from one
event loop. Times come from the injected `clock` (monotonic seconds); deadlines are on it.
"""
from __future__ import annotations

import dataclasses

import asyncio
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from sidecar.admission.cost import ClusterCosts
from sidecar.admission.limiter import ConcurrencyLimiter, LimiterConfig
from sidecar.admission.metrics import AdmissionMetrics, PrometheusAdmissionMetrics
from sidecar.admission.outcomes import REASON_STATUS, Degrade, Refusal
from sidecar.admission.queue import (
    AdmissionQueue,
    DrainMeter,
    Entry,
    QueueConfig,
    admit_or_refuse,
    retry_after_s,
)
from sidecar.scheduling._validate import positive, require
from sidecar.scheduling.signals import P95
from sidecar.scheduling.windows import SampleWindow

# Weight of the newest answered request in a cluster's mean slot hold time (grant to release).
HOLD_EWMA_ALPHA = 0.1
# Weight of the newest admission in each class's share of recent admissions (about the last 50).
SHARE_EWMA_ALPHA = 0.02
# A class's own time-to-first-token on a preempting cluster: this quantile of its recent answers,
# from this many answers. High: a request sent past it is likely to outlive its client.
CLASS_TTFT_QUANTILE = P95
MIN_CLASS_TTFT_SAMPLES = 20

Chooser = Callable[[Sequence[str]], str]  # clusters with a free slot, in the caller's order -> one of them
TtftEstimate = Callable[[str], "float | None"]  # cluster -> expected time to first token (s), None if unknown


@dataclass(frozen=True)
class GateConfig:
    queue: QueueConfig = field(default_factory=QueueConfig)
    limiter: LimiterConfig = field(default_factory=LimiterConfig)  # for every cluster ...
    limiters: Mapping[str, LimiterConfig] = field(default_factory=dict)  # ... unless named here
    default_deadline_s: float = 60.0  # a request that brings no deadline waits at most this long
    degrade_after_s: float | None = None  # None: never degrade
    degrade_classes: tuple[str, ...] | None = None  # classes that may degrade; None: the highest
    # Slots of each cluster that only the highest class may take (never the cluster's last one):
    # slots are not preempted, so without a reserve a VIP request waits for a running request
    # to finish, up to one whole service time.
    reserved_top_slots: int = 0
    drain_window_s: float = 30.0  # window of the drain rate behind wait estimates and Retry-After
    retry_after_min_s: float = 1.0
    retry_after_max_s: float = 60.0
    wait_stats_window_s: float = 60.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "limiters", MappingProxyType(dict(self.limiters)))
        positive("GateConfig.default_deadline_s", self.default_deadline_s)
        if self.degrade_after_s is not None:
            positive("GateConfig.degrade_after_s", self.degrade_after_s)
        if self.degrade_classes is None:
            object.__setattr__(self, "degrade_classes", self.queue.names[:1])
        names = self.queue.names
        unknown = [c for c in self.degrade_classes if c not in names]
        require(not unknown, "GateConfig.degrade_classes", f"must name classes of {names}", self.degrade_classes)
        require(self.reserved_top_slots >= 0, "GateConfig.reserved_top_slots", "must be >= 0", self.reserved_top_slots)
        positive("GateConfig.drain_window_s", self.drain_window_s)
        positive("GateConfig.retry_after_min_s", self.retry_after_min_s)
        require(self.retry_after_max_s >= self.retry_after_min_s, "GateConfig.retry_after_max_s",
                "must be >= retry_after_min_s", self.retry_after_max_s)
        positive("GateConfig.wait_stats_window_s", self.wait_stats_window_s)

    def limiter_for(self, cluster: str) -> LimiterConfig:
        return self.limiters.get(cluster, self.limiter)


@dataclass(frozen=True)
class WaitStats:
    """Waits of the requests of one class admitted (or degraded) in the last wait_stats_window_s."""

    count: int
    p50_s: float | None
    p95_s: float | None


class Permit:
    """A slot on `cluster`. Release it once, when the response ends or the request is dropped."""

    def __init__(self, gate: Gate, cluster: str, priority: str, tenant: str, waited_s: float, in_flight: int,
                 granted_at: float = 0.0, slots: float = 1.0) -> None:
        self.cluster = cluster
        self.priority = priority
        self.tenant = tenant
        self.waited_s = waited_s
        self._gate = gate
        self._in_flight = in_flight  # the cluster's count with this request, for the limiter
        self._granted_at = granted_at  # on the gate's clock
        self.slots = slots  # what it counts for on the cluster (cost.py); 1 unless costs are counted
        self.released = False

    def release(self, latency_s: float | None = None, ok: bool = True, upstream_waiting: float | None = None) -> None:
        """Give the slot back. latency_s (time to first byte preferred, see limiter.py) and ok
        (False for 5xx, resets, timeouts) feed the cluster's limiter; latency_s=None with ok=True
        (never sent, or client gone) teaches it nothing. upstream_waiting: the upstream's own
        queue length if known. Idempotent."""
        if not self.released:
            self.released = True
            self._gate._release(self, latency_s, ok, upstream_waiting)

    def __repr__(self) -> str:
        return f"Permit({self.cluster!r}, {self.priority!r}, tenant={self.tenant!r}, waited_s={self.waited_s:.3f})"


@dataclass(eq=False)
class _Waiter:
    candidates: tuple[str, ...]
    future: asyncio.Future
    chooser: Chooser | None
    hold_until: float = math.inf          # latest start, whatever the deadline
    allow_degrade: bool = False           # a healthy fallback instead of an overload refusal
    tokens: float | None = None           # expected tokens when slots count them (cost.py)


class Gate:
    def __init__(
        self,
        config: GateConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        metrics: AdmissionMetrics | None = None,
        expected_ttft: TtftEstimate | None = None,
        chooser: Chooser | None = None,
    ) -> None:
        self.config = config or GateConfig()
        self._clock = clock
        self._metrics = metrics if metrics is not None else PrometheusAdmissionMetrics()
        self._expected_ttft = expected_ttft or (lambda cluster: None)
        self._chooser = chooser
        self._queue = AdmissionQueue(self.config.queue)
        self._limiters: dict[str, ConcurrencyLimiter] = {}
        self._caps: dict[str, dict[str, int]] = {}       # cluster -> route -> its max_in_flight
        self._in_flight: dict[str, int] = {}
        self._in_flight_by_class: dict[str, dict[str, float]] = {}  # cluster -> class -> slots used
        self._used: dict[str, float] = {}  # cluster -> slots used (requests, or their costs)
        self._costs = ClusterCosts()
        self._class_ttft: dict[tuple[str, str], SampleWindow] = {}  # on preempting clusters
        self._preempting_by_route: dict[str, frozenset[str]] = {}  # route -> its clusters that preempt
        self._preempting: frozenset[str] = frozenset()
        self._hold_s: dict[str, float] = {}  # mean slot hold time of answered requests, per cluster
        self._drain = DrainMeter(self.config.drain_window_s)
        self._waits = {name: SampleWindow(self.config.wait_stats_window_s, 1024) for name in self.config.queue.names}
        self._share = dict.fromkeys(self.config.queue.names, 0.0)  # of recent admissions, per class

    # -- the request path --------------------------------------------------------------------

    async def acquire(
        self,
        candidates: Sequence[str],
        priority: str | None,
        tenant: str,
        deadline: float | None = None,
        now: float | None = None,
        *,
        chooser: Chooser | None = None,
        allow_degrade: bool = False,
        hold_until: float = math.inf,
        degrade_after_s: float | None = None,
        tenant_weight: int = 1,
        tokens: float | None = None,
    ) -> Permit | Refusal | Degrade:
        """A slot on one of `candidates` (cluster names, in preference order), a refusal, or a
        degrade. `deadline`: absolute on the gate's clock (None or inf: now + default_deadline_s),
        when the first token must come; `hold_until`: the latest the request may leave the
        queue whatever its deadline (the sidecar's own hold limit); `now`: the gate's clock()
        unless given. `chooser` picks among the candidates with a free
        slot (default: the gate's, else the first). Cancelling the awaiting task (the client went
        away) takes the request out of the queue at once; it never holds a slot.

        `allow_degrade`: the caller has a healthy fallback outside this gate. Then a request
        the gate would refuse as overloaded (a 503: its deadline cannot cover the expected
        wait, the queue is full, it is evicted or its latest start passes while queued) is a
        Degrade instead, and so is one whose expected wait exceeds `degrade_after_s` (the
        route's; None: the gate's degrade_after_s for its degrade_classes), at once, or once it
        has waited that long. `tenant_weight`: the tenant's share among its class's tenants
        while they compete for slots. `tokens`: the request's expected tokens where the route
        counts slots and shares in tokens (cost.py); None: it counts as one request."""
        require(bool(candidates), "candidates", "must not be empty", list(candidates))
        now = self._clock() if now is None else now
        cls = self.config.queue.resolve(priority)
        if deadline is None or not math.isfinite(deadline):
            deadline = now + self.config.default_deadline_s
        clusters = tuple(dict.fromkeys(candidates))
        for cluster in clusters:
            limiter = self._limiter(cluster)
            self._costs.offered(cluster, tokens, limiter.limit)
        chooser = chooser or self._chooser
        free = [c for c in clusters if self._has_slot(c, cls, tokens)]
        wait = 0.0 if free else self._expected_wait(cls, tenant, clusters, now, tenant_weight)
        ttft = self._ttft(free or clusters, cls)
        if admit_or_refuse(deadline - now, wait, ttft) == "refuse" or wait > hold_until - now:
            return self._refuse(cls, "deadline", now, allow_degrade and not free)
        if free:
            return self._grant(_choose(chooser, free), cls, tenant, 0.0, queued=False, tokens=tokens)
        if degrade_after_s is None and cls in self.config.degrade_classes:
            degrade_after_s = self.config.degrade_after_s
        if not allow_degrade:
            degrade_after_s = None
        if degrade_after_s is not None and wait > degrade_after_s:
            return self._degrade(cls, 0.0)
        waiter = _Waiter(clusters, asyncio.get_running_loop().create_future(), chooser, hold_until, allow_degrade,
                         tokens)
        cost = self._costs.slots(clusters[0], tokens, self._limiters[clusters[0]].limit)
        pushed = self._queue.push(cls, tenant, deadline, now, waiter, tenant_weight, cost)
        if pushed.entry is None:
            return self._refuse(cls, pushed.refused or "queue_full", now, allow_degrade)
        entry = pushed.entry
        if pushed.evicted is not None:
            evicted = pushed.evicted
            self._resolve(evicted, self._refuse(evicted.priority, "evicted", now, evicted.item.allow_degrade,
                                                now - evicted.arrival))
        self._report_depths()
        return await self._wait(entry, waiter, now, degrade_after_s)

    async def _wait(self, entry: Entry, waiter: _Waiter, now: float,
                    degrade_after: float | None) -> Permit | Refusal | Degrade:
        loop = asyncio.get_running_loop()
        # Out at the last moment a slot could still answer in time: the deadline less the
        # expected time to first token (a later slot would only run for a client gone).
        latest_start = min(entry.deadline - self._ttft(waiter.candidates, entry.priority), waiter.hold_until)
        timers = [loop.call_later(max(0.0, latest_start - now), self._on_deadline, entry)]
        if degrade_after is not None:
            timers.append(loop.call_later(degrade_after, self._on_degrade, entry))
        try:
            return await waiter.future
        except asyncio.CancelledError:
            self._abandon(entry, waiter)
            raise
        finally:
            for timer in timers:
                timer.cancel()

    # -- reading -----------------------------------------------------------------------------

    def queue_depth(self, priority: str | None = None) -> int:
        """Waiting requests of one class, or of all with None."""
        return self._queue.depth(priority)

    def limit(self, cluster: str) -> int:
        return self._limiter(cluster).limit

    def in_flight(self, cluster: str) -> int:
        return self._in_flight.get(cluster, 0)

    def drain_rate(self, now: float | None = None) -> float | None:
        """Slots freed per second recently, over all clusters; None when unknown."""
        return self._drain.rate(self._clock() if now is None else now)

    def service_rate(self, clusters: Sequence[str] | None = None) -> float | None:
        """Slots these clusters (all with None) free per second while busy: each one's limit over
        its mean slot hold time, summed over those with a known hold time; None when none has one."""
        clusters = self._limiters if clusters is None else clusters
        rates = [self._limiters[c].limit / self._hold_s[c] for c in clusters if self._hold_s.get(c)]
        return sum(rates) if rates else None

    def wait_stats(self, priority: str, now: float | None = None) -> WaitStats:
        window = self._waits[self.config.queue.resolve(priority)]
        now = self._clock() if now is None else now
        return WaitStats(window.count(now), window.quantile(0.5, now), window.quantile(P95, now))

    # -- inside ------------------------------------------------------------------------------

    def cap_route(self, route: str, caps: Mapping[str, int], preempting: Iterable[str] = ()) -> None:
        """A route's max_in_flight per cluster (its whole set: a cluster it no longer names, or
        names without a cap, is freed of it). Routes sharing a cluster share its limiter, so
        the strictest cap any of them sets holds. A changed cap restarts the cluster's limiter
        (its requests in flight stay counted), and a raised one lets waiters in at once.
        `preempting`: the route's clusters whose engine schedules by priority and preempts a
        running lower class for a higher one; there a request counts against the limit only
        with the requests of its own class and higher."""
        self._preempting_by_route[route] = frozenset(preempting)
        before, self._preempting = self._preempting, frozenset().union(*self._preempting_by_route.values())
        if before != self._preempting:
            self._dispatch(self._clock())
        touched = {cluster for cluster, by_route in self._caps.items() if route in by_route} | set(caps)
        for cluster in touched:
            by_route = self._caps.setdefault(cluster, {})
            by_route.pop(route, None)
            if caps.get(cluster):
                by_route[route] = caps[cluster]
            if not by_route:
                del self._caps[cluster]
            self._apply_cap(cluster)

    def _apply_cap(self, cluster: str) -> None:
        base = self.config.limiter_for(cluster)
        caps = self._caps.get(cluster)
        config = base
        if caps:
            max_limit = min(caps.values())
            config = dataclasses.replace(base, max_limit=max_limit, min_limit=min(base.min_limit, max_limit),
                                         initial_limit=min(base.initial_limit, max_limit))
        current = self._limiters.get(cluster)
        if current is None or current.config != config:
            self._limiters[cluster] = ConcurrencyLimiter(config)
            self._in_flight.setdefault(cluster, 0)
            self._metrics.concurrency(cluster, self._limiters[cluster].limit, self._in_flight[cluster])
            self._dispatch(self._clock())

    def _limiter(self, cluster: str) -> ConcurrencyLimiter:
        limiter = self._limiters.get(cluster)
        if limiter is None:
            limiter = self._limiters[cluster] = ConcurrencyLimiter(self.config.limiter_for(cluster))
            self._in_flight[cluster] = 0
            self._metrics.concurrency(cluster, limiter.limit, 0)
        return limiter

    def _has_slot(self, cluster: str, cls: str | None = None, tokens: float | None = None,
                  any_room: bool = False) -> bool:
        """Room on the cluster for a request of class `cls` (None: of the highest class) and
        `tokens` expected tokens (None: one slot); any_room: for the smallest request. A
        request alone on the cluster always fits."""
        names = self.config.queue.names
        cls = cls or names[0]
        limit = self._limiters[cluster].limit
        if cls != names[0]:
            limit -= min(self.config.reserved_top_slots, limit - 1)
        used = self._used.get(cluster, 0.0)
        if cluster in self._preempting:     # the engine preempts lower classes to run this one
            by_class = self._in_flight_by_class.get(cluster, {})
            used = sum(by_class.get(name, 0.0) for name in names[:names.index(cls) + 1])
        if any_room:
            return used < limit
        need = self._costs.slots(cluster, tokens, self._limiters[cluster].limit)
        return used + need <= limit + 1e-9 or used < 1e-9

    def _ttft(self, clusters: Sequence[str], cls: str | None = None) -> float:
        """The best expected time to first token among these clusters for a request of class
        `cls`; 0 when none is known. On a cluster whose engine preempts, a lower class may be
        preempted on the way to its first token: its own recent tail there counts when higher
        (the cluster's mean spans every class and hides that tail)."""
        known = []
        for cluster in clusters:
            t = self._expected_ttft(cluster)
            if t is not None and math.isfinite(t) and t >= 0:
                window = self._class_ttft.get((cluster, cls)) if cluster in self._preempting else None
                now = self._clock()
                if window is not None and window.count(now) >= MIN_CLASS_TTFT_SAMPLES:
                    t = max(t, window.quantile(CLASS_TTFT_QUANTILE, now) or 0.0)
                known.append(t)
        return min(known, default=0.0)

    def _rate(self, clusters: Sequence[str] | None, now: float) -> float | None:
        """How fast queued requests get slots. A queue only forms while its clusters are at
        their limits, so their service rate, not the recent drain rate: after a quiet spell the
        drain rate still counts the quiet seconds and would refuse the start of every burst."""
        return self.service_rate(clusters) or self._drain.rate(now)

    def _expected_wait(self, cls: str, tenant: str, clusters: Sequence[str], now: float, tenant_weight: int = 1) -> float:
        """Admissions until served over the rate this class gets: the higher classes' recent
        share of admissions goes to the requests they keep sending meanwhile (never below the
        share the weights guarantee this class against them)."""
        rate = self._rate(clusters, now)
        if not rate:
            return 0.0
        classes = self.config.queue.classes
        rank = self.config.queue.names.index(cls)
        guaranteed = classes[rank].weight / sum(c.weight for c in classes[:rank + 1])
        higher = sum(self._share[c.name] for c in classes[:rank])
        return self._queue.position(cls, tenant, tenant_weight) / (rate * max(guaranteed, 1.0 - higher))

    def _retry_after(self, now: float) -> float:
        cfg = self.config
        return retry_after_s(len(self._queue), self._rate(None, now), cfg.retry_after_min_s, cfg.retry_after_max_s)

    def _refuse(self, cls: str, reason: str, now: float, degrade: bool = False,
                waited_s: float = 0.0) -> Refusal | Degrade:
        """A refusal, or with `degrade` (a healthy fallback) a Degrade where the refusal would
        be for overload (503); a tenant over its own share is refused all the same."""
        if degrade and REASON_STATUS[reason] == 503:
            return self._degrade(cls, waited_s)
        self._metrics.refused(cls, reason)
        return Refusal(reason, self._retry_after(now))

    def _degrade(self, cls: str, waited_s: float) -> Degrade:
        self._waits[cls].add(self._clock(), waited_s)
        self._metrics.degraded(cls, waited_s)
        return Degrade(waited_s)

    def _grant(self, cluster: str, cls: str, tenant: str, waited_s: float, queued: bool,
               tokens: float | None = None) -> Permit:
        slots = self._costs.slots(cluster, tokens, self._limiters[cluster].limit)
        self._in_flight[cluster] += 1
        self._used[cluster] = self._used.get(cluster, 0.0) + slots
        by_class = self._in_flight_by_class.setdefault(cluster, {})
        by_class[cls] = by_class.get(cls, 0.0) + slots
        in_flight = self._in_flight[cluster]
        self._waits[cls].add(self._clock(), waited_s)
        for name, share in self._share.items():
            self._share[name] = share + SHARE_EWMA_ALPHA * ((name == cls) - share)
        self._metrics.admitted(cls, waited_s, queued)
        self._metrics.concurrency(cluster, self._limiters[cluster].limit, in_flight)
        return Permit(self, cluster, cls, tenant, waited_s, in_flight, self._clock(), slots)

    def _release(self, permit: Permit, latency_s: float | None, ok: bool, upstream_waiting: float | None) -> None:
        now = self._clock()
        cluster = permit.cluster
        self._in_flight[cluster] = max(0, self._in_flight[cluster] - 1)
        self._used[cluster] = max(0.0, self._used.get(cluster, 0.0) - permit.slots)
        by_class = self._in_flight_by_class.get(cluster, {})
        by_class[permit.priority] = max(0.0, by_class.get(permit.priority, 0.0) - permit.slots)
        self._drain.add(now)
        limiter = self._limiters[cluster]
        sample = latency_s
        if cluster in self._preempting and permit.priority != self.config.queue.names[0]:
            # A lower class waits behind the engine's preemptions by design; that is not the
            # cluster's overload, and would shrink the limit that keeps its batch full.
            sample = None
        if sample is not None or not ok:
            limiter.on_sample(sample, ok, permit._in_flight, now, upstream_waiting)
        if latency_s is not None and ok and cluster in self._preempting:
            key = (cluster, permit.priority)
            window = self._class_ttft.get(key)
            if window is None:
                window = self._class_ttft[key] = SampleWindow(self.config.wait_stats_window_s, 1024)
            window.add(now, latency_s)
        if latency_s is not None and ok:  # answered: the slot was held for a whole request
            held = max(0.0, now - permit._granted_at)
            mean = self._hold_s.get(cluster)
            self._hold_s[cluster] = held if mean is None else mean + HOLD_EWMA_ALPHA * (held - mean)
        self._metrics.concurrency(cluster, limiter.limit, self._in_flight[cluster])
        self._dispatch(now)

    def _dispatch(self, now: float) -> None:
        """Hand free slots to waiters, in the queue's order. Invariant kept by calling this after
        every freed slot: no waiter waits while one of its candidates has a free slot."""
        for entry in self._queue.expire(now):
            self._resolve(entry, self._refuse(entry.priority, "expired", now))
        while len(self._queue):
            if not any(self._has_slot(c, any_room=True) for c in self._limiters):
                break
            entry = self._queue.pop(lambda e: any(self._has_slot(c, e.priority, e.item.tokens)
                                                  for c in e.item.candidates))
            if entry is None:
                break
            waiter: _Waiter = entry.item
            if waiter.future.done():  # its task was cancelled and has not yet run its handler
                continue
            cluster = _choose(waiter.chooser, [c for c in waiter.candidates
                                               if self._has_slot(c, entry.priority, waiter.tokens)])
            if admit_or_refuse(entry.deadline - now, 0.0, self._ttft([cluster], entry.priority)) == "refuse":
                # Too late to answer in time: the slot goes to the next one, not to wasted work.
                waiter.future.set_result(self._refuse(entry.priority, "expired", now, waiter.allow_degrade,
                                                      now - entry.arrival))
                continue
            waiter.future.set_result(self._grant(cluster, entry.priority, entry.tenant, now - entry.arrival,
                                                 queued=True, tokens=waiter.tokens))
        self._report_depths()

    def _on_deadline(self, entry: Entry) -> None:
        if self._queue.remove(entry):
            now = self._clock()
            self._resolve(entry, self._refuse(entry.priority, "expired", now, entry.item.allow_degrade,
                                              now - entry.arrival))
            self._report_depths()

    def _on_degrade(self, entry: Entry) -> None:
        if self._queue.remove(entry):
            self._resolve(entry, self._degrade(entry.priority, self._clock() - entry.arrival))
            self._report_depths()

    def _abandon(self, entry: Entry, waiter: _Waiter) -> None:
        """The waiting task was cancelled: leave the queue, or give back a slot granted meanwhile."""
        if self._queue.remove(entry):
            self._report_depths()
        future = waiter.future
        if future.done() and not future.cancelled() and isinstance(future.result(), Permit):
            future.result().release()

    def _resolve(self, entry: Entry, result: Refusal | Degrade) -> None:
        future = entry.item.future
        if not future.done():
            future.set_result(result)

    def _report_depths(self) -> None:
        for cls, depth in self._queue.depths().items():
            self._metrics.queue_depth(cls, depth)


def _choose(chooser: Chooser | None, free: Sequence[str]) -> str:
    """The chooser's pick among the free clusters; the first one without a chooser, or when the
    chooser names a cluster that is not free."""
    if chooser is not None:
        picked = chooser(free)
        if picked in free:
            return picked
    return free[0]
