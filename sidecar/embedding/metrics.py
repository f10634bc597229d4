"""Prometheus metrics of the embedding engine (sluice_embed_*, durations in seconds).

The engine talks to an `EmbedMetrics`, so tests pass a fake and nothing global changes.
Texts per second is `rate(sluice_embed_texts_total[1m])`.
"""
from __future__ import annotations

from typing import Protocol

from prometheus_client import Counter, Histogram

_SECONDS = (0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512, 1.0)

BATCH_SIZE = Histogram("sluice_embed_batch_size", "Texts in one model run.",
                       buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))
QUEUE_WAIT = Histogram("sluice_embed_queue_wait_seconds",
                       "Time a text waited from embed() until a worker took it.", buckets=_SECONDS)
INFERENCE = Histogram("sluice_embed_inference_seconds", "Time of one model run.", buckets=_SECONDS)
TEXTS = Counter("sluice_embed_texts_total", "Texts embedded.")
REJECTED = Counter("sluice_embed_queue_full_total",
                   "Texts rejected at once because the embedding queue was full.")


class EmbedMetrics(Protocol):
    def model_run(self, texts: int, seconds: float) -> None: ...
    def queue_wait(self, seconds: float) -> None: ...
    def rejected(self) -> None: ...


class PrometheusMetrics:
    """Reports to the default registry; the sidecar exposes it on /metrics."""

    def model_run(self, texts: int, seconds: float) -> None:
        BATCH_SIZE.observe(texts)
        INFERENCE.observe(seconds)
        TEXTS.inc(texts)

    def queue_wait(self, seconds: float) -> None:
        QUEUE_WAIT.observe(seconds)

    def rejected(self) -> None:
        REJECTED.inc()


class NoMetrics:
    def model_run(self, texts: int, seconds: float) -> None:
        pass

    def queue_wait(self, seconds: float) -> None:
        pass

    def rejected(self) -> None:
        pass
