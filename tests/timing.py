"""Time bounds that hold on a loaded machine (issue 30, item 6): one helper for every test that must
check *when* something happened on the real clock.

A timer of this process's event loop is run late by however long the loop could not run: other
callbacks, the garbage collector, or the operating system giving the CPU to other processes (a 2-core
machine shared with parallel test runs). :class:`LoopLag` measures that lateness while the test runs,
with a probe timer of its own, and :meth:`LoopLag.bound_s` turns it into an upper bound for a timer due
after ``due_s``. A test then asserts ``due_s - tolerance <= elapsed <= lag.bound_s(due_s)``: the lower
bound cannot break under load (load only delays), the upper bound grows with the load measured.

Where a test can avoid the real clock altogether it should: a gate the test opens (an ``asyncio.Event``)
instead of a delay, a counter instead of a duration, or the shared manual clock (tests/fakes.py
``FakeClock``) for code that takes a clock.
"""

from __future__ import annotations

import asyncio
from types import TracebackType

PROBE_PERIOD_S = 0.005
"""How often the probe asks to run (wall s): finer than any timer the tests check (>= 0.1 s)."""

FIXED_SLACK_S = 0.5
"""Added to every bound (wall s): the work of the path under test itself (a loopback round trip, a
parse), which the probe cannot see when it runs between the probe's wake-ups."""

LAG_FACTOR = 10.0
"""Multiple of the worst lateness seen that a bound allows: the path under test may wait for the loop
several times (a timer, then a socket read, then the response write), each as late as the probe's worst."""


class LoopLag:
    """The worst lateness (wall s) of the running event loop over a window, measured by a probe task.

    Use as ``async with LoopLag() as lag: ...`` around the awaited operation; ``lag.worst_s`` is the most
    any probe wake-up came after its due time (0 on an idle machine, about 1 ms in practice), and
    :meth:`bound_s` an upper bound for the operation. The probe keeps measuring until the block exits,
    so reading the bound after the operation includes the lateness seen during it.
    """

    def __init__(self, period_s: float = PROBE_PERIOD_S) -> None:
        if not period_s > 0:
            raise ValueError(f"probe period must be > 0, got {period_s}")
        self.period_s = period_s
        self.worst_s = 0.0
        self.wakeups = 0
        self._task: asyncio.Task[None] | None = None

    async def _probe(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + self.period_s
            await asyncio.sleep(self.period_s)
            self.wakeups += 1
            self.worst_s = max(self.worst_s, loop.time() - due)

    async def __aenter__(self) -> LoopLag:
        self._task = asyncio.create_task(self._probe())
        await asyncio.sleep(0)  # the probe's first timer is set before the operation starts
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def bound_s(self, due_s: float, slack_s: float = FIXED_SLACK_S) -> float:
        """An upper bound (wall s) for the elapsed time of something due after ``due_s`` wall seconds:
        ``due_s + slack_s + LAG_FACTOR * worst_s``. About ``due_s + 0.5`` on an idle machine; a loop that
        was held up for 0.3 s during the window gives ``due_s + 3.5``. A smaller ``slack_s`` for a test
        whose bound must stay below some other deadline on an idle machine (the lag still widens it)."""
        return due_s + slack_s + LAG_FACTOR * self.worst_s
