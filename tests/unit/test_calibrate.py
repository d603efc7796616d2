"""``fairbatch-agent calibrate``: fit a, b, c from a simulator step log (replica_agent/calibrate.py)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from loadgen.sim.engine import EngineConfig, SimEngine
from loadgen.sim.virtual import VirtualRequest, run_virtual
from replica_agent.calibrate import calibrate, read_step_log
from replica_agent.cli import main
from replica_agent.policy.profiles import load_profile


def sim_log(path: Path) -> None:
    prof = load_profile("llama-3-8b-a100")
    rng = random.Random(1)
    reqs = [VirtualRequest(str(i), 200.0 * i, rng.randint(10, 4000), rng.randint(1, 80)) for i in range(150)]
    with open(path, "w") as f:
        run_virtual(reqs, SimEngine(EngineConfig(prof.time_model, 30_000)), step_log=f)


def test_fit_recovers_the_profile(tmp_path: Path) -> None:
    log = tmp_path / "steps.jsonl"
    sim_log(log)
    fit = calibrate(log)
    m = load_profile("llama-3-8b-a100").time_model
    assert fit.model.a_ms == pytest.approx(m.a_ms, rel=1e-4)
    assert fit.model.b_ms_per_new_token == pytest.approx(m.b_ms_per_new_token, rel=1e-4)
    assert fit.model.c_ms_per_context_token == pytest.approx(m.c_ms_per_context_token, rel=1e-3)
    assert fit.r2 > 0.9999 and fit.max_rel_err < 1e-4


def test_cli_prints_coefficients_and_quality(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "steps.jsonl"
    sim_log(log)
    assert main(["calibrate", str(log)]) == 0
    out = capsys.readouterr().out
    for key in ("a = 9.86", "b = 0.0726", "R^2 = ", "max relative error", "mean relative error", "--coefficients"):
        assert key in out


def test_csv_log_and_errors(tmp_path: Path) -> None:
    csv = tmp_path / "s.csv"
    # measured = 10 + 0.1*new + 0.001*ctx exactly.
    csv.write_text("new_tokens,context_tokens,measured_ms\n100,0,20\n1,1000,11.1\n50,500,15.5\n10,3000,14\n")
    new, ctx, ms = read_step_log(csv)
    assert new == [100, 1, 50, 10] and ms == [20, 11.1, 15.5, 14]
    fit = calibrate(csv)
    assert (fit.model.a_ms, fit.model.b_ms_per_new_token, fit.model.c_ms_per_context_token) == (
        pytest.approx(10), pytest.approx(0.1), pytest.approx(0.001))  # fmt: skip
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"new_tokens": 1, "context_tokens": 2}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1: missing field 'measured_ms'"):
        read_step_log(bad)
