"""Clocks with a time scale, so a simulated fleet can run slower (or faster) than real time.

Every component of fairbatch reads time through a :class:`Clock` passed in, never from a global.
All figures inside the product are in *simulated-GPU milliseconds*: with ``scale = 4`` one
simulated millisecond lasts four wall-clock milliseconds, so a replica whose step takes 10 ms of
GPU time sleeps 40 ms of wall time, and a latency measured as 400 wall ms is reported as 100 ms.
With ``scale = 1`` (production) simulated time is wall time.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Clock:
    """Monotonic and unix-epoch time in simulated milliseconds.

    Attributes:
        scale: wall seconds per simulated second (> 0). 1.0 means real time.

    Raises:
        ValueError: if ``scale`` is not positive.
    """

    scale: float = 1.0

    def __post_init__(self) -> None:
        if not self.scale > 0:
            raise ValueError(f"time scale must be > 0, got {self.scale}")

    def now_ms(self) -> float:
        """Monotonic time in simulated ms (origin arbitrary, same for all Clocks in a process)."""
        return time.monotonic() * 1000.0 / self.scale

    def unix_ms(self) -> int:
        """Wall-clock unix time in ms, not scaled (for timestamps exchanged between processes)."""
        return int(time.time() * 1000.0)

    def to_wall_s(self, sim_ms: float) -> float:
        """Wall-clock seconds that ``sim_ms`` simulated milliseconds last."""
        return sim_ms * self.scale / 1000.0

    def to_sim_ms(self, wall_s: float) -> float:
        """Simulated milliseconds that ``wall_s`` wall-clock seconds represent."""
        return wall_s * 1000.0 / self.scale

    async def sleep_ms(self, sim_ms: float) -> None:
        """Sleep ``sim_ms`` simulated milliseconds (never blocks the event loop)."""
        await asyncio.sleep(max(0.0, self.to_wall_s(sim_ms)))
