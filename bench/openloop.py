"""Open-loop load: Poisson arrivals at a fixed rate that never wait for earlier answers."""
from __future__ import annotations

import asyncio
import random
import time
from typing import Awaitable, Callable


async def open_loop(rate: float, seconds: float, seed: int,
                    send: Callable[[int], Awaitable[dict]]) -> list[dict]:
    """Calls send(i) at Poisson arrival times for `seconds`; returns each call's result dict
    with its latency_s added, once every call has finished."""
    rng = random.Random(seed)

    async def timed(i: int) -> dict:
        started = time.monotonic()
        result = await send(i)
        return {**result, "latency_s": time.monotonic() - started}

    tasks, deadline, next_at, i = [], time.monotonic() + seconds, time.monotonic(), 0
    while next_at < deadline:
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        tasks.append(asyncio.create_task(timed(i)))
        i += 1
        next_at += rng.expovariate(rate)
    return list(await asyncio.gather(*tasks))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))] if ordered else float("nan")
