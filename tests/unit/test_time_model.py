"""Batch-time model and its least-squares fit (replica_agent/policy/time_model.py)."""

from __future__ import annotations

import numpy as np
import pytest

from replica_agent.policy.time_model import TimeModel, fit_time_model


def test_fit_recovers_known_coefficients_from_noisy_points():
    rng = np.random.default_rng(1234)
    a, b, c = 9.8, 0.07, 8e-5
    new = rng.integers(1, 4096, size=400).astype(float)
    ctx = rng.integers(0, 200_000, size=400).astype(float)
    y = a + b * new + c * ctx
    y_noisy = y * (1 + rng.normal(0.0, 0.01, size=y.size))
    fit = fit_time_model(new, ctx, y_noisy)
    assert fit.model.a_ms == pytest.approx(a, rel=0.05)
    assert fit.model.b_ms_per_new_token == pytest.approx(b, rel=0.02)
    assert fit.model.c_ms_per_context_token == pytest.approx(c, rel=0.05)
    assert fit.r2 > 0.99
    assert fit.n == 400
    assert fit.max_rel_err < 0.06


def test_fit_exact_points():
    new = [1, 100, 1, 500]
    ctx = [0, 0, 1000, 2000]
    y = [10 + 0.1 * n + 0.001 * k for n, k in zip(new, ctx)]
    fit = fit_time_model(new, ctx, y)
    assert fit.model.a_ms == pytest.approx(10.0)
    assert fit.model.b_ms_per_new_token == pytest.approx(0.1)
    assert fit.model.c_ms_per_context_token == pytest.approx(0.001)
    assert fit.max_rel_err == pytest.approx(0.0, abs=1e-9)


@pytest.mark.parametrize(
    "new,ctx,y",
    [
        ([1, 2], [0, 1], [1.0, 2.0]),  # too few points
        ([1, 2, 3], [0, 1], [1.0, 2.0, 3.0]),  # mismatched lengths
        ([1, 2, 3], [0, 1, 2], [1.0, 0.0, 3.0]),  # non-positive time
        ([5, 5, 5, 5], [0, 1, 2, 3], [1.0, 2.0, 3.0, 4.0]),  # new_tokens constant: degenerate
    ],
)
def test_bad_input_raises(new, ctx, y):
    with pytest.raises(ValueError):
        fit_time_model(new, ctx, y)


def test_model_predictions_and_validation():
    tm = TimeModel(10.0, 0.1, 0.001)
    assert tm.batch_ms(100, 1000) == pytest.approx(21.0)
    assert tm.prefill_ms(1000, 400) == pytest.approx(10 + 60 + 0.4)
    assert tm.tokens_within_ms(20.0) == 100
    assert tm.tokens_within_ms(10.0) == 0
    with pytest.raises(ValueError):
        TimeModel(1.0, 0.0, 0.0)
    with pytest.raises(ValueError):
        TimeModel(-1.0, 0.1, 0.0)
