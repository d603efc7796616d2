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


def test_chunk_sq_term_by_hand():
    from replica_agent.policy.time_model import StepFeatures

    # two decodes (contexts 100 and 200), a 300-token chunk over a 50-token prefix, a 2-token chunk at 0
    f = StepFeatures.from_items([(1, 100), (1, 200), (300, 50), (2, 0)])
    assert f.prefill_chunk_sq_tokens == 300 * 300 + 2 * 2 == 90_004  # decodes (chunk 1) left out
    assert f.chunk_sq_tokens == f.prefill_chunk_sq_tokens + f.num_decodes
    tm = TimeModel(10.0, 0.1, 0.001, 1e-4, -0.05, 1e-5, 500.0)
    # new 304, context 350, prefill chunk x prefix 15,000, 2 decodes, prefill chunk^2 90,004:
    # 10 + 30.4 + 0.35 + 1.5 - 0.1 + 0.90004
    assert tm.step_ms(f) == pytest.approx(43.05004)
    assert tm.batch_ms(304, 350, 15_000, 2, 90_004) == pytest.approx(43.05004)
    # a prompt token is priced at the chunk length K = 500: b' = 0.1 + 1e-5 * 500 = 0.105
    assert tm.prompt_ms_per_token == pytest.approx(0.105)
    # 1,000 fresh tokens in two chunks of 500: the second reads the first, 500 x 500 pairs at e = 1e-4
    assert tm.prefill_ms(1000) == pytest.approx(10 + 105.0 + 25.0)
    # a prompt of K tokens or fewer runs in one chunk: no cross term
    assert tm.prefill_ms(500) == pytest.approx(10 + 52.5) and tm.tokens_within_ms(62.5) == 500
    # the last 600 tokens over 400 computed, in chunks 500 + 100: 10 + 0.105*600 + 0.001*400
    # + 1e-4*(600*400 + 100*500)
    assert tm.prefill_ms(1000, 400) == pytest.approx(10 + 63 + 0.4 + 29)
    # 999 tokens: chunks 500 + 499, 249,500 pairs: 10 + 104.895 + 24.95 = 139.845
    assert tm.prefill_ms(999) == pytest.approx(139.845)
    assert tm.tokens_within_ms(140.0) == 1000 and tm.tokens_within_ms(139.99) == 999
    assert tm.tokens_within_ms(139.845) == 999 and tm.tokens_within_ms(139.84) == 998
    # f = 0 (the profiles): b' = b whatever K
    assert TimeModel(10.0, 0.1, 0.001, chunk_tokens=500.0).prompt_ms_per_token == 0.1


def test_linearized_prices_prompts_and_decodes_as_the_full_model():
    from replica_agent.policy.time_model import StepFeatures

    tm = TimeModel(10.0, 0.1, 0.001, 1e-4, -0.05, 1e-5, 500.0)
    lin = tm.linearized()
    # b' = 0.105, f gone, K kept (the cross term), d shifted so that a decode still costs b + d = 0.05
    assert (lin.a_ms, lin.b_ms_per_new_token, lin.c_ms_per_context_token, lin.e_ms_per_chunk_prefix) == (
        10.0, pytest.approx(0.105), 0.001, 1e-4)
    assert (lin.f_ms_per_chunk_sq, lin.chunk_tokens) == (0.0, 500.0)
    assert lin.b_ms_per_new_token + lin.d_ms_per_decode == pytest.approx(0.05)
    for p, c in ((1, 0), (1000, 0), (1000, 400), (7777, 5000)):
        assert lin.prefill_ms(p, c) == pytest.approx(tm.prefill_ms(p, c))
    for budget in (5.0, 10.0, 115.0, 900.0):
        assert lin.tokens_within_ms(budget) == tm.tokens_within_ms(budget)
    decodes = StepFeatures.from_items([(1, 100)] * 8)
    assert lin.step_ms(decodes) == pytest.approx(tm.step_ms(decodes))
    # a model without f is its own linearization (the profiles, the routers' views)
    plain = TimeModel(10.0, 0.1, 0.001)
    assert plain.linearized() is plain


def test_scaled_keeps_the_chunk_length_and_validation():
    tm = TimeModel(10.0, 0.1, 0.001, 1e-4, -0.05, 1e-5, 500.0).scaled(2.0)
    assert (tm.a_ms, tm.f_ms_per_chunk_sq, tm.chunk_tokens) == (20.0, 2e-5, 500.0)
    assert tm.prompt_ms_per_token == pytest.approx(0.21)  # the margin scales the prompt price too
    with pytest.raises(ValueError):
        TimeModel(10.0, 0.1, 0.001, f_ms_per_chunk_sq=-1e-9)
    with pytest.raises(ValueError):
        TimeModel(10.0, 0.1, 0.001, chunk_tokens=-1.0)
    with pytest.raises(ValueError):
        TimeModel(10.0, 0.1, 0.001, f_ms_per_chunk_sq=float("nan"))


def test_chunk_cross_tokens_counts_the_pairs_between_chunks():
    from replica_agent.policy.time_model import chunk_cross_tokens

    # 2,500 tokens in chunks of 1,000: 1,000 / 1,000 / 500; the second reads 1,000 earlier tokens per
    # token, the third 2,000: 1,000*1,000 + 500*2,000
    assert chunk_cross_tokens(2500, 1000.0) == 2_000_000
    # 3 full chunks of 4: 4*4 + 4*8 = 48 = (144 - 3*16 - 0) / 2
    assert chunk_cross_tokens(12, 4.0) == 48
    # one chunk (R <= K) or no chunk length (K = 0, the profiles): none
    assert chunk_cross_tokens(1000, 1000.0) == 0.0 and chunk_cross_tokens(999, 1000.0) == 0.0
    assert chunk_cross_tokens(10_000, 0.0) == 0.0
    # a fractional K (the online model's mean chunk): 10 tokens at K = 4.5: chunks 4.5 / 4.5 / 1, so
    # 4.5*4.5 + 1*9 = 29.25
    assert chunk_cross_tokens(10, 4.5) == pytest.approx(29.25)
    # it grows as R^2 / 2 for R >> K
    assert chunk_cross_tokens(100_000, 100.0) / (100_000**2 / 2) == pytest.approx(1.0, abs=2e-3)


def test_tokens_within_ms_is_the_exact_inverse_of_the_price():
    """For random models with the cross-chunk term (fractional K included) and budgets at, just under and
    between prices: prefill_ms(P) fits the budget and prefill_ms(P + 1) does not (within 1e-9 of it),
    checked against the price itself, not against the inverse's own arithmetic."""
    import random

    rng = random.Random(20261207)
    for _ in range(3000):
        tm = TimeModel(rng.choice([0.0, 10.0, 28.6]), rng.choice([0.05, 0.0726711, 0.0867]), 0.0,
                       rng.choice([3.3e-6, 2.9e-6, 1e-5, 1e-4]), f_ms_per_chunk_sq=rng.choice([0.0, 3e-6]),
                       chunk_tokens=rng.choice([1.0, 4.5, 256.0, 871.6, 2048.0]))  # fmt: skip
        p = rng.randint(0, 40_000)
        budget = rng.choice([tm.prefill_ms(p), tm.prefill_ms(p) - 1e-3, tm.prefill_ms(p) + rng.uniform(0, 50.0),
                             rng.uniform(0.0, 6000.0)])  # fmt: skip
        n = tm.tokens_within_ms(budget)
        limit = budget + 1e-9 * max(1.0, budget)
        if budget <= tm.a_ms:
            assert n == 0
            continue
        assert tm.prefill_ms(n) <= limit, (tm, budget, n)
        assert tm.prefill_ms(n + 1) > limit, (tm, budget, n)
        if budget == tm.prefill_ms(p):  # a budget at a price gives that prompt; 1e-3 ms under it, one less
            assert n == p
        elif budget == tm.prefill_ms(p) - 1e-3 and p > 0:
            assert n == p - 1
