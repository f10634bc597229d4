"""The embedding engine as the server sees it: warm up once, then `await embed(text)`.

    service = EmbeddingService(EmbeddingSettings.from_env())
    await service.warm_up()        # ModelLoadError: fail the start
    service.ready                  # health: SERVING only once this is True
    vector = await service.embed(text)                    # EmbeddingUnavailable: skip
    prompt = await service.embed_prompt(request.messages)  # vector + context key
    await service.close()
"""
from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from sidecar.embedding.batcher import Batcher
from sidecar.embedding.errors import NotReady
from sidecar.embedding.loader import LoadedModel, load
from sidecar.embedding.metrics import EmbedMetrics, PrometheusMetrics
from sidecar.embedding.prompt import split_prompt
from sidecar.embedding.runtime import CUDA
from sidecar.embedding.settings import EmbeddingSettings


@dataclass(frozen=True)
class EmbeddedPrompt:
    vector: np.ndarray  # [dim] float32, unit length
    context_key: str    # match vectors only among entries with this key
    text: str           # the text that was embedded, before normalisation


class EmbeddingService:
    def __init__(self, settings: EmbeddingSettings | None = None,
                 metrics: EmbedMetrics | None = None):
        self.settings = settings or EmbeddingSettings()
        self._metrics = metrics or PrometheusMetrics()
        self._model: LoadedModel | None = None
        self._batcher: Batcher | None = None
        self._loading: asyncio.Task | None = None

    @property
    def ready(self) -> bool:
        return self._batcher is not None

    @property
    def model(self) -> LoadedModel:
        """Dimension, provider and sha256 of the loaded model (after warm_up)."""
        if self._model is None:
            raise NotReady("the embedding model is not loaded yet")
        return self._model

    async def warm_up(self) -> None:
        """Load, check and warm the model off the event loop. Safe to await twice."""
        if self._loading is None:
            self._loading = asyncio.create_task(self._load())
        await asyncio.shield(self._loading)

    async def _load(self) -> None:
        model = await asyncio.to_thread(load, self.settings, self._metrics)
        self._model = model
        on_gpu = model.provider == CUDA
        self._batcher = Batcher(model.encoder.encode_iter, max_batch=model.encoder.max_batch,
                                min_group=self.settings.min_group(on_gpu),
                                workers=self.settings.worker_count(on_gpu),
                                max_wait_s=self.settings.max_wait_s,
                                max_queue=self.settings.max_queue, metrics=self._metrics)

    @property
    def has_states(self) -> bool | None:
        """Whether `embed(..., with_states=True)` gives token states (the model's graph has
        them: scripts/model_graph.py); None while no model is loaded (not known)."""
        return self._model.encoder.has_states if self.ready and self._model is not None else None

    async def embed(self, text: str, with_states: bool = False):
        """Unit float32 vector of `text`; with_states (and `has_states`): a WithStates, the
        vector and the text's token states from the same run. Raises an EmbeddingUnavailable
        (NothingToEmbed, QueueFull, NotReady) when this request should go on without
        semantic features."""
        if self._batcher is None:
            raise NotReady("the embedding model is not loaded yet")
        return await self._batcher.embed(text, with_states)

    async def embed_prompt(self, messages: Sequence[Any]) -> EmbeddedPrompt:
        """Embed the last user turn of a chat request; see sidecar.embedding.prompt."""
        parts = split_prompt(messages)
        vector = await self.embed(parts.text)
        return EmbeddedPrompt(vector=vector, context_key=parts.context_key, text=parts.text)

    async def close(self) -> None:
        batcher, self._batcher = self._batcher, None
        if batcher is not None:
            await batcher.close()
