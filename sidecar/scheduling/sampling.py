"""Which answers the sidecar reads: every one while a route is quiet, a sample once it is busy.

Reading an answer's status and time to first byte is a gRPC message per request (Envoy's
response headers), one of three on the routing path, and each costs CPU in Envoy and in the
sidecar (../shared/ENVOY_NOTES.md). The signals and breakers need a sample, not every answer:
at 1,000 requests/s one in eight is still ~170 answers a second. An unread answer still ends
its request's in-flight count (the ext_proc stream stays open until the request ends).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from sidecar.scheduling._validate import count


@dataclass
class FeedbackSampler:
    read_all_per_s: int = 50    # every answer is read until this many in the current second
    then_one_in: int = 8        # then one in this many (1: every answer)
    _second: int = field(default=-1, repr=False)
    _count: int = field(default=0, repr=False)

    def __post_init__(self) -> None:
        count("feedback.then_one_in", self.then_one_in)

    def read(self, now: float) -> bool:
        """Whether to read this request's answer (call once per request)."""
        second = int(now)
        if second != self._second:
            self._second, self._count = second, 0
        self._count += 1
        return self._count <= self.read_all_per_s or self._count % self.then_one_in == 0
