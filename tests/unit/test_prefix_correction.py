"""router/prefix_correction.py: the prefix map discounted by the engines' measured hit ratio, by hand."""

from __future__ import annotations

import pytest

from router.prefix_correction import PrefixCorrection


def test_the_predicted_ratio_is_exponentially_weighted() -> None:
    c = PrefixCorrection(horizon=2)  # each new placement halves the old sums
    assert c.predicted_ratio("r0") is None
    c.record("r0", 600, 1000)
    assert c.predicted_ratio("r0") == 0.6
    c.record("r0", 200, 1000)
    # predicted 600 * 0.5 + 200 = 500 of prompt 1000 * 0.5 + 1000 = 1500
    assert c.predicted_ratio("r0") == pytest.approx(1 / 3)


def test_a_map_that_promises_twice_the_measured_hits_is_halved() -> None:
    c = PrefixCorrection(horizon=2)
    c.record("r0", 600, 1000)
    c.record("r0", 200, 1000)
    # measured 500 of 3000 queried = 1/6 against predicted 1/3: factor 0.5
    assert c.factor("r0", 3000, 500) == pytest.approx(0.5)
    measured = {"r0": (3000, 500), "r1": (0, 0)}
    out = c.discount({"r0": 801, "r1": 700}, measured.__getitem__)
    assert out == {"r0": 400, "r1": 700}  # floor(0.5 * 801); r1 never placed on: unchanged


def test_no_discount_when_unknown_or_when_the_engine_finds_more() -> None:
    c = PrefixCorrection(horizon=4)
    c.record("r0", 500, 1000)  # predicted 0.5
    assert c.factor("r0", 0, 0) == 1.0  # nothing measured
    assert c.factor("r0", 1000, 800) == 1.0  # 0.8 measured >= 0.5 predicted: capped at 1
    assert c.factor("r9", 1000, 0) == 1.0  # no placement there
    c.record("r1", 0, 1000)
    assert c.factor("r1", 1000, 0) == 1.0  # the map promised nothing: nothing to discount
    cached = {"r0": 900}
    assert c.discount(cached, lambda rid: (1000, 800)) is cached  # no allocation when nothing changes
    assert c.factor("r0", 1000, 0) == 0.0  # the engine found nothing of what the map promised
    c.forget("r0")
    assert c.predicted_ratio("r0") is None
    with pytest.raises(ValueError):
        PrefixCorrection(horizon=0)
