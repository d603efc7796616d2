"""Live residuals of the batch-time model and the conservative fallback (pure; seed 000).

Seed 000 ("时间预测必须持续校准"): compare predicted with measured iteration times online, watch the
residuals, and use a conservative budget when the error grows. FairBatching's time budget is only
as good as ``a + b * new_tokens + c * context_tokens`` (arXiv 2510.14392, batch time model); an
under-predicting model packs batches that overrun the most urgent decode's deadline.

For each observed step, relative error ``e = (measured_ms - predicted_ms) / predicted_ms``
(positive = the model is optimistic). Two EWMAs with weight ``alpha``:
``bias = (1 - alpha) * bias + alpha * e`` and ``mag = (1 - alpha) * mag + alpha * |e|``.

``inflation_factor()`` = 1 while ``mag <= threshold``, else ``min(max_inflation, 1 + mag)``;
:meth:`ResidualTracker.inflate` scales a, b and c by it, so every predicted batch time (and
with it the batch the policy forms under its budget) is conservative by that factor.

Where it is fed: wherever step times are observed, i.e. the simulator (``--step-log``; virtual
mode feeds it every step) and the vLLM plugin mode (the engine's own step times). In proxy mode
the agent sees only token timestamps of streams, not iteration times (several requests share one
step, and network/SSE jitter is in each gap), so it keeps the configured coefficients: residuals
are exported only by components that see steps.
"""

from __future__ import annotations

from dataclasses import dataclass

from replica_agent.policy.time_model import TimeModel


@dataclass(slots=True)
class ResidualTracker:
    """EWMA of the time model's relative prediction error (see the module docstring).

    Attributes:
        alpha: EWMA weight of the newest observation, in (0, 1].
        threshold: mean |relative error| above which the budget turns conservative (fraction).
        max_inflation: cap on the inflation factor (>= 1).
        bias: EWMA of the signed relative error (fraction; > 0 = model optimistic).
        magnitude: EWMA of the absolute relative error (fraction).
        max_abs: largest |relative error| seen (fraction).
        count: observations so far.
    """

    alpha: float = 0.05
    threshold: float = 0.15
    max_inflation: float = 2.0
    bias: float = 0.0
    magnitude: float = 0.0
    max_abs: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if not 0.0 < self.alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {self.alpha}")
        if self.threshold < 0 or self.max_inflation < 1.0:
            raise ValueError(f"need threshold >= 0 and max_inflation >= 1; got {self.threshold}, {self.max_inflation}")

    def observe(self, predicted_ms: float, measured_ms: float) -> float:
        """Feed one step; returns its relative error (measured - predicted) / predicted.

        Raises:
            ValueError: if ``predicted_ms`` is not > 0.
        """
        if not predicted_ms > 0:
            raise ValueError(f"predicted_ms must be > 0, got {predicted_ms}")
        e = (measured_ms - predicted_ms) / predicted_ms
        w = self.alpha if self.count else 1.0  # the first observation seeds the averages
        self.bias += w * (e - self.bias)
        self.magnitude += w * (abs(e) - self.magnitude)
        if abs(e) > self.max_abs:
            self.max_abs = abs(e)
        self.count += 1
        return e

    def inflation_factor(self) -> float:
        """1 while the mean |error| is within ``threshold``, else min(max_inflation, 1 + mean |error|)."""
        if self.magnitude <= self.threshold:
            return 1.0
        return min(self.max_inflation, 1.0 + self.magnitude)

    def inflate(self, model: TimeModel) -> TimeModel:
        """``model`` with a, b and c scaled by :meth:`inflation_factor` (the same object when it is 1)."""
        f = self.inflation_factor()
        if f == 1.0:
            return model
        return TimeModel(model.a_ms * f, model.b_ms_per_new_token * f, model.c_ms_per_context_token * f)
