"""Requests still waiting for their first byte, and which of them are overdue.

A hanging cluster must be judged while its requests hang, not when they time out (the
timeout is sized for whole answers: tens of seconds). A request is overdue once it has waited
`factor` times the cluster's recent P95 time to first byte, and at least `min_s`; each one is
reported once, and the caller counts it as a failure then. Pure: time comes in as `now`.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from sidecar.scheduling._validate import positive, require


@dataclass(frozen=True)
class OverdueConfig:
    factor: float = 3.0   # overdue past this many times the cluster's P95 time to first byte ...
    min_s: float = 1.0    # ... and never sooner than this after it was sent

    def __post_init__(self) -> None:
        require(isinstance(self.factor, (int, float)) and self.factor >= 1, "OverdueConfig.factor",
                "must be >= 1", self.factor)
        positive("OverdueConfig.min_s", self.min_s)


class FirstByteWatch:
    """Per cluster, the requests sent and not yet answered, oldest first (dicts keep insertion
    order, and requests are added as they are sent). A request is any object, known by id."""

    def __init__(self, config: OverdueConfig | None = None) -> None:
        self.config = config or OverdueConfig()
        self._waiting: dict[str, dict[int, tuple[float, object]]] = {}

    def add(self, cluster: str, request: object, sent_at: float) -> None:
        self._waiting.setdefault(cluster, {})[id(request)] = (sent_at, request)

    def remove(self, cluster: str, request: object) -> None:
        """Its first byte came, or it ended (answered, abandoned, or reported overdue)."""
        waiting = self._waiting.get(cluster)
        if waiting is not None:
            waiting.pop(id(request), None)

    def waiting(self, cluster: str) -> int:
        return len(self._waiting.get(cluster, ()))

    def take_overdue(self, now: float, expected_s: Callable[[str], float | None]) -> list[object]:
        """Every request overdue now, removed from the watch. `expected_s` gives
        a cluster's usual time to first byte (None: nothing known, so nothing is overdue); it is
        asked only when a request has waited `min_s`, so most calls cost a look at each head."""
        found: list[object] = []
        for cluster, waiting in self._waiting.items():
            if not waiting or now - next(iter(waiting.values()))[0] < self.config.min_s:
                continue
            expected = expected_s(cluster)
            if expected is None:
                continue
            limit = max(self.config.min_s, self.config.factor * expected)
            for key, (sent_at, request) in list(waiting.items()):
                if now - sent_at < limit:
                    break
                del waiting[key]
                found.append(request)
        return found
