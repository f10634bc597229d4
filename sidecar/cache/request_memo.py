"""The cache's verdict on a request, remembered for byte-identical repeats.

Repeats are what a cache serves, and working out a request's bypass verdict, scope and exact
key (normalising the prompt, the time-word scan, four canonical-JSON digests) was most of an
exact hit's own cost: ~250 µs of the sidecar's ~1 ms on a 2 KB prompt through Envoy, more than
a pass-through's whole ext_proc exchange. That work depends only on the route's settings, the
body and five headers (credential, Cache-Control, Pragma, host, path), so a repeat reuses it.

One memo belongs to one route (its settings object and name: route metadata that changes or is
parsed again gets a new one), so only the body and those headers vary. It is keyed by a BLAKE2b
digest of them, so no credential is kept, holds at most MAX_ENTRIES results and skips bodies
over MAX_BODY_BYTES, so it holds at most a few MB of prompts.
"""
from __future__ import annotations

import hashlib
from typing import Callable, Generic, Mapping, TypeVar

from sidecar.memo import BoundedMemo, may_keep

MAX_ENTRIES = 1024
MAX_BODY_BYTES = 16 * 1024

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
                 max_body_bytes: int = MAX_BODY_BYTES) -> None:
        """credential_header: the route's tenant header, else Authorization (scope.credential_header)."""
        self._credential_header = credential_header
        self._results: BoundedMemo[T] = BoundedMemo(max_entries)
        self._max_body_bytes = max_body_bytes

    def get(self, body: bytes, headers: Mapping[str, str], work_out: Callable[[], T]) -> T:
        """The remembered result for these inputs, else work_out()'s (remembered if the body is
        small enough; the oldest result goes when full)."""
        if len(body) > self._max_body_bytes or not may_keep(headers):
            return work_out()
        return self._results.get(request_digest(body, headers, self._credential_header), work_out)

    def __len__(self) -> int:
        return len(self._results)
