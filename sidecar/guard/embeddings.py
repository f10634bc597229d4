"""One model run per prompt for the guard and the semantic cache together.

The guard embeds the last user turn before the cache does; the cache then asks the same
embedder for the same text. SharedEmbeddings stands between both and the EmbeddingService:
the guard's vector waits here, keyed by its text, and the cache's request takes it. Bounded
in entries and in bytes; a taken or displaced vector is gone, so it holds no prompt longer
than one request takes to reach the cache.

A route whose verifier aligns token states asks for them with the vector (with_states); from
the first such ask on, the guard's runs fetch them too (a copy from the same run), so the
cache still takes the guard's run instead of running the model again.
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
        self._states_wanted = False     # some caller asked for token states: the guard's runs fetch them

    async def embed(self, text: str, keep: bool = False, with_states: bool = False):
        """The vector of `text`; keep=True leaves it here for the next asker of the same text.
        with_states: the service's WithStates (or the bare vector where the model has none)."""
        found = self._waiting.pop(text, None)
        if found is not None:
            self._bytes -= _size(text, found)
            if not with_states or hasattr(found, "states"):
                self.handed_over += 1
                return found if with_states else _vector(found)
        if with_states:
            self._states_wanted = True
        if with_states or (keep and self._states_wanted):
            result = await self.service.embed(text, with_states=True)
        else:
            result = await self.service.embed(text)
        if keep:
            self._keep(text, result)
        return result if with_states else _vector(result)

    def _keep(self, text: str, vector) -> None:
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


def _vector(result) -> np.ndarray:
    return getattr(result, "vector", result)


def _size(text: str, result) -> int:
    states = getattr(result, "states", None)
    return len(text) * 4 + _vector(result).nbytes + 64 + (0 if states is None else states.nbytes + 112)
