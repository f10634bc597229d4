"""The cache's verdict on a request, remembered for byte-identical repeats.

Repeats are what a cache serves, and working out a request's bypass verdict, scope and exact
key (normalising the prompt, the time-word scan, four canonical-JSON digests) was most of an
exact hit's own cost: ~250 µs of the sidecar's ~1 ms on a 2 KB prompt through Envoy, more than
a pass-through's whole ext_proc exchange. That work depends only on the route's settings, the
body and five headers (credential, Cache-Control, Pragma, host, path), so a repeat reuses it.

One memo belongs to one route (its settings object and name: route metadata that changes or is
parsed again gets a new one), so only the body and those headers vary. It is keyed by a BLAKE2b
digest of them, so no credential is kept, holds at most MAX_ENTRIES results and skips bodies
over MAX_BODY_BYTES. Every route's memo draws on one pool of bytes (the cache budget's share,
sidecar/cache/budget.py), a result charged ENTRY_BYTES and what the caller says it holds (its
prompt; four bytes a body byte when unsaid: an emoji widens a whole str to UCS-4); the oldest
results go first.
"""
from __future__ import annotations

import hashlib
from typing import Callable, Generic, Mapping, TypeVar

from sidecar.cache.budget import BytePool
from sidecar.memo import may_keep

MAX_ENTRIES = 1024
MAX_BODY_BYTES = 16 * 1024
# A result besides its prompt: the digest, the dict slot, the verdict tuple, scope and key.
ENTRY_BYTES = 600

T = TypeVar("T")


def request_digest(body: bytes, headers: Mapping[str, str], credential_header: str) -> bytes:
    """What the verdict depends on besides the route: the caller's credential, Cache-Control
    and Pragma, the endpoint (host and path: part of the scope), and the body."""
    h = hashlib.blake2b(digest_size=16)
    for part in (headers.get(credential_header) or "", headers.get("cache-control") or "",
                 headers.get("pragma") or "", headers.get(":authority") or "", headers.get(":path") or ""):
        encoded = part.encode("utf-8", "surrogatepass")
        h.update(len(encoded).to_bytes(4, "big"))      # length-prefixed: no two inputs run together
        h.update(encoded)
    h.update(body)
    return h.digest()


class RequestMemo(Generic[T]):
    def __init__(self, credential_header: str, max_entries: int = MAX_ENTRIES,
                 max_body_bytes: int = MAX_BODY_BYTES, pool: BytePool | None = None,
                 size: Callable[[T], int] | None = None) -> None:
        """credential_header: the route's tenant header, else Authorization (sidecar.tenancy.credential_header).
        pool: the bytes shared with other routes' memos (None: a pool of this memo's own, for
        max_entries of the largest bodies). size: the bytes a result holds beyond ENTRY_BYTES."""
        self._credential_header = credential_header
        self._results: dict[bytes, tuple[T, int]] = {}      # digest -> (result, bytes), oldest first
        self._max_entries = max_entries
        self._max_body_bytes = max_body_bytes
        self._pool = pool or BytePool(max_entries * (ENTRY_BYTES + 4 * max_body_bytes))
        self._size = size
        self._held = self._pool.holder(self)

    def get(self, body: bytes, headers: Mapping[str, str], work_out: Callable[[], T]) -> T:
        """The remembered result for these inputs, else work_out()'s (remembered if the body is
        small enough and the pool has room after this memo's oldest results went)."""
        if len(body) > self._max_body_bytes or not may_keep(headers):
            return work_out()
        digest = request_digest(body, headers, self._credential_header)
        found = self._results.get(digest)
        if found is not None:
            return found[0]
        result = work_out()
        cost = ENTRY_BYTES + (4 * len(body) if self._size is None else self._size(result))
        while self._results and (len(self._results) >= self._max_entries or not self._pool.fits(cost)):
            self._pool.give_back(self._held, self._results.pop(next(iter(self._results)))[1])
        if self._pool.fits(cost):
            self._results[digest] = (result, cost)
            self._pool.take(self._held, cost)
        return result

    def __len__(self) -> int:
        return len(self._results)
