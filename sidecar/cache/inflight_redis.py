"""In-flight dedup across sidecar replicas for exact keys, over Redis; near prompts (and the
leaders' token states their verifier reads) stay local.

`RedisInFlight` wraps an `InFlight` and has the same `join`. Per replica, the local flight of
a key decides; only its leader talks to Redis:

- It claims the key with `SET sluice:{scope}:lease:<key> <token> NX PX lease_ms` (renewed every
  lease_ms/3 while upstream is slow). Won: it leads for every replica.
- Lost: it waits for the owner on `sluice:{scope}:flight:<key>` (pub/sub, one shared connection
  per replica), holding its local flight so the replica's other requests keep following it.
  It subscribes first and claims again after, so a completion in between is not missed:
  completing writes `sluice:{scope}:done:<key>` (PX done_ms) and publishes in one script, and
  claiming reads that key before trying the lease. It claims again on "abandoned", and every
  poll_s anyway (a crashed owner's lease simply expires).
- Complete: the answer goes to local followers at once, then to Redis in the background.
  Abandon: one local follower takes over (and claims the lease in turn); the lease is deleted
  only if still ours (compare-and-delete) and "abandoned" is published, so the first replica to
  win the new SET NX leads.

A key completed less than done_ms ago counts as in flight: a newcomer gets that answer, except
for PURGE_MARKER_MS after an admin purge of its scope (`purge_marker`), when done answers are
ignored, even ones written since (dedup then only by lease, so nothing purged is served again).
Redis is never waited on for more than op_timeout_s; after a failure it is left alone for
retry_after_s and the replica dedups on its own, so requests neither fail nor hang. Keys carry
the hash tag `{scope}`, so one scope's keys share a Redis Cluster slot.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Awaitable, Callable

from redis.asyncio import Redis
from redis.exceptions import RedisError

from sidecar.cache.inflight import (
    TIMED_OUT, Answered, Follow, InFlight, Lead, Near, WaitResult, Promoted)
from sidecar.cache.store import PURGE_MEMORY_S
from sidecar.redis_retry import once_more_on_a_closed_connection

__all__ = ["RedisInFlight"]

log = logging.getLogger("sluice.inflight")

# KEYS: lease, done, the scope's purge marker. ARGV: token, lease_ms.
# -> {1, payload} done | {2} leads | {3} follows. A recent purge of the scope voids done answers.
_CLAIM = """
if redis.call('EXISTS', KEYS[3]) == 0 then
  local done = redis.call('GET', KEYS[2])
  if done then return {1, done} end
end
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return {2} end
return {3}
"""
# How long a purge voids the answers leaders left for late twins (well past done_ms) and the
# store drops puts asked for before it (its value: when, in ms).
PURGE_MARKER_MS = int(PURGE_MEMORY_S * 1000)
# KEYS: lease. ARGV: token, lease_ms.
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""
# KEYS: lease, done. ARGV: token, payload, done_ms, channel.
_COMPLETE = """
redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
redis.call('PUBLISH', ARGV[4], 'D' .. ARGV[2])
return 1
"""
# KEYS: lease. ARGV: token, channel.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.call('PUBLISH', ARGV[2], 'A')
  return 1
end
return 0
"""
_DONE, _ABANDONED = b"D", b"A"


class _Unavailable(Exception):
    """Redis failed or is being left alone: dedup within this replica only."""


def _names(scope: str, key: str) -> tuple[str, str, bytes, str]:
    """The key's lease, its done answer and its channel, and the scope's purge marker."""
    if "{" in scope or "}" in scope:
        raise ValueError(f"scope: must not contain braces (it is the Redis hash tag), got {scope!r}")
    prefix = f"sluice:{{{scope}}}:"
    return (prefix + "lease:" + key, prefix + "done:" + key, (prefix + "flight:" + key).encode(),
            prefix + "purged")


def purge_marker(scope: str) -> str:
    """Set (PX PURGE_MARKER_MS) by a purge of the scope: claims then ignore the answers its
    leaders left for late twins, which would serve the purged answer again. One key, not a
    scan of the keyspace for the scope's done keys."""
    return _names(scope, "")[3]


class RedisInFlight:
    """See the module doc. One per sidecar process; `aclose` it on shutdown."""

    def __init__(self, redis: Redis, local: InFlight | None = None, *, lease_ms: int = 5_000,
                 done_ms: int = 5_000, poll_s: float = 0.25, op_timeout_s: float = 0.05,
                 retry_after_s: float = 1.0, clock: Callable[[], float] = time.monotonic,
                 replica_id: str | None = None):
        if redis.get_encoder().decode_responses:
            raise ValueError("redis: payloads are bytes, create the client with decode_responses=False")
        for name, value in (("lease_ms", lease_ms), ("done_ms", done_ms), ("poll_s", poll_s),
                            ("op_timeout_s", op_timeout_s), ("retry_after_s", retry_after_s)):
            if value <= 0:
                raise ValueError(f"{name}: must be > 0, got {value!r}")
        self.local = local or InFlight()
        self._redis = redis
        self._lease_ms, self._done_ms, self._poll_s = lease_ms, done_ms, poll_s
        self._op_timeout_s, self._retry_after_s, self._clock = op_timeout_s, retry_after_s, clock
        self._replica = replica_id or uuid.uuid4().hex[:12]
        self._tokens = 0
        self._down_until = float("-inf")
        self._claim_script = redis.register_script(_CLAIM)
        self._renew_script = redis.register_script(_RENEW)
        self._complete_script = redis.register_script(_COMPLETE)
        self._release_script = redis.register_script(_RELEASE)
        self._channels = _Channels(redis, on_error=self._mark_down)
        self._tasks: set[asyncio.Task] = set()
        self._remote_waits = 0

    async def join(self, scope: str, key: str, near: Near | None = None) -> Lead | Follow:
        names = _names(scope, key)
        ticket = await self.local.join(scope, key, near)
        if isinstance(ticket, Follow):
            return _RelayFollow(self, ticket)
        if not ticket.registered or not self.available:
            return ticket
        try:
            claimed = await self._claim(ticket, names)
        except _Unavailable:
            return ticket
        except BaseException:  # cancelled while asking Redis: nobody else will end it
            ticket.abandon()
            raise
        if claimed is None:
            return _RemoteFollow(self, ticket, names)
        if isinstance(claimed, Answered):
            return _Done(claimed)
        return claimed

    @property
    def available(self) -> bool:
        """False while Redis is being left alone after a failure."""
        return self._clock() >= self._down_until

    def stats(self) -> dict[str, int]:
        """The local stats, plus `remote_waits` (flights waiting on another replica) and
        `redis_available` (0 while Redis is left alone)."""
        return {**self.local.stats(), "remote_waits": self._remote_waits,
                "redis_available": int(self.available)}

    async def aclose(self) -> None:
        """Finish background writes (bounded), close the pub/sub connection."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=4 * self._op_timeout_s)
        for task in list(self._tasks):
            task.cancel()
        await self._channels.aclose()

    # ------------------------------------------------------------ internals

    def _mark_down(self) -> None:
        if self.available:
            log.warning("redis unavailable: in-flight dedup within this replica for %.1fs",
                        self._retry_after_s)
        self._down_until = self._clock() + self._retry_after_s

    async def _call(self, op: Callable[[], Awaitable], *, always: bool = False):
        """One Redis operation, bounded; `always` tries even while Redis is left alone."""
        if not (always or self.available):
            raise _Unavailable
        try:
            return await asyncio.wait_for(once_more_on_a_closed_connection(op), self._op_timeout_s)
        except (RedisError, OSError, asyncio.TimeoutError) as e:
            log.debug("redis operation failed: %r", e)
            self._mark_down()
            raise _Unavailable from e

    def _spawn(self, op: Callable[[], Awaitable]) -> asyncio.Task:
        async def run():
            try:
                await self._call(op, always=True)
            except _Unavailable:
                pass
        task = asyncio.get_running_loop().create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _claim(self, local: Lead, names) -> Answered | Lead | None:
        """Answered (done already; local followers got it), a Lead holding the lease, or None
        (another replica leads)."""
        lease, done, channel, purged = names
        if not self.available:
            raise _Unavailable
        self._tokens += 1
        token = f"{self._replica}:{self._tokens}"
        try:
            reply = await self._call(lambda: self._claim_script(
                keys=[lease, done, purged], args=[token, self._lease_ms]))
        except BaseException:  # it may have won the lease all the same: let it go
            self._spawn(lambda: self._release_script(keys=[lease], args=[token, channel]))
            raise
        if reply[0] == 1:
            local.complete(reply[1])
            return Answered(reply[1])
        if reply[0] == 2:
            return _RedisLead(self, local, names, token)
        return None

    async def _wait_remote(self, local: Lead, names, deadline: float) -> WaitResult:
        """Hold the local flight until another replica's leader answers, or this one leads."""
        loop = asyncio.get_running_loop()
        queue, ready = self._channels.add(names[2])
        self._remote_waits += 1
        try:
            try:
                confirmed = await self._call(lambda: asyncio.shield(ready))
            except _Unavailable:
                # No confirmation in time, though commands may still work: the pub/sub
                # connection can be dead without Redis being so (a failover behind a VIP, a
                # dropped flow). The next wait opens a new one instead of using it for minutes.
                self._channels.reset()
                raise
            if not confirmed:
                raise _Unavailable
            while True:
                claimed = await self._claim(local, names)
                if isinstance(claimed, Answered):
                    return claimed
                if claimed is not None:
                    return Promoted(claimed)
                remaining = deadline - loop.time()
                if remaining <= 0:
                    local.abandon()
                    return TIMED_OUT
                try:
                    message = await asyncio.wait_for(queue.get(), min(remaining, self._poll_s))
                except asyncio.TimeoutError:
                    continue
                if message is None:
                    raise _Unavailable
                if message[:1] == _DONE:
                    local.complete(message[1:])
                    return Answered(message[1:])
                # _ABANDONED: claim again
        except _Unavailable:
            return Promoted(local)  # lead within this replica
        except BaseException:  # our client went away: a local follower takes over
            local.abandon()
            raise
        finally:
            self._remote_waits -= 1
            self._channels.discard(names[2], queue)


class _RedisLead(Lead):
    registered = True

    def __init__(self, owner: RedisInFlight, local: Lead, names, token: str):
        self.scope, self.key = local.scope, local.key
        self._owner, self._local, self._names, self._token = owner, local, names, token
        self._ended = False
        self._renewer = asyncio.get_running_loop().create_task(self._renew())

    def complete(self, payload: bytes) -> None:
        self._local.complete(payload)  # checks the type; local followers get it now
        if self._end():
            lease, done, channel, _ = self._names
            self._owner._spawn(lambda: self._owner._complete_script(
                keys=[lease, done], args=[self._token, payload, self._owner._done_ms, channel]))

    def abandon(self) -> None:
        self._local.abandon()
        if self._end():
            lease, _, channel, _ = self._names
            self._owner._spawn(lambda: self._owner._release_script(
                keys=[lease], args=[self._token, channel]))

    def _end(self) -> bool:
        if self._ended:
            return False
        self._ended = True
        self._renewer.cancel()
        return True

    async def _renew(self) -> None:
        owner, lease = self._owner, self._names[0]
        while True:
            await asyncio.sleep(owner._lease_ms / 3000)
            try:
                if not await owner._call(lambda: owner._renew_script(
                        keys=[lease], args=[self._token, owner._lease_ms]), always=True):
                    return  # lost it (expired, another replica leads): nothing left to renew
            except _Unavailable:
                pass


class _RemoteFollow(Follow):
    """This replica's leader of a key while another replica's leader goes upstream."""

    similarity = 1.0

    def __init__(self, owner: RedisInFlight, local: Lead, names):
        self._owner, self._local, self._names = owner, local, names
        self._waited = False

    async def wait(self, timeout_s: float) -> WaitResult:
        if self._waited:
            raise RuntimeError("Follow.wait may be called once")
        self._waited = True
        deadline = asyncio.get_running_loop().time() + timeout_s
        return await self._owner._wait_remote(self._local, self._names, deadline)


class _RelayFollow(Follow):
    """A local follower; promoted, it claims the key in Redis before going upstream."""

    def __init__(self, owner: RedisInFlight, follow: Follow):
        self.similarity = follow.similarity
        self._owner, self._follow = owner, follow

    async def wait(self, timeout_s: float) -> WaitResult:
        deadline = asyncio.get_running_loop().time() + timeout_s
        outcome = await self._follow.wait(timeout_s)
        if not isinstance(outcome, Promoted) or not outcome.lead.registered \
                or not self._owner.available:
            return outcome
        local = outcome.lead
        return await self._owner._wait_remote(local, _names(local.scope, local.key), deadline)


class _Done(Follow):
    """The key was completed moments ago on some replica."""

    similarity = 1.0

    def __init__(self, answer: Answered):
        self._answer = answer

    async def wait(self, timeout_s: float) -> WaitResult:
        return self._answer


class _Channels:
    """One pub/sub connection for every remote wait of a replica.

    `add` registers interest at once; a single task sends SUBSCRIBE/UNSUBSCRIBE in order, so a
    cancelled waiter never interrupts a command, and a reader task delivers messages. The
    `ready` future of `add` is True once the server has confirmed the subscription (messages
    published after that reach the queue), False if the connection failed. On failure every
    queue gets None and everything starts afresh on the next `add`.
    """

    def __init__(self, redis: Redis, on_error: Callable[[], None]):
        self._redis, self._on_error = redis, on_error
        self._queues: dict[bytes, list[asyncio.Queue]] = {}
        self._ready: dict[bytes, asyncio.Future] = {}
        self._sent: set[bytes] = set()            # subscribed on the server, or on the way
        self._unconfirmed: dict[bytes, int] = {}  # SUBSCRIBEs sent and not confirmed yet
        self._wake = asyncio.Event()
        self._pubsub = None
        self._tasks: list[asyncio.Task] = []
        self._closing: set[asyncio.Task] = set()  # pub/subs of failed connections

    def add(self, channel: bytes) -> tuple[asyncio.Queue, asyncio.Future]:
        queue: asyncio.Queue = asyncio.Queue()
        self._queues.setdefault(channel, []).append(queue)
        ready = self._ready.get(channel)
        if ready is None:
            ready = self._ready[channel] = asyncio.get_running_loop().create_future()
            if channel in self._sent and not self._unconfirmed.get(channel):
                ready.set_result(True)
        if not self._tasks:
            self._pubsub = self._redis.pubsub()
            self._tasks = [asyncio.get_running_loop().create_task(self._send(self._pubsub))]
        self._wake.set()
        return queue, ready

    def discard(self, channel: bytes, queue: asyncio.Queue) -> None:
        queues = self._queues.get(channel)
        if queues is None or queue not in queues:
            return
        queues.remove(queue)
        if not queues:
            del self._queues[channel]
            self._ready.pop(channel)
            self._wake.set()

    async def aclose(self) -> None:
        pubsub = self._fail(closing=True)
        if pubsub is not None:
            await pubsub.aclose()
        if self._closing:
            await asyncio.wait(set(self._closing), timeout=1.0)

    async def _send(self, pubsub) -> None:
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                wanted = set(self._queues)
                if subscribe := wanted - self._sent:
                    self._sent |= subscribe
                    for channel in subscribe:
                        self._unconfirmed[channel] = self._unconfirmed.get(channel, 0) + 1
                    await pubsub.subscribe(*subscribe)
                    if len(self._tasks) == 1:  # the first SUBSCRIBE made the connection
                        self._tasks.append(asyncio.get_running_loop().create_task(self._read(pubsub)))
                if unsubscribe := self._sent - wanted:
                    self._sent -= unsubscribe
                    await pubsub.unsubscribe(*unsubscribe)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.debug("redis pub/sub failed: %r", e)
            self._fail()

    async def _read(self, pubsub) -> None:
        try:
            while True:
                message = await pubsub.get_message(timeout=None)
                if message is None:
                    continue
                channel = message["channel"]
                if message["type"] == "message":
                    for queue in self._queues.get(channel, ()):
                        queue.put_nowait(message["data"])
                elif message["type"] == "subscribe":
                    left = self._unconfirmed.get(channel, 1) - 1
                    if left > 0:
                        self._unconfirmed[channel] = left
                        continue
                    self._unconfirmed.pop(channel, None)
                    ready = self._ready.get(channel)
                    if ready is not None and not ready.done() and channel in self._sent:
                        ready.set_result(True)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.debug("redis pub/sub failed: %r", e)
            self._fail()

    def reset(self) -> None:
        """Drop the connection (its waiters are told); the next `add` opens a new one."""
        self._fail()

    def _fail(self, closing: bool = False):
        """Drop the connection and wake every waiter; returns the pub/sub to close."""
        if not closing and self._tasks:
            self._on_error()
        for task in self._tasks:
            if task is not asyncio.current_task():
                task.cancel()
        pubsub, self._pubsub, self._tasks = self._pubsub, None, []
        if pubsub is not None and not closing:
            task = asyncio.get_running_loop().create_task(pubsub.aclose())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        for queues in self._queues.values():
            for queue in queues:
                queue.put_nowait(None)
        for ready in self._ready.values():
            if not ready.done():
                ready.set_result(False)
        self._queues.clear()
        self._ready.clear()
        self._sent.clear()
        self._unconfirmed.clear()
        return pubsub
