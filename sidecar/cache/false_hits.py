"""Reported false hits: a stored answer that must never again serve a given prompt in its scope.

A client (header FEEDBACK_HEADER on a repeat of the request) or an operator (Admin
ReportFalseHit) says that an answer served from cache was wrong. The pair (the entry that
served it, the prompt it was served to) is remembered for its scope, so the lookup treats it as
a miss from then on, on every replica that shares Redis. The entry is identified with the time
it was stored: a fresh answer stored later under the same key is another entry.

Memory is bounded in bytes (least recently reported goes first); in Redis each scope's pairs
are one set under the scope's hash tag, bounded in members and expiring with the longest TTL.
"""
from __future__ import annotations

import hashlib
import logging
import time
from collections import OrderedDict
from typing import Protocol

from sidecar.observability.logs import Throttle
from sidecar.redis_retry import once_more_on_a_closed_connection

log = logging.getLogger("sluice.cache.false_hits")

# A client repeats the request with this header (value `1`) after a cached answer it judged
# wrong: the repeat goes upstream (as Cache-Control: no-cache does) and the pair is reported.
# Not an x-sluice-* header: Envoy strips those from clients.
FEEDBACK_HEADER = "x-cache-false-hit"

# What one remembered pair costs in this process: the 16-byte digest as a bytes object, its
# slot in the ordered dict and its expiry float (measured with tracemalloc: ~200 bytes).
PAIR_BYTES = 200


def pair_id(entry_id: str, stored_at: float, prompt_key: str) -> str:
    """One pair's name: the entry (key and when it was stored, to the millisecond) and the
    exact key of the prompt it must not serve."""
    return f"{entry_id}:{int(stored_at * 1000)}:{prompt_key}"


def _digest(scope: str, pair: str) -> bytes:
    return hashlib.blake2b(f"{scope}\n{pair}".encode(), digest_size=16).digest()


class FalseHits(Protocol):
    def known_now(self, scope: str, pair: str) -> bool:
        """Whether this process knows the pair; no waiting (exact hits served synchronously)."""

    async def known(self, scope: str, pair: str) -> bool:
        """Whether any replica reported the pair."""

    async def report(self, scope: str, pair: str, ttl_s: float) -> None: ...


class MemoryFalseHits:
    def __init__(self, max_bytes: int = 4 << 20, clock=time.time) -> None:
        if max_bytes < PAIR_BYTES:
            raise ValueError(f"max_bytes: must be >= {PAIR_BYTES}, got {max_bytes!r}")
        self._max_pairs = max_bytes // PAIR_BYTES
        self._pairs: OrderedDict[bytes, float] = OrderedDict()   # digest -> expiry
        self._clock = clock

    def __len__(self) -> int:
        return len(self._pairs)

    def known_now(self, scope: str, pair: str) -> bool:
        if not self._pairs:
            return False
        digest = _digest(scope, pair)
        expiry = self._pairs.get(digest)
        if expiry is None:
            return False
        if expiry <= self._clock():
            del self._pairs[digest]
            return False
        return True

    async def known(self, scope: str, pair: str) -> bool:
        return self.known_now(scope, pair)

    async def report(self, scope: str, pair: str, ttl_s: float) -> None:
        digest = _digest(scope, pair)
        self._pairs[digest] = self._clock() + ttl_s
        self._pairs.move_to_end(digest)
        while len(self._pairs) > self._max_pairs:
            self._pairs.popitem(last=False)


# SADD, bound the set (a random member goes when it is full: a tenant reporting without end
# churns only its own scope), and expire the set with the longest TTL an entry can have.
_REPORT = """
redis.call('SADD', KEYS[1], ARGV[1])
if redis.call('SCARD', KEYS[1]) > tonumber(ARGV[3]) then redis.call('SPOP', KEYS[1]) end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""


class RedisFalseHits:
    """Shared with every replica; this process's own reports are also kept in memory, so they
    hold at once here and while Redis is away."""

    def __init__(self, client, prefix: str = "sluice", max_per_scope: int = 10_000,
                 max_ttl_s: float = 7 * 24 * 3600.0, local: MemoryFalseHits | None = None) -> None:
        if not prefix or "{" in prefix or "}" in prefix:
            raise ValueError(f"prefix: must be non-empty, without braces, got {prefix!r}")
        if max_per_scope <= 0:
            raise ValueError(f"max_per_scope: must be > 0, got {max_per_scope!r}")
        self._client = client
        self._prefix = prefix
        self._max_per_scope = max_per_scope
        self._max_ttl_ms = int(max_ttl_s * 1000)
        self._local = local or MemoryFalseHits()
        self._warning = Throttle()

    def _key(self, scope: str) -> str:
        return f"{self._prefix}:{{{scope}}}:false-hits"

    def known_now(self, scope: str, pair: str) -> bool:
        return self._local.known_now(scope, pair)

    async def known(self, scope: str, pair: str) -> bool:
        if self._local.known_now(scope, pair):
            return True
        try:
            found = await once_more_on_a_closed_connection(
                lambda: self._client.sismember(self._key(scope), pair))
        except Exception as exc:  # noqa: BLE001 - Redis away: what this replica knows stands
            self._warn("read", exc)
            return False
        return bool(found)

    async def report(self, scope: str, pair: str, ttl_s: float) -> None:
        await self._local.report(scope, pair, ttl_s)
        try:
            await once_more_on_a_closed_connection(lambda: self._client.eval(
                _REPORT, 1, self._key(scope), pair, self._max_ttl_ms, self._max_per_scope))
        except Exception as exc:  # noqa: BLE001 - kept locally; other replicas learn nothing
            self._warn("write", exc)

    def _warn(self, what: str, exc: Exception) -> None:
        if self._warning.due():
            log.warning("false-hit %s failed on redis (%s): this replica's own reports still hold",
                        what, type(exc).__name__)
