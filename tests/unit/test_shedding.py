"""router/shedding.py: the predicted start of a prompt and the queue decision, worked by hand."""

from __future__ import annotations

import math

import pytest

from replica_agent.policy.pab import ClassBudget
from replica_agent.policy.time_model import TimeModel
from router.drain import DrainEstimator
from router.placement import ReplicaView
from router.shedding import agent_margin_ms, infeasible, lump_start_ms, predict_start, priced_tokens, queue_decision

TM = TimeModel(10.0, 0.1, 0.0)


def view(decode_ms: float, inflight_ms: float, rid: str = "r0", lumps: tuple[float, ...] = (),
         done_at: tuple[float, ...] = ()) -> ReplicaView:
    pab = 900.0 - decode_ms - inflight_ms
    cb = ClassBudget("c", 900.0, pab, TM.tokens_within_ms(pab), 10**6, 1000.0, 100.0, decode_ms, inflight_ms)
    return ReplicaView(rid, True, True, TM, {"c": cb}, 32768, lumps, done_at)


def stalled_drain(rid: str, reserved: float) -> DrainEstimator:
    """Two snapshots 100 ms apart with the reservation unchanged: measured drain rate 0."""
    d = DrainEstimator()
    d.observe(rid, 0.0, {"c": reserved})
    d.observe(rid, 100.0, {"c": reserved})
    assert d.rate(rid, "c") == 0.0
    return d


def test_an_admitted_prefill_bounds_the_wait_though_the_drain_reads_zero() -> None:
    # H = 900, a 4360-token prefill in flight (b*P = 436 ms; a lease), nothing decoding: PAB = 464.
    # P = 5000 -> prefill 10 + 500 = 510 ms; deficit 510 - 464 = 46 <= 436: the wait is at most the
    # in-flight work at full speed, 436 ms (the measured drain rate, 0, would say never)
    w, p = predict_start([view(0.0, 436.0)], stalled_drain("r0", 436.0), "c", 5000, 0)
    assert (w, p) == (pytest.approx(436.0), pytest.approx(510.0))
    # decodes hold half of every step (PAB 14): P = 4000 (410 ms) lacks 396 <= 436; the prefill work
    # runs at half speed, 2 x 436
    w2, _ = predict_start([view(450.0, 436.0)], stalled_drain("r0", 886.0), "c", 4000, 0)
    assert w2 == pytest.approx(872.0)
    # a deficit larger than what is in flight: nothing bounds it but the drain rate (0 -> inf)
    w3, _ = predict_start([view(0.0, 436.0)], stalled_drain("r0", 436.0), "c", 9000, 0)
    assert math.isinf(w3)
    # no usable view: no prediction
    assert predict_start([], DrainEstimator(), "c", 10, 0) is None


def test_lump_start_by_hand() -> None:
    # the docstring's case: prefill 155, reserved 581.4 in two lumps of 290.7, horizon left 448
    lumps = (290.7, 290.7)
    assert math.isinf(lump_start_ms(155.0, 581.4, 448.0, lumps, (1150.0, 1460.0), 1000.0))
    # the first lump ends in 2 ms, but the router sees it free 5 ms from now at the earliest
    # (LUMP_SEEN_MS): 155 + 290.7 = 445.7 > 448 - 5 = 443; the second, 155 > 448 - 460: inf
    assert math.isinf(lump_start_ms(155.0, 581.4, 448.0, lumps, (1002.0, 1460.0), 1000.0))
    # with 3 ms more of horizon: 445.7 <= 451 - 5 = 446 -> 5 ms
    assert lump_start_ms(155.0, 581.4, 451.0, lumps, (1002.0, 1460.0), 1000.0) == pytest.approx(5.0)
    # a lump already due but still listed frees no sooner: the same two answers (the bench_backlog
    # case: 155.2 + 290.7 = 445.9 with 448.5 left, the lump 1.1 ms overdue, was queued, then shed)
    assert math.isinf(lump_start_ms(155.2, 581.4, 448.5, lumps, (998.9, 1317.4), 1000.0))
    assert lump_start_ms(155.0, 581.4, 451.0, lumps, (990.0, 1460.0), 1000.0) == pytest.approx(5.0)
    # an agent that pushes at once (seen_ms 0) lets a due lump free now, as before
    assert lump_start_ms(155.0, 581.4, 448.0, lumps, (990.0, 1460.0), 1000.0, seen_ms=0.0) == 0.0
    # both needed: 155 + 0 <= 448 - 200 at 200 ms
    assert lump_start_ms(155.0, 581.4, 448.0, lumps, (1100.0, 1200.0), 1000.0) == pytest.approx(200.0)


def test_the_deficit_frees_in_the_lumps_the_snapshot_lists() -> None:
    # H = 900; two in-flight prefills of 300 and 136 ms (436 in all) predicted to end at t = 1400 and
    # 1700; decodes hold 450 ms (PAB 14). Now t = 1000.
    v = view(450.0, 436.0, lumps=(300.0, 136.0), done_at=(1400.0, 1700.0))
    # P = 1000 -> prefill 110 ms: at 1400, 110 + 886 - 300 = 696 <= 900 - 400 = 500? no; at 1700,
    # 110 + 450 = 560 <= 900 - 700? no: it cannot start in time here (the drain rate, 1 ms/ms, said 96)
    w, p = predict_start([v], stalled_drain("r0", 886.0), "c", 1000, 0, now_ms=1000.0)
    assert math.isinf(w) and p == pytest.approx(110.0)
    # decodes holding 100 ms (reserved 536, PAB 364), the first lump ending at 1100. P = 4000 (410 ms):
    # now 946 > 900; at 1100, 410 + 536 - 300 = 646 <= 900 - 100 -> 100 ms
    v2 = view(100.0, 436.0, lumps=(300.0, 136.0), done_at=(1100.0, 1700.0))
    assert predict_start([v2], DrainEstimator(), "c", 4000, 0, now_ms=1000.0)[0] == pytest.approx(100.0)
    # it waited 160 ms already: 646 <= 740 - 100 = 640? no; at 1700 410 + 100 <= 740 - 700? no -> inf
    assert math.isinf(predict_start([v2], DrainEstimator(), "c", 4000, 0, now_ms=1000.0, waited_ms=160.0)[0])
    # fits now: 0; the smallest wait over the replicas: an idle second replica takes it at once
    assert predict_start([v2], DrainEstimator(), "c", 3000, 0, now_ms=1000.0)[0] == 0.0  # 310 + 536 <= 900
    assert predict_start([v, view(0.0, 0.0, "r1")], DrainEstimator(), "c", 1000, 0, now_ms=1000.0)[0] == 0.0
    # without the predicted ends (an older agent) or without a clock: the measured drain, a fresh
    # estimator's 1 ms/ms -> 110 - 14 = 96 ms
    assert predict_start([view(450.0, 436.0, lumps=(300.0, 136.0))], DrainEstimator(), "c", 1000, 0,
                         now_ms=1000.0)[0] == pytest.approx(96.0)  # fmt: skip
    assert predict_start([v], DrainEstimator(), "c", 1000, 0)[0] == pytest.approx(96.0)


def test_queue_decision_by_hand() -> None:
    views = [view(0.0, 436.0)]
    pred = predict_start(views, stalled_drain("r0", 436.0), "c", 5000, 0)  # (436, 510)
    margin = agent_margin_ms(views, "c")
    assert margin == 100.0  # ttft 1000 - horizon 900
    # TTFT 1000: 0 + 436 + 510 = 946 > 1000 - 100: refused at arrival
    d = queue_decision(0.0, 0.0, 1000.0, 2000.0, True, pred, margin)
    assert d.refuse and d.expire_reason == "slo-infeasible" and d.wait_ms == pytest.approx(436.0)
    # TTFT 2000: feasible; it may wait until 2000 - 510 = 1490, before the 2000 ms queue limit
    d = queue_decision(0.0, 0.0, 2000.0, 2000.0, True, pred, margin)
    assert not d.refuse and (d.deadline_ms, d.expire_reason) == (pytest.approx(1490.0), "slo-infeasible")
    # not sheddable: only the queue limit
    d = queue_decision(0.0, 0.0, 1000.0, 2000.0, False, pred, margin)
    assert not d.refuse and (d.deadline_ms, d.expire_reason) == (2000.0, "queue-timeout")
    assert infeasible(500.0, 1000.0, pred, margin) and not infeasible(0.0, 2000.0, pred, margin)
    assert not infeasible(0.0, 0.0, None, margin)


def test_priced_tokens_are_what_is_left_on_the_warmest_replica() -> None:
    assert priced_tokens(100, None) == 100 and priced_tokens(100, {}) == 100  # no map: the whole prompt
    assert priced_tokens(100, {"r0": 30, "r1": 70}) == 30  # r1 holds 70: 30 left to compute there
    assert priced_tokens(100, {"r0": 250}) == 0  # never below 0


def slot_view(decode_ms: float, inflight_ms: float, slot_ms: float, rid: str = "r0",
              lumps: tuple[float, ...] = (), done_at: tuple[float, ...] = ()) -> ReplicaView:
    """A budget as the agent sends it with the engine at max_num_seqs: PAB = max(0, H - s - reservations)."""
    pab = max(0.0, 900.0 - slot_ms - decode_ms - inflight_ms)
    cb = ClassBudget("c", 900.0, pab, TM.tokens_within_ms(pab), 10**6, 1000.0, 100.0, decode_ms, inflight_ms, 0, 0,
                     slot_ms)
    return ReplicaView(rid, True, True, TM, {"c": cb}, 32768, lumps, done_at)


def test_a_full_engine_waits_for_a_sequence_slot() -> None:
    # H = 900, decodes 400 ms, a slot frees in 300 ms: the agent sends PAB = 900 - 300 - 400 = 200.
    # P = 2900 (300 ms) lacks 100 of that PAB, but the slot wait passes with time: without it the
    # budget is 900 - 400 = 500 >= 300, so the prompt waits for the slot alone, 300 ms, even though
    # the measured drain rate is 0 (dividing the slot wait by it would say never)
    full = slot_view(400.0, 0.0, 300.0)
    w, p = predict_start([full], stalled_drain("r0", 400.0), "c", 2900, 0)
    assert (w, p) == (pytest.approx(300.0), pytest.approx(300.0))
    # 300 + 300 ms is inside the 1000 ms TTFT less the 100 ms margin: queued, not refused
    assert not queue_decision(0.0, 0.0, 1000.0, 5000.0, True, (w, p), 100.0).refuse
    # the same with the in-flight lumps listed (an admitted 100 ms prefill ending at 50 ms): the budget
    # without the slot, 900 - 400 - 100 = 400 >= 300, is there; the slot wait decides again
    lumpy = slot_view(400.0, 100.0, 300.0, lumps=(100.0,), done_at=(50.0,))
    assert predict_start([lumpy], stalled_drain("r0", 500.0), "c", 2900, 0, now_ms=0.0)[0] == pytest.approx(300.0)
    # the budget without the slot is short too (P = 5900: 600 ms > 500): the drain decides, here never
    assert math.isinf(predict_start([full], stalled_drain("r0", 400.0), "c", 5900, 0)[0])
    # a replica with a free slot is taken at once
    free = view(0.0, 0.0, "r1")
    assert predict_start([full, free], DrainEstimator(), "c", 1000, 0)[0] == 0.0
    # no finish promised (inf): refused as slo-infeasible
    w_inf, _ = predict_start([slot_view(0.0, 0.0, math.inf)], DrainEstimator(), "c", 1000, 0)
    assert math.isinf(w_inf) and queue_decision(0.0, 0.0, 1000.0, 5000.0, True, (w_inf, 110.0), 100.0).refuse
