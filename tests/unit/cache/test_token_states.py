"""Stored prompts' token states (sidecar/cache/token_states.py): bounded in bytes, per scope."""
import numpy as np
import pytest

from sidecar.cache.alignment import STATES_LAYERS
from sidecar.cache.token_states import ENTRY_BYTES, TokenStates, decode_states, encode_states, max_encoded_bytes


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


# -- the shared format (states kept beside an entry in Redis) ------------------------------

def test_encoded_states_decode_to_the_same_float16_rows():
    rows = np.random.default_rng(1).standard_normal((17, 384)).astype(np.float32)
    data = encode_states(rows)
    assert len(data) <= max_encoded_bytes(384)
    back = decode_states(data, 384)
    assert back.dtype == np.float16 and back.shape == (17, 384)
    assert np.array_equal(back, rows.astype(np.float16))


GOOD = encode_states(states(4))


@pytest.mark.parametrize("data", [
    b"", GOOD[:9], GOOD[:-1], GOOD + b"\0\0", b"XXXX" + GOOD[4:],            # short, long, other format
    GOOD[:4] + bytes([STATES_LAYERS + 1]) + GOOD[5:],                    # another layer's states
    GOOD[:5] + (0).to_bytes(2, "little") + GOOD[7:],                      # zero tokens
    GOOD[:5] + (5).to_bytes(2, "little") + GOOD[7:],                      # header says more than there is
    GOOD[:5] + (600).to_bytes(2, "little") + GOOD[7:],                    # more than the model reads
    encode_states(np.full((4, 256), 0.5, np.float32)),                     # another model's width
    GOOD[:9] + np.full(4 * 384, np.nan, np.float16).tobytes(),           # not finite
], ids=["empty", "header-only", "truncated", "trailing", "magic", "other-layer", "zero-tokens", "more-tokens",
        "too-many-tokens", "other-dim", "nan"])
def test_anything_but_states_of_this_width_is_refused(data):
    with pytest.raises(ValueError):
        decode_states(data, 384)


@pytest.mark.parametrize("rows", [np.zeros((0, 384)), np.zeros(384), np.zeros((513, 384))])
def test_only_states_a_reader_accepts_are_encoded(rows):
    with pytest.raises(ValueError):
        encode_states(rows)
