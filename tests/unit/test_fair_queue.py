"""router/fair_queue.py on hand-worked sequences: who is served next, counters after each step.

Costs: w_prefill = 1, w_decode = 2; a request of 100 prompt tokens and max_tokens 100 costs
100 + 2 * 100 = 300 weighted tokens, so a weight-3 tenant's counter grows by 100 and a weight-1
tenant's by 300 per request (exact in floating point).
"""

from __future__ import annotations

import asyncio

import pytest

from router.admission_queue import Attempt, Dispatcher, QueueFull, WaitingRequest
from router.fair_queue import FairQueue, TenantShare


def req(rid: str, tenant: str, prompt: int = 100, max_tokens: int = 100, ttft_deadline: float = float("inf"),
        deadline_ms: float = 1e9) -> WaitingRequest:
    return WaitingRequest(
        request_id=rid, tenant=tenant, slo_class="c", prompt_tokens=prompt, max_tokens=max_tokens,
        enqueued_ms=0.0, deadline_ms=deadline_ms, future=asyncio.get_running_loop().create_future(),
        first_token_deadline_ms=ttft_deadline,
    )


def serve_all(q: FairQueue) -> list[str]:
    """Dispatch one at a time (remove + charge the dispatch cost), as the router does."""
    out = []
    while len(q):
        e = next(q.ordered())
        q.remove(e)
        q.charge(e.tenant, e.prompt_tokens, e.max_tokens)
        out.append(e.request_id)
    return out


async def test_weights_3_to_1_hand_worked_order_and_counters() -> None:
    q = FairQueue(100, 10**9, {"A": TenantShare(3.0), "B": TenantShare(1.0)})
    for i in range(1, 9):
        q.push(req(f"A{i}", "A"))
    for i in range(1, 5):
        q.push(req(f"B{i}", "B"))
    # counters (A, B) before each pick; ties go to the older head (all A were pushed first):
    # (0,0) A1 | (100,0) B1 | (100,300) A2 | (200,300) A3 | (300,300) tie -> A4 | (400,300) B2
    # (400,600) A5 | (500,600) A6 | (600,600) tie -> A7 | (700,600) B3 | (700,900) A8 | (800,900) B4
    expected = ["A1", "B1", "A2", "A3", "A4", "B2", "A5", "A6", "A7", "B3", "A8", "B4"]
    assert [e.request_id for e in q.ordered()] == expected  # the snapshot order ...
    assert serve_all(q) == expected  # ... is the order of one-by-one dispatch
    assert q.counters() == {"A": 800.0, "B": 1200.0}
    assert len(q) == 0 and q.tokens == 0


async def test_counter_step_by_step() -> None:
    q = FairQueue(10, 10**6, {"A": TenantShare(3.0), "B": TenantShare(1.0)})
    a1, b1 = req("A1", "A"), req("B1", "B")
    q.push(a1)
    q.push(b1)
    assert q.charge("A", 100, 100) == 100.0 and q.counter("A") == 100.0
    assert q.charge("B", 100, 100) == 300.0 and q.counter("B") == 300.0
    assert q.charge("B", 0, -50) == -100.0 and q.counter("B") == 200.0  # completion correction


async def test_lift_on_becoming_backlogged() -> None:
    q = FairQueue(100, 10**9, {"A": TenantShare(1.0), "B": TenantShare(1.0), "C": TenantShare(1.0)})
    for i in range(4):
        q.push(req(f"A{i}", "A"))
    for _ in range(3):
        e = next(q.ordered())
        q.remove(e)
        q.charge("A", 100, 100)
    assert q.counter("A") == 900.0
    # B was idle (counter 0): lifted to the minimum among backlogged tenants (A at 900), so it
    # cannot claim 3 requests' worth of banked service; A and B now alternate.
    assert q.push(req("B0", "B")) == 900.0
    q.push(req("B1", "B"))
    q.push(req("A9", "A"))
    # (A, B): (900, 900) tie -> A3, the older head | (1200, 900) B0 | (1200, 1200) tie -> B1 (pushed
    # before A9) | (1200, 1500) A9 -> (1500, 1500)
    assert serve_all(q) == ["A3", "B0", "B1", "A9"]
    # nobody backlogged now: C is lifted to the counter of the last tenant that left the backlog
    assert q.counter("B") == 1500.0
    assert q.push(req("C0", "C")) == 1500.0


async def test_lift_never_lowers_a_counter() -> None:
    q = FairQueue(10, 10**6, {"A": TenantShare(), "B": TenantShare()})
    q.charge("B", 1000, 0)
    q.push(req("A0", "A"))
    assert q.push(req("B0", "B")) == 1000.0


async def test_edf_within_a_tenant() -> None:
    q = FairQueue(10, 10**6, {"A": TenantShare()})
    q.push(req("late", "A", ttft_deadline=900))
    q.push(req("early", "A", ttft_deadline=100))
    q.push(req("mid", "A", ttft_deadline=500))
    q.push(req("mid2", "A", ttft_deadline=500))
    assert [e.request_id for e in q.ordered()] == ["early", "mid", "mid2", "late"]


async def test_band_cap_reserves_min_share_for_lower_band() -> None:
    q = FairQueue(100, 10**9, {"H": TenantShare(1.0, band=0), "L": TenantShare(1.0, band=1, min_share=0.25)})
    for i in range(9):
        q.push(req(f"H{i}", "H"))
    for i in range(3):
        q.push(req(f"L{i}", "L"))
    # cap(band 0) = 1 - 0.25 = 0.75; served (H, L) before each pick, H allowed while H <= 0.75 * (H + L):
    # (0,0) H | (300,0) 300 > 225 -> L | (300,300) H | (600,300) H | (900,300) 900 <= 900 H
    # (1200,300) 1200 > 1125 -> L | (1200,600) H H H (1500, 1800, 2100 <= 2100) | (2400,600) -> L | rest H
    expected = ["H0", "L0", "H1", "H2", "H3", "L1", "H4", "H5", "H6", "L2", "H7", "H8"]
    assert [e.request_id for e in q.ordered()] == expected
    assert serve_all(q) == expected
    assert q.band_served() == {}  # contention over: reset


async def test_higher_band_first_without_reserve() -> None:
    q = FairQueue(100, 10**9, {"H": TenantShare(1.0, band=0), "L": TenantShare(1.0, band=1)})
    q.push(req("L0", "L"))
    q.push(req("H0", "H"))
    q.push(req("H1", "H"))
    assert serve_all(q) == ["H0", "H1", "L0"]  # no min_share below: strict priority


async def test_bounds_and_tokens_ahead() -> None:
    q = FairQueue(3, 250, {"H": TenantShare(band=0), "L": TenantShare(band=1)})
    q.push(req("a", "L", prompt=100))
    q.push(req("b", "H", prompt=100))
    with pytest.raises(QueueFull) as err:
        q.push(req("c", "H", prompt=60))
    assert err.value.limit == "max_tokens"
    q.push(req("c", "H", prompt=50))
    with pytest.raises(QueueFull) as err:
        q.push(req("d", "H", prompt=1))
    assert err.value.limit == "max_requests"
    assert q.tokens_ahead(0) == 150 and q.tokens_ahead(1) == 250
    big = FairQueue(3, 100)
    big.push(req("big", "X", prompt=500))  # an oversize prompt still enters an empty queue
    assert len(big) == 1


async def test_expiry_and_remove_keep_accounts() -> None:
    q = FairQueue(10, 10**6, {"A": TenantShare(), "B": TenantShare()})
    a, b = req("a", "A", deadline_ms=100), req("b", "B", deadline_ms=200)
    q.push(a)
    q.push(b)
    assert q.next_deadline_ms() == 100
    assert [e.request_id for e in q.expire(150)] == ["a"]
    assert [e.request_id for e in q.ordered()] == ["b"]
    assert q.remove(b) and not q.remove(b)
    assert len(q) == 0 and q.tokens == 0 and q.next_deadline_ms() is None


async def test_bounded_bypass_then_hold() -> None:
    """A head that fits nowhere is passed by requests that fit until max_bypass passed it; then its
    hold replica (the only one here) is kept for it and the rest behind it waits."""
    q = FairQueue(100, 10**9, {"A": TenantShare(), "B": TenantShare()})
    big = req("big", "A", prompt=5000)
    q.push(big)
    for i in range(5):
        q.push(req(f"s{i}", "B", prompt=10))

    class Clk:
        scale = 1.0

        def now_ms(self) -> float:
            return 0.0

        def to_wall_s(self, ms: float) -> float:
            return ms / 1000

    admitted: list[str] = []

    async def admit(e: WaitingRequest, attempt: Attempt) -> str | None:
        if e.prompt_tokens > 1000 or "r0" in attempt.avoid:
            return None
        admitted.append(e.request_id)
        return e.request_id

    async def orphan(g: str) -> None:
        pass

    d: Dispatcher[str] = Dispatcher(queue=q, clock=Clk(), admit=admit, release_orphan=orphan, max_bypass=2,  # type: ignore[arg-type]
                                    hold_for=lambda e: "r0")
    stats = await d.dispatch_once()
    # s0 and s1 pass (passed_by reaches max_bypass 2), then r0 is held for the head at once
    assert admitted == ["s0", "s1"] and stats.held and big.passed_by == 2
    q.push(req("s5", "B", prompt=10))
    stats = await d.dispatch_once()
    assert admitted == ["s0", "s1"] and stats.held  # r0 is kept for the head


async def test_aged_lower_band_gets_the_floor_share() -> None:
    # H: band 0; L: band 1 with min_share 0. Every entry costs 100 + 2 * 100 = 300.
    q = FairQueue(100, 10**9, {"H": TenantShare(1.0, 0), "L": TenantShare(1.0, 1, 0.0)}, aging_floor_share=0.5)
    hs = [req(f"h{i}", "H") for i in range(4)]
    low = req("l", "L")
    low.promote_at_ms = 100.0  # arrival 0 + its class's ttft_ms 100
    for e in (*hs, low):
        q.push(e)
    # not aged (now 50): band 0's cap is 1 - 0 = 1, so L comes last
    assert [e.request_id for e in q.ordered(50.0)] == ["h0", "h1", "h2", "h3", "l"]
    assert [e.request_id for e in q.ordered()] == ["h0", "h1", "h2", "h3", "l"]  # no clock: no aging
    # aged (now 100): band 0's cap becomes 1 - 0.5. Pick 1: served 0 <= 0.5 * 0 -> h0; pick 2:
    # band 0 has 300 of 300 served > 0.5 * 300 -> band 1: l
    assert [e.request_id for e in q.ordered(100.0)] == ["h0", "l", "h1", "h2", "h3"]


async def test_merge_counters_and_reconfigure() -> None:
    q = FairQueue(10, 10**6, {"A": TenantShare(1.0)})
    q.charge("A", 100, 0)
    q.merge_counters({"A": 50.0, "B": 400.0})
    assert q.counters() == {"A": 100.0, "B": 400.0}
    q.set_tenants({"A": TenantShare(2.0)})
    assert q.charge("A", 100, 0) == 50.0
    with pytest.raises(ValueError):
        q.set_bounds(0, 1)
