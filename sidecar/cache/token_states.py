"""Stored prompts' token states, for a verifier that aligns them (sidecar/cache/alignment.py).

The embedding engine returns a new prompt's token states from the run that makes its vector
(scripts/model_graph.py's second output), so the request's side costs a copy.  The stored
candidate's side is kept here, per entry, from the run that embedded it when it was stored:
recomputing it would be a second model run on the request path (measured in
docs/semantic-verifier-experiments.md, section 2).

Keyed by (scope, exact key): one tenant's states are never read for another's entries.  Held
as float16 [tokens, 384] (~0.8 KB a token) in least-recently-used order, within their share of
the cache budget (sidecar/cache/budget.py), bytes counted: an array's own bytes plus
ENTRY_BYTES.  Only this process holds them: an entry stored by another replica (a shared Redis
store), or whose states were evicted, has none here, and the verifier then refuses the hit
("verifier_no_states") rather than deciding without them.  The cache stage keeps them only for
a put the store kept, replaces them with the entry, and forgets a scope's on an admin purge
(CacheStage.store, purge_scope).  Those of an entry the store evicts or expires, or another
replica purges, are not told of: they age out here in least-recently-used order (a lookup
reads states only for an entry the store still holds).
"""
from __future__ import annotations

import sys
from collections import OrderedDict

import numpy as np

__all__ = ["TokenStates", "ENTRY_BYTES"]

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
