"""Residual tracker of the time model (replica_agent/policy/residuals.py), hand-worked."""

from __future__ import annotations

import pytest

from replica_agent.policy.residuals import ResidualTracker
from replica_agent.policy.time_model import TimeModel


def test_exact_predictions_keep_the_model() -> None:
    r = ResidualTracker()
    for _ in range(10):
        assert r.observe(20.0, 20.0) == 0.0
    m = TimeModel(10, 0.1, 0.001)
    assert r.inflation_factor() == 1.0 and r.inflate(m) is m


def test_ewma_and_threshold() -> None:
    r = ResidualTracker(alpha=0.5, threshold=0.15, max_inflation=2.0)
    assert r.observe(100.0, 150.0) == pytest.approx(0.5)  # first seeds: bias = mag = 0.5
    assert (r.bias, r.magnitude) == (pytest.approx(0.5), pytest.approx(0.5))
    assert r.inflation_factor() == pytest.approx(1.5)
    r.observe(100.0, 90.0)  # e = -0.1: bias 0.5 + 0.5*(-0.1 - 0.5) = 0.2; mag 0.5 + 0.5*(0.1 - 0.5) = 0.3
    assert (r.bias, r.magnitude) == (pytest.approx(0.2), pytest.approx(0.3))
    m = r.inflate(TimeModel(10, 0.1, 0.001))  # x 1.3
    assert (m.a_ms, m.b_ms_per_new_token, m.c_ms_per_context_token) == (
        pytest.approx(13.0), pytest.approx(0.13), pytest.approx(0.0013))  # fmt: skip
    r.observe(100.0, 100.0)  # mag 0.15 -> at the threshold: back to 1
    assert r.magnitude == pytest.approx(0.15) and r.inflation_factor() == 1.0
    assert r.max_abs == pytest.approx(0.5) and r.count == 3


def test_inflation_is_capped() -> None:
    r = ResidualTracker(max_inflation=1.3)
    r.observe(10.0, 40.0)  # e = 3
    assert r.inflation_factor() == 1.3


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        ResidualTracker(alpha=0)
    with pytest.raises(ValueError):
        ResidualTracker(max_inflation=0.5)
    with pytest.raises(ValueError):
        ResidualTracker().observe(0.0, 1.0)
