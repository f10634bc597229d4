"""The cache's verdict on a request, remembered for byte-identical repeats."""
import gc

import pytest

from sidecar.cache.budget import BytePool
from sidecar.cache.request_memo import ENTRY_BYTES, RequestMemo, request_digest

HEADERS = {"authorization": "Bearer k1", "cache-control": "max-age=60"}


def remembered(memo, body=b"{}", headers=HEADERS):
    calls = []
    result = memo.get(body, headers, lambda: calls.append(1) or object())
    return result, bool(calls)


def test_a_repeat_reuses_the_result_and_any_input_that_counts_makes_a_new_one():
    memo = RequestMemo("authorization")
    first, worked = remembered(memo)
    assert worked
    again, worked = remembered(memo, headers=dict(HEADERS, **{"x-request-id": "other"}))
    assert again is first and not worked                 # other headers do not count
    for changed in ({"body": b'{"a":1}'},
                    {"headers": dict(HEADERS, authorization="Bearer k2")},
                    {"headers": dict(HEADERS, **{"cache-control": "no-cache"})},
                    {"headers": dict(HEADERS, pragma="no-cache")},
                    {"headers": dict(HEADERS, **{":path": "/v1/chat/completions?api-version=2"})},
                    {"headers": dict(HEADERS, **{":authority": "other.example"})}):
        result, worked = remembered(memo, **changed)
        assert worked and result is not first, changed


def test_the_credential_header_is_the_routes_tenant_header_when_it_has_one():
    memo = RequestMemo("x-tenant")
    a, _ = remembered(memo, headers={"x-tenant": "a", "authorization": "Bearer same"})
    b, worked = remembered(memo, headers={"x-tenant": "b", "authorization": "Bearer same"})
    assert worked and a is not b


def test_inputs_do_not_run_together():
    assert request_digest(b"", {"authorization": "ab", "cache-control": "c"}, "authorization") != \
        request_digest(b"", {"authorization": "a", "cache-control": "bc"}, "authorization")


def test_no_credential_is_kept_and_the_memo_is_bounded():
    memo = RequestMemo("authorization", max_entries=3, max_body_bytes=100)
    for i in range(5):
        remembered(memo, body=b'{"i":%d}' % i)
    assert len(memo) == 3
    assert all(len(key) == 16 for key in memo._results)           # digests, not the headers
    remembered(memo, body=b"x" * 101)
    assert len(memo) == 3                                         # large bodies are not remembered
    _, worked = remembered(memo, body=b'{"i":0}')                  # the oldest went first
    assert worked


@pytest.mark.parametrize("body", [b"", b"\xff\xfe"])
def test_any_bytes_are_fine(body):
    assert remembered(RequestMemo("authorization"), body=body)[1]


def test_a_no_store_request_is_not_remembered():
    memo = RequestMemo("authorization")
    for _ in range(2):
        _, worked = remembered(memo, headers={"authorization": "Bearer k1", "cache-control": "no-store"})
        assert worked
    assert len(memo) == 0


def test_every_routes_memo_draws_on_one_pool_of_bytes():
    pool = BytePool(10 * (ENTRY_BYTES + 400))
    busy, quiet = RequestMemo("authorization", pool=pool), RequestMemo("authorization", pool=pool)
    for i in range(50):                       # one route's flood of distinct bodies
        remembered(busy, body=b'{"i":%d}' % i + b" " * 90)
        assert pool.used <= pool.max_bytes
    assert 0 < len(busy) < 50
    remembered(quiet, body=b"{}")             # the full pool: the other route keeps nothing...
    assert len(quiet) == 0
    for i in range(3):                        # ...while the busy one churns its own oldest
        remembered(busy, body=b'{"j":%d}' % i + b" " * 90)
    assert pool.used <= pool.max_bytes
    held = pool.used
    del busy
    gc.collect()
    assert pool.used == 0 < held              # a memo dropped with its route gives its bytes back
    remembered(quiet, body=b"{}")
    assert len(quiet) == 1


def test_a_result_is_charged_what_it_holds():
    pool = BytePool(1 << 20)
    memo = RequestMemo("authorization", pool=pool, size=lambda result: 1000)
    remembered(memo)
    assert pool.used == ENTRY_BYTES + 1000
    unsized = RequestMemo("authorization", pool=pool)
    remembered(unsized, body=b"x" * 100)      # unsaid: four bytes a body byte (UCS-4 at worst)
    assert pool.used == 2 * ENTRY_BYTES + 1000 + 400
