"""router/admission_queue.py: bounds, expiry, removal, dispatch order with bounded bypass."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from router.admission_queue import Dispatcher, FifoQueue, PlacementFailed, QueueFull, QueueTimeout, WaitingRequest


@dataclass
class FakeClock:
    t: float = 0.0
    scale: float = 1.0

    def now_ms(self) -> float:
        return self.t

    def to_wall_s(self, sim_ms: float) -> float:
        return sim_ms / 1000.0


def entry(rid: str, tokens: int = 10, deadline_ms: float = 1000.0) -> WaitingRequest:
    return WaitingRequest(
        request_id=rid, tenant="t", slo_class="interactive", prompt_tokens=tokens, max_tokens=0,
        enqueued_ms=0.0, deadline_ms=deadline_ms, future=asyncio.get_running_loop().create_future(),
    )


async def test_bounds_by_requests_and_tokens() -> None:
    q = FifoQueue(max_requests=2, max_tokens=100)
    q.push(entry("a", 60))
    with pytest.raises(QueueFull) as err:
        q.push(entry("b", 41))
    assert err.value.limit == "max_tokens"
    q.push(entry("b", 40))
    with pytest.raises(QueueFull) as err:
        q.push(entry("c", 0))
    assert err.value.limit == "max_requests"
    assert len(q) == 2 and q.tokens == 100


async def test_oversize_prompt_accepted_into_empty_queue() -> None:
    q = FifoQueue(max_requests=2, max_tokens=100)
    q.push(entry("big", 500))
    assert len(q) == 1


async def test_remove_and_order() -> None:
    q = FifoQueue(10, 1000)
    a, b, c = entry("a"), entry("b"), entry("c")
    for e in (a, b, c):
        q.push(e)
    assert q.remove(b) and not q.remove(b)
    assert [e.request_id for e in q.ordered()] == ["a", "c"]
    assert q.head() is a and q.tokens == 20


async def test_expiry_by_deadline() -> None:
    q = FifoQueue(10, 1000)
    a, b, c = entry("a", deadline_ms=300), entry("b", deadline_ms=100), entry("c", deadline_ms=200)
    for e in (a, b, c):
        q.push(e)
    q.remove(c)
    assert q.next_deadline_ms() == 100
    assert [e.request_id for e in q.expire(250)] == ["b"]
    assert q.next_deadline_ms() == 300
    assert [e.request_id for e in q.expire(300)] == ["a"]
    assert len(q) == 0 and q.next_deadline_ms() is None


def make_dispatcher(q: FifoQueue, clock: FakeClock, fits: set[str], max_bypass: int = 2):
    admitted: list[str] = []
    orphans: list[str] = []

    async def admit(e: WaitingRequest) -> str | None:
        if e.request_id in fits:
            admitted.append(e.request_id)
            return f"lease-{e.request_id}"
        return None

    async def release_orphan(grant: str) -> None:
        orphans.append(grant)

    d = Dispatcher(queue=q, clock=clock, admit=admit, release_orphan=release_orphan, max_bypass=max_bypass)  # type: ignore[arg-type]
    return d, admitted, orphans


async def test_dispatch_in_order_and_timeout() -> None:
    clock = FakeClock()
    q = FifoQueue(10, 1000)
    a, b = entry("a", deadline_ms=50), entry("b", deadline_ms=500)
    q.push(a)
    q.push(b)
    d, admitted, _ = make_dispatcher(q, clock, fits={"b"})
    clock.t = 60
    stats = await d.dispatch_once()
    assert stats.expired == 1 and stats.admitted == 1
    with pytest.raises(QueueTimeout):
        a.future.result()
    assert b.future.result() == "lease-b"
    assert len(q) == 0


async def test_bounded_bypass_of_a_head_that_fits_nowhere() -> None:
    clock = FakeClock()
    q = FifoQueue(10, 1000)
    head = entry("head", 900)
    others = [entry(f"s{i}") for i in range(4)]
    q.push(head)
    for e in others:
        q.push(e)
    d, admitted, _ = make_dispatcher(q, clock, fits={"s0", "s1", "s2", "s3"}, max_bypass=2)
    stats = await d.dispatch_once()
    assert admitted == ["s0", "s1"] and stats.held
    assert head.passed_by == 2
    stats = await d.dispatch_once()  # still held: the head must go first now
    assert admitted == ["s0", "s1"] and stats.held
    assert [e.request_id for e in q.ordered()] == ["head", "s2", "s3"]


async def test_a_less_urgent_band_does_not_pass_a_blocked_urgent_head() -> None:
    # Order U (band 0, fits nowhere), B (band 1, fits: its class has a long horizon), U2 (band 0, fits).
    # B must not take the budget U waits for; U2 (same band as U) may pass U within the bypass bound.
    clock = FakeClock()
    q = FifoQueue(10, 10_000)
    u, b, u2 = entry("u", 900), entry("b"), entry("u2")
    b.priority = 1
    for e in (u, b, u2):
        q.push(e)
    d, admitted, _ = make_dispatcher(q, clock, fits={"b", "u2"}, max_bypass=8)
    await d.dispatch_once()
    assert admitted == ["u2"] and u.passed_by == 1
    assert [e.request_id for e in q.ordered()] == ["u", "b"]


async def test_strict_fifo_with_zero_bypass() -> None:
    q = FifoQueue(10, 1000)
    head, small = entry("head"), entry("small")
    q.push(head)
    q.push(small)
    d, admitted, _ = make_dispatcher(q, FakeClock(), fits={"small"}, max_bypass=0)
    await d.dispatch_once()
    assert admitted == []


async def test_gone_waiter_removed_and_late_grant_released() -> None:
    q = FifoQueue(10, 1000)
    gone, late = entry("gone"), entry("late")
    q.push(gone)
    q.push(late)
    gone.future.cancel()  # client disconnected
    clock = FakeClock()

    async def admit(e: WaitingRequest) -> str | None:
        e.future.cancel()  # the waiter leaves while Reserve is in flight
        return f"lease-{e.request_id}"

    orphans: list[str] = []

    async def release_orphan(g: str) -> None:
        orphans.append(g)

    d = Dispatcher(queue=q, clock=clock, admit=admit, release_orphan=release_orphan)  # type: ignore[arg-type]
    await d.dispatch_once()
    assert orphans == ["lease-late"]
    assert len(q) == 0


async def test_run_wakes_on_wake() -> None:
    q = FifoQueue(10, 1000)
    e = entry("a", deadline_ms=10**9)
    fits: set[str] = set()
    d, admitted, _ = make_dispatcher(q, FakeClock(), fits=fits)
    d.idle_poll_s = 30.0
    task = asyncio.create_task(d.run())
    q.push(e)
    d.wake()
    await asyncio.sleep(0.01)
    assert not e.future.done()
    fits.add("a")
    d.wake()
    assert await asyncio.wait_for(e.future, 1.0) == "lease-a"
    task.cancel()


async def test_a_poison_entry_is_answered_and_removed_and_never_blocks_the_ones_around_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # good, poison, good, good: the poison's placement raises (as Reserve did for max_tokens 2**63) on
    # every try; it must fail once, leave the queue, and the three good ones go in the same pass
    clock = FakeClock()
    q = FifoQueue(10, 1000)
    entries = [entry("g0"), entry("poison"), entry("g1"), entry("g2")]
    for e in entries:
        q.push(e)
    tried: list[str] = []

    async def admit(e: WaitingRequest) -> str | None:
        tried.append(e.request_id)
        if e.request_id == "poison":
            raise ValueError("Value out of range: 9223372036854775808")
        return f"lease-{e.request_id}"

    async def release(grant: str) -> None:
        raise AssertionError("no orphan here")

    d: Dispatcher[str] = Dispatcher(queue=q, clock=clock, admit=admit, release_orphan=release)  # type: ignore[arg-type]
    stats = await d.dispatch_once()
    assert (stats.admitted, stats.failed, stats.held) == (3, 1, False)
    assert tried == ["g0", "poison", "g1", "g2"]
    assert [e.future.result() for e in (entries[0], entries[2], entries[3])] == ["lease-g0", "lease-g1", "lease-g2"]
    with pytest.raises(PlacementFailed) as err:
        entries[1].future.result()
    assert err.value.reason == "ValueError"
    assert len(q) == 0
    stats = await d.dispatch_once()  # nothing left to fail again
    assert (stats.admitted, stats.failed) == (0, 0) and tried == ["g0", "poison", "g1", "g2"]
    assert sum("placing request poison raised ValueError" in r.getMessage() for r in caplog.records) == 1
