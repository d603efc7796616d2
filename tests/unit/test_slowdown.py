"""Correlated slowdowns of the simulated engine (loadgen/sim/slowdown.py): the model's checks and
covariance, the exact OU update, and the fit on series whose parameters are known."""

from __future__ import annotations

import math

import numpy as np
import pytest

from loadgen.sim.slowdown import SlowdownComponent, SlowdownModel, binned_autocovariance, fit_slowdown


class FixedNormals:
    """A Generator stand-in that hands out given standard normals (for hand-worked paths)."""

    def __init__(self, values: list[float]) -> None:
        self.values = values

    def standard_normal(self, n: int) -> np.ndarray:
        out, self.values = self.values[:n], self.values[n:]
        return np.array(out + [0.0] * (n - len(out)))


def test_model_checks_and_json_round_trip() -> None:
    with pytest.raises(ValueError, match="sigma"):
        SlowdownModel(0.0, (SlowdownComponent(-0.1, 1.0),))
    with pytest.raises(ValueError, match="tau_s"):
        SlowdownModel(0.0, (SlowdownComponent(0.1, 0.0),))
    with pytest.raises(ValueError, match="log_mean"):
        SlowdownModel(float("nan"))
    with pytest.raises(ValueError, match="unknown key"):
        SlowdownModel.from_dict({"log_mean": 0.1, "sigma": 0.2})
    with pytest.raises(ValueError, match="sigma"):
        SlowdownModel.from_dict({"components": [{"sigma": 0.2}]})
    with pytest.raises(ValueError, match="number"):
        SlowdownModel.from_dict({"components": [{"sigma": "x", "tau_s": 1}]})
    m = SlowdownModel(0.3, (SlowdownComponent(0.3, 1.0), SlowdownComponent(0.2, 10.0)))
    assert SlowdownModel.from_dict(m.to_dict()) == m
    assert SlowdownModel.from_dict({}) == SlowdownModel()


def test_covariance_by_hand() -> None:
    m = SlowdownModel(0.0, (SlowdownComponent(0.3, 1.0), SlowdownComponent(0.2, 10.0)))
    assert m.covariance(0.0) == pytest.approx(0.09 + 0.04)
    # 0.09 e^-1 + 0.04 e^-0.1 = 0.0331091 + 0.0361935
    assert m.covariance(1.0) == pytest.approx(0.0693026, abs=1e-6)


def test_exact_ou_update_by_hand() -> None:
    m = SlowdownModel(0.2, (SlowdownComponent(0.3, 2.0),))
    p = m.process(FixedNormals([1.0, 0.5]))  # type: ignore[arg-type]
    # first call: the stationary draw 0.3 x 1.0
    assert p.log_factor(10.0) == pytest.approx(0.2 + 0.3)
    # the same instant again: nothing moves, no draw
    assert p.log_factor(10.0) == pytest.approx(0.5)
    # tau ln 2 later: rho = 0.5; x = 0.3 x 0.5 + 0.3 x sqrt(1 - 0.25) x 0.5 = 0.15 + 0.1299038
    assert p.log_factor(10.0 + 2.0 * math.log(2.0)) == pytest.approx(0.2 + 0.2799038, abs=1e-7)
    # a clock that goes back is no time elapsed (the next normal is 0: x decays by nothing)
    assert p.factor(5.0) == pytest.approx(math.exp(0.2 + 0.2799038), rel=1e-7)


def test_process_is_stationary_with_the_model_covariance() -> None:
    m = SlowdownModel(0.4, (SlowdownComponent(0.3, 1.0),))
    p = m.process(np.random.default_rng(7))
    ts = np.arange(0.0, 20000.0, 0.5)
    z = np.array([p.log_factor(t) for t in ts])
    assert z.mean() == pytest.approx(0.4, abs=0.02)
    assert z.var() == pytest.approx(0.09, rel=0.06)
    lag = 2  # 1 s = tau: correlation e^-1
    r = np.corrcoef(z[:-lag], z[lag:])[0, 1]
    assert r == pytest.approx(math.exp(-1.0), abs=0.03)


def _synthetic(seed: int, sigma: float, tau_s: float, white: float, mean: float, dt: float, span_s: float) -> tuple[np.ndarray, np.ndarray]:
    """Steps every ``dt`` s: an AR(1) at rho = exp(-dt / tau) (an OU sampled on a grid) plus white noise."""
    rng = np.random.default_rng(seed)
    n = int(span_s / dt)
    rho = math.exp(-dt / tau_s)
    x = np.empty(n)
    x[0] = sigma * rng.standard_normal()
    e = rng.standard_normal(n) * sigma * math.sqrt(1 - rho * rho)
    for i in range(1, n):
        x[i] = rho * x[i - 1] + e[i]
    return np.arange(n) * dt, mean + x + white * rng.standard_normal(n)


def test_fit_recovers_a_known_process() -> None:
    series = [_synthetic(s, 0.3, 2.0, 0.2, 0.35, 0.025, 600.0) for s in (1, 2)]
    fit = fit_slowdown(series)
    m = fit["model"]
    assert m.log_mean == pytest.approx(0.35, abs=0.05)
    assert sum(c.sigma**2 for c in m.components) == pytest.approx(0.09, rel=0.25)
    assert fit["white_sigma"] == pytest.approx(0.2, abs=0.03)
    # the correlation time of the dominant component within a factor 1.6 of 2 s
    main = max(m.components, key=lambda c: c.sigma)
    assert 2.0 / 1.6 <= main.tau_s <= 2.0 * 1.6
    assert fit["steps"] == 2 * 24000


def test_fit_of_white_noise_finds_no_correlated_part() -> None:
    rng = np.random.default_rng(3)
    t = np.arange(20000) * 0.025
    fit = fit_slowdown([(t, 0.1 + 0.25 * rng.standard_normal(len(t)))])
    assert sum(c.sigma**2 for c in fit["model"].components) < 0.003
    assert fit["white_sigma"] == pytest.approx(0.25, abs=0.01)


def test_fit_refuses_too_few_steps_and_bad_components() -> None:
    t = np.arange(10) * 0.1
    with pytest.raises(ValueError, match="50 steps"):
        fit_slowdown([(t, np.zeros(10))])
    with pytest.raises(ValueError, match="max_components"):
        fit_slowdown([(t, np.zeros(10))], max_components=3)


def test_binned_autocovariance_by_hand() -> None:
    # bins of 1 s, values 1, -1, 1, -1 around mean 0: lag 1 pairs (1, -1) x 3 -> -1; lag 2 -> +1
    t = np.array([0.0, 1.0, 2.0, 3.0])
    z = np.array([1.0, -1.0, 1.0, -1.0])
    cov, pairs = binned_autocovariance([(t, z)], 0.0, 1.0, [1.0, 2.0, 5.0])
    assert cov[0] == pytest.approx(-1.0) and pairs[0] == 3
    assert cov[1] == pytest.approx(1.0) and pairs[1] == 2
    assert math.isnan(cov[2]) and pairs[2] == 0
