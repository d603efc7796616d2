"""EngineTimeModel: the simulated engine's step time (loadgen/sim/engine_time.py), hand-worked values."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from loadgen.sim.engine_time import EngineTimeModel, load_engine_time_model, shipped_path
from replica_agent.policy.time_model import StepFeatures

M = EngineTimeModel(a_ms=10.0, b_ms=0.05, c_ms=1e-4, d_ms=0.02, e_ms=2e-6, f_ms=5e-6)
# Two decodes at contexts 1000 and 3000, one 512-token chunk over a 2048-token prefix.
F = StepFeatures.from_items([(1, 1000), (1, 3000), (512, 2048)])


def test_step_ms_hand_worked() -> None:
    # new = 1 + 1 + 512 = 514; context = 1000 + 3000 + 2048 = 6048; seqs = 3
    # chunk*prefix = 1000 + 3000 + 512*2048 = 1_052_576; chunk^2 = 1 + 1 + 262_144 = 262_146
    assert (F.new_tokens, F.context_tokens, F.num_seqs) == (514, 6048, 3)
    assert (F.chunk_prefix_tokens, F.chunk_sq_tokens) == (1_052_576, 262_146)
    # 10 + 0.05*514 (25.7) + 1e-4*6048 (0.6048) + 0.02*3 (0.06) + 2e-6*1_052_576 (2.105152)
    # + 5e-6*262_146 (1.31073) = 39.780682
    assert M.step_ms(F) == pytest.approx(39.780682, abs=1e-9)
    assert M.mean_ms(F) == pytest.approx(39.780682, abs=1e-9)
    assert M.sampler(3).step_ms(F) == pytest.approx(39.780682, abs=1e-9)  # noise 0: no draw


def test_noise_median_one_and_spread_and_reproducible() -> None:
    noisy = EngineTimeModel(a_ms=10.0, b_ms=0.05, noise_sigma=0.2, seed=7)
    f = StepFeatures.from_items([(100, 0)])  # 10 + 0.05 * 100 = 15 ms noiseless
    s = noisy.sampler(0)
    draws = np.array([s.step_ms(f) for _ in range(4001)])
    assert np.median(draws) == pytest.approx(15.0, rel=0.02)
    assert np.std(np.log(draws / 15.0)) == pytest.approx(0.2, rel=0.06)
    again = noisy.sampler(0)
    assert [again.step_ms(f) for _ in range(5)] == list(draws[:5])  # same seed and stream: same draws
    other = noisy.sampler(1)
    assert [other.step_ms(f) for _ in range(5)] != list(draws[:5])  # another engine of the fleet
    rng = np.random.default_rng(0)
    z = np.random.default_rng(0).standard_normal()
    assert noisy.step_ms(f, rng) == pytest.approx(15.0 * math.exp(0.2 * z))


def test_from_dict_missing_keys_zero_and_errors() -> None:
    m = EngineTimeModel.from_dict({"a_ms": 5, "b_ms": 0.1}, name="x")
    assert (m.c_ms, m.d_ms, m.e_ms, m.f_ms, m.noise_sigma, m.seed) == (0, 0, 0, 0, 0, 0)
    assert m.step_ms(StepFeatures.from_items([(10, 100)])) == pytest.approx(6.0)  # 5 + 0.1 * 10
    with pytest.raises(ValueError, match="unknown key"):
        EngineTimeModel.from_dict({"a_ms": 1, "b": 2})
    with pytest.raises(ValueError, match="c_ms must be a finite number >= 0"):
        EngineTimeModel.from_dict({"a_ms": 1, "c_ms": -1e-5})
    with pytest.raises(ValueError, match="must be a number"):
        EngineTimeModel.from_dict({"a_ms": "10"})
    with pytest.raises(ValueError, match="seed"):
        EngineTimeModel.from_dict({"a_ms": 1, "seed": -1})
    with pytest.raises(ValueError, match="must be > 0"):
        EngineTimeModel.from_dict({"c_ms": 1e-4})
    with pytest.raises(ValueError, match="JSON object"):
        EngineTimeModel.from_dict([1, 2])


def test_load_policy_file_and_shipped(tmp_path) -> None:
    assert load_engine_time_model("policy", "llama-3-8b-a100") is None
    p = tmp_path / "e.json"
    p.write_text(json.dumps({"a_ms": 2.0, "b_ms": 0.5, "noise_sigma": 0.1, "seed": 3}))
    m = load_engine_time_model(str(p), "llama-3-8b-a100")
    assert m is not None and (m.a_ms, m.b_ms, m.noise_sigma, m.seed, m.name) == (2.0, 0.5, 0.1, 3, str(p))
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(ValueError, match="invalid JSON"):
        load_engine_time_model(str(bad), "llama-3-8b-a100")
    with pytest.raises(FileNotFoundError):
        load_engine_time_model(str(tmp_path / "none.json"), "llama-3-8b-a100")
    for prof in ("llama-3-8b-a100", "llama-2-70b-h100-tp4"):
        d = load_engine_time_model(None, prof)  # the benchmarks' default: the shipped file
        path = shipped_path(prof)
        assert d is not None and path is not None and d.name == f"shipped:{prof}"
        assert d.to_dict() == {k: v for k, v in json.loads(path.read_text()).items() if k != "meta"}
        assert d.meta["profile"] == prof
    assert load_engine_time_model(None, "llama-2-7b-h100") is None  # no shipped file: the policy's model


def test_shipped_files_price_chunk_prefix_above_linear_model() -> None:
    """The shipped 8B file charges a 2048 chunk at a 16k prefix near the component model's 287.2 ms
    (docs/engine-time-model.md, spot values), far above the linear policy model's 160 ms."""
    m = load_engine_time_model(None, "llama-3-8b-a100")
    assert m is not None
    t = m.mean_ms(StepFeatures.from_items([(2048, 16384)]))
    assert 0.9 * 287.2 <= t <= 1.1 * 287.2


def test_slowdown_multiplies_the_same_noise_draws() -> None:
    from loadgen.sim.slowdown import SlowdownComponent, SlowdownModel

    noisy = EngineTimeModel(a_ms=10.0, b_ms=0.05, noise_sigma=0.2, seed=7)
    f = StepFeatures.from_items([(100, 0)])  # 15 ms noiseless
    # a constant slowdown (no component) of ln 1.5: every step 1.5 x the same draw as without it
    slow = EngineTimeModel(a_ms=10.0, b_ms=0.05, noise_sigma=0.2, seed=7, slowdown=SlowdownModel(math.log(1.5)))
    a, b = noisy.sampler(2), slow.sampler(2)
    for i in range(5):
        assert b.step_ms(f, 100.0 * i) == pytest.approx(1.5 * a.step_ms(f, 100.0 * i), rel=1e-12)
    # a correlated one: the factor moves with the clock passed in, and the JSON keeps it
    corr = EngineTimeModel.from_dict({"a_ms": 10.0, "slowdown": {"log_mean": 0.0, "components": [{"sigma": 0.5, "tau_s": 1.0}]}})
    assert corr.slowdown == SlowdownModel(0.0, (SlowdownComponent(0.5, 1.0),))
    assert corr.to_dict()["slowdown"] == {"log_mean": 0.0, "components": [{"sigma": 0.5, "tau_s": 1.0}]}
    s = corr.sampler(0)
    same_instant = [s.step_ms(StepFeatures.from_items([(1, 0)]), 5000.0) for _ in range(3)]
    assert same_instant[0] == same_instant[1] == same_instant[2] != 10.0  # one instant, one factor
    assert s.step_ms(StepFeatures.from_items([(1, 0)]), 60_000.0) != same_instant[0]
    with pytest.raises(ValueError, match="slowdown: unknown key"):
        EngineTimeModel.from_dict({"a_ms": 1.0, "slowdown": {"mu": 1}}, "x.json")
    assert "slowdown" not in noisy.to_dict()
