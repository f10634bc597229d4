"""Load the engine from settings: check the files, open the session, warm it, measure it.

Slow (a second or so) and blocking; the service runs it in a thread while the sidecar
reports NOT_SERVING. Every failure is a ModelLoadError that says what to fix.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from sidecar.embedding.encoder import Encoder
from sidecar.embedding.errors import ModelLoadError
from sidecar.embedding.gpu_memory import FreeMemoryProbe, batch_limit_for_memory
from sidecar.embedding.metrics import EmbedMetrics, NoMetrics
from sidecar.embedding.model_files import resolve_files, verify_files
from sidecar.embedding.runtime import CUDA, open_session
from sidecar.embedding.settings import EmbeddingSettings
from sidecar.embedding.tokens import load_tokenizer

log = logging.getLogger("sluice.embedding")

# Two lengths for the run-cost line t = overhead + per_token * tokens; best of a few tries.
_SHORT, _LONG, _TRIES = 8, 64, 3


@dataclass(frozen=True)
class LoadedModel:
    encoder: Encoder
    dimension: int
    provider: str        # the onnxruntime provider that runs the model
    model_sha256: str    # identifies the vector space: a cache keyed on it never mixes models


def load(settings: EmbeddingSettings, metrics: EmbedMetrics | None = None) -> LoadedModel:
    files = resolve_files(settings)
    verify_files(files)
    tokenizer = load_tokenizer(files.tokenizer, settings.max_tokens)
    session = open_session(files.model, settings.provider, settings.intra_op_threads)
    provider = session.get_providers()[0]
    batch_limit = None
    if provider == CUDA and not settings.model_path:
        log.warning("the default int8 embedding model is running on a GPU, where int8 is no "
                    "gain: make the fp16 model with scripts/export_fp16.py and set "
                    "SLUICE_EMBED_MODEL_PATH and SLUICE_EMBED_MODEL_SHA256")
    if provider == CUDA:
        probe = FreeMemoryProbe()
        batch_limit = lambda tokens, ceiling: batch_limit_for_memory(probe(), tokens, ceiling)  # noqa: E731
    encoder = Encoder(session, tokenizer, max_tokens=settings.max_tokens,
                      max_batch=settings.batch_ceiling(on_gpu=provider == CUDA),
                      batch_limit=batch_limit)
    dimension = _check_output(encoder, files.model)
    encoder.run_overhead_tokens = _measure_run_overhead(encoder)
    encoder.run([_filler(encoder, settings.max_tokens)])  # size the buffers for the longest text
    encoder.metrics = metrics or NoMetrics()  # warm-up runs stay out of the metrics
    log.info("embedding model %s loaded on %s: dim %d, max batch %d, run overhead %.0f tokens",
             files.model, provider, dimension, encoder.max_batch, encoder.run_overhead_tokens)
    return LoadedModel(encoder, dimension, provider, files.model_sha256)


def _filler(encoder: Encoder, tokens: int) -> list[int]:
    cls, sep = encoder.tokenizer.token_to_id("[CLS]"), encoder.tokenizer.token_to_id("[SEP]")
    word = encoder.tokenizer.token_to_id("the")
    return [cls if cls is not None else 0] + [word or 1] * (tokens - 2) + [sep if sep is not None else 0]


def _check_output(encoder: Encoder, model) -> int:
    try:
        vectors = encoder.run([encoder.tokenize("warm up"), encoder.tokenize("a longer warm up text")])
    except Exception as exc:  # a graph that loads but cannot run these inputs
        raise ModelLoadError(f"embedding model {model} failed its first run: {exc}") from exc
    if vectors.ndim != 2 or vectors.shape[0] != 2 or vectors.shape[1] < 1:
        raise ModelLoadError(f"embedding model {model} gave vectors of shape {vectors.shape}")
    if not np.isfinite(vectors).all():
        raise ModelLoadError(f"embedding model {model} gave non-finite vectors")
    return int(vectors.shape[1])


def _measure_run_overhead(encoder: Encoder) -> float:
    """The fixed cost of one run, in token-times (the planner's unit)."""
    short, long_ = (_best_time(encoder, _filler(encoder, n)) for n in (_SHORT, _LONG))
    per_token = (long_ - short) / (_LONG - _SHORT)
    if per_token <= 0:  # a GPU's run time hardly grows with length: batching is all gain
        return 4096.0
    return float(min(4096.0, max(1.0, (short - _SHORT * per_token) / per_token)))


def _best_time(encoder: Encoder, ids: list[int]) -> float:
    times = []
    for _ in range(_TRIES):
        started = time.perf_counter()
        encoder.run([ids])
        times.append(time.perf_counter() - started)
    return min(times)
