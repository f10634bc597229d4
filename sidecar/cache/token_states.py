"""Stored prompts' token states, for a verifier that aligns them (sidecar/cache/alignment.py).

The embedding engine returns a new prompt's token states from the run that makes its vector
(scripts/model_graph.py's second output), so the request's side costs a copy.  The stored
candidate's side is kept here, per entry, from the run that embedded it when it was stored:
recomputing it would be a second model run on the request path (measured in
docs/semantic-verifier-experiments.md, section 2).

Keyed by (scope, exact key): one tenant's states are never read for another's entries.  Held
as float16 [tokens, 384] (~0.8 KB a token) in least-recently-used order, within their share of
the cache budget (sidecar/cache/budget.py), bytes counted: an array's own bytes plus
ENTRY_BYTES.  This is the process's share.  A store shared by replicas (Redis) also keeps each
entry's states beside it, in `encode_states`'s format: a replica that finds a candidate whose
states are not here reads them from there and keeps them here (CacheStage.lookup).  An entry
with states in neither place (evicted here, stored by a replica whose store was down, a value
`decode_states` refuses) is refused by the verifier ("verifier_no_states") rather than decided
without them.  The cache stage keeps them only for a put the store kept, replaces them with the
entry, and forgets a scope's on an admin purge (CacheStage.store, purge_scope).  Those of an
entry the store evicts or expires, or another replica purges, are not told of: they age out
here in least-recently-used order (a lookup reads states only for an entry the store still
holds, and a key is a hash of its scope and prompt, so states found under it are that prompt's).
"""
from __future__ import annotations

import struct
import sys
from collections import OrderedDict

import numpy as np

from sidecar.cache.alignment import STATES_LAYERS
from sidecar.embedding.settings import MODEL_POSITION_LIMIT

__all__ = ["TokenStates", "ENTRY_BYTES", "encode_states", "decode_states", "max_encoded_bytes"]

# An entry besides its array's data: the ndarray object, the key tuple and its two strings'
# headers (their characters are counted as they come), the OrderedDict node.
ENTRY_BYTES = 400


class TokenStates:
    def __init__(self, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes: must be > 0, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._held: OrderedDict[tuple[str, str], tuple[np.ndarray, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._held)

    def put(self, scope: str, key: str, states: np.ndarray) -> None:
        """Keeps a stored prompt's states (float16 [tokens, dim]); the least recently used go
        first when the share is full; one larger than the whole share is not kept."""
        states = np.ascontiguousarray(states, dtype=np.float16)
        cost = states.nbytes + ENTRY_BYTES + sys.getsizeof(scope) + sys.getsizeof(key)
        self.discard(scope, key)
        if cost > self.max_bytes:
            return
        while self.nbytes + cost > self.max_bytes:
            _, (_, freed) = self._held.popitem(last=False)
            self.nbytes -= freed
        self._held[(scope, key)] = (states, cost)
        self.nbytes += cost

    def get(self, scope: str, key: str) -> np.ndarray | None:
        found = self._held.get((scope, key))
        if found is None:
            return None
        self._held.move_to_end((scope, key))
        return found[0]

    def discard(self, scope: str, key: str) -> None:
        found = self._held.pop((scope, key), None)
        if found is not None:
            self.nbytes -= found[1]

    def purge_scope(self, scope: str) -> int:
        """Forget every entry of a scope (an admin purge); how many."""
        keys = [k for k in self._held if k[0] == scope]
        for scope_, key in keys:
            self.discard(scope_, key)
        return len(keys)

    def clear(self) -> None:
        """Forget every entry (an admin purge of everything)."""
        self._held.clear()
        self.nbytes = 0


# The shared format: a header (magic with its version, the layer the states are the output of,
# tokens, dim; little-endian), then the float16 values row by row.  A reader refuses anything
# else rather than guess at it: a replica built with another layer is read as having none.
_MAGIC = b"SLT1"
_HEADER = struct.Struct("<4sBHH")
_FLOAT16 = np.dtype("<f2")


def encode_states(states: np.ndarray) -> bytes:
    """A prompt's token states [tokens, dim] as the bytes a shared store keeps."""
    rows = np.ascontiguousarray(states, dtype=_FLOAT16)
    if rows.ndim != 2 or not 0 < rows.shape[0] <= MODEL_POSITION_LIMIT or not 0 < rows.shape[1] < 1 << 16:
        raise ValueError(f"token states: shape {rows.shape} is not [1..{MODEL_POSITION_LIMIT}, dim]")
    return _HEADER.pack(_MAGIC, STATES_LAYERS, *rows.shape) + rows.tobytes()


def max_encoded_bytes(dim: int) -> int:
    """The most bytes `encode_states` makes for states of `dim` (the longest text the model
    reads): a reader need never take more."""
    return _HEADER.size + MODEL_POSITION_LIMIT * dim * _FLOAT16.itemsize


def decode_states(data: bytes, dim: int) -> np.ndarray:
    """`encode_states`'s bytes back as float16 [tokens, dim] (a read-only view of `data`).
    ValueError for anything else: another format or version, another layer's states (not
    STATES_LAYERS) or another model's dim, a length that does not match the header, values
    that are not finite."""
    if len(data) < _HEADER.size:
        raise ValueError(f"token states: {len(data)} bytes, shorter than the header")
    magic, layer, tokens, width = _HEADER.unpack_from(data)
    if magic != _MAGIC:
        raise ValueError("token states: unknown format")
    if layer != STATES_LAYERS:
        raise ValueError(f"token states: of layer {layer}, expected {STATES_LAYERS}")
    if width != dim or not 0 < tokens <= MODEL_POSITION_LIMIT:
        raise ValueError(f"token states: [{tokens}, {width}], expected [1..{MODEL_POSITION_LIMIT}, {dim}]")
    if len(data) != _HEADER.size + tokens * width * _FLOAT16.itemsize:
        raise ValueError(f"token states: {len(data)} bytes for [{tokens}, {width}]")
    rows = np.frombuffer(data, _FLOAT16, offset=_HEADER.size).reshape(tokens, width)
    if not np.isfinite(rows).all():
        raise ValueError("token states: values that are not finite")
    return rows
