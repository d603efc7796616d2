"""router/placement/scorers/reserve_fit.py, worked by hand.

Time model a = 10 ms, b = 0.1 ms/token; horizon 450 ms. A 1,000-token prompt needs 10 + 100 = 110 ms,
so a replica with PAB x ms keeps h = (x - 110) / 450 of the horizon.
"""

from __future__ import annotations

import pytest

from router.placement import PlacementRequest, default_registry
from router.placement.core import PlacementPolicy
from router.placement.scorers.reserve_fit import ReserveFitScorer
from tests.unit.test_placement import replica

REQ = PlacementRequest("interactive", 1000, frozenset())


def test_scores_above_and_below_the_reserve() -> None:
    s = ReserveFitScorer(0.3)
    # PAB 380: h = 270 / 450 = 0.6 >= 0.3 -> 2 - 0.6 = 1.4
    assert s.score(REQ, replica("r0", 380.0)) == pytest.approx(1.4)
    # PAB 245: h = 135 / 450 = 0.3 (at the reserve, inclusive) -> 1.7
    assert s.score(REQ, replica("r1", 245.0)) == pytest.approx(1.7)
    # PAB 200: h = 90 / 450 = 0.2 < 0.3 -> 0.2 - 1 = -0.8
    assert s.score(REQ, replica("r2", 200.0)) == pytest.approx(-0.8)
    with pytest.raises(ValueError):
        ReserveFitScorer(1.5)


def test_packs_above_the_reserve_then_spreads_below_it() -> None:
    reg = default_registry()
    chain = reg.build("pab-chain")
    policy = PlacementPolicy(chain.filters, [(ReserveFitScorer(0.3), 1.0)], chain.picker)
    # h: r0 0.6, r1 0.3, r2 0.2, r3 0.1 -> r1 (least above the reserve), r0, then r2 (most below), r3
    reps = [replica("r0", 380.0), replica("r1", 245.0), replica("r2", 200.0), replica("r3", 155.0)]
    assert policy.place(REQ, reps).candidates[:4] == ("r1", "r0", "r2", "r3")
    # all below the reserve: worst fit, as the default pab profile
    low = [replica("r2", 200.0), replica("r3", 155.0)]
    assert policy.place(REQ, low).candidates[:2] == ("r2", "r3")
