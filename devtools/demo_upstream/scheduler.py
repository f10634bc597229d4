"""Continuous-batching slots, first come first served or by priority as vLLM schedules them.

`capacity` requests run at once (0 = unlimited); the rest wait. With the "fcfs" policy they
wait in arrival order. With "priority" (vLLM's `--scheduling-policy priority`) they wait in
(priority, arrival) order, lower priority values first, and a waiting request whose priority
is better than a running one's preempts it: the running request with the worst priority (the
latest arrival among equals) goes back to the waiting queue, its KV cache lost. When it runs
again it pays a prefill over its prompt and the tokens it already produced (vLLM's recompute
preemption) and redoes the step it was in; the tokens it had sent stay sent.

`kv_tokens` (0 = unlimited) bounds the running batch in tokens as well: each request holds its
prompt plus its whole completion budget while it runs (as TGI's max_batch_total_tokens), and
the head of the waiting queue waits until it fits, holding up those behind it; a request alone
always runs. One long-context request can thus hold the room of many short ones.

A request's engine time goes through `Run.until`, which is where a preemption takes effect.
A waiter whose task is cancelled (its client left) leaves the queue and is never served;
capacity may change at any time.
"""
from __future__ import annotations

import asyncio
import heapq
import itertools

POLICIES = ("fcfs", "priority")


class Run:
    """One request's hold on a slot."""

    def __init__(self, slots: Slots, priority: int, seq: int, tokens: int = 0) -> None:
        self.priority, self.seq, self.tokens = priority, seq, tokens
        self.preemptions = 0
        self._slots = slots
        self._admitted: asyncio.Future[None] | None = None  # while waiting for a slot
        self._wake: asyncio.Future[bool] | None = None      # while sleeping: True when preempted
        self._preempted = False
        self._shift = 0.0       # seconds every due time moved by preemptions
        self._step_start: float | None = None

    @property
    def key(self) -> tuple[int, int]:
        return (self.priority, self.seq)

    def __lt__(self, other: Run) -> bool:
        return self.key < other.key

    async def until(self, due: float, recompute_s: float) -> None:
        """Engine work until `due` (the loop's time, as if never preempted). A preemption
        meanwhile: wait for a slot again, then `recompute_s` of prefill (0 while still in the
        first prefill, which is itself redone) and the interrupted step again from its start."""
        loop = asyncio.get_running_loop()
        if self._step_start is None:
            self._step_start = loop.time()
        while True:
            target = due + self._shift
            if not self._preempted and target > loop.time():
                self._wake = loop.create_future()
                handle = loop.call_later(target - loop.time(), _settle, self._wake, False)
                try:
                    await self._wake
                finally:
                    handle.cancel()
                    self._wake = None
            if not self._preempted:
                self._step_start = target
                return
            await self._slots._readmit(self)
            self._preempted = False
            step = target - self._step_start
            resumed = loop.time() + recompute_s
            self._shift += resumed + step - target
            self._step_start = resumed

    def _preempt(self) -> None:
        self.preemptions += 1
        self._preempted = True
        if self._wake is not None:
            _settle(self._wake, True)


def _settle(future: asyncio.Future, value: object) -> None:
    if not future.done():
        future.set_result(value)


class Slots:
    def __init__(self, capacity: int, policy: str = "fcfs", kv_tokens: int = 0) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        self._capacity = capacity
        self._kv_tokens = kv_tokens
        self.policy = policy
        self._running: set[Run] = set()
        self._waiting: list[Run] = []   # a heap on (priority, seq); fcfs: priority 0 for all
        self._seq = itertools.count()

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def capacity(self) -> int:
        return self._capacity

    @capacity.setter
    def capacity(self, value: int) -> None:
        self._capacity = value
        self._schedule()

    @property
    def kv_tokens(self) -> int:
        return self._kv_tokens

    @kv_tokens.setter
    def kv_tokens(self, value: int) -> None:
        self._kv_tokens = value
        self._schedule()

    @property
    def tokens_running(self) -> int:
        return sum(r.tokens for r in self._running)

    def run(self, priority: int = 0, tokens: int = 0) -> _Hold:
        """`async with slots.run(priority, tokens) as run:` holds a slot (and `tokens` of the
        batch's token room) for the block."""
        return _Hold(self, Run(self, priority if self.policy == "priority" else 0, next(self._seq), tokens))

    def _has_room(self, run: Run) -> bool:
        if not self._running:
            return True
        if self._capacity and len(self._running) >= self._capacity:
            return False
        return not self._kv_tokens or self.tokens_running + run.tokens <= self._kv_tokens

    def _schedule(self) -> None:
        while self._waiting:
            head = self._waiting[0]
            if not self._has_room(head):
                if self.policy != "priority" or not self._running:
                    return
                victim = max(self._running, key=lambda r: r.key)
                if victim.priority <= head.priority:
                    return
                self._running.discard(victim)
                victim._admitted = asyncio.get_running_loop().create_future()
                heapq.heappush(self._waiting, victim)
                victim._preempt()
                continue
            heapq.heappop(self._waiting)
            self._running.add(head)
            _settle(head._admitted, None)

    async def _wait(self, run: Run) -> None:
        heapq.heappush(self._waiting, run)
        self._schedule()
        if run in self._running:
            return
        try:
            await run._admitted
        except asyncio.CancelledError:
            self._leave(run)
            raise

    async def _enter(self, run: Run) -> None:
        run._admitted = asyncio.get_running_loop().create_future()
        await self._wait(run)

    async def _readmit(self, run: Run) -> None:
        """A preempted run waits (already queued by _schedule) for its slot back."""
        try:
            await run._admitted
        except asyncio.CancelledError:
            self._leave(run)
            raise

    def _leave(self, run: Run) -> None:
        """The run is done or its client left: out of the batch or the queue, wherever it is."""
        if run in self._running:
            self._running.discard(run)
        elif run in self._waiting:
            self._waiting.remove(run)
            heapq.heapify(self._waiting)
        self._schedule()


class _Hold:
    def __init__(self, slots: Slots, run: Run) -> None:
        self._slots, self._run = slots, run

    async def __aenter__(self) -> Run:
        await self._slots._enter(self._run)
        return self._run

    async def __aexit__(self, *exc_info: object) -> None:
        self._slots._leave(self._run)
