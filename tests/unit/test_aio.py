"""replica_agent.aio.wait_event keeps a cancellation that asyncio.wait_for drops on Python 3.11.

The case: the waiting task is cancelled in the same loop iteration in which its event is set (the
router's dispatcher when Router.close() cancels it just as a release wakes it). Before the fix,
Router.close() then awaited the dispatcher forever (a 120 s teardown timeout in CI).
"""

from __future__ import annotations

import asyncio
import sys

import pytest

from replica_agent.aio import wait_event


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


async def test_wait_event_results() -> None:
    event = asyncio.Event()
    assert await wait_event(event, 0.01) is False
    event.set()
    assert await wait_event(event, 0.01) is True
    assert await wait_event(event, None) is True
