"""sidecar.eager: a coroutine's first step runs at once; a task carries on only if it waits."""
import asyncio

import pytest

from sidecar import eager


async def immediate():
    return "plan"


async def waits(event: asyncio.Event, log: list):
    try:
        log.append("before")
        await event.wait()
        log.append("after")
        await asyncio.sleep(0)          # a bare yield, then a second real wait
        await asyncio.sleep(0.001)
        return "late plan"
    finally:
        log.append("finally")


async def test_a_coroutine_that_never_waits_needs_no_task():
    started = eager.start(immediate())
    assert (started.done, started.result, started.task) == (True, "plan", None)


async def test_a_coroutine_that_waits_continues_in_a_task_with_its_result():
    event, log = asyncio.Event(), []
    started = eager.start(waits(event, log))
    assert not started.done and log == ["before"]       # the first step ran synchronously
    asyncio.get_running_loop().call_later(0.01, event.set)
    assert await started.task == "late plan"
    assert log == ["before", "after", "finally"]


async def test_an_error_in_the_first_step_is_raised_at_once():
    async def broken():
        raise ValueError("bad settings")

    with pytest.raises(ValueError, match="bad settings"):
        eager.start(broken())


async def test_an_error_after_waiting_reaches_the_awaiting_code():
    async def fails_later():
        await asyncio.sleep(0.001)
        raise KeyError("gone")

    started = eager.start(fails_later())
    with pytest.raises(KeyError):
        await started.task


async def test_cancelling_the_task_cancels_the_waiting_coroutine():
    event, log = asyncio.Event(), []
    started = eager.start(waits(event, log))
    await asyncio.sleep(0.01)
    started.task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await started.task
    assert log == ["before", "finally"]                 # it left its wait: queues are left at once


async def test_a_coroutine_that_swallows_cancellation_returns_its_value():
    async def stubborn():
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            return "cleaned up"

    started = eager.start(stubborn())
    await asyncio.sleep(0)
    started.task.cancel()
    assert await started.task == "cleaned up"
