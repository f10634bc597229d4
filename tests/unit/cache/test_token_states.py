"""Stored prompts' token states (sidecar/cache/token_states.py): bounded in bytes, per scope."""
import numpy as np
import pytest

from sidecar.cache.token_states import ENTRY_BYTES, TokenStates


def states(tokens: int, value: float = 0.5) -> np.ndarray:
    return np.full((tokens, 384), value, dtype=np.float32)


def test_kept_as_float16_and_found_only_in_their_own_scope():
    held = TokenStates(1 << 20)
    held.put("tenant-a", "k", states(10))
    got = held.get("tenant-a", "k")
    assert got.dtype == np.float16 and got.shape == (10, 384)
    assert held.get("tenant-b", "k") is None and held.get("tenant-a", "other") is None


def test_the_bytes_stay_within_the_share_least_recently_used_first():
    one = 10 * 384 * 2 + ENTRY_BYTES + 100
    held = TokenStates(3 * one)
    for key in "abc":
        held.put("s", key, states(10))
    assert len(held) == 3 and held.nbytes <= held.max_bytes
    held.get("s", "a")                     # used: "b" is now the oldest
    held.put("s", "d", states(10))
    assert held.get("s", "b") is None and held.get("s", "a") is not None
    assert held.nbytes <= held.max_bytes
    held.put("s", "huge", states(1000))    # more than the whole share: not kept, nothing lost
    assert held.get("s", "huge") is None and len(held) == 3
    held.put("s", "a", states(20))         # replaced: charged once
    assert held.get("s", "a").shape == (20, 384) and held.nbytes <= held.max_bytes


def test_a_purged_scope_loses_its_states_and_bytes():
    held = TokenStates(1 << 20)
    held.put("s", "a", states(5))
    held.put("t", "a", states(5))
    before = held.nbytes
    assert held.purge_scope("s") == 1
    assert held.get("s", "a") is None and held.get("t", "a") is not None and held.nbytes < before
    with pytest.raises(ValueError):
        TokenStates(0)
