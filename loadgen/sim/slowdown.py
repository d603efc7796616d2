"""Correlated slowdowns of a simulated engine's steps (pure: no I/O, no clock; randomness from an injected,
seeded numpy Generator).

A real engine that shares its CPU (or GPU) with other work does not run each step at its quiet time times an
independent noise draw: its steps run slower in bursts that last from a fraction of a second to several
seconds, when the client, the API servers and the other engines want the same cores (measured on vLLM in
docs/vllm.md, "The simulator with the bench's own slowdowns"). This module models the log of a step's
slowdown factor as a stationary Gaussian process in time::

    ln(step_ms / quiet_ms) = log_mean + sum_j x_j(t) + white
    x_j: Ornstein-Uhlenbeck, stationary std sigma_j, correlation time tau_j:
         cov(x_j(t), x_j(t + D)) = sigma_j^2 * exp(-D / tau_j)

and ``white`` is the engine model's own independent per-step noise (``noise_sigma``). The OU update over a
time step ``D`` is exact: ``x <- x * exp(-D / tau) + sigma * sqrt(1 - exp(-2 D / tau)) * N(0, 1)``
(Gillespie 1996, "Exact numerical simulation of the Ornstein-Uhlenbeck process and its integral", Phys. Rev.
E 54, 2084, eq. 1.3).

:func:`fit_slowdown` estimates ``log_mean``, the components and the white variance from measured step-log
series (the autocovariance of the log ratio in time bins, a sum of exponentials fitted to it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

_BLOCK = 1024


@dataclass(frozen=True, slots=True)
class SlowdownComponent:
    """One OU component of the log slowdown.

    Attributes:
        sigma: stationary standard deviation of the component (of ln factor, dimensionless, >= 0).
        tau_s: correlation time (s, > 0): the covariance at lag D is ``sigma^2 exp(-D / tau_s)``.
    """

    sigma: float
    tau_s: float


@dataclass(frozen=True, slots=True)
class SlowdownModel:
    """The correlated part of an engine's step-time factor (module docstring).

    Attributes:
        log_mean: mean of ln(factor) (dimensionless; 0.3 = steps 1.35x their quiet time at the median).
        components: the OU components (none: a constant factor ``exp(log_mean)``).

    Raises:
        ValueError: a non-finite ``log_mean``, a negative or non-finite sigma, a tau_s <= 0 or non-finite.
    """

    log_mean: float = 0.0
    components: tuple[SlowdownComponent, ...] = ()

    def __post_init__(self) -> None:
        if not math.isfinite(self.log_mean):
            raise ValueError(f"slowdown: log_mean must be finite, got {self.log_mean!r}")
        for c in self.components:
            if not (math.isfinite(c.sigma) and c.sigma >= 0):
                raise ValueError(f"slowdown: sigma must be a finite number >= 0, got {c.sigma!r}")
            if not (math.isfinite(c.tau_s) and c.tau_s > 0):
                raise ValueError(f"slowdown: tau_s must be a finite number > 0, got {c.tau_s!r}")

    @classmethod
    def from_dict(cls, obj: Any) -> SlowdownModel:
        """From ``{"log_mean": m, "components": [{"sigma": s, "tau_s": t}, ...]}`` (missing: 0 / none).

        Raises:
            ValueError: not an object, an unknown key, a non-number, or the class's checks.
        """
        if not isinstance(obj, dict):
            raise ValueError(f"slowdown: expected a JSON object, got {type(obj).__name__}")
        unknown = sorted(set(obj) - {"log_mean", "components"})
        if unknown:
            raise ValueError(f"slowdown: unknown key(s) {', '.join(unknown)}; known: log_mean, components")
        comps = obj.get("components", [])
        if not isinstance(comps, list):
            raise ValueError("slowdown: components must be a list")
        out = []
        for c in comps:
            if not isinstance(c, dict) or set(c) != {"sigma", "tau_s"}:
                raise ValueError(f"slowdown: each component is {{\"sigma\", \"tau_s\"}}, got {c!r}")
            vals = [c["sigma"], c["tau_s"]]
            if any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in vals):
                raise ValueError(f"slowdown: sigma and tau_s must be numbers, got {c!r}")
            out.append(SlowdownComponent(float(vals[0]), float(vals[1])))
        m = obj.get("log_mean", 0.0)
        if isinstance(m, bool) or not isinstance(m, (int, float)):
            raise ValueError(f"slowdown: log_mean must be a number, got {m!r}")
        return cls(float(m), tuple(out))

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of :meth:`from_dict`."""
        return {"log_mean": self.log_mean,
                "components": [{"sigma": c.sigma, "tau_s": c.tau_s} for c in self.components]}  # fmt: skip

    def covariance(self, lag_s: float) -> float:
        """Covariance of ln(factor) at two instants ``lag_s`` apart (s >= 0), the white noise excluded."""
        return sum(c.sigma**2 * math.exp(-abs(lag_s) / c.tau_s) for c in self.components)

    def process(self, rng: np.random.Generator) -> SlowdownProcess:
        """A sample path of this model drawing from ``rng`` (one per engine)."""
        return SlowdownProcess(self, rng)


class SlowdownProcess:
    """One sample path of a :class:`SlowdownModel`, advanced by the caller's clock.

    The first call draws each component from its stationary distribution; later calls move it exactly over
    the time elapsed (module docstring). A clock that goes backwards is treated as no time elapsed.
    """

    __slots__ = ("model", "_rng", "_x", "_t_s", "_buf", "_i")

    def __init__(self, model: SlowdownModel, rng: np.random.Generator) -> None:
        self.model = model
        self._rng = rng
        self._x: list[float] | None = None
        self._t_s = 0.0
        self._buf = np.empty(0)
        self._i = 0

    def _normal(self) -> float:
        if self._i >= self._buf.size:
            self._buf = self._rng.standard_normal(_BLOCK)
            self._i = 0
        z = float(self._buf[self._i])
        self._i += 1
        return z

    def log_factor(self, now_s: float) -> float:
        """ln of the slowdown factor at ``now_s`` (s, the caller's clock)."""
        comps = self.model.components
        if self._x is None:
            self._x = [c.sigma * self._normal() for c in comps]
        else:
            dt = max(0.0, now_s - self._t_s)
            if dt > 0.0:
                for k, c in enumerate(comps):
                    rho = math.exp(-dt / c.tau_s)
                    self._x[k] = self._x[k] * rho + c.sigma * math.sqrt(max(0.0, 1.0 - rho * rho)) * self._normal()
        self._t_s = max(self._t_s, now_s)
        return self.model.log_mean + sum(self._x)

    def factor(self, now_s: float) -> float:
        """The slowdown factor ``exp(log_factor(now_s))`` (dimensionless, > 0)."""
        return math.exp(self.log_factor(now_s))


# ---- the fit ---------------------------------------------------------------------------------------

TAU_GRID_S = tuple(float(x) for x in np.geomspace(0.05, 60.0, 31))
"""Correlation times the fit tries (s): 31 points, geometric, 50 ms to 60 s."""


def binned_autocovariance(series: Sequence[tuple[np.ndarray, np.ndarray]], mean: float, bin_s: float,
                          lags_s: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """Autocovariance of ``z - mean`` between time bins ``lag`` apart, pooled over ``series``.

    Each series is ``(t_s, z)`` (step start times in s, increasing; a value per step). The values are
    averaged in bins of ``bin_s``; the covariance at lag L is the mean of ``m_a * m_b`` over pairs of
    non-empty bins ``round(L / bin_s)`` apart, pooled over the series (never across two series). Two
    distinct bins hold distinct steps, so independent per-step noise adds nothing to it.

    Returns:
        ``(cov, pairs)``: arrays of len(lags_s); ``cov`` NaN where no pair exists.
    """
    sums = np.zeros(len(lags_s))
    pairs = np.zeros(len(lags_s))
    for t, z in series:
        if len(t) == 0:
            continue
        b = np.floor((np.asarray(t) - t[0]) / bin_s).astype(np.int64)
        nb = int(b[-1]) + 1
        s = np.bincount(b, np.asarray(z) - mean, nb)
        n = np.bincount(b, None, nb)
        ok = n > 0
        m = np.where(ok, s / np.maximum(n, 1), 0.0)
        for i, lag in enumerate(lags_s):
            k = max(1, int(round(lag / bin_s)))
            if k >= nb:
                continue
            both = ok[:-k] & ok[k:]
            sums[i] += float((m[:-k] * m[k:])[both].sum())
            pairs[i] += float(both.sum())
    with np.errstate(invalid="ignore", divide="ignore"):
        cov = np.where(pairs > 0, sums / np.maximum(pairs, 1), np.nan)
    return cov, pairs


def fit_slowdown(series: Sequence[tuple[np.ndarray, np.ndarray]], *, bin_s: float = 0.05, max_lag_s: float = 30.0,
                 max_components: int = 2) -> dict[str, Any]:  # fmt: skip
    """Fit :class:`SlowdownModel` and the white noise to measured log step-time ratios.

    Args:
        series: ``(t_s, z)`` per step log: step start times (s, increasing) and ``z = ln(measured / quiet
            model)`` per step; at least 50 steps in all.
        bin_s: time bin of the autocovariance (s). max_lag_s: the longest lag fitted (s).
        max_components: 1 or 2 OU components.

    Method: ``log_mean`` = the mean of z over all steps; the autocovariance at 40 geometric lags from
    ``bin_s`` to ``max_lag_s`` (:func:`binned_autocovariance`) is fitted with ``sum_j sigma_j^2 exp(-L /
    tau_j)``: for each choice of tau_j over :data:`TAU_GRID_S` the variances by non-negative least squares
    with each lag's squared residual weighted by its pairs, their sum capped at the total variance of z;
    the choice kept is the one with the least sum of squared residuals weighted by sqrt(pairs). The
    white variance is what remains (``var(z) - sum sigma_j^2``).

    Returns:
        ``{"model": SlowdownModel, "white_sigma": float, "var": float, "steps": int, "lags_s": [...],
        "cov": [...], "cov_fit": [...], "rms_error": float}``.

    Raises:
        ValueError: fewer than 50 steps, or max_components not 1 or 2.
    """
    if max_components not in (1, 2):
        raise ValueError(f"max_components must be 1 or 2, got {max_components}")
    zs = [np.asarray(z, float) for _, z in series]
    n = sum(len(z) for z in zs)
    if n < 50:
        raise ValueError(f"need at least 50 steps, got {n}")
    allz = np.concatenate(zs)
    mean = float(allz.mean())
    var = float(allz.var())
    lags = np.geomspace(bin_s, max_lag_s, 40)
    lags = np.unique(np.maximum(1, np.round(lags / bin_s)).astype(int)) * bin_s
    cov, pairs = binned_autocovariance(series, mean, bin_s, lags)
    ok = ~np.isnan(cov) & (pairs > 0)
    L, C, w = lags[ok], cov[ok], np.sqrt(pairs[ok])
    best: tuple[float, tuple[SlowdownComponent, ...]] = (float(np.sum(w * C**2)), ())
    taus = TAU_GRID_S
    combos: list[tuple[float, ...]] = [(t,) for t in taus]
    if max_components == 2:
        combos += [(t1, t2) for i, t1 in enumerate(taus) for t2 in taus[i + 1:]]
    for combo in combos:
        a = np.stack([np.exp(-L / t) for t in combo], axis=1)
        v = _nnls_small(a * w[:, None], C * w)
        if v.sum() > var:  # the correlated part cannot exceed the whole variance
            v = v * (var / v.sum())
        err = float(np.sum(w * (C - a @ v) ** 2))
        if err < best[0] - 1e-15:
            best = (err, tuple(SlowdownComponent(math.sqrt(float(x)), t) for x, t in zip(v, combo, strict=True) if x > 0))
    comps = tuple(sorted(best[1], key=lambda c: c.tau_s))
    model = SlowdownModel(mean, comps)
    white = max(0.0, var - sum(c.sigma**2 for c in comps))
    fitted = np.array([model.covariance(x) for x in lags])
    return {"model": model, "white_sigma": math.sqrt(white), "var": var, "steps": n,
            "lags_s": [round(float(x), 3) for x in lags], "cov": [None if np.isnan(c) else round(float(c), 5) for c in cov],
            "cov_fit": [round(float(c), 5) for c in fitted],
            "rms_error": round(float(np.sqrt(np.nanmean((cov - fitted) ** 2))), 5)}  # fmt: skip


def _nnls_small(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Non-negative least squares for 1 or 2 unknowns (exhaustive over the active sets)."""
    k = a.shape[1]
    best_v, best_e = np.zeros(k), float(b @ b)
    subsets = [(0,), (1,), (0, 1)] if k == 2 else [(0,)]
    for s in subsets:
        sub = a[:, list(s)]
        sol, *_ = np.linalg.lstsq(sub, b, rcond=None)
        if np.any(sol < 0):
            continue
        v = np.zeros(k)
        v[list(s)] = sol
        e = float(np.sum((b - a @ v) ** 2))
        if e < best_e:
            best_v, best_e = v, e
    return best_v
