"""One model run per prompt for the guard and the semantic cache together.

The guard embeds the last user turn before the cache does; the cache then asks the same
embedder for the same text. SharedEmbeddings stands between both and the EmbeddingService:
the guard's vector waits here, keyed by its text, and the cache's request takes it. Bounded
in entries and in bytes; a taken or displaced vector is gone, so it holds no prompt longer
than one request takes to reach the cache.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np

MAX_ENTRIES = 256
MAX_BYTES = 4 << 20


class SharedEmbeddings:
    def __init__(self, service, max_entries: int = MAX_ENTRIES, max_bytes: int = MAX_BYTES):
        self.service = service
        self._waiting: OrderedDict[str, np.ndarray] = OrderedDict()
        self._bytes = 0
        self._max_entries = max_entries
        self._max_bytes = max_bytes
        self.handed_over = 0            # vectors the cache took instead of running the model

    async def embed(self, text: str, keep: bool = False) -> np.ndarray:
        """The vector of `text`; keep=True leaves it here for the next asker of the same text."""
        vector = self._waiting.pop(text, None)
        if vector is not None:
            self._bytes -= _size(text, vector)
            self.handed_over += 1
            return vector
        vector = await self.service.embed(text)
        if keep:
            self._keep(text, vector)
        return vector

    def _keep(self, text: str, vector: np.ndarray) -> None:
        size = _size(text, vector)
        if size > self._max_bytes:
            return
        old = self._waiting.pop(text, None)
        if old is not None:
            self._bytes -= _size(text, old)
        self._waiting[text] = vector
        self._bytes += size
        while len(self._waiting) > self._max_entries or self._bytes > self._max_bytes:
            gone_text, gone = self._waiting.popitem(last=False)
            self._bytes -= _size(gone_text, gone)

    def __getattr__(self, name):
        # ready, model, warm_up, close, embed_prompt: the service's own.
        return getattr(self.service, name)


def _size(text: str, vector: np.ndarray) -> int:
    return len(text) * 4 + vector.nbytes + 64
