"""Run a coroutine's first step at once, and make a task only if it has to wait.

Most decisions (route, score, pick; an exact cache hit) never suspend: wrapping them in an
asyncio Task costs a task object, an event-loop turn and a timer per request, a large share of
the sidecar's own work at 1-2k requests a second. Python 3.12's eager task factory does the
same for every task; this is that idea for the one call where it pays, on 3.11 too.
"""
from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Generator
from typing import Any, TypeVar

T = TypeVar("T")


class Started:
    """A coroutine stepped once: `done` with its `result`, or `task` carries on the rest."""

    __slots__ = ("done", "result", "task")

    def __init__(self, done: bool, result: Any = None, task: asyncio.Task | None = None) -> None:
        self.done, self.result, self.task = done, result, task


def start(coro: Coroutine[Any, Any, T]) -> Started:
    """Steps `coro` until it first waits; an exception it raises on the way propagates here."""
    try:
        waiting = coro.send(None)
    except StopIteration as finished:
        return Started(True, finished.value)
    return Started(False, task=asyncio.ensure_future(_resume(coro, waiting)))


async def _resume(coro: Coroutine[Any, Any, T], waiting: Any) -> T:
    return await _Resumed(coro, waiting)


class _Resumed:
    """Hands the task the future `coro` was waiting on, then drives `coro` to its end, passing
    results and exceptions (cancellation included) through as `await` would."""

    __slots__ = ("_coro", "_waiting")

    def __init__(self, coro: Coroutine, waiting: Any) -> None:
        self._coro, self._waiting = coro, waiting

    def __await__(self) -> Generator[Any, Any, Any]:
        coro, waiting = self._coro, self._waiting
        while True:
            try:
                sent = yield waiting
            except BaseException as exc:
                try:
                    waiting = coro.throw(exc)
                except StopIteration as finished:
                    return finished.value
            else:
                try:
                    waiting = coro.send(sent)
                except StopIteration as finished:
                    return finished.value
