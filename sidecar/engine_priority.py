"""Priority carried into the engine: which body field a cluster's engine reads a request's
priority from, and the value the sidecar writes there for a request's class.

A gateway can only reorder requests that have not started; an engine that schedules by
priority (vLLM's `--scheduling-policy priority`) also orders its own waiting queue and preempts
running lower-priority requests. The class comes from admission (a verified header or the
route's default), never from the client: whatever the client put in a field that any of the
route's candidates reads is removed, and only the chosen cluster's field is written.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

KINDS = ("none", "vllm", "field")


@dataclass(frozen=True)
class EngineField:
    """A body field holding the priority: a path into nested objects, and its polarity."""

    path: tuple[str, ...]
    higher_first: bool = False

    def value(self, rank: int, max_rank: int) -> int:
        """The value for urgency `rank` (0 the most urgent) among ranks 0..max_rank."""
        return max_rank - rank if self.higher_first else rank


VLLM = EngineField(("priority",), higher_first=False)


def engine_field(kind: str, field: str = "", higher_first: bool = False) -> EngineField | None:
    """From a candidate's settings; None when its engine takes no priority. Raises ValueError."""
    kind = kind or "none"
    if kind not in KINDS:
        raise ValueError(f"engine_priority.kind: expected one of {', '.join(KINDS)}, got {kind!r}")
    if kind == "none":
        return None
    if kind == "vllm":
        return VLLM
    path = tuple(field.split(".")) if field else ()
    if not path or not all(path):
        raise ValueError(f"engine_priority.field: expected a body field (a.b.c), got {field!r}")
    return EngineField(path, higher_first)


def class_ranks(classes: Sequence[str], configured: Mapping[str, int]) -> dict[str, int]:
    """Each class's urgency rank: the route's mapping, else the class's place in the order.
    Raises ValueError for a class the gate does not have."""
    unknown = sorted(set(configured) - set(classes))
    if unknown:
        raise ValueError(f"admission.engine_ranks: unknown classes {unknown} (classes: {', '.join(classes)})")
    return {name: configured.get(name, i) for i, name in enumerate(classes)}


def rewrite(data: dict, strip: Iterable[EngineField], write: EngineField | None, value: int | None) -> bool:
    """Remove every field in `strip` from the parsed body, then set `write` to `value` (when
    both are given). True when the body changed. An object on the way that is not an object
    (the client's) is replaced: the engine would reject it anyway."""
    changed = False
    for f in strip:
        changed |= _remove(data, f.path)
    if write is not None and value is not None:
        node = data
        for key in write.path[:-1]:
            child = node.get(key)
            if not isinstance(child, dict):
                child = node[key] = {}
            node = child
        node[write.path[-1]] = value
        changed = True
    return changed


def _remove(data: Any, path: tuple[str, ...]) -> bool:
    for key in path[:-1]:
        if not isinstance(data, dict):
            return False
        data = data.get(key)
    if isinstance(data, dict) and path[-1] in data:
        del data[path[-1]]
        return True
    return False
