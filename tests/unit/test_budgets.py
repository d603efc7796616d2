"""router/budgets.py: freshness by TTL on the router clock, Reserve answers applied at once, wake-ups."""

from __future__ import annotations

import asyncio

import pytest

from proto import admission_pb2
from router.budgets import BudgetBook
from tests.fakes import FakeClock




def snapshot(rid: str = "r0", seq: int = 1, pab_ms: float = 300.0, healthy: bool = True, ttl_ms: int = 500,
             max_prompt: int = 8192) -> admission_pb2.BudgetSnapshot:
    return admission_pb2.BudgetSnapshot(
        replica_id=rid, seq=seq, timestamp_ms=0, ttl_ms=ttl_ms, healthy=healthy, max_prompt_tokens=max_prompt,
        coefficients=admission_pb2.TimeModelCoefficients(a_ms=10, b_ms_per_new_token=0.1, c_ms_per_context_token=0),
        classes=[admission_pb2.ClassBudget(
            slo_class="interactive", ttft_ms=500, tpot_ms=50, horizon_ms=450, pab_ms=pab_ms,
            pab_tokens=int((pab_ms - 10) / 0.1), kv_free_tokens=100000, kv_limited_tokens=100000,
        )],
    )


def test_fresh_within_ttl_then_stale() -> None:
    clock = FakeClock(1000.0)
    book = BudgetBook(clock, ["r0", "r1"])  # type: ignore[arg-type]
    assert book.usable("r0", "interactive") is None  # nothing received
    assert book.update("r0", snapshot())
    assert book.usable("r0", "interactive").pab_ms == 300.0
    clock.t += 500
    assert book.usable("r0", "interactive") is not None  # exactly ttl old: still fresh
    clock.t += 1
    assert book.usable("r0", "interactive") is None
    views = {v.replica_id: v for v in book.views()}
    assert not views["r0"].fresh and not views["r1"].fresh
    assert views["r0"].max_prompt_tokens == 8192
    assert book.age_ms("r0") == 501 and book.age_ms("r1") is None


def test_unhealthy_is_zero_budget() -> None:
    book = BudgetBook(FakeClock(1000.0), ["r0"])  # type: ignore[arg-type]
    book.update("r0", snapshot(healthy=False))
    assert book.usable("r0", "interactive") is None
    assert not book.views()[0].healthy


def test_old_seq_ignored_and_unknown_replica() -> None:
    book = BudgetBook(FakeClock(1000.0), ["r0"])  # type: ignore[arg-type]
    assert book.update("r0", snapshot(seq=5, pab_ms=300))
    assert not book.update("r0", snapshot(seq=4, pab_ms=100))
    assert book.usable("r0", "interactive").pab_ms == 300
    assert not book.update("rX", snapshot(rid="rX"))


def test_disconnect_makes_stale_and_restart_accepts_lower_seq() -> None:
    book = BudgetBook(FakeClock(1000.0), ["r0"])  # type: ignore[arg-type]
    book.update("r0", snapshot(seq=9))
    book.mark_disconnected("r0")
    assert book.usable("r0", "interactive") is None
    assert book.update("r0", snapshot(seq=1, pab_ms=200))  # agent restarted
    assert book.usable("r0", "interactive").pab_ms == 200


def test_reserve_answer_applied_at_once() -> None:
    book = BudgetBook(FakeClock(1000.0), ["r0"])  # type: ignore[arg-type]
    book.update("r0", snapshot(pab_ms=450))
    before = book.usable("r0", "interactive")
    assert before.inflight_reservation_ms == 0
    book.apply_reserve("r0", "interactive", 250.0, 2400)
    after = book.usable("r0", "interactive")
    assert (after.pab_ms, after.pab_tokens) == (250.0, 2400)
    assert after.inflight_reservation_ms == 200.0  # the lease counts as reserved until the next snapshot
    book.apply_reserve("r0", "batch", 1.0, 1)  # unknown class: ignored
    book.apply_reserve("rX", "interactive", 1.0, 1)  # unknown replica: ignored


async def test_waiters_and_listeners_woken_on_every_change() -> None:
    book = BudgetBook(FakeClock(1000.0), ["r0"])  # type: ignore[arg-type]
    calls: list[int] = []
    book.add_listener(lambda: calls.append(book.version))
    waiter = asyncio.create_task(book.wait_changed(1.0))
    await asyncio.sleep(0)
    book.update("r0", snapshot())
    assert await waiter is True
    book.apply_reserve("r0", "interactive", 100.0, 900)
    book.notify()
    assert calls == [1, 2, 3]
    assert await book.wait_changed(0.01) is False


def test_take_local_deducts_predicted_prefill_before_the_answer() -> None:
    book = BudgetBook(FakeClock(1000.0), ["r0"])  # type: ignore[arg-type]
    book.update("r0", snapshot(pab_ms=300))  # pab_tokens 2900
    book.take_local("r0", "interactive", 1000)  # 10 + 0.1 * 1000 = 110 ms
    b = book.usable("r0", "interactive")
    assert (b.pab_ms, b.pab_tokens, b.inflight_reservation_ms) == (190.0, 1900, 110.0)
    book.apply_reserve("r0", "interactive", 195.0, 1850)  # the agent's figures win
    b = book.usable("r0", "interactive")
    assert (b.pab_ms, b.pab_tokens) == (195.0, 1850)


def test_inflight_lumps_come_from_the_snapshot_then_the_routers_own_placements() -> None:
    book = BudgetBook(FakeClock(1000.0), ["r0"])  # type: ignore[arg-type]
    snap = snapshot()
    snap.inflight_prefill_ms.extend([40.0, 25.0])
    snap.inflight_prefill_done_ms.extend([50.0, 80.0])  # ms after the snapshot: router clock 1050, 1080
    book.update("r0", snap)
    v = book.views()[0]
    assert (v.inflight_prefill_ms, v.inflight_prefill_done_at_ms) == ((40.0, 25.0), (1050.0, 1080.0))
    # its lump is b * P = 100 ms (no a: it rides in a batch), ending 100 ms after the last one
    book.take_local("r0", "interactive", 1000)
    v = book.views()[0]
    assert (v.inflight_prefill_ms, v.inflight_prefill_done_at_ms) == ((40.0, 25.0, 100.0), (1050.0, 1080.0, 1180.0))
    for _ in range(20):  # bounded at MAX_LOCAL_LUMPS = 16 entries: the rest join the last one
        book.take_local("r0", "interactive", 10)
    v = book.views()[0]
    assert len(v.inflight_prefill_ms) == len(v.inflight_prefill_done_at_ms) == 16
    assert v.inflight_prefill_ms[-1] == pytest.approx(1.0 + 7) and sum(v.inflight_prefill_ms) == pytest.approx(185.0)
    assert v.inflight_prefill_done_at_ms[-1] == pytest.approx(1180.0 + 20)
    # the next snapshot replaces them; ends without lumps of the same count are dropped
    bad = snapshot(seq=2)
    bad.inflight_prefill_ms.extend([40.0])
    bad.inflight_prefill_done_ms.extend([50.0, 60.0])
    book.update("r0", bad)
    v = book.views()[0]
    assert (v.inflight_prefill_ms, v.inflight_prefill_done_at_ms) == ((40.0,), ())


def test_an_answer_keeps_the_takes_still_awaiting_theirs() -> None:
    # a = 10, b = 0.1 ms/token; PAB 300 ms / 2900 tokens. Placements A (1000 tokens, 110 ms) and C
    # (500 tokens, 60 ms) both on r0 before A's answer: A's answer (the agent saw only A: 190 ms,
    # 1900 tokens) must leave C deducted: 190 - 60 = 130 ms, 1900 - 500 = 1400 tokens
    book = BudgetBook(FakeClock(1000.0), ["r0"])  # type: ignore[arg-type]
    book.update("r0", snapshot(pab_ms=300))
    book.take_local("r0", "interactive", 1000, awaiting_key="A")
    book.take_local("r0", "interactive", 500, awaiting_key="C")
    b = book.usable("r0", "interactive")
    assert (b.pab_ms, b.pab_tokens) == (130.0, 1400)
    book.forget_take("r0", "A")  # A's answer came (router/core.py: forget_take, then apply_reserve)
    book.apply_reserve("r0", "interactive", 190.0, 1900)
    b = book.usable("r0", "interactive")
    assert (b.pab_ms, b.pab_tokens) == (pytest.approx(130.0), 1400)
    # a snapshot (agent before C: PAB 250, 2400 tokens) is read minus C too: 190 ms, 1900 tokens
    book.update("r0", snapshot(seq=2, pab_ms=250))
    b = book.usable("r0", "interactive")
    assert (b.pab_ms, b.pab_tokens) == (pytest.approx(190.0), 1900)
    # C's answer (the agent saw both: 130 ms, 1400 tokens) ends it; nothing awaits any more
    book.forget_take("r0", "C")
    book.apply_reserve("r0", "interactive", 130.0, 1400)
    b = book.usable("r0", "interactive")
    assert (b.pab_ms, b.pab_tokens) == (130.0, 1400)
    book.update("r0", snapshot(seq=3, pab_ms=130))
    assert book.usable("r0", "interactive").pab_ms == 130.0


def test_a_reserve_without_answer_stops_being_deducted() -> None:
    book = BudgetBook(FakeClock(1000.0), ["r0"])  # type: ignore[arg-type]
    book.update("r0", snapshot(pab_ms=300))
    book.take_local("r0", "interactive", 1000, awaiting_key="A")
    book.forget_take("r0", "A")  # the Reserve failed: the next snapshot's figures stand alone
    book.update("r0", snapshot(seq=2, pab_ms=300))
    assert book.usable("r0", "interactive").pab_ms == 300.0


def test_the_slot_wait_comes_with_the_snapshot_and_survives_a_local_take() -> None:
    book = BudgetBook(FakeClock(1000.0), ["r0"])  # type: ignore[arg-type]
    snap = snapshot(pab_ms=300)
    snap.classes[0].slot_wait_ms = 120.0  # the agent: the engine is at max_num_seqs, a slot frees in 120 ms
    book.update("r0", snap)
    assert book.usable("r0", "interactive").slot_wait_ms == 120.0
    book.take_local("r0", "interactive", 1000)
    assert book.usable("r0", "interactive").slot_wait_ms == 120.0
    # an old agent sends none (0 = a free slot); a negative figure from a broken one counts as 0
    snap2 = snapshot(seq=2, pab_ms=300)
    snap2.classes[0].slot_wait_ms = -5.0
    book.update("r0", snap2)
    assert book.usable("r0", "interactive").slot_wait_ms == 0.0


def test_snapshot_time_model_prices_as_sent_and_drops_non_finite_coefficients():
    from proto import admission_pb2
    from router.budgets import snapshot_time_model

    tm = snapshot_time_model(admission_pb2.TimeModelCoefficients(
        a_ms=10.0, b_ms_per_new_token=0.1, c_ms_per_context_token=0.0, e_ms_per_chunk_prefix=1e-4, chunk_tokens=500.0))
    # 1,000 tokens in two chunks of 500: 10 + 100 + 1e-4 * 500 * 500
    assert tm is not None and tm.prefill_ms(1000) == pytest.approx(135.0)
    # an older agent sends no e or K (proto3 zeros): the linear price, as before
    old = snapshot_time_model(admission_pb2.TimeModelCoefficients(a_ms=10.0, b_ms_per_new_token=0.1))
    assert old is not None and old.prefill_ms(1000) == 110.0
    for bad in ({"chunk_tokens": float("inf")}, {"e_ms_per_chunk_prefix": float("nan")}, {"a_ms": float("inf")}):
        fields = {"a_ms": 10.0, "b_ms_per_new_token": 0.1, **bad}
        assert snapshot_time_model(admission_pb2.TimeModelCoefficients(**fields)) is None
    assert snapshot_time_model(admission_pb2.TimeModelCoefficients(a_ms=10.0, b_ms_per_new_token=0.0)) is None
