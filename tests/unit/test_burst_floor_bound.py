"""scripts/burst_floor_bound.py: the capacity bound from the disjoint-span attainment bound."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadgen.fleet.bench import build_arrivals, trace_rows
from loadgen.fleet.bound import interval_attainment_bound
from loadgen.sim.engine_time import load_engine_time_model
from loadgen.traces import arrival_granularity_ms
from replica_agent.policy.profiles import load_profile, vllm_serve_batch_defaults
from tests.scripts import load_script

bfb = load_script("burst_floor_bound")


def test_main_scans_the_streams_and_reports_the_first_failing_grid_rate(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # 2 replicas of the 8B A100 on azure-code, a 40 s window with 10 s of warm-up: small enough to scan here
    cond = bfb.Condition("azure-code", ((2, "llama-3-8b-a100", None),), 1000.0, 100.0, "c.json", "azure-code, 2 x 8B")
    monkeypatch.setattr(bfb, "CONDITIONS", (cond,))
    (tmp_path / "c.json").write_text(json.dumps({
        "duration_s": 40.0, "warmup_s": 10.0, "best_baseline_token_goodput": "b",
        "policies": {"b": {"capacity_rps": 5.0}, "pab+fairbatching": {"capacity_rps": 22.0}}}))
    # made-up steady bounds and capacities that put short grids around this stream's crossings (about 11.3 and
    # 19.1 req/s; streams of 2 windows are far from monotone in the rate)
    steady = [{"condition": cond.label, "request_floor_bound_rps": 19.0, "token_floor_bound_rps": 12.0,
               "measured": {"best_baseline_token_floor_rps": 4.0, "pab_token_floor_rps": 13.0}}]
    (tmp_path / "steady.json").write_text(json.dumps(steady))
    out = tmp_path / "burst.json"
    out.write_text(json.dumps([{"condition": "kept from before"}, {"condition": cond.label, "stale": True}]))
    assert bfb.main(["--out", str(out), "--headline", str(tmp_path), "--steady", str(tmp_path / "steady.json"),
                     "--start-frac", "0.8", "--merge"]) == 0
    # --merge keeps the other condition's row and replaces this one's
    (row, other) = json.loads(out.read_text())
    assert other == {"condition": "kept from before"} and row["condition"] == cond.label and "stale" not in row
    # the streams again, built and bounded here: bench-fleet's arrivals, the one-kind disjoint-span bound
    kept, native, _ = trace_rows("azure-code", arrival_granularity_ms("azure-code"), 0)
    batch = vllm_serve_batch_defaults(load_profile("llama-3-8b-a100").gpu).resolve(None, None)
    engine = load_engine_time_model(None, "llama-3-8b-a100")

    def attainment(rate: float, by: str) -> float:
        reqs = build_arrivals(kept, native, rate, 40.0, 2, 0, 0.0)
        att, _ = interval_attainment_bound([r.arrival_ms for r in reqs], [r.prompt_tokens for r in reqs],
                                           [r.output_tokens for r in reqs], engine, 1000.0, 100.0, 2, 10_000.0,
                                           40_000.0, batch.max_num_batched_tokens, served_by=by)  # fmt: skip
        return att

    for key, by, start, stop in (("token", "tokens", 10.4, 12.0 * 1.02), ("request", "requests", 17.6, 19.0 * 1.02)):
        grid = {float(r): a for r, a in row[f"{key}_floor_grid"].items()}
        rates = sorted(grid)
        assert rates[0] == pytest.approx(start, abs=1e-3) and rates[-1] <= stop
        for lo, hi in zip(rates, rates[1:]):
            assert hi / lo == pytest.approx(1.02, abs=1e-6)
        got = row[f"{key}_floor_burst_bound_rps"]
        assert got is not None  # a crossing inside the grid
        # the reported rate and every grid rate above it fail the floor; the one below passes
        assert all(a < 0.9 for r, a in grid.items() if r >= got - 0.005)
        below = max(r for r in rates if r < got - 0.005)
        assert grid[below] >= 0.9
        # recomputed independently at the reported grid rate (the figure is rounded to 0.01) and the one below
        at = min(rates, key=lambda r: abs(r - got))
        assert at == pytest.approx(got, abs=0.005) and attainment(at, by) == pytest.approx(grid[at], abs=1e-6)
        assert attainment(below, by) == pytest.approx(grid[below], abs=1e-6)
        # a burst bound is no looser than the steady one it scans below
        assert got <= stop


def test_a_mixed_fleet_is_scanned_to_1_5x_its_estimate_with_the_pooled_bound(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from loadgen.fleet.bench import parse_fleet
    from loadgen.fleet.bound import pooled_interval_attainment_bound

    # 1 A100 + 1 H100 of the 8B on azure-code, 40 s window, 10 s warm-up; made-up steady estimates
    cond = bfb.Condition("azure-code", ((1, "llama-3-8b-a100", None), (1, "llama-3-8b-h100", None)), 1000.0, 100.0,
                         "h.json", "azure-code, 1 A100 + 1 H100")  # fmt: skip
    monkeypatch.setattr(bfb, "CONDITIONS", (cond,))
    (tmp_path / "h.json").write_text(json.dumps({
        "duration_s": 40.0, "warmup_s": 10.0, "policies": {"pab+fairbatching": {"capacity_rps": 16.0}}}))
    # (this stream crosses 0.9 near 25.6 req/s per token and 29.7 per request: past 1.02x these estimates)
    steady = [{"condition": cond.label, "request_floor_bound_rps": 22.0, "token_floor_bound_rps": 20.0,
               "measured": {"best_baseline_token_floor_rps": 4.0, "pab_token_floor_rps": 20.0}}]
    (tmp_path / "steady.json").write_text(json.dumps(steady))
    out = tmp_path / "burst.json"
    assert bfb.main(["--out", str(out), "--headline", str(tmp_path), "--steady", str(tmp_path / "steady.json"),
                     "--start-frac", "0.8", "--conditions", cond.label]) == 0
    (row,) = json.loads(out.read_text())
    kept, native, _ = trace_rows("azure-code", arrival_granularity_ms("azure-code"), 0)
    kinds = [k for spec in ("1:llama-3-8b-a100", "1:llama-3-8b-h100") for k in parse_fleet(spec)]

    def attainment(rate: float, by: str) -> float:
        reqs = build_arrivals(kept, native, rate, 40.0, 2, 0, 0.0)
        att, _ = pooled_interval_attainment_bound(
            [r.arrival_ms for r in reqs], [r.prompt_tokens for r in reqs], [r.output_tokens for r in reqs],
            [(k.engine_time, k.count, k.max_num_batched_tokens) for k in kinds], 1000.0, 100.0, 10_000.0, 40_000.0,
            served_by=by)  # fmt: skip
        return att

    for key, by, start, steady_rps in (("token", "tokens", 16.0, 20.0), ("request", "requests", 12.8, 22.0)):
        grid = {float(r): a for r, a in row[f"{key}_floor_grid"].items()}
        rates = sorted(grid)
        # a mixed fleet's steady figure is an estimate: the grid goes on past it, to 1.5x
        assert rates[0] == pytest.approx(start, abs=1e-6) and 1.02 * steady_rps < rates[-1] <= 1.5 * steady_rps
        top = rates[-1]
        assert attainment(top, by) == pytest.approx(grid[top], abs=1e-6)
        got = row[f"{key}_floor_burst_bound_rps"]
        assert got is not None and got > 1.02 * steady_rps  # a crossing inside the grid, past the estimate
        at = min(rates, key=lambda r: abs(r - got))
        assert all(a < 0.9 for r, a in grid.items() if r >= at) and grid[rates[rates.index(at) - 1]] >= 0.9
        assert attainment(at, by) == pytest.approx(grid[at], abs=1e-6)
