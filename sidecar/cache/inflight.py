"""In-flight dedup (request coalescing) within one sidecar process.

When a request's exact cache key, or a near-identical prompt in the same scope, is already on
its way upstream, the newcomer waits for that answer instead of going upstream itself:

    ticket = await inflight.join(scope, key, Near(vector, 0.95, prompt, same))
    if isinstance(ticket, Follow):
        outcome = await ticket.wait(timeout_s)     # bounded by the request's own deadline
        if isinstance(outcome, Answered):
            return serve(outcome.payload)
        # Promoted: the leader gave up and this request leads now; TimedOut: go alone
        ticket = outcome.lead if isinstance(outcome, Promoted) else unregistered_lead(scope, key)
    with ticket:                                   # abandons unless completed
        payload = await go_upstream()
        store_in_cache(payload)
        ticket.complete(payload)

A Lead MUST end with `complete(payload)` or `abandon()`; whichever comes first counts, so a
`finally: lead.abandon()` (or `with lead:`) is always right. Complete only with an answer the
followers may be served; on an upstream error, abandon (one follower then tries).

Handover: when a leader abandons (upstream failed, timed out, client went away) exactly one
follower is promoted, the earliest that asked for the same key; the others keep waiting for it.
If only near-identical followers are left, the flight ends and they join again in arrival order:
the first leads, the rest follow it if they are near enough to *it* (so an answer is only ever
shared between prompts that were compared with each other).

Bounds: at most `max_keys` flights and `max_followers` per flight. Beyond them `join` returns a
Lead with `registered` False: the request goes upstream as if there were no dedup. A leader's
token states (Near.states, for a `same` that reads them) are kept with its flight within
`max_states_bytes` together (default 16 MiB: ~1,400 prompts of a typical ~11 KB, 85 of the
longest the embedder reads by default, 256 tokens at 192 KiB); past it a flight keeps none, and
near prompts then follow it only where `same` decides without them. They are the array the
leader's request holds for its own cache entry anyway, not a copy.

The payload is opaque bytes. Nothing here does I/O; waiting is an asyncio future per follower.
"""
from __future__ import annotations

import abc
import asyncio
import itertools
from dataclasses import dataclass
from typing import Callable

import numpy as np

__all__ = ["InFlight", "Near", "Lead", "Follow", "Answered", "Promoted", "Released", "RELEASED", "TimedOut",
           "TIMED_OUT", "unregistered_lead"]


@dataclass(frozen=True, eq=False)
class Near:
    """Ask to share the flight of a near-identical prompt (cosine >= threshold, same scope).

    `text` and `states` (the prompt's token states, or None) are kept with this request's
    flight if it leads; `same(leader_text, cosine, leader_states)` may veto a match the cosine
    allows (e.g. `same_question(leader_text, text, cosine, settings, (leader_states,
    states)).hit`); `leader_states` is None where the leader had none or they were past
    `max_states_bytes`.
    """

    vector: np.ndarray
    threshold: float
    text: str = ""
    same: Callable[[str, float, np.ndarray | None], bool] | None = None
    states: np.ndarray | None = None

    def __post_init__(self) -> None:
        if not 0.0 < self.threshold <= 1.0:
            raise ValueError(f"threshold: must be in (0, 1], got {self.threshold!r}")


@dataclass(frozen=True)
class Answered:
    payload: bytes


@dataclass(frozen=True)
class Promoted:
    lead: "Lead"  # this request leads now: go upstream, then complete or abandon


@dataclass(frozen=True)
class TimedOut:
    pass


TIMED_OUT = TimedOut()


@dataclass(frozen=True)
class Released:
    """The leader's answer may not be shared: go upstream alone, now."""


RELEASED = Released()
# What a follower's wait ends with.
WaitResult = Answered | Promoted | Released | TimedOut


class Lead(abc.ABC):
    """The right (and duty) to go upstream for a flight. Ends with `complete` or `abandon`;
    whichever comes first counts, later calls are no-ops. As a context manager it abandons on
    exit unless completed."""

    scope: str
    key: str
    registered: bool  # False: nobody can follow this one (bounds, or dedup off)

    @abc.abstractmethod
    def complete(self, payload: bytes) -> None:
        """Hand the answer to every follower. Call it after storing the answer in the cache."""

    @abc.abstractmethod
    def abandon(self) -> None:
        """Give up; one follower takes over."""

    def release(self) -> None:
        """The answer came but may not be shared (a 4xx, Cache-Control: private, a tool call,
        ...): every follower goes upstream on its own at once, as handing over one at a time
        would only make each wait for the same refusal. Implementations without it (the
        cross-replica lead) hand over as abandon does."""
        self.abandon()

    def __enter__(self) -> "Lead":
        return self

    def __exit__(self, *exc: object) -> None:
        self.abandon()


class Follow(abc.ABC):
    """A place in a flight's queue. Await `wait` right away (once); cancelling it leaves cleanly."""

    similarity: float  # 1.0 for the same key, else the cosine to the leader's prompt

    @abc.abstractmethod
    async def wait(self, timeout_s: float) -> WaitResult:
        """Answered, Promoted (now lead: complete or abandon) or TimedOut (go upstream alone)."""


# ---------------------------------------------------------------- in-process implementation


@dataclass(frozen=True, eq=False)
class _Probe:
    """A Near with its vector made unit-length float32."""

    unit: np.ndarray
    threshold: float
    text: str
    same: Callable[[str, float, np.ndarray | None], bool] | None
    states: np.ndarray | None


def _probe(near: Near | None) -> _Probe | None:
    if near is None:
        return None
    v = np.asarray(near.vector, dtype=np.float32).ravel()
    norm = float(np.linalg.norm(v))
    if not np.isfinite(norm) or norm == 0.0:
        return None
    return _Probe(v / norm, near.threshold, near.text, near.same, near.states)


class _Flight:
    __slots__ = ("scope", "key", "probe", "lead", "waiters", "slot", "states", "states_bytes")

    def __init__(self, scope: str, key: str, probe: _Probe | None):
        self.scope, self.key, self.probe = scope, key, probe
        self.lead: _LocalLead | None = None
        self.waiters: dict[int, _Waiter] = {}  # arrival order
        self.slot = -1
        self.states: np.ndarray | None = None  # the leader's, within max_states_bytes
        self.states_bytes = 0


class _Waiter:
    __slots__ = ("id", "key", "probe", "future", "flight", "similarity")

    def __init__(self, id_: int, key: str, probe: _Probe | None, future: asyncio.Future):
        self.id, self.key, self.probe, self.future = id_, key, probe, future
        self.flight: _Flight | None = None
        self.similarity = 0.0


class _VectorIndex:
    """Unit vectors of one scope's flights, one row each; free rows are zero."""

    def __init__(self, dim: int):
        self.matrix = np.zeros((16, dim), dtype=np.float32)
        self.flights: list[_Flight | None] = [None] * 16
        self.free = list(range(15, -1, -1))
        self.size = 0

    def add(self, flight: _Flight) -> None:
        if not self.free:
            n = len(self.flights)
            self.matrix = np.concatenate([self.matrix, np.zeros_like(self.matrix)])
            self.flights.extend([None] * n)
            self.free = list(range(2 * n - 1, n - 1, -1))
        flight.slot = self.free.pop()
        self.matrix[flight.slot] = flight.probe.unit
        self.flights[flight.slot] = flight
        self.size += 1

    def remove(self, flight: _Flight) -> None:
        self.matrix[flight.slot] = 0.0
        self.flights[flight.slot] = None
        self.free.append(flight.slot)
        flight.slot = -1
        self.size -= 1

    def nearest(self, probe: _Probe) -> list[tuple[float, _Flight]]:
        """Flights at cosine >= the probe's threshold, nearest first."""
        sims = self.matrix @ probe.unit
        rows = np.flatnonzero(sims >= probe.threshold)
        rows = rows[np.argsort(-sims[rows], kind="stable")]
        return [(float(sims[r]), self.flights[r]) for r in rows]


class _LocalLead(Lead):
    def __init__(self, owner: "InFlight | None", scope: str, key: str, flight: _Flight | None):
        self.scope, self.key = scope, key
        self.registered = flight is not None
        self._owner, self._flight = owner, flight
        self._ended = False

    def complete(self, payload: bytes) -> None:
        if not isinstance(payload, bytes):
            raise TypeError(f"payload: must be bytes, got {type(payload).__name__}")
        if self._ended:
            return
        self._ended = True
        if self._flight is not None:
            self._owner._complete(self._flight, self, payload)

    def abandon(self) -> None:
        self._end_by(self._owner._abandon)

    def release(self) -> None:
        self._end_by(self._owner._release)

    def _end_by(self, hand_on) -> None:
        if self._ended:
            return
        self._ended = True
        if self._flight is not None:
            hand_on(self._flight, self)


class _LocalFollow(Follow):
    def __init__(self, owner: "InFlight", waiter: _Waiter):
        self.similarity = waiter.similarity
        self._owner, self._waiter = owner, waiter
        self._waited = False

    async def wait(self, timeout_s: float) -> WaitResult:
        if self._waited:
            raise RuntimeError("Follow.wait may be called once")
        self._waited = True
        future = self._waiter.future
        try:
            if not future.done():
                await asyncio.wait((future,), timeout=max(0.0, timeout_s))
        except asyncio.CancelledError:  # our client went away
            self._owner._leave(self._waiter)
            raise
        if future.done():
            return future.result()
        self._owner._leave(self._waiter)
        self._owner._counts["timed_out"] += 1
        return TIMED_OUT


def unregistered_lead(scope: str, key: str) -> Lead:
    """A Lead nobody follows: for requests that go upstream without dedup."""
    return _LocalLead(None, scope, key, None)


class InFlight:
    """Flights of one sidecar process; see the module doc."""

    def __init__(self, *, max_keys: int = 10_000, max_followers: int = 1_000,
                 max_states_bytes: int = 16 * 2**20):
        if max_keys < 1:
            raise ValueError(f"max_keys: must be >= 1, got {max_keys!r}")
        if max_followers < 0:
            raise ValueError(f"max_followers: must be >= 0, got {max_followers!r}")
        if max_states_bytes < 0:
            raise ValueError(f"max_states_bytes: must be >= 0, got {max_states_bytes!r}")
        self._max_keys, self._max_followers = max_keys, max_followers
        self._max_states_bytes, self._states_bytes = max_states_bytes, 0
        self._flights: dict[tuple[str, str], _Flight] = {}
        self._indexes: dict[tuple[str, int], _VectorIndex] = {}
        self._ids = itertools.count()
        self._followers = 0
        self._counts = dict.fromkeys(
            ("led", "followed_exact", "followed_near", "promoted", "released", "timed_out", "overflow",
             "states_not_kept"), 0)

    async def join(self, scope: str, key: str, near: Near | None = None) -> Lead | Follow:
        """Lead or follow the flight of `key` (or of a near prompt) in `scope`.

        Async to match the Redis-backed implementation; it never suspends, so it is atomic."""
        waiter = _Waiter(next(self._ids), key, _probe(near), asyncio.get_running_loop().create_future())
        lead = self._place(scope, waiter)
        if lead is None:
            return _LocalFollow(self, waiter)
        if lead.registered:
            self._counts["led"] += 1
        return lead

    def stats(self) -> dict[str, int]:
        """Gauges `leaders`, `followers` and `states_bytes` (leaders' token states kept) now,
        and counters since start."""
        return {"leaders": len(self._flights), "followers": self._followers,
                "states_bytes": self._states_bytes, **self._counts}

    # ------------------------------------------------------------ internals

    def _place(self, scope: str, waiter: _Waiter) -> Lead | None:
        """Attach the waiter to the flight it should follow (None), or return the Lead it gets."""
        flight, waiter.similarity = self._find(scope, waiter.key, waiter.probe)
        if flight is not None:
            self._attach(waiter, flight)
            self._counts["followed_exact" if flight.key == waiter.key else "followed_near"] += 1
            return None
        if (scope, waiter.key) in self._flights:  # same key, but no room left to follow it
            self._counts["overflow"] += 1
            return unregistered_lead(scope, waiter.key)
        return self._lead(scope, waiter.key, waiter.probe)

    def _find(self, scope: str, key: str, probe: _Probe | None) -> tuple[_Flight | None, float]:
        """The flight to follow: the same key first, else the nearest one that has room, if
        `same` agrees. Only that one is asked, as the cache's lookup asks of its nearest stored
        prompt only: `same` may be the verifier (~0.5 ms), and asking it of every flight above
        its cosine floor would hold the event loop for each flight of the scope at every join."""
        flight = self._flights.get((scope, key))
        if flight is not None:
            return (flight, 1.0) if len(flight.waiters) < self._max_followers else (None, 0.0)
        if probe is None:
            return None, 0.0
        index = self._indexes.get((scope, probe.unit.shape[0]))
        for cosine, candidate in index.nearest(probe) if index else ():
            if len(candidate.waiters) >= self._max_followers:
                continue
            if probe.same is None or probe.same(candidate.probe.text, cosine, candidate.states):
                return candidate, cosine
            break
        return None, 0.0

    def _lead(self, scope: str, key: str, probe: _Probe | None) -> Lead:
        if len(self._flights) >= self._max_keys:
            self._counts["overflow"] += 1
            return unregistered_lead(scope, key)
        flight = _Flight(scope, key, probe)
        self._flights[(scope, key)] = flight
        if probe is not None:
            dim = probe.unit.shape[0]
            self._indexes.setdefault((scope, dim), _VectorIndex(dim)).add(flight)
            self._keep_states(flight, probe.states)
        flight.lead = _LocalLead(self, scope, key, flight)
        return flight.lead

    def _keep_states(self, flight: _Flight, states: np.ndarray | None) -> None:
        """The leader's token states with its flight, if they fit within max_states_bytes."""
        if states is None:
            return
        nbytes = int(getattr(states, "nbytes", 0))
        if self._states_bytes + nbytes > self._max_states_bytes:
            self._counts["states_not_kept"] += 1
            return
        flight.states, flight.states_bytes = states, nbytes
        self._states_bytes += nbytes

    def _attach(self, waiter: _Waiter, flight: _Flight) -> None:
        waiter.flight = flight
        flight.waiters[waiter.id] = waiter
        self._followers += 1

    def _detach(self, waiter: _Waiter) -> None:
        del waiter.flight.waiters[waiter.id]
        waiter.flight = None
        self._followers -= 1

    def _end(self, flight: _Flight) -> list[_Waiter]:
        """Forget the flight; returns its waiters, detached."""
        del self._flights[(flight.scope, flight.key)]
        if flight.slot >= 0:
            index_key = (flight.scope, flight.probe.unit.shape[0])
            index = self._indexes[index_key]
            index.remove(flight)
            if index.size == 0:
                del self._indexes[index_key]
        flight.lead = None
        self._states_bytes -= flight.states_bytes
        flight.states, flight.states_bytes = None, 0
        waiters = list(flight.waiters.values())
        for waiter in waiters:
            self._detach(waiter)
        return waiters

    def _complete(self, flight: _Flight, lead: _LocalLead, payload: bytes) -> None:
        if flight.lead is not lead:
            return
        answer = Answered(payload)
        for waiter in self._end(flight):
            waiter.future.set_result(answer)

    def _abandon(self, flight: _Flight, lead: _LocalLead) -> None:
        if flight.lead is not lead:
            return
        heir = next((w for w in flight.waiters.values() if w.key == flight.key), None)
        if heir is not None:  # same key: the flight goes on under its new leader
            self._detach(heir)
            flight.lead = _LocalLead(self, flight.scope, flight.key, flight)
            self._promote(heir, flight.lead)
            return
        for waiter in self._end(flight):  # only near prompts left: each joins again
            lead = self._place(flight.scope, waiter)
            if lead is not None:
                self._promote(waiter, lead)

    def _release(self, flight: _Flight, lead: _LocalLead) -> None:
        if flight.lead is not lead:
            return
        for waiter in self._end(flight):
            self._counts["released"] += 1
            waiter.future.set_result(RELEASED)

    def _promote(self, waiter: _Waiter, lead: Lead) -> None:
        self._counts["promoted"] += 1
        waiter.future.set_result(Promoted(lead))

    def _leave(self, waiter: _Waiter) -> None:
        """A follower stops waiting (timeout or cancelled)."""
        if waiter.future.done():
            outcome = waiter.future.result()
            if isinstance(outcome, Promoted):  # promoted just as it left: pass the lead on
                outcome.lead.abandon()
            return
        self._detach(waiter)
        waiter.future.cancel()
