"""The cache store of a single replica: everything in this process, bounded four ways.

- In bytes: at most `max_bytes`, whatever the mix of scopes; a put that goes past it evicts
  the least recently used entries of any scope (a hit, exact or semantic, counts as a use).
  An entry is charged its key, scope name, prompt, answer and vector row, plus a measured
  constant for its share of the dicts, heap and objects that find it; a scope is charged its
  index arrays (sized to its entries: see vector_index.py) and constants for its own
  structures.  bench/cache_memory.py compares this account with the process's RSS.
- Overall: at most `max_entries`, least recently used first, as above.
- Per scope: at most `max_entries_per_scope`; a put into a full scope evicts that scope's
  least recently used entry, so one tenant cannot push out the others.
- In time: an entry is never returned once its TTL has passed.  Expired entries are also
  dropped without being asked for: every operation pops a few from an expiry heap, so a
  store that is only written to does not keep dead entries until the LRU reaches them.

RedisStore keeps one of these as its local tier: the shared vectors (with empty prompts and
answers) and the answers this replica stored or fetched.  The clock is injected (seconds since
the epoch) for tests.
"""
from __future__ import annotations

import heapq
import math
import sys
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from sidecar.cache.store import PURGE_MEMORY_S, Entry, Neighbour, StoreLimits
from sidecar.cache.vector_index import DEFAULT_EXACT_MAX, VectorIndex, as_unit

__all__ = ["MemoryStore"]

# Expired entries dropped per operation, at most, besides the one looked up.
_PURGE_BATCH = 16
# A semantic hit whose entry has expired is dropped and the search runs again, this often.
_NEAREST_TRIES = 4
# Bytes an entry holds besides its strings and vector row: its Entry and slot, its nodes in
# the two LRU orders, its expiry-heap tuples (stale ones included, up to two per entry), and
# with a vector its key's place in the index.  Measured with tracemalloc on CPython 3.11
# (tests/unit/cache/test_cache_store.py checks the account against it).
ENTRY_BYTES = 480
INDEX_ROW_BYTES = 240
# A scope's own structures (its LRU order, index object, dict entry), and while its index has
# rows, the arrays' objects and the allocator's share of their small blocks.  Measured as RSS
# under a flood of one-entry scopes with evictions (bench/cache_memory.py), where the freed
# blocks of evicted scopes fragment the heap: RSS stays within a few % of the account there.
SCOPE_BYTES = 1_600
INDEX_ARRAYS_BYTES = 800


@dataclass(slots=True)
class _Slot:
    entry: Entry
    expires_at: float
    cost: int           # bytes charged for it, besides its scope's index arrays


@dataclass(slots=True)
class _Scope:
    index: VectorIndex
    order: OrderedDict[str, None] = field(default_factory=OrderedDict)  # least recent first
    index_bytes: int = 0        # the index's arrays as last charged


def entry_cost(entry: Entry, with_vector: bool) -> int:
    """Bytes charged for one entry (its vector's row is charged with its scope's index)."""
    return (ENTRY_BYTES + (INDEX_ROW_BYTES if with_vector else 0) + sys.getsizeof(entry.entry_id)
            + sys.getsizeof(entry.scope) + sys.getsizeof(entry.prompt) + sys.getsizeof(entry.answer))


class MemoryStore:
    """CacheStore in this process.  Not thread-safe: use it from one event loop."""

    def __init__(self, limits: StoreLimits | None = None, *, dim: int = 384,
                 exact_max: int = DEFAULT_EXACT_MAX,
                 clock: Callable[[], float] = time.time) -> None:
        self.limits = limits or StoreLimits()
        self.dim = dim
        self._exact_max = exact_max
        self._clock = clock
        self._slots: OrderedDict[tuple[str, str], _Slot] = OrderedDict()  # least recent first
        self._scopes: dict[str, _Scope] = {}
        self._expiry: list[tuple[float, str, str]] = []  # (expires_at, scope, key), stale ok
        self._bytes = 0         # charged for what is held now: entries and scopes
        # When each scope (None: all of them) was last purged, for puts asked for before then;
        # kept PURGE_MEMORY_S, so bounded by the purges of that long.
        self._purged_at: dict[str | None, float] = {}

    # -- CacheStore ---------------------------------------------------------------------

    @property
    def healthy(self) -> bool:
        return True

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def get_exact(self, scope: str, exact_key: str) -> Entry | None:
        return self.get_exact_now(scope, exact_key)

    def get_exact_now(self, scope: str, exact_key: str) -> Entry | None:
        """Without awaiting: an exact hit is then served with no task (CacheStage.look_now)."""
        slot = self._live(scope, exact_key, self._clock())
        return None if slot is None else slot.entry

    async def nearest(self, scope: str, vector: np.ndarray,
                      min_similarity: float) -> Neighbour | None:
        return self.nearest_now(scope, vector, min_similarity)

    async def put(self, scope: str, exact_key: str, prompt: str, vector: np.ndarray | None,
                  answer: bytes, ttl_s: float, asked_at: float | None = None,
                  states: bytes | None = None) -> bool:
        """CacheStore.put; `states` are not kept: one process's are the cache stage's."""
        now = self._clock()
        if asked_at is not None and self.purged_since(scope, asked_at):
            return False
        return self.put_now(Entry(exact_key, scope, prompt, answer, now), vector, now + ttl_s)

    async def get_states(self, scope: str, exact_keys: list[str], max_bytes: int) -> list[bytes | None]:
        """None for each: this store keeps no states (the cache stage holds them)."""
        return [None] * len(exact_keys)

    async def purge_scope(self, scope: str) -> int:
        return self.purge_scope_now(scope)

    async def purge_all(self) -> int:
        """Delete every entry of every scope (admin); how many there were."""
        return self.purge_all_now()

    def purge_all_now(self) -> int:
        self._note_purge(None)
        deleted = len(self._slots)
        self._slots.clear()
        self._scopes.clear()
        self._expiry.clear()
        self._bytes = 0
        return deleted

    # -- the same, synchronous (RedisStore drives its mirror with these) -----------------

    def __len__(self) -> int:
        return len(self._slots)

    @property
    def nbytes(self) -> int:
        """Bytes charged against limits.max_bytes for what the store holds now."""
        return self._bytes

    @property
    def scope_count(self) -> int:
        return len(self._scopes)

    def scope_size(self, scope: str) -> int:
        s = self._scopes.get(scope)
        return 0 if s is None else len(s.order)

    def peek(self, scope: str, exact_key: str) -> Entry | None:
        """The entry held under the key, expired or not, without marking it used."""
        slot = self._slots.get((scope, exact_key))
        return None if slot is None else slot.entry

    def nearest_now(self, scope: str, vector: np.ndarray,
                    min_similarity: float) -> Neighbour | None:
        now = self._clock()
        self._purge_expired(now)
        s = self._scopes.get(scope)
        for _ in range(_NEAREST_TRIES):
            if s is None or not len(s.index):
                return None
            found = s.index.search(vector, min_similarity)
            if found is None:
                return None
            slot = self._live(scope, found[0], now)
            if slot is not None:
                return Neighbour(slot.entry, found[1])
            s = self._scopes.get(scope)  # the expired hit was dropped; search again
        return None

    def put_now(self, entry: Entry, vector: np.ndarray | None, expires_at: float) -> bool:
        """Store `entry` until `expires_at` (clock time); replaces an entry of the same id.
        False when it was not stored (expired already, or larger than the whole store)."""
        unit = None if vector is None else as_unit(vector, self.dim)  # raises before changes
        now = self._clock()
        self._purge_expired(now)
        expires_at = min(expires_at, now + self.limits.max_ttl_s)
        scope, key = entry.scope, entry.entry_id
        cost = entry_cost(entry, unit is not None)
        if expires_at <= now or cost + SCOPE_BYTES > self.limits.max_bytes:
            self.discard(scope, key)        # the replaced answer is not served in its stead
            return False
        old = self._slots.get((scope, key))
        if old is None:
            s = self._scopes.get(scope)
            if s is not None and len(s.order) >= self.limits.max_entries_per_scope:
                self._remove(scope, next(iter(s.order)))
            if len(self._slots) >= self.limits.max_entries:
                self._remove(*next(iter(self._slots)))
        s = self._scopes.get(scope)
        if s is None:
            s = self._scopes[scope] = _Scope(VectorIndex(self.dim, exact_max=self._exact_max))
            self._bytes += SCOPE_BYTES
        if unit is not None:
            s.index.add(key, unit)
        elif key in s.index:
            s.index.discard(key)
        self._index_changed(s)
        self._bytes += cost - (0 if old is None else old.cost)
        self._slots[(scope, key)] = _Slot(entry, expires_at, cost)
        self._slots.move_to_end((scope, key))
        s.order[key] = None
        s.order.move_to_end(key)
        heapq.heappush(self._expiry, (expires_at, scope, key))
        if len(self._expiry) > 2 * len(self._slots) + 1024:
            self._expiry = [(v.expires_at, sc, k) for (sc, k), v in self._slots.items()]
            heapq.heapify(self._expiry)
        while self._bytes > self.limits.max_bytes and self._slots:
            self._remove(*next(iter(self._slots)))     # the least recently used, any scope
        return True

    def discard(self, scope: str, exact_key: str) -> bool:
        """Forget one entry; False if it was not here."""
        if (scope, exact_key) not in self._slots:
            return False
        self._remove(scope, exact_key)
        return True

    def purge_scope_now(self, scope: str) -> int:
        """Delete the scope's entries; puts asked for before now are dropped (put's asked_at)."""
        self._note_purge(scope)
        s = self._scopes.pop(scope, None)
        if s is None:
            return 0
        for key in s.order:
            self._bytes -= self._slots.pop((scope, key)).cost
        self._bytes -= SCOPE_BYTES + s.index_bytes
        return len(s.order)

    def adopt_purges(self, other: "MemoryStore") -> None:
        """Remember `other`'s recent purges, as this store replaces it (same clock)."""
        for scope, at in other._purged_at.items():
            self._purged_at[scope] = max(at, self._purged_at.get(scope, -math.inf))

    # -- bookkeeping ----------------------------------------------------------------------

    def purged_since(self, scope: str, since: float) -> bool:
        """The scope (or every scope) was purged at `since` or later."""
        return max(self._purged_at.get(scope, -math.inf), self._purged_at.get(None, -math.inf)) >= since

    def _note_purge(self, scope: str | None) -> None:
        now = self._clock()
        self._purged_at = {s: t for s, t in self._purged_at.items() if t > now - PURGE_MEMORY_S}
        self._purged_at[scope] = now

    def _live(self, scope: str, key: str, now: float) -> _Slot | None:
        """The slot if present and unexpired, marked as just used; drops an expired one."""
        slot = self._slots.get((scope, key))
        if slot is None:
            return None
        if slot.expires_at <= now:
            self._remove(scope, key)
            return None
        self._slots.move_to_end((scope, key))
        self._scopes[scope].order.move_to_end(key)
        return slot

    def _remove(self, scope: str, key: str) -> None:
        self._bytes -= self._slots.pop((scope, key)).cost
        s = self._scopes[scope]
        del s.order[key]
        if s.index.discard(key):
            self._index_changed(s)
        if not s.order:
            del self._scopes[scope]
            self._bytes -= SCOPE_BYTES + s.index_bytes

    def _index_changed(self, s: _Scope) -> None:
        now_bytes = s.index.nbytes + (INDEX_ARRAYS_BYTES if s.index.capacity else 0)
        self._bytes += now_bytes - s.index_bytes
        s.index_bytes = now_bytes

    def _purge_expired(self, now: float) -> None:
        heap = self._expiry
        for _ in range(_PURGE_BATCH):
            if not heap or heap[0][0] > now:
                return
            expires_at, scope, key = heapq.heappop(heap)
            slot = self._slots.get((scope, key))
            if slot is not None and slot.expires_at == expires_at:
                self._remove(scope, key)
