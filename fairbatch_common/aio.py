"""asyncio helpers shared by the servers (router, agent, simulated engine)."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from aiohttp import web

T = TypeVar("T")

log = logging.getLogger(__name__)


class FirstChunkStreamResponse(web.StreamResponse):
    """A stream response whose status line and headers go out with its first body write.

    aiohttp's ``StreamResponse.prepare`` sends the headers at once, in a segment of their own: the
    next hop wakes for them, and again for the first chunk. A relay that prepares before it has a
    chunk (the agent, while the engine runs the prefill) or just before its first write (the router)
    sends both in one ``send`` this way (aiohttp's own opt-in, as ``web.Response`` does). Everything
    else is ``web.StreamResponse``: a ``write_eof()`` without a body still sends the headers.
    """

    _send_headers_immediately = False


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


async def within(aw: Awaitable[T], timeout_s: float | None) -> T:
    """Await ``aw`` for at most ``timeout_s`` wall seconds (None: no limit) and return its result.

    The same as ``asyncio.wait_for(aw, timeout_s)`` except that a cancellation of the caller
    always propagates, also when ``aw`` completes in the same loop iteration (see
    :func:`wait_event`; CPython gh-86296). On timeout ``aw`` is cancelled, as with ``wait_for``.

    Raises:
        TimeoutError: when ``timeout_s`` passes first.
    """
    async with asyncio.timeout(timeout_s):
        return await aw


async def stop_task(task: asyncio.Task[Any], timeout_s: float = 5.0) -> bool:
    """Cancel ``task`` and wait for it to end, at most ``timeout_s`` wall seconds.

    ``asyncio.wait`` rather than ``await task`` inside ``try/except CancelledError``: that pattern
    also swallows a cancellation aimed at the caller, and waits forever for a task that drops its
    own (see :func:`wait_event`).

    Returns:
        True when the task ended in time (logged otherwise, and left running).
    """
    task.cancel()
    done, _ = await asyncio.wait([task], timeout=timeout_s)
    if not done:
        log.warning("task %s did not stop within %.1f s of its cancellation", task.get_name(), timeout_s)
        return False
    if not task.cancelled() and task.exception() is not None:
        log.warning("task %s ended with %r", task.get_name(), task.exception())
    return True


def file_stamp(path: str | os.PathLike[str]) -> tuple[int, int] | None:
    """``(mtime_ns, size)`` of a file, None when it cannot be read (a change detector, not a hash)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


async def watch_file(
    path: str | os.PathLike[str], poll_s: float, hup: asyncio.Event, on_change: Callable[[bool], object]
) -> None:
    """Call ``on_change(signalled)`` on SIGHUP (``hup`` set) or when the file's mtime/size changes
    (polled every ``poll_s`` wall seconds; 0 = only on ``hup``). One call at a time; runs until cancelled.
    A Kubernetes ConfigMap update (an atomic symlink swap) changes the stamp like an edit does."""
    stamp = file_stamp(path)
    while True:
        await wait_event(hup, poll_s if poll_s > 0 else None)
        signalled = hup.is_set()
        hup.clear()
        new_stamp = file_stamp(path)
        if not signalled and (new_stamp is None or new_stamp == stamp):
            continue
        stamp = new_stamp
        on_change(signalled)
