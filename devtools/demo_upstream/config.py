"""Live-tunable options: one table drives both the CLI flags and /admin/config."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Callable

from .scheduler import POLICIES

ERROR_MODES = ("500", "reset", "midstream", "hang")


@dataclass
class Config:
    model: str = "demo-model"
    ttft_ms: float = 50.0
    tokens_per_s: float = 200.0
    tokens: int = 16
    error_rate: float = 0.0
    error_mode: str = "500"
    capacity: int = 0
    kv_tokens: int = 0
    slowdown_per_running: float = 0.0
    tail_rate: float = 0.0
    tail_factor: float = 10.0
    seed: int | None = None
    scheduling_policy: str = "fcfs"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class ConfigError(ValueError):
    def __init__(self, name: str, message: str) -> None:
        super().__init__(f"{name}: {message}")
        self.name = name


def _number(kind: type, low: float, high: float | None = None, above_low: bool = False):
    """Converter for CLI strings and JSON numbers, with a range check."""

    def convert(value: Any):
        # JSON true/false are ints to Python; a flag set to `true` is a caller bug.
        if isinstance(value, bool) or (kind is int and isinstance(value, float)):
            raise ValueError(f"expected {kind.__name__}, got {value!r}")
        number = kind(value)
        if number < low or (above_low and number == low) or (high is not None and number > high):
            bounds = f"{'>' if above_low else '>='} {low}" + (f" and <= {high}" if high is not None else "")
            raise ValueError(f"must be {bounds}, got {number}")
        return number

    return convert


def _model(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError("must be a non-empty string")
    return value


def _error_mode(value: Any) -> str:
    value = str(value)
    if value not in ERROR_MODES:
        raise ValueError(f"must be one of {', '.join(ERROR_MODES)}")
    return value


def _policy(value: Any) -> str:
    value = str(value)
    if value not in POLICIES:
        raise ValueError(f"must be one of {', '.join(POLICIES)}")
    return value


def _seed(value: Any) -> int | None:
    return None if value is None else _number(int, float("-inf"))(value)


# name -> (converter, help); defaults live on Config.
OPTIONS: dict[str, tuple[Callable[[Any], Any], str]] = {
    "model": (_model, "model id reported in /v1/models, metrics and answers without a model"),
    "ttft_ms": (_number(float, 0), "time to first token in milliseconds"),
    "tokens_per_s": (_number(float, 0, above_low=True), "decode speed after the first token"),
    "tokens": (_number(int, 1), "completion length in tokens; a request's max_tokens caps it"),
    "error_rate": (_number(float, 0, 1), "share of chat requests that fail (0..1)"),
    "error_mode": (_error_mode, "how a failing request fails: 500, reset (before headers), midstream (reset mid-body) or hang (no answer until the client leaves)"),
    "capacity": (_number(int, 0), "requests served at once, the rest queue FIFO; 0 = unlimited"),
    "kv_tokens": (_number(int, 0), "tokens the running batch holds at most (each request: prompt + completion "
                                   "budget), the rest queue; 0 = unlimited"),
    "slowdown_per_running": (
        _number(float, 0),
        "per-token time grows by this factor for each running request above capacity/2",
    ),
    "tail_rate": (_number(float, 0, 1), "share of requests whose time to first token is multiplied by tail_factor"),
    "tail_factor": (_number(float, 1), "the long tail: TTFT multiplier for tail_rate of requests"),
    "seed": (_seed, "seed for completion text and error draws"),
    "scheduling_policy": (_policy, "fcfs, or priority as vLLM: the body's integer 'priority' orders the waiting "
                                   "queue (lower first) and preempts running requests of a worse priority"),
}

assert set(OPTIONS) == {f.name for f in fields(Config)}


def validate(changes: Any) -> dict[str, Any]:
    """Convert a JSON object of option changes; raises ConfigError on the first bad one."""
    if not isinstance(changes, dict):
        raise ConfigError("body", "expected a JSON object of options")
    converted = {}
    for name, value in changes.items():
        if name not in OPTIONS:
            raise ConfigError(name, f"unknown option (known: {', '.join(OPTIONS)})")
        try:
            converted[name] = OPTIONS[name][0](value)
        except (TypeError, ValueError) as exc:
            raise ConfigError(name, str(exc)) from None
    return converted
