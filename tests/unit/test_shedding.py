"""router/shedding.py: the predicted start of a prompt and the queue decision, worked by hand."""

from __future__ import annotations

import math

import pytest

from replica_agent.policy.pab import ClassBudget
from replica_agent.policy.time_model import TimeModel
from router.drain import DrainEstimator
from router.placement import ReplicaView
from router.shedding import agent_margin_ms, infeasible, predict_start, queue_decision

TM = TimeModel(10.0, 0.1, 0.0)


def view(decode_ms: float, inflight_ms: float, rid: str = "r0") -> ReplicaView:
    pab = 900.0 - decode_ms - inflight_ms
    cb = ClassBudget("c", 900.0, pab, TM.tokens_within_ms(pab), 10**6, 1000.0, 100.0, decode_ms, inflight_ms)
    return ReplicaView(rid, True, True, TM, {"c": cb}, 32768)


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
