"""Upstream timeout for one request, from its size and what the cluster has been observed to do."""
from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass

from sidecar.scheduling._validate import count, non_negative, positive, require
from sidecar.scheduling.model import ClusterSnapshot

_SIZE = re.compile(r"(?<![a-z0-9.])(?:(\d+)x)?(\d+(?:\.\d+)?)b(?![a-z0-9])", re.IGNORECASE)


@dataclass(frozen=True)
class TimeoutConfig:
    min_ms: int = 5_000  # route bounds: the result is clamped to [min_ms, max_ms]
    max_ms: int = 600_000
    # Seed rule, used until the cluster has TTFB and tokens/s observations:
    base_s: float = 30.0
    per_512_prompt_tokens_s: float = 15.0
    large_model_factor: float = 2.0
    large_model_min_b: float = 65.0  # billions of parameters, read from the model name
    # Observed rule: safety_factor * (TTFB P95 + max_tokens / tokens_per_s)
    safety_factor: float = 2.0
    default_max_tokens: int = 1024  # when the request does not set max_tokens
    # The route's time-to-first-byte budget (Envoy's per-try timeout); None: no such cut.
    first_byte_ms: int | None = None

    def __post_init__(self) -> None:
        count("TimeoutConfig.min_ms", self.min_ms)
        count("TimeoutConfig.max_ms", self.max_ms)
        require(self.max_ms >= self.min_ms, "TimeoutConfig.max_ms", f"must be >= min_ms ({self.min_ms})", self.max_ms)
        positive("TimeoutConfig.base_s", self.base_s)
        non_negative("TimeoutConfig.per_512_prompt_tokens_s", self.per_512_prompt_tokens_s)
        require(self.large_model_factor >= 1, "TimeoutConfig.large_model_factor", "must be >= 1", self.large_model_factor)
        positive("TimeoutConfig.large_model_min_b", self.large_model_min_b)
        require(self.safety_factor >= 1, "TimeoutConfig.safety_factor", "must be >= 1", self.safety_factor)
        count("TimeoutConfig.default_max_tokens", self.default_max_tokens)
        if self.first_byte_ms is not None:
            count("TimeoutConfig.first_byte_ms", self.first_byte_ms)


@functools.lru_cache(maxsize=256)     # a route's few model names, asked on every request
def model_size_b(model: str | None) -> float | None:
    """Parameters in billions as the name tells them: 'llama-3.1-70b' -> 70, 'mixtral-8x22b' -> 176."""
    sizes = [float(n or 1) * float(b) for n, b in _SIZE.findall(model or "")]
    return max(sizes) if sizes else None


def upstream_timeout_ms(
    prompt_tokens: int,
    max_tokens: int | None,
    model: str | None,
    signals: ClusterSnapshot | None,
    config: TimeoutConfig,
) -> int:
    return upstream_timeout(prompt_tokens, max_tokens, model, signals, config)[0]


def upstream_timeout(
    prompt_tokens: int,
    max_tokens: int | None,
    model: str | None,
    signals: ClusterSnapshot | None,
    config: TimeoutConfig,
) -> tuple[int, str]:
    """(ms, what decided it): observed (the cluster's TTFB and tokens/s), seed (prompt size and
    model), or route_min / route_max when the route's bounds clamped it."""
    ttfb, rate = (signals.ttfb_p95_s, signals.tokens_per_s) if signals else (None, None)
    if ttfb is not None and rate:
        tokens = max_tokens if max_tokens and max_tokens > 0 else config.default_max_tokens
        seconds = config.safety_factor * (ttfb + tokens / rate)
        source = "observed"
    else:
        source = "seed"
        seconds = config.base_s + config.per_512_prompt_tokens_s * max(prompt_tokens, 0) / 512
        size = model_size_b(model)
        if size is not None and size >= config.large_model_min_b:
            seconds *= config.large_model_factor
    ms = math.ceil(seconds * 1000)
    if ms < config.min_ms:
        return config.min_ms, "route_min"
    if ms > config.max_ms:
        return config.max_ms, "route_max"
    return ms, source
