"""fairbatch_common.aio.wait_event keeps a cancellation that asyncio.wait_for drops on Python 3.11.

The case: the waiting task is cancelled in the same loop iteration in which its event is set (the
router's dispatcher when Router.close() cancels it just as a release wakes it). Before the fix,
Router.close() then awaited the dispatcher forever (a 120 s teardown timeout in CI).
"""

from __future__ import annotations

import asyncio
import sys

import pytest

from fairbatch_common.aio import wait_event, within
from tests.timing import LoopLag


async def set_and_cancel_together(wait) -> str:
    event = asyncio.Event()

    async def waiter() -> str:
        await wait(event)
        return "returned"

    task = asyncio.create_task(waiter())
    await asyncio.sleep(0)
    await asyncio.sleep(0)  # the waiter is parked on the event
    event.set()
    task.cancel()
    try:
        return await task
    except asyncio.CancelledError:
        return "cancelled"


async def test_wait_event_propagates_a_cancellation_that_races_the_event() -> None:
    assert await set_and_cancel_together(lambda e: wait_event(e, 10.0)) == "cancelled"


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="CPython gh-86296 is fixed in 3.12")
async def test_wait_for_drops_that_cancellation_on_python_3_11() -> None:
    # the reason for wait_event: the same race through asyncio.wait_for loses the cancellation
    assert await set_and_cancel_together(lambda e: asyncio.wait_for(e.wait(), 10.0)) == "returned"


async def test_within_propagates_a_cancellation_that_races_the_result() -> None:
    # the router's queued request: its grant future is resolved just as the client leaves
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[str] = loop.create_future()

    async def waiter() -> str:
        return await within(fut, 10.0)

    task = asyncio.create_task(waiter())
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    fut.set_result("grant")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert fut.result() == "grant"  # still there for the caller's cleanup to release


async def test_within_results_and_timeout() -> None:
    loop = asyncio.get_running_loop()
    done: asyncio.Future[int] = loop.create_future()
    done.set_result(7)
    assert await within(done, 0.01) == 7
    assert await within(asyncio.sleep(0, result="x"), None) == "x"
    pending: asyncio.Future[int] = loop.create_future()
    with pytest.raises(TimeoutError):
        await within(pending, 0.01)
    assert pending.cancelled()  # like wait_for, the awaited future is cancelled on timeout


async def test_wait_event_results() -> None:
    event = asyncio.Event()
    assert await wait_event(event, 0.01) is False
    event.set()
    assert await wait_event(event, 0.01) is True
    assert await wait_event(event, None) is True


async def test_stop_task_ends_a_task_and_bounds_one_that_ignores_its_cancellation() -> None:
    from fairbatch_common.aio import stop_task

    normal = asyncio.create_task(asyncio.sleep(10))
    await asyncio.sleep(0)
    assert await stop_task(normal, 1.0) is True and normal.cancelled()

    release = asyncio.Event()

    async def stubborn() -> None:  # drops every cancellation, as the 3.11 wait_for race can
        while not release.is_set():
            try:
                await asyncio.sleep(0.02)
            except asyncio.CancelledError:
                continue

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    loop = asyncio.get_running_loop()
    async with LoopLag() as lag:
        t0 = loop.time()
        assert await stop_task(task, 0.1) is False  # bounded: returns after 0.1 s, the task still runs
        assert 0.09 <= loop.time() - t0 <= lag.bound_s(0.1) and not task.done()

    # the caller's own cancellation is not swallowed while it waits
    caller = asyncio.create_task(stop_task(task, 10.0))
    await asyncio.sleep(0.01)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    release.set()  # let it end, so the test's loop can close
    await asyncio.wait_for(task, 1.0)
