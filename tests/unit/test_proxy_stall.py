"""The agent's stall rule (replica_agent/proxy.py ``_next_chunk``): engine silence counts only while
the agent runs."""

from __future__ import annotations

import asyncio
import time

import pytest

from replica_agent.proxy import EngineStalled, _next_chunk


class _Late:
    """An upstream iterator whose one chunk arrives ``after_s`` after creation (never when None)."""

    def __init__(self, after_s: float | None) -> None:
        self.after_s = after_s
        self.t0 = time.monotonic()

    def __aiter__(self) -> _Late:
        return self

    async def __anext__(self) -> bytes:
        if self.after_s is None:
            await asyncio.sleep(3600)
        await asyncio.sleep(max(0.0, self.t0 + self.after_s - time.monotonic()))
        return b"data: x\n\n"


async def test_silent_engine_is_a_stall() -> None:
    t0 = time.monotonic()
    with pytest.raises(EngineStalled):
        await _next_chunk(_Late(None), 0.4)
    assert 0.35 < time.monotonic() - t0 < 1.0


async def test_a_paused_agent_is_not_a_stalled_engine() -> None:
    # The loop is blocked from 0.05 s to 0.55 s (the agent did not run); the chunk is there at 0.7 s.
    # Slices of 0.1 s: the blocked one counts 0.2, the next 0.1, and the chunk comes in the third:
    # 0.3 s of silence < 0.4. A single 0.4 s timer would have fired on resuming, at 0.55 s.
    loop = asyncio.get_running_loop()
    loop.call_later(0.05, time.sleep, 0.5)
    assert await _next_chunk(_Late(0.7), 0.4) == b"data: x\n\n"
