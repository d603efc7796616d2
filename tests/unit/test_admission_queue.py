"""router/admission_queue.py: bounds, expiry, removal, dispatch order, work conservation and holds."""

from __future__ import annotations

import asyncio

import pytest

from router.admission_queue import (
    Attempt,
    Dispatcher,
    FifoQueue,
    PlacementFailed,
    QueueFull,
    QueueTimeout,
    WaitingRequest,
)
from tests.fakes import FakeClock
from tests.timing import LoopLag




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


PLACED: dict[int, dict[str, str]] = {}  # dispatcher -> request id -> replica (test bookkeeping)


def make_dispatcher(q: FifoQueue, clock: FakeClock, fits: set[str], max_bypass: int = 2,
                    replicas: tuple[str, ...] = ("r0",), hold: str | None = None):
    """``fits``: request ids that fit (on every replica not avoided); ``hold``: the replica
    ``hold_for`` names (None: no hold callback)."""
    admitted: list[str] = []
    orphans: list[str] = []
    placed: dict[str, str] = {}

    async def admit(e: WaitingRequest, attempt: Attempt) -> str | None:
        if e.request_id in fits:
            free = [r for r in replicas if r not in attempt.avoid]
            if free:
                admitted.append(e.request_id)
                placed[e.request_id] = free[0]
                return f"lease-{e.request_id}"
        return None

    async def release_orphan(grant: str) -> None:
        orphans.append(grant)

    d = Dispatcher(queue=q, clock=clock, admit=admit, release_orphan=release_orphan, max_bypass=max_bypass,  # type: ignore[arg-type]
                   hold_for=None if hold is None else (lambda e: hold))
    PLACED[id(d)] = placed
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


async def test_a_head_that_fits_nowhere_never_holds_the_queue() -> None:
    # Without a hold callback every entry that fits is admitted, whatever waits ahead of it.
    clock = FakeClock()
    q = FifoQueue(10, 1000)
    head = entry("head", 900)
    for e in (head, *[entry(f"s{i}") for i in range(4)]):
        q.push(e)
    d, admitted, _ = make_dispatcher(q, clock, fits={"s0", "s1", "s2", "s3"}, max_bypass=2)
    stats = await d.dispatch_once()
    assert admitted == ["s0", "s1", "s2", "s3"] and not stats.held
    assert head.passed_by == 4 and [e.request_id for e in q.ordered()] == ["head"]


async def test_after_max_bypass_one_replica_is_held_for_the_head() -> None:
    # Two replicas; the head fits nowhere. Pass 1: s0 and s1 pass it (passed_by 2 = max_bypass),
    # then r1 is held for it. Pass 2: s2 and s3 (behind the head) may only use r0.
    clock = FakeClock()
    q = FifoQueue(10, 1000)
    head = entry("head", 900)
    others = [entry(f"s{i}") for i in range(4)]
    q.push(head)
    q.push(others[0])
    q.push(others[1])
    d, admitted, _ = make_dispatcher(q, clock, fits={"s0", "s1", "s2", "s3"}, max_bypass=2,
                                     replicas=("r1", "r0"), hold="r1")
    stats = await d.dispatch_once()
    assert admitted == ["s0", "s1"] and PLACED[id(d)] == {"s0": "r1", "s1": "r1"}
    assert head.passed_by == 2 and stats.held and d.hold == (head, "r1")
    q.push(others[2])
    q.push(others[3])
    stats = await d.dispatch_once()
    assert admitted == ["s0", "s1", "s2", "s3"] and stats.held
    assert PLACED[id(d)]["s2"] == PLACED[id(d)]["s3"] == "r0"
    # the head leaves (its client went away): the hold ends
    head.future.cancel()
    assert d.hold is None


async def test_a_less_urgent_band_never_takes_the_replica_held_for_an_urgent_head() -> None:
    # Order U (band 0, fits nowhere), B (band 1, fits), U2 (band 0, fits); replicas r0, r1. Before
    # B is tried behind the blocked U, r0 is held for U; B and U2 still start, on r1 (work
    # conservation on every other replica).
    clock = FakeClock()
    q = FifoQueue(10, 10_000)
    u, b, u2 = entry("u", 900), entry("b"), entry("u2")
    b.priority = 1
    for e in (u, b, u2):
        q.push(e)
    d, admitted, _ = make_dispatcher(q, clock, fits={"b", "u2"}, max_bypass=8, replicas=("r0", "r1"), hold="r0")
    await d.dispatch_once()
    assert admitted == ["b", "u2"] and PLACED[id(d)] == {"b": "r1", "u2": "r1"} and d.hold == (u, "r0")
    assert u.passed_by == 9  # B: +max_bypass, U2: +1
    # with one replica only, B waits behind U (the old band rule, now on the held replica alone)
    q2 = FifoQueue(10, 10_000)
    u, b = entry("u", 900), entry("b")
    b.priority = 1
    q2.push(u)
    q2.push(b)
    d2, admitted2, _ = make_dispatcher(q2, clock, fits={"b"}, hold="r0")
    await d2.dispatch_once()
    assert admitted2 == [] and d2.hold == (u, "r0")


async def test_zero_bypass_holds_at_once() -> None:
    q = FifoQueue(10, 1000)
    head, small = entry("head"), entry("small")
    q.push(head)
    q.push(small)
    d, admitted, _ = make_dispatcher(q, FakeClock(), fits={"small"}, max_bypass=0, hold="r0")
    await d.dispatch_once()  # small passes once (nothing held yet), then r0 is held for head
    assert admitted == ["small"] and d.hold == (head, "r0")
    q.push(entry("small2"))
    await d.dispatch_once()
    assert admitted == ["small"]


async def test_on_time_entries_are_offered_first_late_ones_after() -> None:
    # phase 1 asks every entry for an on-time placement, phase 2 the normal fit
    q = FifoQueue(10, 1000)
    late, fresh = entry("late"), entry("fresh")
    q.push(late)
    q.push(fresh)
    calls: list[tuple[str, bool]] = []

    async def admit(e: WaitingRequest, attempt: Attempt) -> str | None:
        calls.append((e.request_id, attempt.on_time_only))
        if e.request_id == "late" and attempt.on_time_only:
            return None
        return e.request_id

    async def orphan(g: str) -> None:
        pass

    d = Dispatcher(queue=q, clock=FakeClock(), admit=admit, release_orphan=orphan)  # type: ignore[arg-type]
    stats = await d.dispatch_once()
    assert calls == [("late", True), ("fresh", True), ("late", False)] and stats.admitted == 2


async def test_max_scan_truncates_a_pass() -> None:
    q = FifoQueue(10, 1000)
    for i in range(5):
        q.push(entry(f"e{i}"))
    d, admitted, _ = make_dispatcher(q, FakeClock(), fits={"e0", "e1", "e2", "e3", "e4"})
    d.max_scan = 3
    stats = await d.dispatch_once()
    assert stats.truncated and admitted == ["e0", "e1", "e2"]
    stats = await d.dispatch_once()
    assert not stats.truncated and admitted == ["e0", "e1", "e2", "e3", "e4"]


async def test_truncated_passes_resume_where_they_stopped() -> None:
    # 4 entries that fit nowhere (2 admit calls each), then one that fits; 3 calls per pass.
    # Without resuming, every pass would retry the first two and never reach "ok".
    q = FifoQueue(10, 1000)
    for i in range(4):
        q.push(entry(f"no{i}"))
    q.push(entry("ok"))
    d, admitted, _ = make_dispatcher(q, FakeClock(), fits={"ok"})
    d.max_scan = 3
    for _ in range(4):
        await d.dispatch_once()
    assert admitted == ["ok"]


async def test_gone_waiter_removed_and_late_grant_released() -> None:
    q = FifoQueue(10, 1000)
    gone, late = entry("gone"), entry("late")
    q.push(gone)
    q.push(late)
    gone.future.cancel()  # client disconnected
    clock = FakeClock()

    async def admit(e: WaitingRequest, attempt: Attempt) -> str | None:
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

    async def admit(e: WaitingRequest, attempt: Attempt) -> str | None:
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


async def test_a_sheddable_entry_is_never_placed_late_a_non_sheddable_one_is() -> None:
    # both fit only by the normal fit (phase 2: their TTFT can no longer be met anywhere); the
    # non-sheddable one is placed late, the sheddable one stays queued for an on-time start, and is
    # placed as soon as one exists (phase 1)
    clock = FakeClock()
    q = FifoQueue(10, 1000)
    shed_me, keep = entry("shed", deadline_ms=10**9), entry("keep", deadline_ms=10**9)
    shed_me.sheddable = True
    q.push(shed_me)
    q.push(keep)
    on_time: set[str] = set()
    tries: list[tuple[str, bool]] = []

    async def admit(e: WaitingRequest, attempt: Attempt) -> str | None:
        tries.append((e.request_id, attempt.on_time_only))
        if attempt.on_time_only and e.request_id not in on_time:
            return None
        return f"lease-{e.request_id}"

    async def release(grant: str) -> None:
        raise AssertionError("no orphan here")

    d: Dispatcher[str] = Dispatcher(queue=q, clock=clock, admit=admit, release_orphan=release)  # type: ignore[arg-type]
    stats = await d.dispatch_once()
    assert stats.admitted == 1 and keep.future.result() == "lease-keep"
    assert tries == [("shed", True), ("keep", True), ("keep", False)]  # "shed" never tried late
    assert not shed_me.future.done() and len(q) == 1
    on_time.add("shed")
    stats = await d.dispatch_once()
    assert stats.admitted == 1 and shed_me.future.result() == "lease-shed" and len(q) == 0


async def test_a_kept_sheddable_entry_is_asked_again_within_shed_recheck_ms_without_a_wake() -> None:
    # a sheddable entry nothing places; ``shed`` keeps it twice, then says it can no longer start in
    # time (as a prediction that relied on a prefill ending, which overran). No budget push wakes
    # the dispatcher (idle poll 30 s): the recheck timer (10 ms) alone must bring the next passes,
    # so the request is refused in tens of ms, not at the next periodic push or its deadline
    clock = FakeClock()
    q = FifoQueue(10, 1000)
    e = entry("s", deadline_ms=10**9)
    e.sheddable, e.expire_reason = True, "slo-infeasible"
    q.push(e)
    asked: list[float] = []

    def shed(entry_: WaitingRequest, now_ms: float) -> bool:
        asked.append(now_ms)
        return len(asked) >= 3

    async def admit(entry_: WaitingRequest, attempt: Attempt) -> str | None:
        return None

    async def release(grant: str) -> None:
        raise AssertionError("no orphan here")

    d: Dispatcher[str] = Dispatcher(queue=q, clock=clock, admit=admit, release_orphan=release,  # type: ignore[arg-type]
                                    idle_poll_s=30.0, shed=shed, shed_recheck_ms=10.0)
    stats = await d.dispatch_once()
    assert (stats.shed_kept, stats.expired) == (1, 0) and not e.future.done()
    task = asyncio.create_task(d.run())
    d.wake()  # one push (the entry's arrival), then none
    try:
        with pytest.raises(QueueTimeout) as err:
            await asyncio.wait_for(e.future, 5.0)  # the woken pass keeps it; 10 ms later it is shed
        assert err.value.reason == "slo-infeasible" and len(asked) == 3 and len(q) == 0
    finally:
        task.cancel()
    # a non-sheddable entry (expire_reason queue-timeout) is never asked, so never counted
    q2 = FifoQueue(10, 1000)
    q2.push(entry("n", deadline_ms=10**9))
    d2: Dispatcher[str] = Dispatcher(queue=q2, clock=clock, admit=admit, release_orphan=release,  # type: ignore[arg-type]
                                     shed=shed)
    assert (await d2.dispatch_once()).shed_kept == 0


# ---------------------------------------------------------------- issue 25: a backlog that stops draining


def late_queue(n: int, first_token_deadline_ms: float = float("inf")) -> tuple[FifoQueue, list[WaitingRequest]]:
    q = FifoQueue(4096, 10**9)
    es = [entry(f"e{i}", deadline_ms=10**9) for i in range(n)]
    for e in es:
        e.first_token_deadline_ms = first_token_deadline_ms
        q.push(e)
    return q, es


def late_only_admit(calls: list[tuple[str, bool]]):  # noqa: ANN201
    """Fails every on-time attempt, places every normal-fit one: a queue of requests whose TTFT is
    lost, in front of replicas with budget (the issue's fleet at t = 30 s)."""

    async def admit(e: WaitingRequest, attempt: Attempt) -> str | None:
        calls.append((e.request_id, attempt.on_time_only))
        return None if attempt.on_time_only else f"lease-{e.request_id}"

    return admit


async def release_none(grant: str) -> None:
    raise AssertionError("no orphan here")


async def test_a_long_queue_that_fails_phase_one_is_placed_in_phase_two() -> None:
    # 100 entries, the default 64 calls per pass. Phase 1 stops once it has used
    # 64 - min(late, 32) calls: after 32 calls (32 late entries), so phase 2 places those 32 in the
    # same pass. Before the fix phase 1 spent all 64 calls, every pass was cut in phase 1 and
    # resumed in phase 1: 0 placed, pass after pass.
    q, es = late_queue(100)
    calls: list[tuple[str, bool]] = []
    d: Dispatcher[str] = Dispatcher(queue=q, clock=FakeClock(), admit=late_only_admit(calls),  # type: ignore[arg-type]
                                    release_orphan=release_none)
    stats = await d.dispatch_once()
    assert stats.truncated and stats.admit_calls == 64 and stats.admitted == 32
    assert calls == [(f"e{i}", True) for i in range(32)] + [(f"e{i}", False) for i in range(32)]
    assert [e.future.done() for e in es] == [True] * 32 + [False] * 68
    # the next passes resume at e32 (the first entry phase 1 did not try): 32, 32, then the last 4
    admitted = [(await d.dispatch_once()).admitted for _ in range(3)]
    assert admitted == [32, 32, 4] and len(q) == 0


async def test_phase_one_skips_entries_past_their_first_token_deadline() -> None:
    # with a monotone placement (skip_dominated), an entry whose first-token deadline passed cannot
    # be on time anywhere: no phase-1 call, straight to the normal fit
    clock = FakeClock(t=5000.0)
    q, es = late_queue(70, first_token_deadline_ms=4000.0)
    fresh = entry("fresh", deadline_ms=10**9)
    fresh.first_token_deadline_ms = 6000.0
    q.push(fresh)
    calls: list[tuple[str, bool]] = []
    d: Dispatcher[str] = Dispatcher(queue=q, clock=clock, admit=late_only_admit(calls),  # type: ignore[arg-type]
                                    release_orphan=release_none, skip_dominated=True)
    stats = await d.dispatch_once()
    # phase 1: one call (fresh), phase 2: 63 calls on e0..e62 (64 in all); fresh comes last in order
    assert calls[0] == ("fresh", True) and all(not on_time for _, on_time in calls[1:])
    assert stats.admitted == 63 and stats.truncated
    assert (await d.dispatch_once()).admitted == 8 and len(q) == 0


async def test_max_scan_below_two_is_refused() -> None:
    with pytest.raises(ValueError, match="max_scan"):
        Dispatcher(queue=FifoQueue(1, 1), clock=FakeClock(), admit=late_only_admit([]),  # type: ignore[arg-type]
                   release_orphan=release_none, max_scan=1)


async def test_one_wake_drains_a_late_backlog_without_another_push() -> None:
    # the router's loop: one wake (the last arrival), idle poll 30 s, no budget push after it.
    # Truncated passes chain at once, so the whole backlog is placed within a push period.
    q, es = late_queue(200)
    d: Dispatcher[str] = Dispatcher(queue=q, clock=FakeClock(), admit=late_only_admit([]),  # type: ignore[arg-type]
                                    release_orphan=release_none, idle_poll_s=30.0)
    loop = asyncio.get_running_loop()
    async with LoopLag() as lag:
        t0 = loop.time()
        task = asyncio.create_task(d.run())
        d.wake()
        try:
            # not waiting for the 30 s idle poll: within one push period (100 ms) on an idle machine, and as
            # much later as the loop was held up (the passes themselves hold it: the probe sees them)
            await asyncio.wait_for(asyncio.gather(*(e.future for e in es)), 20.0)
            assert loop.time() - t0 <= lag.bound_s(0.1, slack_s=0.0)
        finally:
            task.cancel()
    assert len(q) == 0


async def test_watchdog_reports_a_queue_that_does_not_move_while_a_head_could_be_placed() -> None:
    # a dispatcher whose admit never places (an agent that refuses every Reserve its view promised)
    # while the probe says the head fits: stalled from the first complete pass on; a pass that
    # admits ends it; a probe that finds no room means a full fleet, not a stall
    clock = FakeClock(t=1000.0)
    q, es = late_queue(3)
    room = {"probe": True, "admit": False}

    async def admit(e: WaitingRequest, attempt: Attempt) -> str | None:
        return f"lease-{e.request_id}" if room["admit"] else None

    probed: list[tuple[str, Attempt]] = []

    def probe(e: WaitingRequest, attempt: Attempt) -> bool:
        probed.append((e.request_id, attempt))
        return room["probe"]

    d: Dispatcher[str] = Dispatcher(queue=q, clock=clock, admit=admit, release_orphan=release_none,  # type: ignore[arg-type]
                                    probe=probe)
    assert (await d.dispatch_chain()).stalled and d.stalled_ms(1000.0) == 0.0
    assert probed == [("e0", Attempt())]  # one band: its head only
    clock.t = 4000.0
    assert (await d.dispatch_chain()).stalled and d.stalled_ms(4500.0) == 3500.0
    room["probe"] = False  # no replica has room: the queue waits, nothing is stalled
    assert not (await d.dispatch_chain()).stalled and d.stalled_ms(5000.0) == 0.0
    room["probe"] = True
    clock.t = 6000.0
    assert (await d.dispatch_chain()).stalled and d.stalled_ms(7000.0) == 1000.0
    room["admit"] = True
    stats = await d.dispatch_chain()
    assert stats.admitted == 3 and not stats.stalled and d.stalled_ms(9000.0) == 0.0


async def test_watchdog_probes_each_band_head_as_the_dispatcher_may_place_it() -> None:
    # two bands: the head of band 0 is sheddable (probed on time only); the band-1 head sits
    # behind the holder, so it is probed with the held replica avoided
    clock = FakeClock()
    q = FifoQueue(10, 1000)
    a, b, c = entry("a", deadline_ms=10**9), entry("b", deadline_ms=10**9), entry("c", deadline_ms=10**9)
    a.sheddable = True
    c.priority = 1
    for e in (a, b, c):
        q.push(e)
    probed: list[tuple[str, Attempt]] = []

    async def admit(e: WaitingRequest, attempt: Attempt) -> str | None:
        return None

    def probe(e: WaitingRequest, attempt: Attempt) -> bool:
        probed.append((e.request_id, attempt))
        return False

    d: Dispatcher[str] = Dispatcher(queue=q, clock=clock, admit=admit, release_orphan=release_none,  # type: ignore[arg-type]
                                    probe=probe, max_bypass=0, hold_for=lambda e: "r1")
    stats = await d.dispatch_chain()
    assert d.hold is not None and d.hold[0] is a and not stats.stalled
    assert probed == [("a", Attempt(on_time_only=True)), ("c", Attempt(avoid=frozenset({"r1"})))]


async def test_wake_if_waiting_asks_for_a_pass_only_when_one_could_change_something() -> None:
    # the core's budget-book listener (a release or a budget push): no entry, no hold, no stall -> no
    # pass; an entry waiting, or a hold or stall still recorded (a pass clears them) -> a pass
    q = FifoQueue(10, 1000)
    d, _, _ = make_dispatcher(q, FakeClock(), fits=set())
    d.wake_if_waiting()
    assert not d._wake.is_set()  # noqa: SLF001 - the event run() waits on
    e = entry("a")
    q.push(e)
    d.wake_if_waiting()
    assert d._wake.is_set()  # noqa: SLF001
    d._wake.clear()  # noqa: SLF001
    assert q.remove(e) and len(q) == 0
    d._stalled_since_ms = 5.0  # noqa: SLF001 - a stall recorded before the queue emptied
    d.wake_if_waiting()
    assert d._wake.is_set()  # noqa: SLF001
    d.wake()  # the unconditional wake stays unconditional
    assert d._wake.is_set()  # noqa: SLF001
