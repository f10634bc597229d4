"""Read the load an upstream reports in Prometheus text exposition (vLLM's /metrics).

Never raises on bad input: a line that does not parse is skipped.
"""
from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field

from sidecar.scheduling.model import UpstreamLoad

WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
KV_CACHE = "vllm:kv_cache_usage_perc"
KV_CACHE_LEGACY = "vllm:gpu_cache_usage_perc"  # vLLM before the V1 engine

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*(,|\})')
_UNESCAPE = re.compile(r"\\(.)")


@dataclass(frozen=True)
class Sample:
    name: str
    value: float
    labels: dict[str, str] = field(default_factory=dict)


def parse_samples(text: str | bytes) -> Iterator[Sample]:
    """Every well-formed sample line; comments, blank and malformed lines are skipped."""
    if isinstance(text, (bytes, bytearray)):
        text = bytes(text).decode("utf-8", errors="replace")
    if not isinstance(text, str):
        return
    for line in text.splitlines():
        sample = _parse_line(line.strip())
        if sample is not None:
            yield sample


def upstream_load(text: str | bytes) -> UpstreamLoad | None:
    """vLLM's queue and KV-cache figures. Request counts are summed over label sets (one per
    engine or model); KV-cache usage is a fraction, so it is averaged. A metric that is absent
    leaves its field None; None when none of them is present."""
    found: dict[str, list[float]] = {}
    for sample in parse_samples(text):
        # Counts and a fraction: a negative one is garbage (it would make the cluster look best).
        if sample.name in (WAITING, RUNNING, KV_CACHE, KV_CACHE_LEGACY) and math.isfinite(sample.value) \
                and sample.value >= 0:
            found.setdefault(sample.name, []).append(sample.value)
    kv = found.get(KV_CACHE) or found.get(KV_CACHE_LEGACY)
    load = UpstreamLoad(
        waiting=sum(found[WAITING]) if WAITING in found else None,
        running=sum(found[RUNNING]) if RUNNING in found else None,
        kv_cache_usage=sum(kv) / len(kv) if kv else None,
    )
    return None if load == UpstreamLoad() else load


def _parse_line(line: str) -> Sample | None:
    if not line or line.startswith("#"):
        return None
    name_match = _NAME.match(line)
    if name_match is None:
        return None
    rest = line[name_match.end():]
    labels: dict[str, str] = {}
    if rest.startswith("{"):
        parsed = _parse_labels(rest)
        if parsed is None:
            return None
        labels, rest = parsed
    if not rest[:1].isspace():
        return None
    parts = rest.split()
    if len(parts) not in (1, 2):  # value, then an optional timestamp
        return None
    try:
        value = float(parts[0])
    except ValueError:
        return None
    return Sample(name_match.group(), value, labels)


def _parse_labels(rest: str) -> tuple[dict[str, str], str] | None:
    """Parse '{a="x",b="y"}' at the start of rest; return the labels and what follows."""
    labels: dict[str, str] = {}
    pos = 1
    if rest[pos:].lstrip().startswith("}"):
        return labels, rest[rest.index("}", pos) + 1:]
    while True:
        match = _LABEL.match(rest, pos)
        if match is None:
            return None
        labels[match.group(1)] = _UNESCAPE.sub(_unescape, match.group(2))
        pos = match.end()
        if match.group(3) == "}":
            return labels, rest[pos:]
        if rest[pos:].lstrip().startswith("}"):  # trailing comma
            return labels, rest[rest.index("}", pos) + 1:]


def _unescape(match: re.Match[str]) -> str:
    return "\n" if match.group(1) == "n" else match.group(1)
