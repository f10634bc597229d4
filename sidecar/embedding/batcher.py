"""The asyncio micro-batcher: many concurrent `await embed(text)`, one worker thread.

Policy, and why:
- A text that arrives while the worker is idle runs at once: under no load nobody pays
  for batching.
- Texts that arrive while the worker is busy queue up; when it is free it takes up to
  `max_batch` of them in one go. Under load batches form by themselves, with no timer.
- `max_wait_s` (0 by default) lets the worker, once it is free, wait that long at most
  for a fuller batch. That pays on a GPU, where a run of 32 costs about what a run of 1
  does; on a CPU a run costs in proportion to its tokens, so waiting only idles it.
- The queue is bounded: past `max_queue` waiting texts, `embed` fails at once with
  QueueFull, and the request goes on without semantic features instead of waiting.
- Inference never runs on the event loop; results go back to it as each model run ends,
  so short texts of a batch are not held for the long ones.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from sidecar.embedding.errors import EmbeddingUnavailable, NotReady, QueueFull
from sidecar.embedding.metrics import EmbedMetrics, NoMetrics

log = logging.getLogger("sluice.embedding")

# encode_iter(texts) yields (indices into texts, results) per model run; a result is a
# vector or the exception for that text.
EncodeIter = Callable[[Sequence[str]], Iterator[tuple[list[int], list]]]


@dataclass
class _Waiting:
    text: str
    future: asyncio.Future
    since: float


class Batcher:
    def __init__(self, encode_iter: EncodeIter, *, max_batch: int, max_wait_s: float,
                 max_queue: int, metrics: EmbedMetrics | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        self._encode_iter = encode_iter
        self._max_batch = max_batch
        self._max_wait_s = max_wait_s
        self._max_queue = max_queue
        self._metrics = metrics or NoMetrics()
        self._clock = clock
        self._queue: deque[_Waiting] = deque()
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sluice-embed")
        self._drainer: asyncio.Task | None = None
        self._filled = asyncio.Event()
        self._closed = False

    @property
    def queued(self) -> int:
        return len(self._queue)

    async def embed(self, text: str) -> np.ndarray:
        """The unit vector of `text`; raises an EmbeddingUnavailable when there is none."""
        if not isinstance(text, str):
            raise TypeError(f"embed() takes a str, not {type(text).__name__}")
        if self._closed:
            raise NotReady("the embedding engine is shutting down")
        if len(self._queue) >= self._max_queue:
            self._metrics.rejected()
            raise QueueFull(f"embedding queue full ({self._max_queue} texts waiting)")
        future = asyncio.get_running_loop().create_future()
        self._queue.append(_Waiting(text, future, self._clock()))
        if self._drainer is None:
            self._drainer = asyncio.create_task(self._drain())
        elif len(self._queue) >= self._max_batch:
            self._filled.set()
        return await future

    async def close(self) -> None:
        """Refuse new texts, finish the queued ones, stop the worker thread."""
        self._closed = True
        if self._drainer is not None:
            await asyncio.shield(self._drainer)
        self._worker.shutdown(wait=True)

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        first = True
        try:
            while self._queue:
                if not first:
                    await self._wait_for_fuller_batch()
                first = False
                batch = self._take_batch()
                if batch:
                    await loop.run_in_executor(self._worker, self._work, batch, loop)
                # Let the callers just answered run first: their next texts join this batch.
                await asyncio.sleep(0)
        finally:
            self._drainer = None

    async def _wait_for_fuller_batch(self) -> None:
        if self._max_wait_s <= 0 or len(self._queue) >= self._max_batch:
            return
        left = self._queue[0].since + self._max_wait_s - self._clock()
        if left <= 0:
            return
        self._filled.clear()
        try:
            await asyncio.wait_for(self._filled.wait(), left)
        except asyncio.TimeoutError:
            pass

    def _take_batch(self) -> list[_Waiting]:
        batch: list[_Waiting] = []
        while self._queue and len(batch) < self._max_batch:
            waiting = self._queue.popleft()
            if not waiting.future.done():  # a caller that gave up (cancelled) costs nothing
                batch.append(waiting)
        return batch

    def _work(self, batch: list[_Waiting], loop: asyncio.AbstractEventLoop) -> None:
        """On the worker thread: embed the batch, hand each result back to the loop."""
        now = self._clock()
        for waiting in batch:
            self._metrics.queue_wait(now - waiting.since)
        try:
            for indices, results in self._encode_iter([w.text for w in batch]):
                loop.call_soon_threadsafe(_deliver, [batch[i].future for i in indices], results)
        except Exception as exc:
            log.exception("embedding run failed")
            failure = EmbeddingUnavailable(f"embedding failed: {exc}")
            loop.call_soon_threadsafe(_deliver, [w.future for w in batch], [failure] * len(batch))


def _deliver(futures: list[asyncio.Future], results: list) -> None:
    for future, result in zip(futures, results):
        if future.done():
            continue
        if isinstance(result, BaseException):
            future.set_exception(result)
        else:
            future.set_result(result)
