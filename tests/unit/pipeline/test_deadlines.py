"""Deadline and timeout arithmetic (sidecar/deadlines.py): tables, no clock."""
import pytest

from sidecar import deadlines
from sidecar.deadlines import HOLD_LIMIT_S


@pytest.mark.parametrize("header, expected", [
    (None, None),                    # none sent
    ("1500", 101.5),                 # 1.5 s from the arrival at 100
    ("0", 100.0),                    # spent already: a deadline, not none
    ("-1", None), ("soon", None), ("nan", None), ("inf", None), ("", None),
])
def test_the_clients_budget_counts_from_its_arrival(header, expected):
    headers = {} if header is None else {deadlines.DEADLINE_HEADER: header}
    assert deadlines.client_deadline(headers, started=100.0) == expected


@pytest.mark.parametrize("now, client, route_limit_s, expected", [
    (100.0, None, 30.0, 30.0),               # the route's limit
    (100.0, 101.0, 30.0, 1.0),               # the client's budget left
    (100.0, 99.0, 30.0, 0.0),                # spent: no wait at all
    (100.0, None, 300.0, HOLD_LIMIT_S),      # never past the hold limit
    (100.0, 1000.0, 300.0, HOLD_LIMIT_S),    # whatever the client's budget
    (120.0, None, 300.0, HOLD_LIMIT_S - 20), # the hold counts from the arrival
])
def test_a_follower_waits_the_least_of_its_limits(now, client, route_limit_s, expected):
    assert deadlines.follow_for(now, 100.0, client, route_limit_s) == pytest.approx(expected)


@pytest.mark.parametrize("client, default_s, expected", [
    (None, 60.0, 160.0), (105.0, 60.0, 105.0), (1000.0, 60.0, 1000.0),
])
def test_admission_queues_against_the_clients_deadline_else_the_routes(client, default_s, expected):
    assert deadlines.admission_deadline(100.0, client, default_s) == expected


@pytest.mark.parametrize("estimate, client, expected", [
    ((9000, "observed"), None, (9000, "observed")),           # no budget: the estimate
    ((9000, "seed"), 105.0, (5000, "client_deadline")),       # 5 s left: cut to it
    ((3000, "route_min"), 105.0, (3000, "route_min")),        # the estimate is shorter
    ((9000, "seed"), 99.0, (1, "client_deadline")),           # spent: 1 ms, never 0 (no timeout)
    ((9000, "seed"), 100.0001, (1, "client_deadline")),       # a fraction of a ms: rounded up
])
def test_the_upstream_timeout_is_cut_to_the_clients_budget(estimate, client, expected):
    assert deadlines.upstream_timeout_ms(*estimate, now=100.0, client=client) == expected


def test_the_hold_limit_leaves_room_within_envoys_one_extension():
    assert deadlines.hold_until(100.0) == 100.0 + HOLD_LIMIT_S
    assert HOLD_LIMIT_S < deadlines.EXTEND_AFTER_S + deadlines.EXTENDED_MESSAGE_TIMEOUT_S - 2
