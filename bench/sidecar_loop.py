"""The event loop `sluice serve` runs on (SLUICE_EVENT_LOOP), for benchmarks that must compare
like with like: uvloop by default, asyncio's own when asked or when uvloop is missing."""
from __future__ import annotations

import asyncio

from sidecar.config import SidecarConfig
from sidecar.service.event_loop import loop_factory


def name() -> str:
    return loop_factory(_event_loop())[1]


def run(coroutine):
    """asyncio.run(coroutine), on the sidecar's loop."""
    new_loop, _ = loop_factory(_event_loop())
    with asyncio.Runner(loop_factory=new_loop) as runner:
        return runner.run(coroutine)


def _event_loop() -> str:
    return SidecarConfig.from_env(redis_url="").event_loop      # only the loop: Redis settings aside
