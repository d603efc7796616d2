"""Online calibration of the batch-time model and its conservative margin (pure: no I/O, no clock).

Why: FairBatching fills each step up to its time budget and PAB admits up to the TTFT horizon, so
both are only as good as the step-time prediction (arXiv 2510.14392, "batch time model"; the
design's rule "time prediction must be calibrated continuously"). A profile fitted offline is off
on a real replica by 5-30 % per step (docs/engine-time-model.md), mostly in one direction for a given
batch shape. This module learns the coefficients from observed steps and plans with a prediction
that is conservative by a margin learned from the recent errors, always on, with no threshold.

Model: ``y = x . theta`` with ``x = (1, prefill_tokens, num_decodes, context_tokens,
prefill_chunk_prefix_tokens, prefill_chunk_sq_tokens)`` and ``theta = (a, b, b + d, c, e, f)``
(:class:`~replica_agent.policy.time_model.TimeModel`; ``prefill_tokens = new_tokens - num_decodes``).
``f`` prices each prefill chunk's squared length (issue 27 item 7): without it a linear ``b`` charges
every chunk at the chunk size it was fitted on, and the one-step-ahead error depends on the chunk size
(docs/evaluation.md "Online time model on two engine models": -4 to -8 % on chunks under 2,048 tokens,
+7 to +20 % on chunks over 4,096; its largest error, 6.6 %, came to 1.4 % with ``f``). The
model also keeps ``K``, the mean chunk length its prefill tokens ran in,
``K = sum lam^(n-i) v_i q_i / sum lam^(n-i) v_i p_i`` (``q_i`` = prefill_chunk_sq_tokens, ``p_i`` =
prefill_tokens, ``v_i`` the observation's weight), the chunk length prompts are priced at
(``TimeModel.chunk_tokens``: a prompt token costs ``b + f * K``, which is what the linear fit charged).
A prefill token and a decode each get their own coefficient, so a stretch of decode-only steps
(all that proxy mode can time) teaches the decode cost and leaves the prefill cost where it was:
with one coefficient for both, ``b`` would slide to the decode slope (0.043 against 0.073 ms
per token for Llama-3-8B A100) and every prefill would be under-priced by 40 %.

Fit: exponentially weighted, relative-error least squares with a ridge prior at the profile,

    theta_n = argmin  sum_i lam^(n-i) w_i (y_i - x_i . theta)^2  +  kappa * sum_j s_j (theta_j - theta0_j)^2

with ``w_i = 1 / y_i^2`` (each step's squared *relative* error, as the profiles were fitted),
``lam`` the forgetting factor (memory ``1 / (1 - lam)`` steps), and ``s_j = A_jj / N`` the
mean per observation of ``w x_j^2`` (``A = sum lam^(n-i) w_i x_i x_i^T``, ``N = sum lam^(n-i)``
the observations in memory), so ``kappa`` counts the prior as that many observations in every
direction, in the units of the data. This is recursive least squares with forgetting (the same sufficient statistics ``A`` and
``g = sum lam^(n-i) w_i x_i y_i``, updated in O(16) per step) solved in closed form; the ridge
term replaces RLS's initial covariance and, unlike it, does not fade. That is the fix for RLS's
known failure under forgetting, covariance wind-up when a direction is not excited (a replica
that only decodes for an hour says nothing about ``e``): such a coefficient stays at the prior
instead of drifting. Coefficients are kept in the TimeModel's domain (a, c, e >= 0, b > 0) by an
active set: a coefficient the unconstrained solution puts below its floor is fixed there and the
rest re-solved (at most 5 passes).

Margin: for each step, before the update, ``r = measured / predicted`` with the current point
model (a one-step-ahead, out-of-sample error); observations with a weight below 1 (a step seen as k
samples of weight 1/k) add one entry to the window per unit of weight. ``margin = clamp(quantile_q(r over the last
window steps), 1, max_margin)``; until ``min_samples`` steps are seen it is ``initial_margin``.
The planning model is the point model with every coefficient times ``margin``
(:meth:`OnlineTimeModel.conservative`), so a step of the shape just seen runs longer than planned
in about ``1 - q`` of the cases. ``q = 0.97`` by default: issue 12 asks for fewer than 5 % of steps
longer than planned.

``CalibratorConfig.chunk_sq_term = False`` drops ``f`` (its feature is taken as 0, so it stays at the
prior's and the other five coefficients are solved exactly as without it): the model before issue 27.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np

from replica_agent.policy.time_model import StepFeatures, TimeModel

_B_FLOOR = 1e-9  # TimeModel needs b > 0 and b + d > 0
N_TERMS = 6
_FLOORS = np.array([0.0, _B_FLOOR, _B_FLOOR, 0.0, 0.0, 0.0])
_FLOORS.flags.writeable = False
TERMS = ("a", "b", "d", "c", "e", "f")
"""Names of the TimeModel coefficients the calibrator exports (``d`` = decode cost - b)."""


@dataclass(frozen=True, slots=True)
class CalibratorConfig:
    """Settings of :class:`OnlineTimeModel` (module docstring for the formulas).

    Attributes:
        forgetting: lam in (0, 1]: weight of a step seen k steps ago is lam^k (0.995: memory ~200 steps).
        prior_weight: kappa >= 0: the profile counts as this many observations in every direction
            (1 since issue 27: at 5 the prior's pull kept the chunk^2 term and the prices of a profile
            far from the engine short of the data; docs/evaluation.md "Online time model").
        margin_quantile: q in (0.5, 1): the margin is this quantile of measured / predicted.
        window: steps of relative errors kept for the quantiles (>= 8).
        min_samples: steps before the learned margin replaces ``initial_margin`` (>= 1).
        initial_margin: margin before ``min_samples`` steps (>= 1; default 1: the profile as it is,
            for the well under a second of steps a replica needs to learn its own).
        max_margin: cap of the margin (>= initial_margin).
        refit_every: solve the normal equations and recompute the margin every this many steps' worth
            of observations (>= 1; an observation of weight w counts w, so proxy mode's k per-stream
            samples of one step count as one step, as in plugin mode and the fleet simulation; the
            statistics and the error window are updated at every observation).
        chunk_sq_term: learn ``f``, the prefill chunk^2 term (module docstring); False: the five-term
            model of before issue 27 (f stays at the prior's).
    """

    forgetting: float = 0.995
    prior_weight: float = 1.0
    margin_quantile: float = 0.97
    window: int = 256
    min_samples: int = 16
    initial_margin: float = 1.0
    max_margin: float = 2.0
    refit_every: int = 1
    chunk_sq_term: bool = True

    def __post_init__(self) -> None:
        if not 0.0 < self.forgetting <= 1.0:
            raise ValueError(f"forgetting must be in (0, 1], got {self.forgetting}")
        if self.prior_weight < 0:
            raise ValueError(f"prior_weight must be >= 0, got {self.prior_weight}")
        if not 0.5 < self.margin_quantile < 1.0:
            raise ValueError(f"margin_quantile must be in (0.5, 1), got {self.margin_quantile}")
        if self.window < 8 or self.min_samples < 1 or self.refit_every < 1:
            raise ValueError("need window >= 8, min_samples >= 1, refit_every >= 1")
        if not 1.0 <= self.initial_margin <= self.max_margin:
            raise ValueError(f"need 1 <= initial_margin <= max_margin, got {self.initial_margin}, {self.max_margin}")


def features_vector(f: StepFeatures, chunk_sq: bool = True) -> tuple[float, float, float, float, float, float]:
    """``x = (1, prefill_tokens, num_decodes, context_tokens, prefill_chunk_prefix_tokens,
    prefill_chunk_sq_tokens)`` of one step (the last 0 when ``chunk_sq`` is False)."""
    return (1.0, float(f.new_tokens - f.num_decodes), float(f.num_decodes), float(f.context_tokens),
            float(f.prefill_chunk_prefix_tokens), float(f.prefill_chunk_sq_tokens) if chunk_sq else 0.0)  # fmt: skip


def _theta(tm: TimeModel) -> np.ndarray:
    return np.array([tm.a_ms, tm.b_ms_per_new_token, tm.b_ms_per_new_token + tm.d_ms_per_decode,
                     tm.c_ms_per_context_token, tm.e_ms_per_chunk_prefix, tm.f_ms_per_chunk_sq])  # fmt: skip


def _model(theta: np.ndarray, chunk_tokens: float = 0.0) -> TimeModel:
    b = max(_B_FLOOR, float(theta[1]))
    return TimeModel(float(theta[0]), b, float(theta[3]), float(theta[4]), max(_B_FLOOR, float(theta[2])) - b,
                     float(theta[5]), chunk_tokens)  # fmt: skip


def solve_ridge(a_mat: np.ndarray, g: np.ndarray, n_obs: float, prior: np.ndarray, kappa: float) -> np.ndarray:
    """The constrained minimiser of the module docstring's objective.

    Args:
        a_mat: ``A``, shape (6, 6); g: ``g``, shape (6,); n_obs: ``N``, observations in memory (> 0);
            prior: ``theta0``, shape (6,); kappa: prior weight (observations).

    Returns:
        theta, shape (6,), with theta[1], theta[2] >= 1e-9 and the others >= 0 (a system of the first
        k < 6 terms gives shape (k,)).
    """
    s = np.diag(a_mat) / n_obs
    s = np.where(s > 0, s, 1.0)
    reg = kappa * s
    lhs = a_mat + np.diag(reg)
    rhs = g + reg * prior
    floors = _FLOORS[: g.shape[0]]  # (a 5-term system, as before f, solves the same way)
    # first pass, nothing fixed yet: the whole system as it is (the general pass below would solve the
    # same matrix, copied by the index, against rhs - 0, i.e. the same numbers)
    try:
        theta = np.linalg.solve(lhs, rhs)
    except np.linalg.LinAlgError:
        return prior.copy()
    fixed = theta < floors
    if not fixed.any():
        return theta
    theta = np.maximum(theta, floors)
    for _ in range(g.shape[0] - 1):
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


def _quantile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolation quantile of a sorted non-empty list (numpy's default method)."""
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (pos - lo) * (sorted_values[hi] - sorted_values[lo])


class OnlineTimeModel:
    """Learns a, b, c, d, e, f (and the chunk length K) from observed steps and gives the conservative planning model.

    Args:
        prior: the profile's coefficients (the starting point and the ridge anchor).
        config: settings (defaults: :class:`CalibratorConfig`).

    Attributes:
        count: steps observed.
    """

    def __init__(self, prior: TimeModel, config: CalibratorConfig | None = None) -> None:
        self.prior = prior
        self.config = config or CalibratorConfig()
        self._theta0 = _theta(prior)
        self._a = np.zeros((N_TERMS, N_TERMS))
        self._g = np.zeros(N_TERMS)
        self._n = 0.0
        self._chunk_sq = 0.0  # sum lam^(n-i) v_i * prefill_chunk_sq_tokens_i (module docstring, K)
        self._chunk_tok = 0.0  # sum lam^(n-i) v_i * prefill_tokens_i
        self._model = prior
        self._ratios: deque[float] = deque(maxlen=self.config.window)
        self._margin_cache: float | None = None
        self._conservative: TimeModel | None = None
        self._since_fit = 0.0  # steps' worth of observations since the last refit
        self._step_share = 0.0  # weight seen since the error window's last entry
        self._pending: list[tuple[tuple[float, ...], float, float, float, float]] = []  # (x, w, y, lam, weight)
        self.count = 0

    def observe(self, features: StepFeatures, measured_ms: float, weight: float = 1.0) -> float | None:
        """Feed one executed step; returns measured / predicted by the model before the update.

        Args:
            features: what the step computed.
            measured_ms: its duration (ms), > 0 and finite, else the step is ignored (None returned).
            weight: this observation's share of one step (proxy mode sees one step from each of
                its k streams: weight 1/k each), in (0, 1].
        """
        if not (measured_ms > 0 and math.isfinite(measured_ms)) or features.new_tokens <= 0 or not weight > 0:
            return None
        x = features_vector(features, self.config.chunk_sq_term)
        predicted = self._model.step_ms(features)
        ratio = measured_ms / predicted if predicted > 0 else math.inf
        lam = self.config.forgetting if weight == 1.0 else self.config.forgetting**weight  # per step, not per share
        # folded into A, g and N at the next refit (:meth:`_fold`): the same sums, one numpy pass per
        # refit instead of an outer product per observation (proxy mode observes every relayed token)
        self._pending.append((x, weight / (measured_ms * measured_ms), measured_ms, lam, weight))
        self.count += 1
        # the error window holds one ratio per step: proxy mode's k samples of one step (weight 1/k
        # each) add one entry, not k (k entries would shorten the window's memory to window / k steps)
        self._step_share += weight
        if math.isfinite(ratio) and self._step_share >= 1.0 - 1e-9:
            self._ratios.append(ratio)
            self._step_share = 0.0
        self._since_fit += weight
        if self._since_fit >= self.config.refit_every - 1e-9:
            self._refit()
        return ratio if math.isfinite(ratio) else None

    def _fold(self) -> None:
        """Add the pending observations to ``A``, ``g`` and ``N``, exactly as one update each in
        order would: observation i of k is discounted by the product of the forgetting factors of
        the observations after it, and the old sums by the product of all k."""
        pending = self._pending
        if not pending:
            return
        if len(pending) == 1:  # one update as it is (refit_every 1)
            x, w, y, lam, weight = pending.pop()
            xv = np.array(x)
            self._a = lam * self._a + w * np.outer(xv, xv)
            self._g = lam * self._g + (w * y) * xv
            self._n = lam * self._n + weight
            self._chunk_sq = lam * self._chunk_sq + weight * x[5]
            self._chunk_tok = lam * self._chunk_tok + weight * x[1]
            return
        lams = np.array([p[3] for p in pending])
        after = np.ones(len(pending))  # prod of lam_j for j > i
        if len(pending) > 1:
            after[:-1] = np.cumprod(lams[::-1])[::-1][1:]
        total = float(np.prod(lams))
        xs = np.array([p[0] for p in pending])  # (k, 6)
        w = np.array([p[1] for p in pending]) * after
        y = np.array([p[2] for p in pending])
        v = after * np.array([p[4] for p in pending])  # observation weights, discounted
        self._a = total * self._a + (xs * w[:, None]).T @ xs
        self._g = total * self._g + xs.T @ (w * y)
        self._n = total * self._n + float(v.sum())
        self._chunk_sq = total * self._chunk_sq + float(v @ xs[:, 5])
        self._chunk_tok = total * self._chunk_tok + float(v @ xs[:, 1])
        pending.clear()

    def _refit(self) -> None:
        self._since_fit = 0.0
        self._margin_cache = None
        self._fold()
        theta = solve_ridge(self._a, self._g, self._n, self._theta0, self.config.prior_weight)
        self._model = _model(theta, self.chunk_tokens())
        self._conservative = None

    def chunk_tokens(self) -> float:
        """K: the mean chunk length of the prefill tokens in memory (tokens; module docstring); the
        prior's ``chunk_tokens`` before any prefill step is seen."""
        if self._chunk_tok > 0.0:
            return self._chunk_sq / self._chunk_tok
        return self.prior.chunk_tokens

    def model(self) -> TimeModel:
        """The point estimate (the prior until the first step)."""
        return self._model

    def margin(self) -> float:
        """The planning margin: ``clamp(quantile_q(measured / predicted), 1, max_margin)`` (module docstring)."""
        if self._margin_cache is None:
            cfg = self.config
            if len(self._ratios) < cfg.min_samples:
                self._margin_cache = cfg.initial_margin
            else:
                q = _quantile(sorted(self._ratios), cfg.margin_quantile)
                self._margin_cache = min(cfg.max_margin, max(1.0, q))
        return self._margin_cache

    def conservative(self) -> TimeModel:
        """The model to plan with: every coefficient of :meth:`model` times :meth:`margin`."""
        if self._conservative is None:
            self._conservative = self._model.scaled(self.margin())
        return self._conservative

    def residual_quantiles(self, qs: tuple[float, ...] = (0.5, 0.9, 0.95, 0.99)) -> dict[float, float]:
        """Quantiles of ``measured / predicted - 1`` over the window (empty dict before any step)."""
        if not self._ratios:
            return {}
        arr = np.fromiter(self._ratios, float, len(self._ratios)) - 1.0
        return {q: float(v) for q, v in zip(qs, np.quantile(arr, qs), strict=True)}

    def mean_abs_rel_error(self) -> float:
        """Mean of ``|measured / predicted - 1|`` over the window (NaN before any step)."""
        if not self._ratios:
            return math.nan
        return float(np.mean(np.abs(np.fromiter(self._ratios, float, len(self._ratios)) - 1.0)))
