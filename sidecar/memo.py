"""A bounded memo for pure functions of a hashable key: the oldest result goes when full.

Insertion order stands in for recency (no per-hit bookkeeping): what is popular is worked out
again soon after it is dropped, and a hit costs one dict lookup.
"""
from __future__ import annotations

from typing import Callable, Generic, Hashable, Mapping, TypeVar

T = TypeVar("T")
_MISSING = object()


def may_keep(headers: Mapping[str, str]) -> bool:
    """False for a client that said Cache-Control: no-store: no memo keeps anything of its
    request. Any mention counts (a stricter reading than the cache policy's parse)."""
    return "no-store" not in (headers.get("cache-control") or "").lower()


class BoundedMemo(Generic[T]):
    def __init__(self, max_entries: int) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be at least 1")
        self._results: dict[Hashable, T] = {}
        self._max_entries = max_entries

    def get(self, key: Hashable, work_out: Callable[[], T]) -> T:
        """The remembered result for `key`, else work_out()'s, remembered. An exception from
        work_out is raised and nothing is remembered."""
        result = self._results.get(key, _MISSING)
        if result is _MISSING:
            result = work_out()
            if len(self._results) >= self._max_entries:
                del self._results[next(iter(self._results))]
            self._results[key] = result
        return result

    def discard(self, key: Hashable) -> None:
        self._results.pop(key, None)

    def __iter__(self):
        """The keys, oldest first."""
        return iter(self._results)

    def __len__(self) -> int:
        return len(self._results)
