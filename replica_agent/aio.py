"""asyncio helpers shared by the servers (router, agent, simulated engine)."""

from __future__ import annotations

import asyncio


async def wait_event(event: asyncio.Event, timeout_s: float | None) -> bool:
    """Wait until ``event`` is set or ``timeout_s`` wall seconds pass; True when it was set.

    A cancellation of the caller always propagates. ``asyncio.wait_for(event.wait(), t)`` does
    not guarantee that on Python 3.11: when the task is cancelled in the same loop iteration in
    which the event is set, ``wait_for`` returns the result and drops the CancelledError
    (CPython gh-86296, fixed in 3.12). A server loop that does this never stops: the router's
    dispatcher hung ``Router.close()`` that way (tests/unit/test_aio.py reproduces it).
    ``asyncio.timeout`` (3.11+) keeps the cancellation.

    Args:
        event: the event to wait for.
        timeout_s: wall seconds; None waits without a limit.
    """
    if event.is_set():
        return True
    try:
        async with asyncio.timeout(timeout_s):
            await event.wait()
    except TimeoutError:
        return False
    return True
