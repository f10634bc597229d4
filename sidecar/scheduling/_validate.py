"""Checks used by the config dataclasses: each failure names the bad field."""
from __future__ import annotations

import math


def require(ok: bool, field: str, why: str, value: object) -> None:
    """Raise ValueError("<field> <why> (got <value>)") unless ok."""
    if not ok:
        raise ValueError(f"{field} {why} (got {value!r})")


def positive(field: str, value: float) -> None:
    require(_finite(value) and value > 0, field, "must be > 0", value)


def non_negative(field: str, value: float) -> None:
    require(_finite(value) and value >= 0, field, "must be >= 0", value)


def fraction(field: str, value: float) -> None:
    require(_finite(value) and 0 <= value <= 1, field, "must be within [0, 1]", value)


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def count(field: str, value: int) -> None:
    require(isinstance(value, int) and not isinstance(value, bool) and value >= 1, field, "must be an integer >= 1", value)
