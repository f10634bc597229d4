"""Sliding-window statistics with bounded memory. Time is always passed in (seconds, monotonic)."""
from __future__ import annotations

import math
from collections import deque


class Ewma:
    """Exponentially weighted moving average; the first sample sets the value."""

    def __init__(self, alpha: float) -> None:
        self._alpha = alpha
        self.value: float | None = None

    def add(self, sample: float) -> None:
        self.value = sample if self.value is None else self.value + self._alpha * (sample - self.value)


class SampleWindow:
    """The samples of the last `window_s` seconds, at most `max_samples` of them (the newest).

    Quantiles come from a sorted copy that is refreshed at most every `refresh_s` once samples
    change: sorting ~1,000 samples on every request cost more than the rest of the sidecar's
    routing path, and a P95 over a minute does not move in a quarter of a second."""

    def __init__(self, window_s: float, max_samples: int, refresh_s: float = 0.25) -> None:
        self._window_s = window_s
        self._refresh_s = refresh_s
        self._samples: deque[tuple[float, float]] = deque(maxlen=max_samples)
        self._sorted: list[float] | None = None
        self._sorted_at = -math.inf
        self._dirty = False

    def add(self, now: float, value: float) -> None:
        self._prune(now)
        self._samples.append((now, value))
        self._dirty = True

    def count(self, now: float) -> int:
        self._prune(now)
        return len(self._samples)

    def newest_at(self) -> float | None:
        """When the newest sample was added; None when there is none."""
        return self._samples[-1][0] if self._samples else None

    def quantile(self, q: float, now: float) -> float | None:
        """Nearest-rank quantile of the samples in the window; None when there are none."""
        self._prune(now)
        if not self._samples:
            return None
        if self._sorted is None or (self._dirty and now - self._sorted_at >= self._refresh_s):
            self._sorted = sorted(value for _, value in self._samples)
            self._sorted_at, self._dirty = now, False
        rank = max(1, math.ceil(q * len(self._sorted)))
        return self._sorted[rank - 1]

    def clear(self) -> None:
        self._samples.clear()
        self._sorted = None

    def _prune(self, now: float) -> None:
        horizon = now - self._window_s
        while self._samples and self._samples[0][0] <= horizon:
            self._samples.popleft()
            self._dirty = True


class OutcomeWindow:
    """Success and failure counts over the last `window_s` seconds, kept in `buckets` time buckets
    with running totals (read on every request, so O(1) rather than a sum over the buckets)."""

    def __init__(self, window_s: float, buckets: int = 20) -> None:
        self._window_s = window_s
        self._width = window_s / buckets
        self._buckets: deque[list[int]] = deque()  # [bucket index, ok, failed]
        self._total = self._failed = 0

    def add(self, now: float, ok: bool) -> None:
        self._prune(now)
        index = math.floor(now / self._width)
        if not self._buckets or index > self._buckets[-1][0]:
            self._buckets.append([index, 0, 0])
        self._buckets[-1][1 if ok else 2] += 1
        self._total += 1
        self._failed += not ok

    def counts(self, now: float) -> tuple[int, int]:
        """(total, failed) in the window."""
        self._prune(now)
        return self._total, self._failed

    def clear(self) -> None:
        self._buckets.clear()
        self._total = self._failed = 0

    def _prune(self, now: float) -> None:
        horizon = now - self._window_s
        while self._buckets and (self._buckets[0][0] + 1) * self._width <= horizon:
            _, ok, failed = self._buckets.popleft()
            self._total -= ok + failed
            self._failed -= failed
