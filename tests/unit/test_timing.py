"""tests/timing.py LoopLag: the lateness it measures is the time the loop could not run."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.timing import FIXED_SLACK_S, LAG_FACTOR, LoopLag


async def test_a_blocked_loop_is_seen_as_late_as_it_was_blocked() -> None:
    loop = asyncio.get_running_loop()
    async with LoopLag() as lag:
        await asyncio.sleep(0.02)
        loop.call_soon(time.sleep, 0.2)  # the loop cannot run for 0.2 s
        await asyncio.sleep(0.05)
    # the probe's wake-up due within 5 ms (its period) of the block's start ran after it: >= 0.2 - 0.005 late
    assert lag.worst_s >= 0.195
    assert lag.bound_s(1.0) >= 1.0 + FIXED_SLACK_S + LAG_FACTOR * 0.195
    assert lag.wakeups >= 2


def test_the_bound_is_the_due_time_plus_slack_plus_ten_worst_lags() -> None:
    lag = LoopLag()
    assert lag.bound_s(0.4) == pytest.approx(0.4 + 0.5)  # idle: nothing late yet
    lag.worst_s = 0.3
    assert lag.bound_s(1.0) == pytest.approx(1.0 + 0.5 + 10 * 0.3)  # 4.5 s
    assert lag.bound_s(0.0, slack_s=0.2) == pytest.approx(0.2 + 10 * 0.3)  # 3.2 s
    with pytest.raises(ValueError):
        LoopLag(0.0)
