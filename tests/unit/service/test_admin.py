"""The Admin gRPC service (unit level): clusters, purge, drain, loopback-only."""
import grpc
import pytest

from sidecar.service.admin import AdminService, DrainStarted, admin_parts, is_loopback
from sidecar.service.admin_cli import cluster_table
from sidecar.protos import admin_pb2
from sidecar.scheduling import BreakerState
from sidecar.scheduling.model import ClusterSnapshot


class Aborted(Exception):
    pass


class Context:
    def __init__(self, peer="ipv4:127.0.0.1:40000"):
        self._peer = peer
        self.code = self.details = None

    def peer(self):
        return self._peer

    async def abort(self, code, details):
        self.code, self.details = code, details
        raise Aborted(details)


class Scheduler:
    def snapshot(self, now):
        return {"b": ClusterSnapshot("b", in_flight=2, ttfb_p95_s=0.25, error_rate=0.1, requests_in_window=20),
                "a": ClusterSnapshot("a")}

    def breaker_states(self, now):
        return {"b": BreakerState.HALF_OPEN, "c": BreakerState.OPEN}


class Store:
    def __init__(self):
        self.purged = []

    async def purge_scope(self, scope):
        self.purged.append(scope)
        return 3


class StoreWithPurgeAll(Store):
    async def purge_all(self):
        return 42


def service(store=None, **kwargs):
    drains = []

    def drain():
        drains.append(1)
        return DrainStarted(5.0, 20.0, len(drains) > 1)

    scores = {"b": 0.75}
    return AdminService(Scheduler(), store, drain, score=scores.get, **kwargs), drains


@pytest.mark.parametrize("peer, local", [
    ("ipv4:127.0.0.1:5000", True), ("ipv4:127.0.1.1:5000", True), ("ipv6:[::1]:5000", True),
    ("ipv6:[::ffff:127.0.0.1]:5000", True), ("unix:/tmp/sock", True),
    ("ipv6:%5B::1%5D:43748", True), ("ipv6:%5B::ffff:127.0.0.1%5D:1", True),   # as gRPC writes them
    ("ipv6:%5Bfe80::1%5D:43748", False),
    ("ipv4:10.0.0.7:5000", False), ("ipv6:[fe80::1]:5000", False), ("ipv4:128.0.0.1:1", False), ("", False),
])
def test_is_loopback(peer, local):
    assert is_loopback(peer) is local


async def test_list_clusters():
    admin, _ = service()
    response = await admin.ListClusters(admin_pb2.ListClustersRequest(), Context())
    a, b, c = response.clusters
    assert (a.name, a.breaker, a.HasField("score"), a.HasField("ttfb_p95_s"), a.HasField("error_rate")) == (
        "a", "closed", False, False, False)
    assert (b.name, b.breaker, b.score, b.in_flight, b.ttfb_p95_s, b.error_rate, b.requests_in_window) == (
        "b", "half_open", 0.75, 2, 0.25, 0.1, 20)
    assert (c.name, c.breaker) == ("c", "open")
    table = cluster_table(response.clusters).splitlines()
    assert table[0].split() == ["cluster", "breaker", "score", "in_flight", "ttfb_p95", "error_rate", "requests"]
    assert table[2].split() == ["b", "half_open", "0.75", "2", "250ms", "10.0%", "20"]


async def test_remote_peers_are_refused_unless_allowed():
    admin, drains = service()
    context = Context("ipv4:10.1.2.3:5555")
    for call, request in ((admin.ListClusters, admin_pb2.ListClustersRequest()),
                          (admin.Drain, admin_pb2.DrainRequest()),
                          (admin.PurgeCache, admin_pb2.PurgeCacheRequest(all=True))):
        with pytest.raises(Aborted):
            await call(request, context)
        assert context.code == grpc.StatusCode.PERMISSION_DENIED
    assert drains == []
    allowed, _ = service(allow_remote=True)
    assert len((await allowed.ListClusters(admin_pb2.ListClustersRequest(), context)).clusters) == 3


async def test_purge_a_scope():
    store = Store()
    admin, _ = service(store)
    response = await admin.PurgeCache(admin_pb2.PurgeCacheRequest(scope="ab" * 32), Context())
    assert response.deleted == 3 and store.purged == ["ab" * 32]


@pytest.mark.parametrize("store, request_, code", [
    (None, admin_pb2.PurgeCacheRequest(scope="x"), grpc.StatusCode.FAILED_PRECONDITION),
    (Store(), admin_pb2.PurgeCacheRequest(), grpc.StatusCode.INVALID_ARGUMENT),
    (Store(), admin_pb2.PurgeCacheRequest(scope=""), grpc.StatusCode.INVALID_ARGUMENT),
    (Store(), admin_pb2.PurgeCacheRequest(all=True), grpc.StatusCode.UNIMPLEMENTED),
])
async def test_purge_refusals(store, request_, code):
    admin, _ = service(store)
    context = Context()
    with pytest.raises(Aborted):
        await admin.PurgeCache(request_, context)
    assert context.code == code


async def test_purge_all_when_the_store_can():
    admin, _ = service(StoreWithPurgeAll())
    assert (await admin.PurgeCache(admin_pb2.PurgeCacheRequest(all=True), Context())).deleted == 42


async def test_drain_starts_the_graceful_stop_once():
    admin, drains = service()
    first = await admin.Drain(admin_pb2.DrainRequest(), Context())
    second = await admin.Drain(admin_pb2.DrainRequest(), Context())
    assert (first.drain_delay_s, first.grace_s, first.already_draining) == (5.0, 20.0, False)
    assert second.already_draining and len(drains) == 2


def test_built_app_names_its_scheduler_and_store():
    from sidecar.service.app import build
    from sidecar.config import SidecarConfig

    app = build(SidecarConfig(semantic=False))
    scheduler, store = admin_parts(app)
    assert scheduler is app.pipeline.route.scheduler and store is app.pipeline.cache
    assert admin_parts(build(SidecarConfig(cache=False)))[1] is None


async def test_a_purge_forgets_the_token_states_kept_beside_the_entries():
    import numpy as np
    from sidecar.config import SidecarConfig
    from sidecar.service.app import build
    app = build(SidecarConfig(semantic=False))
    held = app.pipeline.cache._rt.token_states
    for scope in ("gone", "kept"):
        held.put(scope, "k", np.zeros((3, 384), np.float16))
    admin, _ = service(admin_parts(app)[1])
    await admin.PurgeCache(admin_pb2.PurgeCacheRequest(scope="gone"), Context())
    assert held.get("gone", "k") is None and held.get("kept", "k") is not None
    await admin.PurgeCache(admin_pb2.PurgeCacheRequest(all=True), Context())
    assert len(held) == 0 and held.nbytes == 0


async def test_unreachable_store_is_unavailable():
    class Down(Store):
        async def purge_scope(self, scope):
            raise ConnectionError("redis is down")

    admin, _ = service(Down())
    context = Context()
    with pytest.raises(Aborted):
        await admin.PurgeCache(admin_pb2.PurgeCacheRequest(scope="s"), context)
    assert context.code == grpc.StatusCode.UNAVAILABLE and "redis is down" in context.details


def test_the_redis_round_trip_deadline_reaches_every_shared_part():
    """SLUICE_REDIS_TIMEOUT_S: the cache store, dedup and the token limiter all wait that long."""
    from sidecar.service.app import build
    from sidecar.config import SidecarConfig
    app = build(SidecarConfig(redis_url="redis://127.0.0.1:1/0", redis_timeout_s=0.4, cache_secret="s" * 16,
                              semantic=False))
    assert app.store.settings.timeout_s == 0.4
    assert app.pipeline.cache._rt.inflight._op_timeout_s == 0.4
    assert app.pipeline.route.admission._tokens.config.redis_timeout_s == 0.4


def test_admissions_ttft_estimate_lapses(monkeypatch):
    """The gate's deadline refusals use the scheduler's measured time to first byte, which
    lapses (app.TTFT_ESTIMATE_MAX_AGE_S) so that one slow answer cannot refuse every later
    request with a deadline for good."""
    from sidecar.service import app as app_module
    from sidecar.config import SidecarConfig
    app = app_module.build(SidecarConfig(cache=False))
    gate, signals = app.pipeline.route.admission.gate, app.pipeline.route.scheduler.signals
    now = [1000.0]
    monkeypatch.setattr(app_module.time, "monotonic", lambda: now[0])
    signals.on_first_byte("upstream_a", 4.0, now=now[0])
    assert gate._expected_ttft("upstream_a") == pytest.approx(4.0)
    now[0] += app_module.TTFT_ESTIMATE_MAX_AGE_S + 1
    assert gate._expected_ttft("upstream_a") is None


async def test_tail_streams_matching_records_and_ends_on_drain():
    import asyncio

    from sidecar.observability.record_feed import RecordFeed
    feed = RecordFeed()
    admin, _ = service(feed=feed)
    stream = admin.Tail(admin_pb2.TailRequest(route="chat"), Context())
    first = asyncio.ensure_future(stream.__anext__())
    while not feed.active:
        await asyncio.sleep(0)
    feed.publish({"route": "other"}, '{"route":"other"}')
    feed.publish({"route": "chat"}, '{"route":"chat"}')
    assert (await first).json == '{"route":"chat"}'
    feed.close()                               # the sidecar drains: the stream ends
    with pytest.raises(StopAsyncIteration):
        await stream.__anext__()
    assert not feed.active


async def test_tail_refusals():
    from sidecar.observability.record_feed import MAX_READERS, Filter, RecordFeed
    feed = RecordFeed()
    admin, _ = service(feed=feed)
    context = Context(peer="ipv4:10.0.0.9:5000")
    with pytest.raises(Aborted):
        await admin.Tail(admin_pb2.TailRequest(), context).__anext__()
    assert context.code == grpc.StatusCode.PERMISSION_DENIED and not feed.active
    for _ in range(MAX_READERS):
        feed.subscribe(Filter())
    context = Context()
    with pytest.raises(Aborted):
        await admin.Tail(admin_pb2.TailRequest(), context).__anext__()
    assert context.code == grpc.StatusCode.RESOURCE_EXHAUSTED
