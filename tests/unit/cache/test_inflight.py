"""In-flight dedup within one process: one upstream call per flight, handover, bounds."""
import asyncio

import numpy as np
import pytest

from sidecar.cache.inflight import (
    RELEASED, TIMED_OUT, Answered, Follow, InFlight, Lead, Near, Promoted, TimedOut)

PAYLOAD = b'{"answer": "click forgot password"}'


def unit(*xs: float) -> np.ndarray:
    v = np.array(xs, dtype=np.float32)
    return v / np.linalg.norm(v)


def near(cosine: float, threshold: float = 0.9, **kw) -> Near:
    """A 2-d vector at `cosine` to (1, 0)."""
    return Near(np.array([cosine, np.sqrt(1 - cosine**2)], dtype=np.float32), threshold, **kw)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_hundred_concurrent_joins_cost_one_upstream_call():
    inflight = InFlight()
    upstream_calls = 0

    async def request() -> bytes:
        nonlocal upstream_calls
        ticket = await inflight.join("route", "k")
        if isinstance(ticket, Follow):
            outcome = await ticket.wait(5)
            assert isinstance(outcome, Answered)
            return outcome.payload
        with ticket:
            upstream_calls += 1
            await asyncio.sleep(0.01)
            ticket.complete(PAYLOAD)
            return PAYLOAD

    answers = await asyncio.gather(*(request() for _ in range(100)))
    assert answers == [PAYLOAD] * 100
    assert upstream_calls == 1
    assert inflight.stats()["leaders"] == inflight.stats()["followers"] == 0
    assert inflight.stats()["led"] == 1 and inflight.stats()["followed_exact"] == 99


async def test_abandon_promotes_exactly_one_follower_and_the_rest_get_its_answer():
    inflight = InFlight()
    lead = await inflight.join("r", "k")
    follows = [await inflight.join("r", "k") for _ in range(10)]
    waits = [asyncio.create_task(f.wait(5)) for f in follows]
    await settle()
    lead.abandon()
    await settle()
    done = [w for w in waits if w.done()]
    assert len(done) == 1 and waits[0] in done  # the earliest follower, only it
    promoted = done[0].result()
    assert isinstance(promoted, Promoted) and promoted.lead.registered
    assert inflight.stats() == {**inflight.stats(), "leaders": 1, "followers": 9}
    promoted.lead.complete(PAYLOAD)
    assert await asyncio.gather(*waits[1:]) == [Answered(PAYLOAD)] * 9
    assert inflight.stats()["leaders"] == 0


async def test_release_sends_every_follower_upstream_at_once():
    """The leader's answer came whole but may not be shared (a 4xx, private): handing over one
    at a time would make each follower wait for the same refusal in turn."""
    inflight = InFlight()
    lead = await inflight.join("r", "k")
    follows = [await inflight.join("r", "k") for _ in range(5)]
    waits = [asyncio.create_task(f.wait(5)) for f in follows]
    await settle()
    lead.release()
    await settle()
    assert all(w.done() for w in waits) and {w.result() for w in waits} == {RELEASED}
    assert (inflight.stats()["leaders"], inflight.stats()["followers"], inflight.stats()["released"]) == (0, 0, 5)
    lead.abandon()                                    # a lead ends once
    assert isinstance(await inflight.join("r", "k"), Lead)      # the next request leads anew


async def test_chain_of_abandons_hands_over_one_at_a_time():
    inflight = InFlight()
    lead = await inflight.join("r", "k")
    waits = [asyncio.create_task((await inflight.join("r", "k")).wait(5)) for _ in range(3)]
    await settle()
    for i in range(3):
        lead.abandon()
        outcome = await waits[i]
        assert isinstance(outcome, Promoted)
        assert sum(w.done() for w in waits) == i + 1
        lead = outcome.lead
    lead.abandon()
    assert inflight.stats()["leaders"] == 0


async def test_leader_client_disconnect_abandons_in_finally():
    inflight = InFlight()
    lead = await inflight.join("r", "k")

    async def leader():
        with lead:  # abandons on any exit that did not complete, cancellation included
            await asyncio.sleep(10)

    task = asyncio.create_task(leader())
    follow_waits = [asyncio.create_task((await inflight.join("r", "k")).wait(5)) for _ in range(2)]
    await settle()
    task.cancel()
    outcome = await follow_waits[0]
    assert isinstance(outcome, Promoted)
    assert not follow_waits[1].done()
    outcome.lead.complete(PAYLOAD)
    assert await follow_waits[1] == Answered(PAYLOAD)


async def test_complete_then_abandon_is_a_noop_and_payload_must_be_bytes():
    inflight = InFlight()
    lead = await inflight.join("r", "k")
    follow = await inflight.join("r", "k")
    with pytest.raises(TypeError):
        lead.complete("text")
    lead.complete(PAYLOAD)
    lead.abandon()
    lead.complete(b"other")
    assert await follow.wait(1) == Answered(PAYLOAD)
    assert isinstance(await inflight.join("r", "k"), Lead)  # a new flight


async def test_follower_timeout_returns_timed_out_and_leaves_no_state():
    inflight = InFlight()
    lead = await inflight.join("r", "k")
    follow = await inflight.join("r", "k")
    assert await follow.wait(0.02) is TIMED_OUT
    assert inflight.stats()["followers"] == 0 and inflight.stats()["timed_out"] == 1
    lead.abandon()  # nobody to promote: the flight ends
    assert inflight.stats()["leaders"] == 0
    with pytest.raises(RuntimeError):
        await follow.wait(1)


async def test_cancelled_follower_leaves_and_is_never_promoted():
    inflight = InFlight()
    lead = await inflight.join("r", "k")
    gone = asyncio.create_task((await inflight.join("r", "k")).wait(5))
    stays = asyncio.create_task((await inflight.join("r", "k")).wait(5))
    await settle()
    gone.cancel()
    await settle()
    assert inflight.stats()["followers"] == 1
    lead.abandon()
    assert isinstance(await stays, Promoted)


async def test_follower_cancelled_just_as_it_is_promoted_passes_the_lead_on():
    inflight = InFlight()
    lead = await inflight.join("r", "k")
    first = asyncio.create_task((await inflight.join("r", "k")).wait(5))
    second = asyncio.create_task((await inflight.join("r", "k")).wait(5))
    await settle()
    lead.abandon()   # first is promoted, but before it runs its client goes away
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    outcome = await second
    assert isinstance(outcome, Promoted)
    outcome.lead.abandon()
    assert inflight.stats()["leaders"] == inflight.stats()["followers"] == 0


async def test_zero_timeout_still_gets_an_answer_already_there():
    inflight = InFlight()
    lead = await inflight.join("r", "k")
    follow = await inflight.join("r", "k")
    lead.complete(PAYLOAD)
    assert await follow.wait(0) == Answered(PAYLOAD)


@pytest.mark.parametrize("scope, cosine, threshold, follows", [
    ("r", 0.97, 0.95, True),    # near, same scope
    ("r", 0.94, 0.95, False),   # below threshold
    ("other", 0.999, 0.95, False),  # another scope
    ("r", 1.0, 1.0, True),      # threshold 1 needs the very same direction
])
async def test_semantic_join(scope, cosine, threshold, follows):
    inflight = InFlight()
    lead = await inflight.join("r", "k1", near(1.0, text="how do I reset my password"))
    ticket = await inflight.join(scope, "k2", near(cosine, threshold))
    assert isinstance(ticket, Follow) is follows
    if follows:
        assert ticket.similarity == pytest.approx(cosine, abs=1e-6)
        lead.complete(PAYLOAD)
        assert await ticket.wait(1) == Answered(PAYLOAD)
        assert inflight.stats()["followed_near"] == 1


async def test_semantic_join_picks_the_nearest_flight_and_exact_key_first():
    inflight = InFlight()
    far = await inflight.join("r", "far", near(0.92, threshold=0.999))
    best = await inflight.join("r", "best", near(0.99, threshold=0.999))
    ticket = await inflight.join("r", "new", near(1.0, threshold=0.9))
    assert isinstance(far, Lead) and isinstance(best, Lead) and ticket.similarity == pytest.approx(0.99)
    far.complete(b"far")
    best.complete(b"best")
    assert await ticket.wait(1) == Answered(b"best")
    exact = await inflight.join("r", "k")  # no vector
    ticket = await inflight.join("r", "k", near(1.0))
    assert isinstance(ticket, Follow) and ticket.similarity == 1.0
    exact.abandon()
    assert isinstance(await ticket.wait(1), Promoted)


async def test_same_predicate_vetoes_a_near_match():
    inflight = InFlight()
    seen = []

    def same(leader_text: str, cosine: float, leader_states) -> bool:
        seen.append((leader_text, round(cosine, 3), leader_states))
        return "not" not in leader_text

    await inflight.join("r", "k1", near(1.0, text="is it not safe"))
    ticket = await inflight.join("r", "k2", near(0.99, text="is it safe", same=same))
    assert isinstance(ticket, Lead)
    assert seen == [("is it not safe", 0.99, None)]


async def test_same_is_asked_of_the_nearest_flight_with_room_only():
    """`same` may be the verifier: one call a join, not one for every flight above the floor."""
    inflight = InFlight(max_followers=1)
    apart = lambda text, cosine, leader_states: False  # noqa: E731
    for i, cosine in enumerate((0.999, 0.99, 0.98, 0.97)):
        assert isinstance(await inflight.join("r", f"k{i}", near(cosine, text=f"leader {i}", same=apart)), Lead)
    assert isinstance(await inflight.join("r", "full", near(0.9995)), Follow)    # k0 has no room left
    asked = []

    def same(leader_text: str, cosine: float, leader_states) -> bool:
        asked.append(leader_text)
        return leader_text != "leader 1"

    assert isinstance(await inflight.join("r", "new", near(1.0, text="new", same=same)), Lead)
    assert asked == ["leader 1"]


def states(tokens: int) -> np.ndarray:
    return np.full((tokens, 4), 0.5, dtype=np.float16)      # 8 bytes a token


async def test_same_predicate_reads_the_leaders_token_states():
    inflight = InFlight()
    leader_states = states(3)
    seen = []

    def same(leader_text: str, cosine: float, leader_states) -> bool:
        seen.append(leader_states)
        return leader_states is not None

    lead = await inflight.join("r", "k1", near(1.0, text="a", states=leader_states))
    assert inflight.stats()["states_bytes"] == 24
    ticket = await inflight.join("r", "k2", near(0.99, text="b", same=same, states=states(2)))
    assert isinstance(ticket, Follow) and seen[0] is leader_states       # the array itself, no copy
    lead.complete(PAYLOAD)
    assert await ticket.wait(1) == Answered(PAYLOAD)
    assert inflight.stats()["states_bytes"] == 0                         # given back with the flight


async def test_leaders_states_are_kept_within_max_states_bytes():
    inflight = InFlight(max_states_bytes=40)
    same = lambda text, cosine, leader_states: leader_states is not None  # noqa: E731
    first = await inflight.join("r", "k1", near(1.0, 0.99, text="a", states=states(3)))     # 24 bytes
    second = await inflight.join("r", "k2", Near(unit(0.0, 1.0), 0.99, "b", states=states(3)))  # 48 > 40
    stats = inflight.stats()
    assert stats["states_bytes"] == 24 and stats["states_not_kept"] == 1
    # A near follower of the flight that kept none is refused by a `same` that needs them.
    assert isinstance(await inflight.join("r", "k3", Near(unit(0.01, 1.0), 0.99, "c", same)), Lead)
    follower = await inflight.join("r", "k4", near(0.999, 0.99, text="d", same=same))
    assert isinstance(follower, Follow)
    first.abandon()
    second.abandon()
    assert isinstance(await follower.wait(1), Promoted)
    assert inflight.stats()["states_bytes"] == 0
    with pytest.raises(ValueError):
        InFlight(max_states_bytes=-1)


async def test_near_followers_rejoin_when_their_leader_abandons():
    inflight = InFlight()
    lead = await inflight.join("r", "k0", near(1.0))
    # a is near the leader and near b; c is near the leader but not near a.
    a = asyncio.create_task((await inflight.join("r", "a", near(0.96, 0.95))).wait(5))
    b_vec = Near(unit(0.96, np.sqrt(1 - 0.96**2)) * 3, 0.95)  # not unit: normalised on join
    b = asyncio.create_task((await inflight.join("r", "b", b_vec)).wait(5))
    c = asyncio.create_task((await inflight.join("r", "c", Near(unit(0.96, -np.sqrt(1 - 0.96**2)), 0.95))).wait(5))
    await settle()
    lead.abandon()
    await settle()
    assert a.done() and c.done() and not b.done()  # a and c each lead now; b follows a
    lead_a, lead_c = a.result().lead, c.result().lead
    assert (lead_a.key, lead_c.key) == ("a", "c")
    lead_c.complete(b"c")
    lead_a.complete(b"a")
    assert await b == Answered(b"a")
    assert inflight.stats()["leaders"] == inflight.stats()["followers"] == 0


async def test_exact_follower_is_preferred_heir_over_near_ones():
    inflight = InFlight()
    lead = await inflight.join("r", "k", near(1.0))
    near_wait = asyncio.create_task((await inflight.join("r", "n", near(0.99))).wait(5))
    exact_wait = asyncio.create_task((await inflight.join("r", "k", near(1.0))).wait(5))
    await settle()
    lead.abandon()
    outcome = await exact_wait
    assert isinstance(outcome, Promoted) and not near_wait.done()
    outcome.lead.complete(PAYLOAD)
    assert await near_wait == Answered(PAYLOAD)


async def test_zero_or_missing_vector_is_exact_only():
    inflight = InFlight()
    await inflight.join("r", "k1", Near(np.zeros(2), 0.9))
    assert isinstance(await inflight.join("r", "k2", near(1.0)), Lead)
    with pytest.raises(ValueError):
        Near(np.ones(2), 0.0)


async def test_max_keys_reached_gives_an_unregistered_lead():
    inflight = InFlight(max_keys=2)
    a, b = await inflight.join("r", "a"), await inflight.join("r", "b")
    c = await inflight.join("r", "c")
    assert a.registered and b.registered and isinstance(c, Lead) and not c.registered
    assert isinstance(await inflight.join("r", "c"), Lead)  # nobody follows an unregistered lead
    c.complete(PAYLOAD)  # harmless
    a.complete(PAYLOAD)
    assert (await inflight.join("r", "c")).registered
    assert inflight.stats()["overflow"] == 2


async def test_max_followers_reached_sends_the_rest_upstream():
    inflight = InFlight(max_followers=2)
    lead = await inflight.join("r", "k", near(1.0))
    tickets = [await inflight.join("r", "k") for _ in range(3)]
    assert [isinstance(t, Follow) for t in tickets] == [True, True, False]
    assert not tickets[2].registered
    # a full flight is skipped by near joins too
    assert isinstance(await inflight.join("r", "n", near(0.99)), Lead)
    lead.complete(PAYLOAD)
    assert [await t.wait(1) for t in tickets[:2]] == [Answered(PAYLOAD)] * 2


async def test_outcomes_are_pattern_matchable():
    inflight = InFlight()
    lead = await inflight.join("r", "k")
    follow = await inflight.join("r", "k")
    lead.complete(PAYLOAD)
    match await follow.wait(1):
        case Answered(payload):
            assert payload == PAYLOAD
        case Promoted(_) | TimedOut():
            pytest.fail("expected an answer")
