"""The cache's one byte budget in this process (SLUICE_CACHE_MAX_MIB), and its shares.

Callers choose what the cache holds (prompts, scopes, request bodies), so everything that grows
with them draws on one budget, each part evicting its own least recently used when its share
is full, and the total stays within the budget whatever the traffic:
  store     entries, answers, vectors and each scope's index (sidecar/cache/memory_store.py);
            with Redis, the local tier and the mirror of the shared vectors;
  profiles  the same-question checks' profiles of prompts (sidecar/cache/equivalence.py);
  memos     every route's request memo together (sidecar/cache/request_memo.py);
  false_hits  the reported false hits this process remembers (sidecar/cache/false_hits.py);
  token_states  stored prompts' token states for a verifier that aligns them
            (sidecar/cache/token_states.py; empty unless a route's verifier reads them).
The store takes what the small shares leave.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

__all__ = ["CacheBudget", "BytePool", "DEFAULT_BUDGET_BYTES"]

DEFAULT_BUDGET_BYTES = 256 * 2**20     # SLUICE_CACHE_MAX_MIB's default (sidecar/config.py)

PROFILES_SHARE = 1 / 16
MEMOS_SHARE = 1 / 16
FALSE_HITS_SHARE = 1 / 64
# ~11.7 KB a stored prompt on average (14.5 tokens in fp16 with its keys; `make bench-verifier`):
# 16 MiB of the default budget holds ~1,400.
TOKEN_STATES_SHARE = 1 / 16


@dataclass(frozen=True)
class CacheBudget:
    total: int      # bytes

    def __post_init__(self) -> None:
        if self.total <= 0:
            raise ValueError(f"total: must be > 0, got {self.total!r}")

    @property
    def profiles(self) -> int:
        return int(self.total * PROFILES_SHARE)

    @property
    def memos(self) -> int:
        return int(self.total * MEMOS_SHARE)

    @property
    def false_hits(self) -> int:
        return int(self.total * FALSE_HITS_SHARE)

    @property
    def token_states(self) -> int:
        return int(self.total * TOKEN_STATES_SHARE)

    @property
    def store(self) -> int:
        return self.total - self.profiles - self.memos - self.false_hits - self.token_states


class BytePool:
    """Bytes that several holders draw on together (each route's request memo): a holder that
    cannot take what it needs evicts its own oldest, or keeps nothing."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes: must be > 0, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self.used = 0

    def fits(self, nbytes: int) -> bool:
        return self.used + nbytes <= self.max_bytes

    def holder(self, owner: object) -> list[int]:
        """A cell of the bytes `owner` holds (add to it with take, return with give_back);
        what is in it when the owner is collected comes back to the pool."""
        held = [0]
        weakref.finalize(owner, self._return_all, held)
        return held

    def take(self, held: list[int], nbytes: int) -> None:
        self.used += nbytes
        held[0] += nbytes

    def give_back(self, held: list[int], nbytes: int) -> None:
        self.used -= nbytes
        held[0] -= nbytes

    def _return_all(self, held: list[int]) -> None:
        self.used -= held[0]
        held[0] = 0
