"""router/work_shed.py: the work of a request, the contention share, the quantile refusal (hand-worked)."""

from __future__ import annotations

import math

import pytest

from replica_agent.policy.time_model import TimeModel
from router.placement import ReplicaView
from router.work_shed import WorkShed, WorkShedSettings, refuse_by_work, request_work_ms, views_time_model

TM = TimeModel(10.0, 0.1, 0.001, 0.0001, 0.05)  # a, b, c, e, d


def test_request_work_by_hand() -> None:
    # P = 100, O = 3: b*P = 10; e*P^2/2 = 0.0001 * 10000 / 2 = 0.5; O*(b + d) = 3 * 0.15 = 0.45;
    # c*(O*P + O*(O-1)/2) = 0.001 * (300 + 3) = 0.303; a (the step's) not charged: 11.253
    assert request_work_ms(TM, 100, 3) == pytest.approx(11.253)
    # no decode: only the prefill terms; a prompt of 0 tokens with 1 decode: b + d = 0.15
    assert request_work_ms(TM, 100, 0) == pytest.approx(10.5)
    assert request_work_ms(TM, 0, 1) == pytest.approx(0.15)
    assert request_work_ms(TM, -5, -1) == 0.0


def test_no_contention_refuses_nothing() -> None:
    gate = WorkShed(WorkShedSettings(gain=2.0, max_share=0.5, window=4, horizon=10, min_samples=1))
    assert not any(gate.arrive(w) for w in (1.0, 1000.0, 1e9))
    assert gate.contention_share == 0.0 and gate.threshold_ms() == math.inf


def test_share_quantile_and_window_by_hand() -> None:
    gate = WorkShed(WorkShedSettings(gain=2.0, max_share=0.5, window=4, horizon=10, min_samples=2))
    assert gate.arrive(5.0) is False  # q = 0: threshold inf
    gate.budget_refused()  # s = 0 + 1/10
    assert gate.contention_share == pytest.approx(0.1)
    assert gate.refuse_share() == pytest.approx(0.2)
    assert gate.arrive(10.0) is False  # 1 sample < min_samples 2; then s = 0.1 * 0.9 = 0.09
    assert gate.contention_share == pytest.approx(0.09)
    # q = 2 * 0.09 = 0.18; works [5, 10]: k = ceil(0.82 * 2) = 2 -> threshold 10; 20 > 10 refused
    assert gate.threshold_ms() == 10.0
    assert gate.arrive(20.0) is True  # s = 0.081
    # q = 0.162; works [5, 10, 20]: k = ceil(0.838 * 3) = ceil(2.514) = 3 -> 20; 7 kept
    assert gate.threshold_ms() == 20.0
    assert gate.arrive(7.0) is False  # s = 0.0729; works [5, 7, 10, 20]
    assert gate.arrive(1.0) is False  # window 4: 5 (the oldest) leaves -> [1, 7, 10, 20]; s = 0.06561
    assert gate.contention_share == pytest.approx(0.06561)
    # q = 0.13122: k = ceil(0.86878 * 4) = ceil(3.475) = 4 -> 20
    assert gate.threshold_ms() == 20.0
    for _ in range(10):  # s = 0.06561 + 1 = capped at 1; q = min(0.5, 2) = 0.5: k = ceil(0.5 * 4) = 2 -> 7
        gate.budget_refused()
    assert gate.contention_share == 1.0
    assert gate.threshold_ms() == 7.0
    assert gate.arrive(7.0) is False and gate.arrive(7.5) is True  # refused above, never at, the quantile


def test_the_share_decays_per_arrival() -> None:
    gate = WorkShed(WorkShedSettings(horizon=4, min_samples=1))
    gate.budget_refused()  # 0.25
    for _ in range(3):
        gate.arrive(1.0)
    assert gate.contention_share == pytest.approx(0.25 * 0.75**3)


@pytest.mark.parametrize("kw", [{"gain": 0.0}, {"max_share": 0.0}, {"max_share": 1.0}, {"window": 0},
                                {"horizon": 0}, {"min_samples": 0}])  # fmt: skip
def test_settings_refuse_bad_values(kw: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        WorkShedSettings(**kw)  # type: ignore[arg-type]


def test_refuse_by_work_prices_on_the_first_usable_view() -> None:
    other = TimeModel(10.0, 1.0, 0.0)
    stale = ReplicaView("r0", True, False, other, {})
    view = ReplicaView("r1", True, True, TM, {})
    assert views_time_model([stale, view]) is TM
    assert views_time_model([stale]) is None
    gate = WorkShed(WorkShedSettings(gain=10.0, max_share=0.5, window=8, horizon=10, min_samples=1))
    assert refuse_by_work(gate, [stale], 100, 3) is False  # not priced, not counted
    assert len(gate._sorted) == 0
    assert refuse_by_work(gate, [stale, view], 100, 0) is False  # 10.5 ms; s = 0
    gate.budget_refused()  # s = 0.1 -> q = 0.5: threshold = the 1-sample median 10.5
    assert refuse_by_work(gate, [view], 100, 3) is True  # 11.253 > 10.5
    assert refuse_by_work(gate, [view], 50, 0) is False  # 5.125
