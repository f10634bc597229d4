"""One canonical JSON for every digest Sluice keys on (cache scopes, prompt context keys).

Sorted keys, no spaces, ASCII escapes: one spelling per value, so equal values give equal
digests on every replica and version. A value JSON cannot hold (an object of another type, mixed
key types, a cycle) raises TypeError or ValueError: never a digest that could equal another's.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any

_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def canonical_digest(value: Any) -> str:
    """SHA-256 hex of the canonical JSON of a JSON-like value."""
    return hashlib.sha256(_ENCODER.encode(value).encode("ascii")).hexdigest()
