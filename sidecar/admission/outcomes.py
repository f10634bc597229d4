"""What admission answers besides a permit: a refusal (with its HTTP status) or a degrade.

Every refusal reason maps to one status in `REASON_STATUS`: 429 when the caller (a tenant) is over
its own share and should slow down, 503 when the sidecar as a whole is overloaded.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

# reason -> HTTP status of the immediate response
REASON_STATUS = MappingProxyType({
    "queue_full": 503,   # the whole queue is at its bound
    "class_full": 503,   # the request's priority class is at its bound
    "evicted": 503,      # queued, then pushed out by a higher-priority arrival into a full queue
    "deadline": 503,     # the deadline cannot cover the expected wait plus time to first token
    "expired": 503,      # waited in the queue until its deadline passed
    "tenant_full": 429,  # the tenant already has its cap of queued requests
    "rpm": 429,          # the tenant's requests-per-minute budget on this route is spent
    "tpm": 429,          # the tenant's tokens-per-minute budget on this route is spent
})
REASONS = tuple(REASON_STATUS)


@dataclass(frozen=True)
class Refusal:
    """Answer at once with `status` and a Retry-After of `retry_after_s` (round it up to whole seconds)."""

    reason: str
    retry_after_s: float

    @property
    def status(self) -> int:
        return REASON_STATUS[self.reason]

    def __post_init__(self) -> None:
        if self.reason not in REASON_STATUS:
            raise ValueError(f"Refusal.reason must be one of {REASONS} (got {self.reason!r})")


@dataclass(frozen=True)
class Degrade:
    """The request waited `waited_s` (longer than degrade_after_s) without a slot: send it to the
    route's fallback cluster instead, outside this gate's queue."""

    waited_s: float
