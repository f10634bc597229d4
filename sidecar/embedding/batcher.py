"""The asyncio micro-batcher: many concurrent `await embed(text)`, a worker thread or two.

Policy, and why:
- A text that arrives while the worker is idle and nothing is queued runs at once:
  under no load nobody pays for batching, whatever max_wait is.
- Texts that arrive while the worker is busy queue up; when it is free it takes a group
  of them in one go. Under load batches form by themselves, with no timer.
- How many it takes: on a GPU (min_group None) up to `max_batch`, since a run of 128
  short texts costs about what a run of one does. On a CPU a run costs in proportion
  to its tokens and batching only saves the fixed cost of each run, while a big group
  makes some texts wait behind others that came later; so it takes a quarter of the
  backlog, at least `min_group` and at most `max_batch`: the reordering inside a group
  then costs a text about a quarter of the time it spent queued at most, and the
  deeper the queue (where the extra throughput matters most) the bigger the batches.
  Taking all 32 at once instead raised p99 latency by a sixth at 8 to 32 concurrent
  callers in a simulation of the CPU's run costs; bench/embed.py measures both.
- `max_wait_s` (0 by default) lets a free worker that just finished a run with texts
  queued wait that long at most for a fuller group; on a CPU it only idles the worker.
- The queue is bounded: past `max_queue` waiting texts, `embed` fails at once with
  QueueFull, and the request goes on without semantic features instead of waiting.
- Inference never runs on the event loop; results go back to it as each model run ends,
  so short texts of a group are not held for the long ones.
- `workers` model runs may go at once (threads calling the one onnxruntime session, which
  is thread-safe): a text that comes while a run is going starts on a free worker at once
  instead of waiting for that run, and under load both cores run model code even while
  one of them is busy elsewhere (a run split over two threads then waits for it).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from sidecar.embedding.errors import EmbeddingUnavailable, NotReady, QueueFull
from sidecar.embedding.metrics import EmbedMetrics, NoMetrics

if TYPE_CHECKING:
    from sidecar.embedding.encoder import WithStates

log = logging.getLogger("sluice.embedding")

# encode_iter(texts[, with_states]) yields (indices into texts, results) per model run; a
# result is a vector (a WithStates for a text that asked for states) or the exception for that
# text.  with_states is passed only when some text of the group asked.
EncodeIter = Callable[..., Iterator[tuple[list[int], list]]]


@dataclass
class _Waiting:
    text: str
    future: asyncio.Future
    since: float
    with_states: bool = False


class Batcher:
    def __init__(self, encode_iter: EncodeIter, *, max_batch: int, max_wait_s: float,
                 max_queue: int, min_group: int | None = None, workers: int = 1,
                 metrics: EmbedMetrics | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        """min_group None: take up to max_batch (GPU); else a quarter of the backlog,
        from min_group to max_batch (CPU). workers: model runs at once."""
        if workers < 1:
            raise ValueError("workers must be at least 1")
        self._encode_iter = encode_iter
        self._max_batch = max_batch
        self._min_group = min_group
        self._max_wait_s = max_wait_s
        self._max_queue = max_queue
        self._metrics = metrics or NoMetrics()
        self._clock = clock
        self._queue: deque[_Waiting] = deque()
        # One thread per worker, and a lone text always on the first: the thread that
        # ran the last text (its caches, onnxruntime's per-thread state) runs the next.
        self._threads = [ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"sluice-embed-{n}")
                         for n in range(workers)]
        self._drainers: dict[int, asyncio.Task] = {}  # worker number -> its busy drainer
        self._filled = asyncio.Event()
        self._closed = False
        self._answered_at = float("-inf")  # when the last results went back

    @property
    def queued(self) -> int:
        return len(self._queue)

    async def embed(self, text: str, with_states: bool = False) -> np.ndarray | WithStates:
        """The unit vector of `text` (with_states: a WithStates, when the model has them);
        raises an EmbeddingUnavailable when there is none."""
        if not isinstance(text, str):
            raise TypeError(f"embed() takes a str, not {type(text).__name__}")
        if self._closed:
            raise NotReady("the embedding engine is shutting down")
        if len(self._queue) >= self._max_queue:
            # Callers that gave up stay queued until a worker takes them: they must not fill it.
            self._queue = deque(w for w in self._queue if not w.future.done())
            if len(self._queue) >= self._max_queue:
                self._metrics.rejected()
                raise QueueFull(f"embedding queue full ({self._max_queue} texts waiting)")
        future = asyncio.get_running_loop().create_future()
        self._queue.append(_Waiting(text, future, self._clock(), with_states))
        if len(self._drainers) < len(self._threads):
            number = next(n for n in range(len(self._threads)) if n not in self._drainers)
            self._drainers[number] = asyncio.create_task(self._drain(number))
        elif len(self._queue) >= self._max_batch:
            self._filled.set()
        return await future

    async def close(self) -> None:
        """Refuse new texts, finish the queued ones, stop the worker threads."""
        self._closed = True
        if self._drainers:
            await asyncio.shield(asyncio.gather(*self._drainers.values()))
        for thread in self._threads:
            thread.shutdown(wait=True)

    async def _drain(self, number: int) -> None:
        """One worker's loop: take a group, run it, until the queue is empty."""
        loop = asyncio.get_running_loop()
        try:
            while self._queue:
                # Only texts that came while the worker was busy may wait for a fuller
                # group; one sent after the last answer (a lone caller's next) runs at once.
                if self._queue[0].since < self._answered_at:
                    await self._wait_for_fuller_batch()
                batch = self._take_batch()
                if batch:
                    await loop.run_in_executor(self._threads[number], self._work, batch, loop)
                # Let the callers just answered run first: their next texts join the next group.
                await asyncio.sleep(0)
        finally:
            # Here, not in a done callback: embed() must never count a drainer that has
            # left its loop, or a text queued in between would wait for nobody.
            del self._drainers[number]

    async def _wait_for_fuller_batch(self) -> None:
        if self._max_wait_s <= 0 or len(self._queue) >= self._max_batch:    # the queue is not empty
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
        size = group_size(len(self._queue), self._max_batch, self._min_group)
        batch: list[_Waiting] = []
        while self._queue and len(batch) < size:
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
            texts = [w.text for w in batch]
            wants = [w.with_states for w in batch]
            runs = self._encode_iter(texts, wants) if any(wants) else self._encode_iter(texts)
            for indices, results in runs:
                loop.call_soon_threadsafe(self._deliver, [batch[i].future for i in indices], results)
        except Exception as exc:
            log.exception("embedding run failed")
            failure = EmbeddingUnavailable(f"embedding failed: {exc}")
            loop.call_soon_threadsafe(self._deliver, [w.future for w in batch], [failure] * len(batch))

    def _deliver(self, futures: list[asyncio.Future], results: list) -> None:
        """On the loop: hand each caller its vector or exception."""
        self._answered_at = self._clock()
        for future, result in zip(futures, results):
            if future.done():
                continue
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)


def group_size(backlog: int, max_batch: int, min_group: int | None) -> int:
    """How many queued texts the worker takes at once (see the module's policy)."""
    if min_group is None:
        return max_batch
    return max(1, min(max_batch, max(min_group, backlog // 4)))

