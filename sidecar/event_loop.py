"""Which asyncio event loop runs the sidecar: uvloop when it is installed, else asyncio's own.

Why: a semantic hit wakes the loop more often than an exact one (the embedding worker hands
its result back through the loop), and uvloop's wake-ups and callbacks are compiled. Through
Envoy on the 2-core box it took 15-20% off the event loop's CPU per semantic hit and gave
5-11% more semantic hits a second at 16-64 connections (bench.cache); exact hits and plain
routing changed within the noise. `SLUICE_EVENT_LOOP=asyncio` is the way back.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable

from sidecar.config import ConfigError


def loop_factory(choice: str) -> tuple[Callable[[], asyncio.AbstractEventLoop] | None, str]:
    """(factory for asyncio.Runner, None for asyncio's default; the loop's name) for a
    SLUICE_EVENT_LOOP value (config.EVENT_LOOPS). ConfigError when uvloop is asked for and
    not installed."""
    if choice == "asyncio":
        return None, "asyncio"
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise ConfigError("event_loop: uvloop is not installed (pip install uvloop), "
                              "or set SLUICE_EVENT_LOOP=asyncio") from None
        return None, "asyncio"
    return uvloop.new_event_loop, "uvloop"
