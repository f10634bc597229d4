"""The decision record's shape, the timeout's source, and the tail feed's bounds."""
import asyncio

import pytest

from sidecar.request.context import Outcome, RequestContext
from sidecar.request.decision_record import AdmissionWhy, CacheWhy, TimeoutWhy, record, span_attributes
from sidecar.observability.record_feed import READER_BYTES, Filter, RecordFeed
from sidecar.scheduling import Decision, TimeoutConfig
from sidecar.scheduling.model import ClusterSnapshot
from sidecar.scheduling.scorers import ScoreBreakdown
from sidecar.scheduling.timeout import upstream_timeout


def test_record_of_a_routed_request():
    ctx = RequestContext(cache_status="miss")
    ctx.why.cache = CacheWhy("numbers_differ", 0.95123456)
    ctx.why.picked = Decision("a", role="primary", scores={"a": ScoreBreakdown(0.8, {"load": 1.0, "latency": None})},
                              dropped={"b": "breaker_open"})
    ctx.why.admission = AdmissionWhy("batch", "admitted", 812.34, 4, 3)
    ctx.why.timeout = TimeoutWhy(30000, "seed")
    assert record(ctx) == {
        "cache": {"verdict": "miss", "reason": "numbers_differ", "similarity": 0.9512},
        "scores": {"a": 0.8},
        "dropped": {"b": "breaker_open"},
        "admission": {"class": "batch", "result": "admitted", "waited_ms": 812.3, "limit": 4, "in_flight": 3},
        "timeout": {"ms": 30000, "from": "seed"},
    }


def test_record_of_a_request_nothing_could_take():
    ctx = RequestContext(outcome=Outcome.REFUSED)
    ctx.why.unavailable = Decision.unavailable(2.0, {"a": "breaker_open", "b": "saturated"})
    assert record(ctx) == {"dropped": {"a": "breaker_open", "b": "saturated"}}


def test_a_fallback_says_so():
    ctx = RequestContext()
    ctx.why.picked = Decision("small", role="fallback", degraded=True, scores={"small": ScoreBreakdown(1.0)},
                              dropped={"a": "breaker open"})
    assert record(ctx)["picked"] == {"role": "fallback", "degraded": True, "probe": False}


def test_record_is_empty_for_an_untouched_request_and_span_attributes_are_flat():
    assert record(RequestContext()) == {}
    ctx = RequestContext(cache_status="exact")
    ctx.why.cache = CacheWhy("exact", 1.0, 0.97)
    ctx.why.picked = Decision("a", scores={"a": ScoreBreakdown(0.5)}, dropped={"b": "saturated"})
    attributes = span_attributes(record(ctx))
    assert attributes["sluice.cache.verifier_score"] == 0.97
    assert attributes["sluice.candidates.scored"] == ["a"] and attributes["sluice.candidates.score"] == [0.5]
    assert attributes["sluice.candidates.dropped"] == ["b"]
    assert attributes["sluice.candidates.dropped_by"] == ["saturated"]
    assert all(isinstance(v, (str, bool, int, float, list)) for v in attributes.values())


@pytest.mark.parametrize("snapshot,config,source", [
    (None, TimeoutConfig(), "seed"),
    (ClusterSnapshot("a", ttfb_p95_s=5.0, tokens_per_s=100.0), TimeoutConfig(), "observed"),
    (None, TimeoutConfig(min_ms=5_000, max_ms=10_000), "route_max"),
    (ClusterSnapshot("a", ttfb_p95_s=0.01, tokens_per_s=10_000.0), TimeoutConfig(min_ms=5_000), "route_min"),
])
def test_timeout_says_what_decided_it(snapshot, config, source):
    ms, said = upstream_timeout(100, 100, "demo", snapshot, config)
    assert said == source
    assert config.min_ms <= ms <= config.max_ms


async def test_feed_filters_bounds_bytes_and_closes():
    feed = RecordFeed()
    assert not feed.active
    reader = feed.subscribe(Filter(route="chat"))
    feed.publish({"route": "other"}, "x")
    line = "y" * 1000
    for _ in range(READER_BYTES // 1000 + 50):
        feed.publish({"route": "chat"}, line)
    assert reader.size <= READER_BYTES
    first, dropped = await reader.next()
    assert first == line and dropped >= 50
    feed.close()
    while (item := await reader.next()) is not None:
        assert item[1] == 0
    assert feed.subscribe(Filter()) is None


async def test_reader_waits_for_the_next_record():
    feed = RecordFeed()
    reader = feed.subscribe(Filter(outcome="answered"))
    waiting = asyncio.ensure_future(reader.next())
    await asyncio.sleep(0)
    feed.publish({"outcome": "routed"}, "no")
    feed.publish({"outcome": "answered"}, "yes")
    assert await asyncio.wait_for(waiting, 1) == ("yes", 0)
