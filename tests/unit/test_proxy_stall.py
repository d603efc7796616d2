"""The agent's stall rule (replica_agent/proxy.py ``StallWatch``): engine silence counts only while
the agent runs, and restarts at every chunk."""

from __future__ import annotations

import asyncio
import time

from replica_agent.proxy import EngineStalled, StallWatch
from tests.timing import LoopLag


class _Recorder:
    """``on_stall`` of a watch: when (monotonic s) and with what it was called."""

    def __init__(self) -> None:
        self.calls: list[tuple[float, EngineStalled]] = []

    def __call__(self, exc: EngineStalled) -> None:
        self.calls.append((time.monotonic(), exc))


async def _until_called(rec: _Recorder, lag: LoopLag, due_s: float) -> None:
    """Wait for the watch's call, at most :meth:`LoopLag.bound_s` of ``due_s`` (then the assert tells)."""
    start = time.monotonic()
    while not rec.calls and time.monotonic() - start < lag.bound_s(due_s) + 0.5:
        await asyncio.sleep(0.01)


async def test_silent_engine_is_a_stall() -> None:
    rec = _Recorder()
    async with LoopLag() as lag:
        t0 = time.monotonic()
        watch = StallWatch(0.4, rec)
        await _until_called(rec, lag, 0.4)
        await asyncio.sleep(0.3)  # three more slices of 0.1 s
        watch.close()
    assert len(rec.calls) == 1  # once, not once per slice after the stall
    at, exc = rec.calls[0]
    # due 0.4 s after the start; a loop held up runs the watch's timer later (never earlier)
    assert 0.35 < at - t0 <= lag.bound_s(0.4)
    assert exc.timeout_s == 0.4


async def test_chunks_restart_the_silence() -> None:
    # A chunk every 0.15 s for 0.9 s (six times the 0.4 s rule's slice of 0.1 s, 2.25 rules long):
    # never 0.4 s of silence, so no stall; then silence: the stall comes 0.4 s after the last chunk.
    rec = _Recorder()
    async with LoopLag() as lag:
        watch = StallWatch(0.4, rec)
        for _ in range(6):
            await asyncio.sleep(0.15)
            watch.saw_chunk()
        last = time.monotonic()
        assert rec.calls == []
        await _until_called(rec, lag, 0.4)
        watch.close()
    assert len(rec.calls) == 1
    assert 0.35 < rec.calls[0][0] - last <= lag.bound_s(0.4)


async def test_a_paused_agent_is_not_a_stalled_engine() -> None:
    # The loop is blocked from 0.05 s to 0.55 s (the agent did not run); the chunk is there at 0.7 s.
    # Slices of 0.1 s: the blocked one counts 0.2, the next 0.1, and the chunk comes in the third:
    # 0.3 s of silence < 0.4. A single 0.4 s timer would have fired on resuming, at 0.55 s.
    rec = _Recorder()
    loop = asyncio.get_running_loop()
    t0 = time.monotonic()
    watch = StallWatch(0.4, rec)
    loop.call_later(0.05, time.sleep, 0.5)
    await asyncio.sleep(max(0.0, t0 + 0.7 - time.monotonic()))
    watch.saw_chunk()
    assert rec.calls == []
    watch.close()


async def test_close_stops_the_watch() -> None:
    rec = _Recorder()
    watch = StallWatch(0.2, rec)
    watch.close()
    await asyncio.sleep(0.5)
    assert rec.calls == []


async def _wait_calls(rec: _Recorder, limit_s: float = 10.0) -> None:
    deadline = time.monotonic() + limit_s
    while not rec.calls and time.monotonic() < deadline:
        await asyncio.sleep(0.02)


async def test_the_predicted_prefill_is_not_silence() -> None:
    """Issue 30: the timer starts ``grace_s`` (the predicted prefill) from now: no stall before
    grace + stall (0.6 + 0.2 s; a timer never fires early, a loaded machine only later), then one."""
    rec = _Recorder()
    t0 = time.monotonic()
    watch = StallWatch(0.2, rec, grace_s=0.6)
    await _wait_calls(rec)
    watch.close()
    assert len(rec.calls) == 1 and rec.calls[0][0] - t0 >= 0.8 - 0.01


async def test_a_chunk_during_the_grace_ends_it() -> None:
    """A first chunk before the predicted end of the prefill: from then on the usual rule (stall 0.2 s
    after it), not grace + stall from the start (10.2 s)."""
    rec = _Recorder()
    watch = StallWatch(0.2, rec, grace_s=10.0)
    await asyncio.sleep(0.05)
    watch.saw_chunk()
    chunk_at = time.monotonic()
    await _wait_calls(rec, 8.0)
    watch.close()
    assert len(rec.calls) == 1 and rec.calls[0][0] - chunk_at >= 0.2 - 0.01


async def test_a_held_relay_is_not_a_stalled_engine() -> None:
    """While ``held()`` (the client does not read, so the relay does not read the engine) the silence
    does not count: no stall in 1 s held with a 0.2 s rule; after the hold, a stall 0.2 s later."""
    rec = _Recorder()
    held = [True]
    watch = StallWatch(0.2, rec, held=lambda: held[0])
    await asyncio.sleep(1.0)
    assert rec.calls == []
    held[0] = False
    released = time.monotonic()
    await _wait_calls(rec)
    watch.close()
    assert len(rec.calls) == 1 and rec.calls[0][0] - released >= 0.2 - 0.06  # the slice of 0.05 s in progress


def test_a_request_stall_marks_the_engine_only_when_the_engine_is_silent_too() -> None:
    from replica_agent.proxy import engine_wide_stall

    assert not engine_wide_stall(0.05, 3.0)  # the scrape answered 50 ms ago: that request alone
    assert not engine_wide_stall(1.49, 3.0)
    assert engine_wide_stall(1.5, 3.0)  # silent for half the stall timeout: the engine stopped
    assert engine_wide_stall(None, 3.0)  # never answered
