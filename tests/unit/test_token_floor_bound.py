"""scripts/token_floor_bound.py and the bound line of scripts/headline_tables.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadgen.fleet.bench import trace_rows
from loadgen.fleet.bound import steady_state_bound
from loadgen.sim.engine_time import load_engine_time_model
from loadgen.traces import arrival_granularity_ms
from replica_agent.policy.profiles import load_profile, vllm_serve_batch_defaults
from tests.scripts import load_script

tfb = load_script("token_floor_bound")
tables = load_script("headline_tables")


def _fleet_json(path: Path, caps: dict[str, float], best: str, token_bound: float | None = None) -> None:
    d = {"best_baseline_token_goodput": best,
         "policies": {n: {"capacity_token_floor_rps": c, "capacity_token_floor_bound": "interpolated"}
                      for n, c in caps.items()}}  # fmt: skip
    if token_bound is not None:
        d["token_steady_state_bound"] = {"rps": token_bound}
    path.write_text(json.dumps(d))


def _table_json(path: Path, caps: dict[str, float], best: str, token_bound: float, **fields: object) -> None:
    """A bench-fleet JSON that ``headline_tables.table`` can render: :func:`_fleet_json` with no measured rows, the
    profile llama-3-8b-a100, TPOT 100 ms and ``fields`` (trace, replicas, ttft_ms, duration_s, fleet...)."""
    _fleet_json(path, caps, best, token_bound=token_bound)
    d = json.loads(path.read_text())
    for p in d["policies"].values():
        p.update(rows=[], capacity_rps=0.0, capacity_bound="below-sweep")
    d.update(profile="llama-3-8b-a100", tpot_ms=100.0, **fields)
    path.write_text(json.dumps(d))


def test_main_gives_the_bounds_and_the_largest_ratio(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cond = tfb.Condition("azure-conv", ((2, "llama-3-8b-a100", None),), 1000.0, 100.0, "c.json", "azure-conv, 2 x 8B")
    monkeypatch.setattr(tfb, "CONDITIONS", (cond,))
    _fleet_json(tmp_path / "c.json", {"dynamo-kv+fairbatching": 10.0, "pab+fairbatching": 12.0},
                "dynamo-kv+fairbatching")
    out = tmp_path / "bounds.json"
    assert tfb.main(["--out", str(out), "--headline", str(tmp_path)]) == 0
    (row,) = json.loads(out.read_text())
    # the same bound computed here directly: 2 replicas of the shipped 8B A100 engine, vllm serve's A100 batch
    kept, _, _ = trace_rows("azure-conv", arrival_granularity_ms("azure-conv"), 0)
    prof = load_profile("llama-3-8b-a100")
    batch = vllm_serve_batch_defaults(prof.gpu).resolve(None, None)
    args = ([r.prompt_tokens for r in kept], [r.output_tokens for r in kept],
            load_engine_time_model(None, "llama-3-8b-a100"), 1000.0, 100.0, 2, prof.kv_capacity_tokens,
            batch.max_num_seqs, batch.max_num_batched_tokens, 0.9)  # fmt: skip
    tok = steady_state_bound(*args, served_by="tokens").rps
    assert row["token_floor_bound_rps"] == pytest.approx(tok, abs=0.01)
    assert row["request_floor_bound_rps"] == pytest.approx(steady_state_bound(*args).rps, abs=0.01)
    # serving 90 % of the tokens costs more than serving the cheapest 90 % of the requests
    assert row["token_floor_bound_rps"] < row["request_floor_bound_rps"]
    assert row["measured"] == {"best_baseline": "dynamo-kv+fairbatching", "best_baseline_token_floor_rps": 10.0,
                               "pab": "pab+fairbatching", "pab_token_floor_rps": 12.0}
    assert row["largest_ratio_over_best_baseline"] == pytest.approx(tok / 10.0, abs=1e-3)


def test_measured_is_none_without_the_file_and_below_the_sweep(tmp_path: Path) -> None:
    cond = tfb.Condition("azure-conv", ((2, "llama-3-8b-a100", None),), 1000.0, 100.0, "missing.json", "x")
    assert tfb.measured(cond, tmp_path) is None
    d = {"best_baseline_token_goodput": "b", "policies": {
        "b": {"capacity_token_floor_rps": 0.0, "capacity_token_floor_bound": "below-sweep"},
        "pab+fairbatching": {"capacity_token_floor_rps": 9.0, "capacity_token_floor_bound": "interpolated"}}}
    (tmp_path / "missing.json").write_text(json.dumps(d))
    m = tfb.measured(cond, tmp_path)
    assert m["best_baseline_token_floor_rps"] is None and m["pab_token_floor_rps"] == 9.0


def test_measured_takes_the_pab_policy_with_the_highest_bracketed_floor(tmp_path: Path) -> None:
    cond = tfb.Condition("azure-conv", ((2, "llama-3-8b-a100", None),), 1000.0, 100.0, "m.json", "x")
    d = {"best_baseline_token_goodput": "b", "policies": {
        "b": {"capacity_token_floor_rps": 5.0, "capacity_token_floor_bound": "interpolated"},
        "pab+fairbatching": {"capacity_token_floor_rps": 9.0, "capacity_token_floor_bound": "interpolated"},
        "pab-pool+fairbatching": {"capacity_token_floor_rps": 11.0, "capacity_token_floor_bound": "interpolated"},
        "pab-prefix+fairbatching": {"capacity_token_floor_rps": 30.0, "capacity_token_floor_bound": "below-sweep"}}}
    (tmp_path / "m.json").write_text(json.dumps(d))
    m = tfb.measured(cond, tmp_path)
    # 11 > 9; the 30 was not bracketed, so it counts as no capacity
    assert m["pab"] == "pab-pool+fairbatching" and m["pab_token_floor_rps"] == 11.0
    assert m["pab_token_floors"] == {"pab+fairbatching": 9.0, "pab-pool+fairbatching": 11.0,
                                     "pab-prefix+fairbatching": None}


def test_headline_bound_line(tmp_path: Path) -> None:
    _fleet_json(tmp_path / "f.json", {"dynamo-kv+fairbatching": 50.0, "pab+fairbatching": 80.0},
                "dynamo-kv+fairbatching", token_bound=100.0)
    d = json.loads((tmp_path / "f.json").read_text())
    line = tables.bound_line(d)
    # 80 / 100 and 50 / 100 of the bound; 100 / 50 = 2.00x at most over the best baseline
    assert "100.0 req/s" in line and "dynamo-kv+fairbatching 0.50" in line and "pab+fairbatching 0.80" in line
    assert "2.00x `dynamo-kv+fairbatching`" in line
    # a baseline whose per-token capacity is below the sweep gives no ratio
    d["policies"]["dynamo-kv+fairbatching"]["capacity_token_floor_bound"] = "below-sweep"
    line = tables.bound_line(d)
    assert "can exceed" not in line and "dynamo-kv+fairbatching 0.50" not in line and "pab+fairbatching 0.80" in line
    # a mixed fleet: an estimate, no claim on what a policy can reach
    d["fleet"] = [{"profile": "llama-3-8b-a100", "count": 8}, {"profile": "llama-3-8b-h100", "count": 8}]
    line = tables.bound_line(d)
    assert "estimate" in line and "not a bound" in line and "can exceed" not in line
    del d["token_steady_state_bound"]
    assert tables.bound_line(d) == ""


def test_prefix_trace_bound_is_the_grid_rate_above_the_last_stream_that_fits(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """mooncake-conv on 2 replicas, a 40 s window (10 s warm-up): the bound reported is the grid rate just
    above the last one whose stream's offered rate fits that stream's bound; the streams of the grid
    rate below it fit, of it and the next ones do not; it lies below the trace-wide bound (which credits
    sharing with the whole trace, not only with the stream offered)."""
    from loadgen.fleet.bench import build_arrivals, kinds_steady_bound, parse_fleet
    from loadgen.fleet.bound import shared_prefix_tokens
    from loadgen.traces import PREFIX_BLOCK_TOKENS

    cond = tfb.Condition("mooncake-conv", ((2, "llama-3-8b-a100", None),), 5000.0, 100.0, "m.json", "mooncake, 2 x 8B")
    monkeypatch.setattr(tfb, "CONDITIONS", (cond,))
    (tmp_path / "m.json").write_text(json.dumps({"duration_s": 40.0, "warmup_s": 10.0, "seed": 0, "policies": {}}))
    monkeypatch.setattr(tfb, "STREAM_GRID_FROM", 0.45)  # fewer grid streams (the crossing is near 0.6 here)
    st = tfb.stream_settings(cond, tmp_path)
    assert (st.duration_s, st.warmup_s, st.seed, st.window_offset) == (40.0, 10.0, 0, 0.0)
    b = tfb.bounds(cond, st)
    tok, wide = b["tokens"], b["trace_wide_tokens"]
    assert 0.0 < tok < wide and 0.0 < b["requests"] < b["trace_wide_requests"]

    # the stream's bound and offered rate computed here from their parts
    kept, native, _ = trace_rows("mooncake-conv", arrival_granularity_ms("mooncake-conv"), 0)
    kinds = parse_fleet("2:llama-3-8b-a100")

    def fits(rate: float) -> bool:
        reqs = build_arrivals(kept, native, rate, 40.0, 2, 0)
        credit = shared_prefix_tokens([r.prefix_ids for r in reqs], [r.prompt_tokens for r in reqs],
                                      PREFIX_BLOCK_TOKENS, [r.arrival_ms for r in reqs], 5000.0)
        idx = [i for i, r in enumerate(reqs) if r.arrival_ms >= 10_000.0]
        bound = kinds_steady_bound(kinds, [reqs[i].prompt_tokens for i in idx], [reqs[i].output_tokens for i in idx],
                                   5000.0, 100.0, [float(credit[i]) for i in idx], served_by="tokens")
        return bound >= len(idx) / 30.0

    grid = [0.45 * wide * 1.02**k for k in range(200) if 0.45 * wide * 1.02**k <= 1.5 * wide * (1 + 1e-12)]
    k = min(range(len(grid)), key=lambda i: abs(grid[i] - tok))
    assert grid[k] == pytest.approx(tok, rel=1e-9)  # the function multiplies step by step: last-bit differences
    assert k > 0 and fits(grid[k - 1])
    assert not any(fits(g) for g in grid[k:k + 3])
    # main writes it (rounded) with the trace-wide one beside it (the bounds just computed, not again)
    monkeypatch.setattr(tfb, "bounds", lambda c, stream=None: b)
    out = tmp_path / "bounds.json"
    assert tfb.main(["--out", str(out), "--headline", str(tmp_path)]) == 0
    (row,) = json.loads(out.read_text())
    assert row["bound_on"] == "stream" and row["file"] == "m.json" and row["measured"] is None
    assert row["token_floor_bound_rps"] == round(tok, 2) and row["trace_wide_token_floor_bound_rps"] == round(wide, 2)


def test_headline_table_takes_the_stream_bound_beside_the_file(tmp_path: Path) -> None:
    _table_json(tmp_path / "m.json", {"dynamo-kv+fairbatching": 10.0, "pab+fairbatching": 12.0},
                "dynamo-kv+fairbatching", 30.0, trace="mooncake-conv", replicas=2, ttft_ms=5000.0, duration_s=40.0)
    assert "30.0 req/s; per-token capacity as a share of it: dynamo-kv+fairbatching 0.33" in tables.table(tmp_path / "m.json")
    (tmp_path / "token-floor-bounds.json").write_text(json.dumps([
        {"condition": "other", "file": "other.json", "bound_on": "stream", "token_floor_bound_rps": 99.0},
        {"condition": "m", "file": "m.json", "bound_on": "stream", "token_floor_bound_rps": 15.0}]))
    text = tables.table(tmp_path / "m.json")
    # 10 / 15 = 0.67, 12 / 15 = 0.80, 15 / 10 = 1.50x; the trace-wide 30 named beside it
    assert "on the stream offered" in text and "30.0 req/s with credit from the whole trace): 15.0 req/s" in text
    assert "dynamo-kv+fairbatching 0.67, pab+fairbatching 0.80" in text and "1.50x `dynamo-kv+fairbatching`" in text


def test_headline_table_adds_the_burst_bound_beside_the_file(tmp_path: Path) -> None:
    _table_json(tmp_path / "h.json", {"static-queue-cap+fairbatching": 100.0, "pab+fairbatching": 150.0},
                "static-queue-cap+fairbatching", 210.0, trace="azure-code", replicas=16, ttft_ms=1000.0,
                duration_s=240.0, fleet=[{"profile": "llama-3-8b-a100", "count": 8, "engine_time_model": {"name": "a"}},
                                         {"profile": "llama-3-8b-h100", "count": 8, "engine_time_model": {"name": "h"}}])
    assert "with bursts" not in tables.table(tmp_path / "h.json")
    (tmp_path / "burst-floor-bounds.json").write_text(json.dumps([
        {"file": "other.json", "token_floor_burst_bound_rps": 999.0},
        {"file": "h.json", "token_floor_burst_bound_rps": 200.0}]))
    text = tables.table(tmp_path / "h.json")
    # the mixed fleet's steady figure stays an estimate; the burst one is a bound: 100 / 200, 150 / 200, 200 / 100
    assert "not a bound" in text and "Per-token bound with bursts" in text and ": 200.0 req/s" in text
    assert "static-queue-cap+fairbatching 0.50, pab+fairbatching 0.75" in text
    assert "can exceed 2.00x `static-queue-cap+fairbatching`" in text
    # a row whose scan never fell below the floor gives no line
    (tmp_path / "burst-floor-bounds.json").write_text(json.dumps([{"file": "h.json", "token_floor_burst_bound_rps": None}]))
    assert "with bursts" not in tables.table(tmp_path / "h.json")
