"""The micro-batcher's policy, with a fake encoder: when it runs, what it groups, what it
rejects, how failures reach callers. The real model is in test_embedding.py."""
from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from sidecar.embedding.batcher import Batcher, group_size
from sidecar.embedding.errors import EmbeddingUnavailable, NothingToEmbed, NotReady, QueueFull


class FakeEncoder:
    """Vector = [len(text)]; records each call's texts and the thread it ran on."""

    def __init__(self, delay: float = 0.0, gate: threading.Event | None = None):
        self.delay = delay
        self.gate = gate
        self.calls: list[list[str]] = []
        self.threads: set[str] = set()

    def encode_iter(self, texts):
        if self.gate is not None:
            self.gate.wait(5)
        self.calls.append(list(texts))
        self.threads.add(threading.current_thread().name)
        time.sleep(self.delay)
        results = []
        for text in texts:
            if text == "boom":
                raise RuntimeError("onnxruntime fell over")
            results.append(NothingToEmbed("empty") if not text else np.array([len(text)], np.float32))
        yield list(range(len(texts))), results


class FakeMetrics:
    def __init__(self):
        self.runs, self.waits, self.rejections = [], [], 0

    def model_run(self, texts, seconds):
        self.runs.append(texts)

    def queue_wait(self, seconds):
        self.waits.append(seconds)

    def rejected(self):
        self.rejections += 1


def make(encoder, **kwargs):
    options = dict(max_batch=8, max_wait_s=0.0, max_queue=64)
    options.update(kwargs)
    return Batcher(encoder.encode_iter, **options)


async def test_a_lone_text_runs_at_once_even_with_a_long_max_wait():
    encoder = FakeEncoder()
    batcher = make(encoder, max_wait_s=0.5)
    started = time.perf_counter()
    assert (await batcher.embed("abc"))[0] == 3
    assert time.perf_counter() - started < 0.1
    assert encoder.calls == [["abc"]]
    await batcher.close()


async def test_inference_runs_off_the_event_loop():
    encoder = FakeEncoder()
    batcher = make(encoder)
    await batcher.embed("x")
    assert encoder.threads and threading.current_thread().name not in encoder.threads
    await batcher.close()


async def test_texts_that_arrive_while_busy_share_the_next_run():
    gate = threading.Event()
    encoder = FakeEncoder(gate=gate)
    batcher = make(encoder, max_batch=8)
    first = asyncio.ensure_future(batcher.embed("first"))
    await asyncio.sleep(0.01)  # the worker has taken "first" and is held at the gate
    rest = [asyncio.ensure_future(batcher.embed("t" * n)) for n in range(1, 11)]
    await asyncio.sleep(0.01)
    gate.set()
    results = await asyncio.gather(first, *rest)
    assert [r[0] for r in results] == [5] + list(range(1, 11))  # each caller its own result
    assert [len(c) for c in encoder.calls] == [1, 8, 2]          # max_batch respected
    await batcher.close()


async def busy_with_one_queued(**options):
    """A batcher whose worker is held on "a" with "bb" queued; set the gate to go on."""
    gate = threading.Event()
    encoder = FakeEncoder(gate=gate)
    batcher = make(encoder, **options)
    callers = [asyncio.ensure_future(batcher.embed("a"))]
    await asyncio.sleep(0.01)
    callers.append(asyncio.ensure_future(batcher.embed("bb")))
    await asyncio.sleep(0.01)
    return gate, encoder, batcher, callers


async def test_max_wait_lets_a_free_worker_wait_for_a_fuller_batch():
    gate, encoder, batcher, callers = await busy_with_one_queued(max_batch=4, max_wait_s=0.2)
    gate.set()                     # worker frees up with one text queued: it waits ...
    await asyncio.sleep(0.05)
    late = [asyncio.ensure_future(batcher.embed("c" * n)) for n in (3, 4, 5)]  # ... and fills
    await asyncio.gather(*callers, *late)
    assert [len(c) for c in encoder.calls] == [1, 4]
    await batcher.close()


async def test_max_wait_is_a_bound():
    gate, encoder, batcher, callers = await busy_with_one_queued(max_batch=32, max_wait_s=0.05)
    started = time.perf_counter()
    gate.set()
    await asyncio.gather(*callers)
    assert time.perf_counter() - started < 0.2
    await batcher.close()


async def test_a_full_queue_rejects_at_once_and_counts_it():
    gate = threading.Event()
    metrics = FakeMetrics()
    encoder = FakeEncoder(gate=gate)
    batcher = Batcher(encoder.encode_iter, max_batch=2, max_wait_s=0, max_queue=3, metrics=metrics)
    running = asyncio.ensure_future(batcher.embed("running"))
    await asyncio.sleep(0.01)
    queued = [asyncio.ensure_future(batcher.embed(f"q{i}")) for i in range(3)]
    await asyncio.sleep(0)
    started = time.perf_counter()
    with pytest.raises(QueueFull):
        await batcher.embed("one too many")
    assert time.perf_counter() - started < 0.01
    assert metrics.rejections == 1 and batcher.queued == 3
    gate.set()
    await asyncio.gather(running, *queued)
    assert len(metrics.waits) == 4
    await batcher.close()


async def test_callers_that_gave_up_do_not_fill_the_queue():
    gate = threading.Event()
    encoder = FakeEncoder(gate=gate)
    batcher = Batcher(encoder.encode_iter, max_batch=2, max_wait_s=0, max_queue=3)
    running = asyncio.ensure_future(batcher.embed("running"))
    await asyncio.sleep(0.01)
    gone = [asyncio.ensure_future(batcher.embed(f"q{i}")) for i in range(3)]
    await asyncio.sleep(0)
    for caller in gone:
        caller.cancel()                                   # their requests ended
    await asyncio.sleep(0)
    fresh = asyncio.ensure_future(batcher.embed("fresh"))  # room again: not QueueFull
    await asyncio.sleep(0)
    gate.set()
    assert (await fresh).shape and (await running).shape
    await batcher.close()


async def test_a_text_with_nothing_to_embed_fails_alone():
    batcher = make(FakeEncoder())
    results = await asyncio.gather(batcher.embed("ok"), batcher.embed(""), return_exceptions=True)
    assert results[0][0] == 2 and isinstance(results[1], NothingToEmbed)
    await batcher.close()


async def test_an_inference_crash_reaches_every_caller_and_the_batcher_goes_on():
    batcher = make(FakeEncoder())
    results = await asyncio.gather(batcher.embed("x"), batcher.embed("boom"), return_exceptions=True)
    assert all(isinstance(r, EmbeddingUnavailable) for r in results[1:])
    assert (await batcher.embed("again"))[0] == 5
    await batcher.close()


async def test_a_cancelled_caller_costs_no_inference():
    gate = threading.Event()
    encoder = FakeEncoder(gate=gate)
    batcher = make(encoder)
    first = asyncio.ensure_future(batcher.embed("first"))
    await asyncio.sleep(0.01)
    doomed = asyncio.ensure_future(batcher.embed("doomed"))
    kept = asyncio.ensure_future(batcher.embed("kept"))
    await asyncio.sleep(0)
    doomed.cancel()
    gate.set()
    await asyncio.gather(first, kept)
    assert encoder.calls == [["first"], ["kept"]]
    await batcher.close()


async def test_close_finishes_queued_texts_then_refuses():
    gate = threading.Event()
    batcher = make(FakeEncoder(gate=gate))
    pending = [asyncio.ensure_future(batcher.embed(t)) for t in ("a", "bb")]
    await asyncio.sleep(0.01)
    closing = asyncio.ensure_future(batcher.close())
    await asyncio.sleep(0)
    with pytest.raises(NotReady):
        await batcher.embed("late")
    gate.set()
    await closing
    assert [r[0] for r in await asyncio.gather(*pending)] == [1, 2]


async def test_rejects_non_text():
    batcher = make(FakeEncoder())
    with pytest.raises(TypeError):
        await batcher.embed(None)
    await batcher.close()


@pytest.mark.parametrize("backlog, max_batch, min_group, expected", [
    (100, 32, None, 32), (3, 32, None, 32),      # GPU: all it may
    (1, 32, 4, 4), (8, 32, 4, 4), (40, 32, 4, 10), (500, 32, 4, 32),  # CPU: a quarter
    (500, 2, 4, 2),                              # never above max_batch
])
def test_group_size(backlog, max_batch, min_group, expected):
    assert group_size(backlog, max_batch, min_group) == expected


async def test_on_a_cpu_the_worker_takes_a_quarter_of_the_backlog():
    gate = threading.Event()
    encoder = FakeEncoder(gate=gate)
    batcher = make(encoder, max_batch=32, min_group=4)
    first = asyncio.ensure_future(batcher.embed("first"))
    await asyncio.sleep(0.01)
    rest = [asyncio.ensure_future(batcher.embed(f"t{n}")) for n in range(40)]
    await asyncio.sleep(0.01)
    gate.set()
    await asyncio.gather(first, *rest)
    assert [len(c) for c in encoder.calls][:3] == [1, 10, 7]  # 40 // 4, then 30 // 4
    await batcher.close()


async def test_a_lone_caller_never_waits_for_a_batch_after_a_run():
    # One caller, one text at a time: each text finds the worker idle and nothing queued.
    batcher = make(FakeEncoder(), max_wait_s=0.2)
    started = time.perf_counter()
    for _ in range(5):
        await batcher.embed("again")
    assert time.perf_counter() - started < 0.2
    await batcher.close()


async def test_with_two_workers_a_text_that_comes_during_a_run_starts_at_once():
    gate = threading.Event()
    encoder = FakeEncoder(gate=gate)
    batcher = make(encoder, workers=2)
    first = asyncio.ensure_future(batcher.embed("first"))
    await asyncio.sleep(0.01)            # worker 1 holds "first" at the gate
    second = asyncio.ensure_future(batcher.embed("second!"))
    await asyncio.sleep(0.01)            # worker 2 has taken it and waits at the gate too
    assert batcher.queued == 0
    gate.set()
    assert [r[0] for r in await asyncio.gather(first, second)] == [5, 7]
    assert sorted(map(tuple, encoder.calls)) == [("first",), ("second!",)]
    await batcher.close()


async def test_never_more_runs_at_once_than_workers():
    running, most = 0, 0
    lock = threading.Lock()

    def encode_iter(texts):
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        time.sleep(0.005)
        with lock:
            running -= 1
        yield list(range(len(texts))), [np.array([len(t)], np.float32) for t in texts]

    batcher = Batcher(encode_iter, max_batch=4, max_wait_s=0, max_queue=256, min_group=1, workers=2)
    results = await asyncio.gather(*(batcher.embed("t" * n) for n in range(1, 41)))
    assert [r[0] for r in results] == list(range(1, 41))
    assert most == 2
    await batcher.close()


def test_workers_must_be_positive():
    with pytest.raises(ValueError):
        Batcher(FakeEncoder().encode_iter, max_batch=4, max_wait_s=0, max_queue=4, workers=0)


async def test_token_states_are_asked_for_only_when_a_caller_of_the_group_wants_them():
    asked = []

    def encode_iter(texts, with_states=None):
        asked.append(None if with_states is None else list(with_states))
        yield list(range(len(texts))), [("states", t) if with_states and with_states[i] else t
                                        for i, t in enumerate(texts)]
    batcher = Batcher(encode_iter, max_batch=8, max_wait_s=0.0, max_queue=64)
    assert await batcher.embed("plain") == "plain"
    assert await batcher.embed("aligned", with_states=True) == ("states", "aligned")
    assert asked == [None, [True]]        # a vector-only group calls encode_iter as before
    await batcher.close()
