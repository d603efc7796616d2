"""router/drain.py: the drain rate of a replica's reservations, hand-worked."""

from __future__ import annotations

import math

import pytest

from router.drain import DrainEstimator, wait_for_budget_ms


def test_drain_rate_counts_what_this_router_added() -> None:
    d = DrainEstimator(alpha=0.3, min_dt_ms=5.0)
    assert d.rate("r0", "k") is None
    d.observe("r0", 0.0, {"k": 500.0})
    assert d.rate("r0", "k") is None  # one snapshot: no rate yet
    d.note_added("r0", 100.0)
    # 100 ms later 450 reserved: freed = 500 + 100 - 450 = 150 ms in 100 ms -> 1.5 ms/ms
    d.observe("r0", 100.0, {"k": 450.0})
    assert d.rate("r0", "k") == pytest.approx(1.5)
    # nothing freed in the next 100 ms: sample 0 -> EWMA 1.5 + 0.3 * (0 - 1.5) = 1.05
    d.observe("r0", 200.0, {"k": 450.0})
    assert d.rate("r0", "k") == pytest.approx(1.05)
    # a snapshot 2 ms later is merged into the next one (min_dt_ms 5)
    d.observe("r0", 202.0, {"k": 0.0})
    assert d.rate("r0", "k") == pytest.approx(1.05)
    # reservations that grew (work admitted by another router) count as 0 freed, never negative
    d.observe("r0", 300.0, {"k": 900.0})
    assert d.rate("r0", "k") == pytest.approx(1.05 * 0.7)
    d.forget("r0")
    assert d.rate("r0", "k") is None
    with pytest.raises(ValueError):
        DrainEstimator(alpha=0.0)


def test_wait_for_budget() -> None:
    assert wait_for_budget_ms(210.0, 1.05) == pytest.approx(200.0)
    assert wait_for_budget_ms(-5.0, 0.0) == 0.0  # nothing missing
    assert wait_for_budget_ms(10.0, 0.0) == math.inf  # nothing frees
    assert wait_for_budget_ms(10.0, None) == 10.0  # unknown: 1 ms/ms
