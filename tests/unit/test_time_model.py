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


def test_step_features_from_items_by_hand():
    from replica_agent.policy.time_model import StepFeatures

    # two decodes at contexts 100 and 300, one 512-token chunk over a 1024-token prefix
    f = StepFeatures.from_items([(1, 100), (1, 300), (512, 1024)])
    assert (f.new_tokens, f.context_tokens, f.num_seqs) == (514, 1424, 3)
    assert f.chunk_prefix_tokens == 100 + 300 + 512 * 1024  # 524,688
    assert f.chunk_sq_tokens == 1 + 1 + 512 * 512  # 262,146
    assert f.prefill_chunk_prefix_tokens == 512 * 1024  # decodes (chunk 1) left out
    with pytest.raises(ValueError):
        StepFeatures.from_items([(-1, 0)])


def test_chunk_prefix_term_by_hand():
    from replica_agent.policy.time_model import StepFeatures

    tm = TimeModel(10.0, 0.07, 8e-5, 1e-7)
    f = StepFeatures.from_items([(2048, 16384)])
    # 10 + 0.07*2048 + 8e-5*16384 + 1e-7*2048*16384 = 10 + 143.36 + 1.31072 + 3.3554432
    assert tm.step_ms(f) == pytest.approx(158.0261632)
    # prefill of the last 2048 tokens of an 18432-token prompt in one iteration is the same step
    assert tm.prefill_ms(18432, 16384) == pytest.approx(158.0261632)
    # e defaults to 0: the profiles' linear model is unchanged
    assert TimeModel(10.0, 0.07, 8e-5).prefill_ms(18432, 16384) == pytest.approx(10 + 143.36 + 1.31072)
    with pytest.raises(ValueError):
        TimeModel(10.0, 0.07, 8e-5, -1e-9)
