"""OnlineTimeModel: the fit converges on noise-free steps, the margin is the quantile worked out by
hand, an unexcited coefficient stays at the prior, the domain constraints hold."""

import math

import numpy as np
import pytest

from replica_agent.policy.calibration import CalibratorConfig, OnlineTimeModel, solve_ridge
from replica_agent.policy.time_model import StepFeatures, TimeModel

PRIOR = TimeModel(9.86, 0.0727, 7.94e-5)  # the llama-3-8b-a100 all_batches profile
TRUTH = TimeModel(11.0, 0.064, 9.0e-5, 3.6e-6, -0.02)  # an engine the profile mis-predicts: decodes at 0.044


def _steps(rng, n):
    """Random batches: decodes (contexts 128..4096) plus, in half of them, a prefill chunk over a prefix."""
    out = []
    for _ in range(n):
        items = [(1, int(rng.integers(128, 4096))) for _ in range(int(rng.integers(1, 64)))]
        if rng.random() < 0.5:
            items.append((int(rng.integers(64, 2048)), int(rng.choice([0, 1024, 4096, 16384]))))
        out.append(StepFeatures.from_items(items))
    return out


def test_converges_to_the_engine_on_noise_free_steps():
    rng = np.random.default_rng(7)
    cal = OnlineTimeModel(PRIOR)
    steps = _steps(rng, 800)
    for f in steps:
        cal.observe(f, TRUTH.step_ms(f))
    m = cal.model()
    # the prior's pull is kappa = 5 observations against 1 / (1 - 0.995) = 200 in memory, 5 / 205 = 2.4 %
    # of the prior's own error (10-37 % per step, the cross term below the worst): within 2 % on every step,
    # 1 % on average
    errs = [abs(m.step_ms(f) / TRUTH.step_ms(f) - 1) for f in _steps(rng, 200)]
    assert max(errs) < 0.02 and sum(errs) / len(errs) < 0.01
    # the prefill cross term was learned from zero: a 2048-token chunk at a 16k prefix
    big = StepFeatures.from_items([(2048, 16384)])
    assert TRUTH.step_ms(big) == pytest.approx(11 + 0.064 * 2048 + 9e-5 * 16384 + 3.6e-6 * 2048 * 16384)  # 253.35
    assert m.step_ms(big) == pytest.approx(TRUTH.step_ms(big), rel=0.02)
    assert PRIOR.step_ms(big) < 0.7 * TRUTH.step_ms(big)  # what the profile alone planned: 160 ms
    # after the early errors have left the window, the margin is ~1 (no error left to cover)
    assert 1.0 <= cal.margin() < 1.02
    assert cal.mean_abs_rel_error() < 0.01


def test_margin_is_the_quantile_of_measured_over_predicted():
    # a prior so strong the point model cannot move: each step's ratio is exactly the one fed
    cfg = CalibratorConfig(forgetting=1.0, prior_weight=1e12, margin_quantile=0.95, window=20, min_samples=10,
                           initial_margin=1.1)
    cal = OnlineTimeModel(PRIOR, cfg)
    f = StepFeatures.from_items([(1, 1000)] * 8)
    ratios = [1.0 + k / 100 for k in range(20)]  # 1.00 .. 1.19
    for k, r in enumerate(ratios):
        if k == 9:
            assert cal.margin() == 1.1  # 9 samples < min_samples: the initial margin
        cal.observe(f, PRIOR.step_ms(f) * r)
    # numpy's linear quantile of 20 sorted values at 0.95: position 0.95 * 19 = 18.05 -> 1.18 + 0.05 * 0.01
    assert cal.margin() == pytest.approx(1.1805)
    c = cal.conservative()
    assert c.a_ms == pytest.approx(9.86 * 1.1805) and c.b_ms_per_new_token == pytest.approx(0.0727 * 1.1805)
    q = cal.residual_quantiles((0.5,))
    assert q[0.5] == pytest.approx(0.095)  # median of 0.00 .. 0.19
    # optimistic errors never shrink the plan below the point model
    for _ in range(20):
        cal.observe(f, PRIOR.step_ms(f) * 0.8)
    assert cal.margin() == 1.0


def test_the_margin_is_capped():
    cal = OnlineTimeModel(PRIOR, CalibratorConfig(prior_weight=1e12, min_samples=1, max_margin=1.5))
    f = StepFeatures.from_items([(1, 1000)])
    cal.observe(f, PRIOR.step_ms(f) * 3.0)
    assert cal.margin() == 1.5


def test_decode_only_replica_leaves_e_at_the_prior():
    rng = np.random.default_rng(3)
    cal = OnlineTimeModel(PRIOR)
    for _ in range(400):  # batch sizes and mean contexts drawn apart, as in the profiles' batch mix
        mu = rng.uniform(128, 4096)
        f = StepFeatures.from_items([(1, int(max(16, rng.normal(mu, 0.3 * mu)))) for _ in range(int(rng.integers(1, 128)))])
        cal.observe(f, TRUTH.step_ms(f))
    m = cal.model()
    assert m.e_ms_per_chunk_prefix == 0.0  # never excited: no drift, no wind-up
    assert m.b_ms_per_new_token == pytest.approx(PRIOR.b_ms_per_new_token)  # nor the prefill token's cost
    f = StepFeatures.from_items([(1, 2000)] * 64)
    assert m.step_ms(f) == pytest.approx(TRUTH.step_ms(f), rel=0.01)  # decodes themselves are learned
    # the decode slope was learned as d: from the prior's 0.0727 most of the way (> 75 %) to the engine's
    # 0.064 - 0.02 = 0.044; the rest is the ridge's pull along a direction the batch size and the summed
    # context share (both grow with the batch)
    slope = m.b_ms_per_new_token + m.d_ms_per_decode
    assert 0.044 <= slope < 0.0727 - 0.75 * (0.0727 - 0.044)


def test_constraints_by_active_set():
    # data that says a < 0: y = 0.1 * new exactly, prior a = 10 with no weight -> a is fixed at 0
    xs = [(1.0, float(n), 0.0, 0.0, 0.0) for n in (10, 20, 40, 80)]
    a_mat = sum(np.outer(x, x) / (0.1 * x[1]) ** 2 for x in xs)
    g = sum(np.array(x) * (0.1 * x[1]) / (0.1 * x[1]) ** 2 for x in xs)
    w = len(xs)
    # shift: y = 0.1 * new - 0.5 would want a = -0.5; here a = 0 is exact anyway
    theta = solve_ridge(a_mat, g, w, np.array([10.0, 0.07, 0.07, 0.0, 0.0]), 1e-9)
    assert theta[0] == pytest.approx(0.0, abs=1e-6) and theta[1] == pytest.approx(0.1)
    g2 = sum(np.array(x) * (0.1 * x[1] - 0.5) / (0.1 * x[1]) ** 2 for x in xs)
    theta2 = solve_ridge(a_mat, g2, w, np.array([10.0, 0.07, 0.07, 0.0, 0.0]), 1e-9)
    assert theta2[0] == 0.0 and theta2[1] > 0  # the unconstrained a = -0.5 is clipped, b re-solved


def test_bad_observations_are_ignored_and_config_validated():
    cal = OnlineTimeModel(PRIOR)
    f = StepFeatures.from_items([(1, 100)])
    assert cal.observe(f, math.nan) is None and cal.observe(f, 0.0) is None
    assert cal.observe(StepFeatures.from_items([]), 10.0) is None
    assert cal.count == 0 and cal.model() is PRIOR and math.isnan(cal.mean_abs_rel_error())
    with pytest.raises(ValueError):
        CalibratorConfig(margin_quantile=1.0)
    with pytest.raises(ValueError):
        CalibratorConfig(initial_margin=3.0, max_margin=2.0)


def test_k_weighted_samples_of_one_step_add_one_entry_to_the_error_window() -> None:
    # proxy mode sees one step as k = 4 samples of weight 1/4: the window must hold one ratio per
    # step, so 20 such steps (80 samples) fill 20 entries, as 20 whole-step observations do
    prior = TimeModel(10.0, 0.1, 0.0)
    whole, split = OnlineTimeModel(prior), OnlineTimeModel(prior)
    f = StepFeatures(4, 400, 400, 4, 4, 0, 4)  # four decodes
    for i in range(20):
        ms = 12.0 + (i % 5)
        whole.observe(f, ms)
        for _ in range(4):
            split.observe(f, ms, weight=0.25)
    assert len(whole._ratios) == 20  # noqa: SLF001
    assert len(split._ratios) == 20  # noqa: SLF001


def test_refit_every_counts_steps_worth_of_weight_not_observations() -> None:
    # proxy mode: 4 streams see one step each (weight 1/4): 8 observations are 2 steps' worth, so with
    # refit_every=2 the model is solved after the 8th observation and not before (the prior stays until then)
    prior = TimeModel(9.86, 0.0727, 7.94e-5)
    cal = OnlineTimeModel(prior, CalibratorConfig(refit_every=2))
    f = StepFeatures(4, 4000, 0, 4, 4, 0, 4)  # 4 decodes
    for i in range(8):
        assert cal.model() is prior, i
        cal.observe(f, 40.0, 0.25)
    assert cal.model() is not prior


def test_folding_observations_at_refit_gives_the_sums_of_one_update_each() -> None:
    # 50 random steps of mixed weights: solving every step's worth and every 5 steps' worth must give the same
    # statistics and the same model at a common refit (the forgetting of each observation is the
    # product of the factors of the ones after it)
    import random

    prior = TimeModel(9.86, 0.0727, 7.94e-5)
    each, batched = OnlineTimeModel(prior, CalibratorConfig(refit_every=1)), OnlineTimeModel(
        prior, CalibratorConfig(refit_every=5))
    rng = random.Random(1)
    for _ in range(50):
        k = rng.randint(1, 8)
        f = StepFeatures(k + rng.randint(0, 500), rng.randint(0, 20000), rng.randint(0, 20000), k, k, 0, k)
        ms, w = rng.uniform(10.0, 60.0), rng.choice([1.0, 0.5, 0.25])
        each.observe(f, ms, w)
        batched.observe(f, ms, w)
    each._refit()  # noqa: SLF001 - a common refit (refits come every 1 and 5 steps' worth of weight)
    batched._refit()  # noqa: SLF001
    m1, m2 = each.model(), batched.model()
    for t1, t2 in zip((m1.a_ms, m1.b_ms_per_new_token, m1.c_ms_per_context_token, m1.d_ms_per_decode),
                      (m2.a_ms, m2.b_ms_per_new_token, m2.c_ms_per_context_token, m2.d_ms_per_decode), strict=True):
        assert t2 == pytest.approx(t1, rel=1e-9, abs=1e-12)


def _solve_ridge_every_pass_indexed(a_mat, g, n_obs, prior, kappa):
    """solve_ridge as it was before its first pass solved the whole system directly: every pass,
    the first included, through the active set's index (the reference for the test below)."""
    s = np.diag(a_mat) / n_obs
    s = np.where(s > 0, s, 1.0)
    reg = kappa * s
    lhs = a_mat + np.diag(reg)
    rhs = g + reg * prior
    floors = np.array([0.0, 1e-9, 1e-9, 0.0, 0.0])
    fixed = np.zeros(5, dtype=bool)
    theta = prior.copy()
    for _ in range(5):
        free = ~fixed
        theta_f = np.where(fixed, floors, 0.0)
        sub_rhs = rhs[free] - lhs[np.ix_(free, fixed)] @ theta_f[fixed]
        try:
            sol = np.linalg.solve(lhs[np.ix_(free, free)], sub_rhs)
        except np.linalg.LinAlgError:
            return prior.copy()
        theta = theta_f
        theta[free] = sol
        below = free & (theta < floors)
        if not below.any():
            return theta
        fixed |= below
        theta = np.maximum(theta, floors)
    return np.maximum(theta, floors)


def test_direct_first_pass_gives_the_same_bits_as_the_indexed_pass() -> None:
    """The first pass solves the whole system without the index: the same numbers, bit for bit, on
    random systems with and without binding floors (and on a singular one: the prior)."""
    rng = np.random.default_rng(12)
    prior = np.array([10.0, 0.07, 0.07, 0.0005, 0.0])
    bound = 0
    for _ in range(400):
        xs = rng.uniform(0.0, 1.0, (40, 5)) * np.array([1.0, 2000.0, 256.0, 60000.0, 1e6])
        xs[:, 0] = 1.0
        true = rng.normal(prior, np.abs(prior) * 2 + 0.01)
        y = np.maximum(0.5, xs @ true + rng.normal(0.0, 1.0, 40))
        w = 1.0 / y**2
        a_mat, g = (xs * w[:, None]).T @ xs, xs.T @ (w * y)
        kappa = float(rng.choice([0.0, 1e-9, 5.0]))
        got, ref = solve_ridge(a_mat, g, 40.0, prior, kappa), _solve_ridge_every_pass_indexed(a_mat, g, 40.0, prior,
                                                                                              kappa)
        assert got.tobytes() == ref.tobytes()
        bound += bool((ref <= np.array([0.0, 1e-9, 1e-9, 0.0, 0.0])).any())
    assert 20 < bound < 380  # both branches taken
    singular = np.zeros((5, 5))
    assert solve_ridge(singular, np.zeros(5), 1.0, prior, 0.0).tobytes() == prior.tobytes()


# ---- the prefill chunk^2 term f and the chunk length K (issue 27 item 7) ---------------------------

CHUNKY = TimeModel(10.0, 0.06, 8.0e-5, 3.0e-6, -0.02, 5.0e-6)  # an engine whose chunks cost f * chunk^2


def _chunky_steps(rng, n):
    """Decode batches, and in most steps one prefill chunk of 16..4096 tokens over a prefix (the chunk length
    varies independently of the rest, as FairBatching's and vLLM's chunks do)."""
    out = []
    for _ in range(n):
        items = [(1, int(rng.integers(128, 4096))) for _ in range(int(rng.integers(1, 64)))]
        if rng.random() < 0.8:
            items.append((int(rng.integers(16, 4096)), int(rng.choice([0, 1024, 4096]))))
        out.append(StepFeatures.from_items(items))
    return out


def test_chunk_length_is_the_forgetting_weighted_mean_chunk_by_hand() -> None:
    # forgetting 0.5, a solve every step: a 100-token chunk, then a 300-token one (weight 1 each):
    # K = (0.5 * 100^2 + 300^2) / (0.5 * 100 + 300) = 95,000 / 350 = 271.43 tokens
    cal = OnlineTimeModel(PRIOR, CalibratorConfig(forgetting=0.5, refit_every=1))
    assert cal.chunk_tokens() == 0.0  # the prior's before any prefill
    cal.observe(StepFeatures.from_items([(100, 0)]), 20.0)
    assert cal.chunk_tokens() == pytest.approx(100.0)
    cal.observe(StepFeatures.from_items([(300, 0), (1, 500)]), 40.0)  # the decode adds nothing to K
    assert cal.chunk_tokens() == pytest.approx(95_000 / 350)
    assert cal.model().chunk_tokens == pytest.approx(95_000 / 350)
    # folded every 2 steps (refit_every 2) the sums are the same
    two = OnlineTimeModel(PRIOR, CalibratorConfig(forgetting=0.5, refit_every=2))
    two.observe(StepFeatures.from_items([(100, 0)]), 20.0)
    two.observe(StepFeatures.from_items([(300, 0), (1, 500)]), 40.0)
    assert two.chunk_tokens() == pytest.approx(95_000 / 350)
    # a decode-only step decays both sums alike: K unchanged
    cal.observe(StepFeatures.from_items([(1, 500)] * 4), 15.0)
    assert cal.chunk_tokens() == pytest.approx(95_000 / 350)


def test_learns_the_chunk_sq_term_and_the_one_step_error_vanishes() -> None:
    rng = np.random.default_rng(11)
    with_f = OnlineTimeModel(PRIOR, CalibratorConfig(prior_weight=1e-6))
    without = OnlineTimeModel(PRIOR, CalibratorConfig(prior_weight=1e-6, chunk_sq_term=False))
    for f in _chunky_steps(rng, 600):
        with_f.observe(f, CHUNKY.step_ms(f))
        without.observe(f, CHUNKY.step_ms(f))
    m = with_f.model()
    assert m.f_ms_per_chunk_sq == pytest.approx(5.0e-6, rel=1e-3)
    assert m.b_ms_per_new_token == pytest.approx(0.06, rel=1e-3)
    assert m.e_ms_per_chunk_prefix == pytest.approx(3.0e-6, rel=1e-2)
    assert without.model().f_ms_per_chunk_sq == 0.0
    # one step ahead on fresh steps: exact with f; without it, small chunks over-priced and big ones under
    fresh = _chunky_steps(rng, 300)
    err_f = [abs(CHUNKY.step_ms(f) / m.step_ms(f) - 1) for f in fresh]
    assert max(err_f) < 1e-3
    m5 = without.model()

    def signed(lo, hi):
        sel = [f for f in fresh if lo <= f.prefill_chunk_sq_tokens ** 0.5 < hi]
        return sum(CHUNKY.step_ms(f) / m5.step_ms(f) - 1 for f in sel) / len(sel)

    assert signed(16, 1024) < -0.01 and signed(3072, 4096) > 0.02  # the residual grows with the chunk
    assert with_f.mean_abs_rel_error() < 1e-3 < without.mean_abs_rel_error()


def test_chunk_sq_term_off_is_the_five_term_model() -> None:
    # chunk_sq_term=False: f stays at the prior's and a, b, d, c, e are the five-term ridge solution of the
    # same observations (solve_ridge on the 5 x 5 statistics, built here by hand)
    rng = np.random.default_rng(5)
    cal = OnlineTimeModel(PRIOR, CalibratorConfig(chunk_sq_term=False, forgetting=1.0, refit_every=1, prior_weight=5.0))
    a_mat, g = np.zeros((5, 5)), np.zeros(5)
    for f in _chunky_steps(rng, 120):
        y = CHUNKY.step_ms(f)
        cal.observe(f, y)
        x = np.array([1.0, f.new_tokens - f.num_decodes, f.num_decodes, f.context_tokens, f.prefill_chunk_prefix_tokens])
        a_mat += np.outer(x, x) / y**2
        g += x / y
    theta = solve_ridge(a_mat, g, 120.0, np.array([9.86, 0.0727, 0.0727, 7.94e-5, 0.0]), 5.0)
    m = cal.model()
    got = [m.a_ms, m.b_ms_per_new_token, m.b_ms_per_new_token + m.d_ms_per_decode, m.c_ms_per_context_token,
           m.e_ms_per_chunk_prefix]
    assert got == pytest.approx(list(theta), rel=1e-7)
    assert m.f_ms_per_chunk_sq == 0.0 and m.prompt_ms_per_token == m.b_ms_per_new_token


def test_decode_only_replica_leaves_f_and_k_at_the_prior() -> None:
    prior = TimeModel(9.86, 0.0727, 7.94e-5, f_ms_per_chunk_sq=2e-6, chunk_tokens=700.0)
    cal = OnlineTimeModel(prior)
    rng = np.random.default_rng(3)
    for _ in range(300):
        f = StepFeatures.from_items([(1, int(rng.integers(128, 4096))) for _ in range(int(rng.integers(1, 128)))])
        cal.observe(f, CHUNKY.step_ms(f))
    m = cal.model()
    assert m.f_ms_per_chunk_sq == pytest.approx(2e-6) and m.chunk_tokens == 700.0
    assert m.prompt_ms_per_token == pytest.approx(m.b_ms_per_new_token + 2e-6 * 700)
