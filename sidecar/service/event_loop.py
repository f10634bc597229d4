"""Which asyncio event loop runs the sidecar: uvloop when it is installed, else asyncio's own.

Why: most of the sidecar's own CPU per request is the event loop and gRPC's callbacks on it
(wake-ups, futures, tasks), and uvloop's are compiled. Through Envoy on the 2-core box, two
stacks side by side taking turns at 64 connections: the routing path 5-20% more req/s, exact
hits 8%, a no-op pass-through 20%; in alternating runs, semantic hits 5-11% (the event loop's CPU
per hit -15-20%).
`SLUICE_EVENT_LOOP=asyncio` is the way back. uvloop counts timers in whole milliseconds, so a
sub-millisecond SLUICE_EMBED_MAX_WAIT_MS is 0 there.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable

from sidecar.config import EVENT_LOOPS, ConfigError


def loop_factory(choice: str) -> tuple[Callable[[], asyncio.AbstractEventLoop] | None, str]:
    """(factory for asyncio.Runner, None for asyncio's default; the loop's name) for a
    SLUICE_EVENT_LOOP value (config.EVENT_LOOPS). ConfigError when uvloop is asked for and
    not installed."""
    if choice not in EVENT_LOOPS:           # SidecarConfig has refused it already
        raise ValueError(f"unknown event loop {choice!r}")
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
