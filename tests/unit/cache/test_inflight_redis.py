"""In-flight dedup across replicas over a real redis-server; Redis trouble never fails a request."""
import asyncio
import shutil
import socket
import subprocess
import time

import pytest
from redis.asyncio import Redis

from sidecar.cache.inflight import Answered, Follow, InFlight, Lead, Promoted, TimedOut
from sidecar.cache.inflight_redis import RedisInFlight
from devtools.stack import free_port

PAYLOAD = b"\x00binary answer\xff"
REDIS_SERVER = shutil.which("redis-server")
pytestmark = pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server not installed")




class RedisServer:
    def __init__(self):
        self.port = free_port()
        self.proc = subprocess.Popen(
            [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 5
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.1).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.01)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture(scope="module")
def server():
    s = RedisServer()
    yield s
    s.stop()


@pytest.fixture
async def replicas(server):
    """make(**kw) -> a RedisInFlight with its own client and local InFlight: one replica."""
    made: list[RedisInFlight] = []

    def make(port: int = server.port, **kw) -> RedisInFlight:
        kw = {"poll_s": 0.05, "op_timeout_s": 0.5, **kw}  # generous: a slow test host is not an outage
        r = RedisInFlight(Redis(port=port), InFlight(), **kw)
        made.append(r)
        return r

    async with Redis(port=server.port) as admin:
        await admin.flushall()
    yield make
    for r in made:
        await r.aclose()
        await r._redis.aclose()


async def settle(seconds: float = 0.02) -> None:
    await asyncio.sleep(seconds)


async def follow_all(ticket_list, timeout=5.0):
    return await asyncio.gather(*(t.wait(timeout) for t in ticket_list))


async def test_one_replica_leads_and_the_others_followers_get_the_payload(replicas):
    a, b = replicas(), replicas()
    lead = await a.join("s", "k")
    assert isinstance(lead, Lead) and lead.registered
    a_followers = [await a.join("s", "k") for _ in range(5)]
    b_followers = [await b.join("s", "k") for _ in range(20)]
    assert all(isinstance(t, Follow) for t in a_followers + b_followers)
    waits = asyncio.gather(*(t.wait(5) for t in a_followers + b_followers))
    await settle()
    assert b.stats()["remote_waits"] == 1  # one per replica waits on Redis, the rest locally
    lead.complete(PAYLOAD)
    assert await waits == [Answered(PAYLOAD)] * 25
    assert a.stats()["leaders"] == b.stats()["leaders"] == 0
    assert b.stats()["remote_waits"] == 0 and not b._channels._queues


async def test_completion_just_before_subscribing_is_not_missed(replicas):
    a, b = replicas(), replicas()
    lead = await a.join("s", "k")
    follow = await b.join("s", "k")  # lease taken: b will wait for a
    lead.complete(PAYLOAD)           # ... but a completes before b subscribes
    await asyncio.wait(set(a._tasks))
    assert await follow.wait(1) == Answered(PAYLOAD)


async def test_a_key_completed_moments_ago_is_answered_at_once(replicas):
    a, b = replicas(done_ms=2000), replicas()
    lead = await a.join("s", "k")
    lead.complete(PAYLOAD)
    await asyncio.wait(set(a._tasks))
    ticket = await b.join("s", "k")
    assert isinstance(ticket, Follow) and await ticket.wait(0) == Answered(PAYLOAD)
    assert b.stats()["leaders"] == 0


async def test_abandon_on_one_replica_hands_over_to_exactly_one_follower(replicas):
    a, b = replicas(), replicas()
    lead = await a.join("s", "k")
    tickets = [await a.join("s", "k") for _ in range(3)] + [await b.join("s", "k") for _ in range(3)]
    waits = [asyncio.create_task(t.wait(5)) for t in tickets]
    await settle()
    lead.abandon()
    done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    await settle(0.1)  # time for a second (wrong) promotion to show up
    finished = [w for w in waits if w.done()]
    assert len(finished) == 1
    promoted = finished[0].result()
    assert isinstance(promoted, Promoted)
    promoted.lead.complete(PAYLOAD)
    assert await asyncio.gather(*(w for w in waits if w is not finished[0])) == [Answered(PAYLOAD)] * 5


async def test_abandon_with_no_local_followers_hands_over_to_another_replica(replicas):
    a, b = replicas(), replicas(poll_s=2.0)
    lead = await a.join("s", "k")
    waits = [asyncio.create_task(t.wait(5)) for t in [await b.join("s", "k") for _ in range(3)]]
    await settle()
    started = time.monotonic()
    lead.abandon()
    promoted = await waits[0]  # the one that waits on Redis for the replica
    assert isinstance(promoted, Promoted) and time.monotonic() - started < 1.0  # by message, not poll
    assert not any(w.done() for w in waits[1:])
    promoted.lead.complete(PAYLOAD)
    assert await asyncio.gather(*waits[1:]) == [Answered(PAYLOAD)] * 2


async def test_a_crashed_leaders_lease_expires_and_a_follower_takes_over(replicas):
    a, b = replicas(lease_ms=200), replicas()
    lead = await a.join("s", "k")
    lead._renewer.cancel()  # the replica dies: no renewal, no abandon
    follow = await b.join("s", "k")
    started = time.monotonic()
    outcome = await follow.wait(5)
    assert isinstance(outcome, Promoted) and 0.1 < time.monotonic() - started < 1.0
    outcome.lead.complete(PAYLOAD)


async def test_leader_renews_its_lease_while_upstream_is_slow(replicas):
    a, b = replicas(lease_ms=150), replicas()
    lead = await a.join("s", "k")
    follow = await b.join("s", "k")
    wait = asyncio.create_task(follow.wait(5))
    await settle(0.5)  # more than three leases
    assert not wait.done()
    lead.complete(PAYLOAD)
    assert await wait == Answered(PAYLOAD)


@pytest.mark.parametrize("how", ["timeout", "cancel"])
async def test_remote_waiter_that_leaves_passes_the_wait_to_a_local_follower(replicas, how):
    a, b = replicas(), replicas()
    lead = await a.join("s", "k")
    first, second = await b.join("s", "k"), await b.join("s", "k")
    leaving = asyncio.create_task(first.wait(0.1 if how == "timeout" else 5))
    stays = asyncio.create_task(second.wait(5))
    if how == "timeout":
        assert isinstance(await leaving, TimedOut)
    else:
        await settle()
        leaving.cancel()
    await settle()
    assert not stays.done()
    assert b.stats()["remote_waits"] == 1 and b.stats()["followers"] == 0
    lead.complete(PAYLOAD)
    assert await stays == Answered(PAYLOAD)
    assert b.stats()["leaders"] == b.stats()["remote_waits"] == 0 and not b._channels._queues


async def test_leader_cancelled_abandons_and_a_follower_takes_over(replicas):
    a, b = replicas(), replicas()
    lead = await a.join("s", "k")

    async def leader():
        with lead:
            await asyncio.sleep(10)

    task = asyncio.create_task(leader())
    wait = asyncio.create_task((await b.join("s", "k")).wait(5))
    await settle()
    task.cancel()
    outcome = await wait
    assert isinstance(outcome, Promoted)
    outcome.lead.abandon()
    await asyncio.wait(set(b._tasks))
    assert await b._redis.keys("*") == []


async def test_near_prompts_dedup_within_a_replica(replicas):
    import numpy as np
    from sidecar.cache.inflight import Near
    a = replicas()
    lead = await a.join("s", "k1", Near(np.array([1.0, 0.0]), 0.9))
    ticket = await a.join("s", "k2", Near(np.array([0.99, 0.14]), 0.9))
    assert isinstance(ticket, Follow)
    lead.complete(PAYLOAD)
    assert await ticket.wait(1) == Answered(PAYLOAD)


async def test_scope_with_braces_is_refused(replicas):
    with pytest.raises(ValueError, match="scope"):
        await replicas().join("a{b}", "k")


async def test_decode_responses_client_is_refused(server):
    async with Redis(port=server.port, decode_responses=True) as client:
        with pytest.raises(ValueError, match="decode_responses"):
            RedisInFlight(client)


async def timed(coro, limit=0.2):
    started = time.monotonic()
    result = await coro
    assert time.monotonic() - started < limit
    return result


@pytest.fixture
async def blackhole():
    """A port that accepts connections and never answers."""
    writers = []

    async def swallow(reader, writer):
        writers.append(writer)
        await reader.read()

    server = await asyncio.start_server(swallow, "127.0.0.1", 0)
    yield server.sockets[0].getsockname()[1]
    server.close()
    for writer in writers:
        writer.close()
    await server.wait_closed()


@pytest.mark.parametrize("where", ["refused", "blackhole"])
async def test_redis_down_never_hangs_and_local_dedup_still_works(replicas, blackhole, where):
    port = free_port() if where == "refused" else blackhole
    r = replicas(port=port, op_timeout_s=0.05)
    lead = await timed(r.join("s", "k"))
    assert isinstance(lead, Lead) and lead.registered
    follow = await timed(r.join("s", "k"))
    assert isinstance(follow, Follow)
    assert r.stats()["redis_available"] == 0
    lead.complete(PAYLOAD)
    assert await timed(follow.wait(1)) == Answered(PAYLOAD)
    lead2 = await timed(r.join("s", "k2"))  # left alone now: no Redis round trip at all
    follow2 = await timed(r.join("s", "k2"))
    lead2.abandon()
    promoted = await timed(follow2.wait(1))
    assert isinstance(promoted, Promoted)
    promoted.lead.complete(PAYLOAD)
    await timed(r.aclose(), limit=0.5)


async def test_redis_dies_while_waiting_the_waiter_leads_locally(replicas):
    own = RedisServer()
    try:
        a, b = (replicas(port=own.port, op_timeout_s=0.05) for _ in range(2))
        lead = await a.join("s", "k")
        waits = [asyncio.create_task(t.wait(5)) for t in [await b.join("s", "k") for _ in range(3)]]
        await settle()
        own.stop()
        started = time.monotonic()
        done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        assert time.monotonic() - started < 0.3
        assert len(done) == 1 and isinstance(promoted := done.pop().result(), Promoted)
        rest = [w for w in waits if not w.done()]
        promoted.lead.complete(PAYLOAD)  # Redis is gone: served to this replica's followers
        assert await asyncio.gather(*rest) == [Answered(PAYLOAD)] * 2
        lead.abandon()
    finally:
        own.stop()


async def test_redis_back_after_retry_window_is_used_again(replicas):
    now = [0.0]
    r = replicas(port=free_port(), op_timeout_s=0.05, clock=lambda: now[0])
    (await r.join("s", "k")).abandon()
    assert not r.available
    now[0] += 1.0
    assert r.available


async def test_join_cancelled_while_asking_redis_leaves_no_state(replicas):
    r = replicas()
    (await r.join("s", "warm")).abandon()  # connection made
    joining = asyncio.create_task(r.join("s", "k"))
    await asyncio.sleep(0)  # it has joined locally and is waiting for Redis
    assert r.stats()["leaders"] == 1
    joining.cancel()
    with pytest.raises(asyncio.CancelledError):
        await joining
    assert r.stats()["leaders"] == 0
    await asyncio.wait(set(r._tasks))
    assert await r._redis.keys("*lease*") == []


async def test_a_pub_sub_connection_that_confirms_nothing_is_replaced(replicas):
    """Commands work but the pub/sub connection is dead (a dropped flow): the wait that finds
    out leads locally, and the next remote wait runs on a new connection."""
    a, b = replicas(), replicas(op_timeout_s=0.2, retry_after_s=0.05)
    real_pubsub = b._redis.pubsub
    dead = []

    def pubsub_that_never_confirms():
        pubsub = real_pubsub()
        if not dead:
            async def never(*channels):
                await asyncio.sleep(3600)
            pubsub.subscribe = never
        dead.append(pubsub)
        return pubsub
    b._redis.pubsub = pubsub_that_never_confirms
    lead = await a.join("s", "k")
    first = await b.join("s", "k")
    promoted = await first.wait(2)
    assert isinstance(promoted, Promoted)                            # led locally, not stuck
    promoted.lead.abandon()
    lead.complete(PAYLOAD)
    await asyncio.wait(set(a._tasks))
    await settle(0.1)                                                # past retry_after_s
    lead2 = await a.join("s", "k2")
    second = await b.join("s", "k2")
    await settle(0.3)
    lead2.complete(PAYLOAD)
    assert await second.wait(2) == Answered(PAYLOAD) and len(dead) == 2   # a new pub/sub answered
