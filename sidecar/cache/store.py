"""Where cached answers live: the interface both tiers of the cache use, and its bounds.

An entry is one stored answer, found two ways within its scope (tenant, model, context):
exactly, by the key the caller derives from the request (a sha256 hex string), or
semantically, by the stored prompt vector nearest to the request's.  The answer is opaque
bytes: the caller serialises it (CachedAnswer.to_bytes), this layer never looks inside.

Implementations: MemoryStore (one replica, the default) and RedisStore (shared by every
replica).  Neither raises on a backend failure in the request path: a failed lookup is a
miss, a failed put is dropped.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from sidecar.cache.budget import DEFAULT_BUDGET_BYTES, CacheBudget

__all__ = ["CacheStore", "Entry", "Neighbour", "StoreLimits", "StoreUnavailable"]


# How long a purge is remembered, so that a put asked for before it is dropped: longer than
# an answer takes to arrive (the reference Envoy's stream idle timeout is 300 s).
PURGE_MEMORY_S = 900.0
# The store's share of the default cache budget (SLUICE_CACHE_MAX_MIB, sidecar/cache/budget.py).
DEFAULT_MAX_BYTES = CacheBudget(DEFAULT_BUDGET_BYTES).store


@dataclass(frozen=True, slots=True)
class Entry:
    entry_id: str      # the exact key it was stored under; unique within its scope
    scope: str
    prompt: str
    answer: bytes
    stored_at: float   # seconds since the epoch


@dataclass(frozen=True, slots=True)
class Neighbour:
    entry: Entry
    similarity: float  # cosine between the query and the stored prompt vector


class StoreUnavailable(Exception):
    """An admin operation (purge) could not reach the shared backend; retry it."""


@dataclass(frozen=True)
class StoreLimits:
    """Bounds on what a store holds.  Every entry also has its own TTL.

    max_bytes: what the store's entries hold in this process, all scopes together: keys,
        prompts, answers, vectors and each scope's own structures (sidecar/cache/memory_store.py
        counts them); the least recently used entry of any scope goes first.  The bound that
        holds whatever the mix: one scope of many entries or many scopes of one.
    max_entries: all scopes together; the least recently used entry goes first.
    max_entries_per_scope: one scope (tenant) never holds more than this; a full scope
        evicts its own least recently used entry, never another scope's.  So a tenant
        that floods the cache with distinct prompts churns only its own entries, while
        the overall bound is shared in least-recently-used order.
    max_ttl_s: the longest TTL a put may ask for (longer ones are cut to it).
    """

    max_entries: int = 100_000
    max_entries_per_scope: int = 20_000
    max_ttl_s: float = 7 * 24 * 3600.0
    max_bytes: int = DEFAULT_MAX_BYTES

    def __post_init__(self) -> None:
        if self.max_bytes <= 0:
            raise ValueError(f"max_bytes: must be > 0, got {self.max_bytes!r}")
        if self.max_entries <= 0:
            raise ValueError(f"max_entries: must be > 0, got {self.max_entries!r}")
        if not 0 < self.max_entries_per_scope <= self.max_entries:
            raise ValueError(f"max_entries_per_scope: must be in (0, max_entries], "
                             f"got {self.max_entries_per_scope!r}")
        if self.max_ttl_s <= 0:
            raise ValueError(f"max_ttl_s: must be > 0, got {self.max_ttl_s!r}")


class CacheStore(Protocol):
    async def start(self) -> None:
        """Connect and load what is needed; never fails for an unreachable backend."""

    async def close(self) -> None: ...

    @property
    def healthy(self) -> bool:
        """False while the backend is unreachable (lookups miss, puts are dropped)."""

    async def get_exact(self, scope: str, exact_key: str) -> Entry | None: ...

    async def nearest(self, scope: str, vector: np.ndarray,
                      min_similarity: float) -> Neighbour | None:
        """The entry of `scope` whose prompt vector is most similar to `vector`, if at
        least `min_similarity` (cosine; vectors are unit float32 of the store's dim)."""

    async def put(self, scope: str, exact_key: str, prompt: str, vector: np.ndarray | None,
                  answer: bytes, ttl_s: float, asked_at: float | None = None,
                  states: bytes | None = None) -> bool:
        """Store (or replace) the entry under `exact_key`; without a vector it can only be
        found exactly.  Never served after `ttl_s` seconds.  `asked_at` (the store's clock):
        when the answer was asked for; if the scope was purged since, the put is dropped, as
        the answer may be what the purge was for (an upstream answer in flight during it).
        `states`: the prompt's token states (sidecar/cache/token_states.py's encode_states),
        kept with the entry, and gone with it, by a store that shares them between replicas;
        a store of one process ignores them (the cache stage keeps its own).
        Whether the entry was stored (False: dropped, and any entry it replaced is gone)."""

    async def get_states(self, scope: str, exact_keys: list[str], max_bytes: int) -> list[bytes | None]:
        """The states put with each entry, in one round trip, as stored (the caller decodes
        them): None for an entry without them, one gone, a value over `max_bytes` (never read
        whole), and all None when the backend cannot answer or keeps none."""

    async def purge_scope(self, scope: str) -> int:
        """Delete every entry of `scope` (everywhere it is shared); how many were deleted.
        Raises StoreUnavailable when a shared backend cannot be reached."""
