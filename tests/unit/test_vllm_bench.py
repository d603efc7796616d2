"""The pure parts of ``make bench-vllm`` (loadgen/vllm_bench.py): workload scaling, step-log features,
the fit, the SLO rule, rate windows and verdicts. The real-engine stages are run by the bench itself."""

from __future__ import annotations

import math

import numpy as np
import pytest

from loadgen.traces import TraceRequest
from loadgen.vllm_bench import (
    engine_ms,
    fit_step_log,
    latency_breakdown,
    measured_front_ms,
    scaled_trace,
    slo_rule,
    step_features,
    verdict,
    window,
)


def test_scaled_trace_scales_and_clips_to_the_context() -> None:
    reqs = [TraceRequest(0.0, 1033, 134), TraceRequest(5.0, 14050, 1000), TraceRequest(9.0, 1, 1)]
    out = scaled_trace(reqs, 0.25, 2048)
    # 1033 * 0.25 = 258.25 -> 258, 134 * 0.25 = 33.5 -> 34 (round half to even)
    assert (out[0].prompt_tokens, out[0].output_tokens) == (258, 34)
    # output 250; prompt 3512.5 clipped to 2048 - 250 = 1798
    assert (out[1].prompt_tokens, out[1].output_tokens) == (1798, 250)
    assert (out[2].prompt_tokens, out[2].output_tokens) == (1, 1)  # at least one token each
    assert [r.arrival_ms for r in out] == [0.0, 5.0, 9.0]
    with pytest.raises(ValueError):
        scaled_trace(reqs, 0.0)


def _line(items: list[tuple[int, int]], ms: float) -> dict[str, float]:
    """A step-log line as the plugin writes it for (chunk, prefix) items."""
    return {"new_tokens": sum(c for c, _ in items), "context_tokens": sum(p for _, p in items),
            "batch_size": len(items), "num_decodes": sum(1 for c, _ in items if c == 1),
            "chunk_prefix_tokens": sum(c * p for c, p in items), "chunk_sq_tokens": sum(c * c for c, _ in items),
            "measured_ms": ms}  # fmt: skip


def test_step_features_and_kinds() -> None:
    x, kind = step_features(_line([(1, 100), (1, 300)], 5.0))
    assert kind == "decode" and x.tolist() == [1.0, 2.0, 400.0, 2.0, 400.0, 2.0]
    x, kind = step_features(_line([(512, 1024)], 5.0))
    assert kind == "prefill" and x.tolist() == [1.0, 512.0, 1024.0, 1.0, 512 * 1024.0, 512 * 512.0]
    _, kind = step_features(_line([(1, 100), (64, 0)], 5.0))
    assert kind == "mixed"


TRUE = {"a_ms": 20.0, "b_ms": 0.4, "c_ms": 0.002, "d_ms": 0.5, "e_ms": 1e-5, "f_ms": 2e-5}


def _grid() -> list[list[tuple[int, int]]]:
    steps = [[(1, ctx)] * b for b in (1, 4, 16, 32) for ctx in (128, 512, 1024)]
    steps += [[(n, 0)] for n in (128, 512, 1024, 2048)] + [[(512, 1024)], [(1024, 512)]]
    steps += [[(1, 300)] * 8 + [(256, 0)], [(1, 700)] * 3 + [(1024, 0)]]
    return steps


def test_fit_recovers_the_coefficients_of_noise_free_steps() -> None:
    lines = [_line(items, engine_ms(TRUE, items)) for items in _grid()]
    fit = fit_step_log(lines)
    for k, v in TRUE.items():
        assert fit["engine"][k] == pytest.approx(v, rel=1e-4), k
    assert fit["engine"]["noise_sigma"] == pytest.approx(0.0, abs=1e-6)
    assert fit["error_by_kind"]["all"]["max_rel_err"] == pytest.approx(0.0, abs=1e-6)
    assert fit["error_by_kind"]["decode"]["n"] == 12 and fit["error_by_kind"]["prefill"]["n"] == 6
    assert fit["error_by_kind"]["mixed"]["n"] == 2
    # the linear form misses e, f and d: some error left
    assert fit["error_by_kind"]["all"]["linear_mean_rel_err"] > 0.005
    with pytest.raises(ValueError):
        fit_step_log(lines[:5])


def test_fit_of_noisy_steps_reports_the_noise() -> None:
    rng = np.random.default_rng(7)
    lines = [_line(items, engine_ms(TRUE, items) * math.exp(rng.normal(0, 0.05))) for items in _grid() * 20]
    fit = fit_step_log(lines)
    # sigma of ln(measured / fitted) ~ the 0.05 drawn (the fit absorbs a little of it)
    assert 0.04 < fit["engine"]["noise_sigma"] < 0.06
    assert fit["engine"]["b_ms"] == pytest.approx(0.4, rel=0.05)


def test_slo_rule_by_hand() -> None:
    engine = {"a_ms": 10.0, "b_ms": 1.0, "c_ms": 0.01, "d_ms": 0.0, "e_ms": 0.0, "f_ms": 0.0}
    reqs = [TraceRequest(0.0, p, o) for p, o in ((50, 10), (100, 20), (300, 40))]
    slo = slo_rule(engine, reqs)
    # median prompt 100: prefill 10 + 100 = 110 ms -> 4 x = 440 ms; p99 prompt (linear: 100 + 0.98 x 200 =
    # 296): prefill 306 ms -> 2 x = 612 -> 610 ms; the larger wins
    assert slo["ttft_ms"] == 610.0 and slo["p99_prompt"] == 296
    # 16 decodes at context 100 + 20 // 2 = 110: 10 + 16 + 0.01 * 16 * 110 = 43.6 ms -> 2 x = 87.2 -> 90 ms
    assert slo["tpot_ms"] == 90.0
    assert slo["median_prompt"] == 100 and slo["median_output"] == 20
    # all prompts alike: the median rule wins (4 x 110 = 440 > 2 x 110)
    assert slo_rule(engine, [TraceRequest(0.0, 100, 20)] * 3)["ttft_ms"] == 440.0


def test_latency_breakdown_by_hand() -> None:
    # two engines; histogram sums in seconds. Engine 0: 2 new TTFTs summing 0.3 s, queue 0.04 s, prefill 0.2 s;
    # engine 1: 2 new TTFTs summing 0.5 s, queue 0.06 s, prefill 0.2 s; ITL 10 samples, 0.2 s in all
    z = {"ttft": (0.0, 0.0), "queue": (0.0, 0.0), "prefill": (0.0, 0.0), "itl": (0.0, 0.0)}
    before = [z, {**z, "ttft": (1.0, 3.0)}]
    after = [{"ttft": (0.3, 2.0), "queue": (0.04, 2.0), "prefill": (0.2, 2.0), "itl": (0.1, 5.0)},
             {"ttft": (1.5, 5.0), "queue": (0.06, 2.0), "prefill": (0.2, 2.0), "itl": (0.1, 5.0)}]
    b = latency_breakdown(before, after, client_ttft_mean_ms=250.0)
    # TTFT (0.3 + 0.5) / 4 = 200 ms; queue 0.1 / 4 = 25 ms; prefill 0.4 / 4 = 100 ms; ITL 0.2 / 10 = 20 ms
    assert b["ttft_mean_ms"] == 200.0 and b["queue_mean_ms"] == 25.0 and b["prefill_mean_ms"] == 100.0
    assert b["itl_mean_ms"] == 20.0
    assert b["front_ms"] == 125.0  # 250 - 25 - 100
    none = latency_breakdown([z], [z], client_ttft_mean_ms=250.0)
    assert none["ttft_mean_ms"] is None and none["front_ms"] is None
    with pytest.raises(ValueError):
        latency_breakdown([z], [z, z], None)


def test_measured_front_is_the_median_over_the_setups_rows() -> None:
    rows = lambda *fs: {"rows": [{"latency_breakdown": {"front_ms": f}} for f in fs]}  # noqa: E731
    doc = {"single": {"a": rows(10.0, 30.0), "b": rows(20.0, None)}, "pair": {}}
    assert measured_front_ms(doc, "single") == 20.0
    assert measured_front_ms(doc, "pair") is None


def test_window_is_bench_policies_rate_scaling() -> None:
    trace = [TraceRequest(t, 10, 5) for t in (0.0, 1000.0, 2000.0, 3000.0, 4000.0)]
    # native 1 rps, rate 2 rps: arrivals halved; 1.5 s window keeps 0, 500, 1000 ms
    out = window(trace, 1.0, 2.0, 1.5)
    assert [r.arrival_ms for r in out] == [0.0, 500.0, 1000.0]


def test_window_trace_k_is_the_kth_window_rebased() -> None:
    from loadgen.vllm_bench import window_trace

    trace = [TraceRequest(t, 10 + i, 5) for i, t in enumerate((0.0, 1000.0, 2000.0, 3000.0, 4000.0, 5000.0))]
    # native 1 rps, rate 2 rps, 1 s windows: window k holds trace arrivals [2k, 2k + 2) s, i.e. 2 requests
    assert window_trace(trace, 1.0, 2.0, 1.0, 0) == trace
    w1 = window(window_trace(trace, 1.0, 2.0, 1.0, 1), 1.0, 2.0, 1.0)
    assert [(r.arrival_ms, r.prompt_tokens) for r in w1] == [(0.0, 12), (500.0, 13)]
    w2 = window(window_trace(trace, 1.0, 2.0, 1.0, 2), 1.0, 2.0, 1.0)
    assert [(r.arrival_ms, r.prompt_tokens) for r in w2] == [(0.0, 14), (500.0, 15)]
    with pytest.raises(ValueError):
        window_trace(trace, 1.0, 2.0, 1.0, -1)


def test_pool_windows_sums_counts_and_weights_by_requests() -> None:
    from loadgen.vllm_bench import pool_windows

    a = {"rate_rps": 1.0, "requests": 30, "ok": 30, "failed": 0, "slo_attainment": 0.9, "ttft_p99_ms": 800.0,
         "rejected": {"slo-infeasible": 2}, "latency_breakdown": {"front_ms": 100.0}, "loadavg_after": [1.0]}
    b = {"rate_rps": 1.0, "requests": 10, "ok": 9, "failed": 1, "slo_attainment": 0.5, "ttft_p99_ms": 1200.0,
         "rejected": {"slo-infeasible": 1, "queue-timeout": 1}, "latency_breakdown": {"front_ms": 200.0},
         "loadavg_after": [2.0]}  # fmt: skip
    p = pool_windows([a, b])
    # (0.9 x 30 + 0.5 x 10) / 40 = 0.8 met; p99 (800 x 30 + 1200 x 10) / 40 = 900; front (3000 + 2000) / 40 = 125
    assert p["requests"] == 40 and p["ok"] == 39 and p["failed"] == 1
    assert p["slo_attainment"] == pytest.approx(0.8) and p["ttft_p99_ms"] == pytest.approx(900.0)
    assert p["rejected"] == {"slo-infeasible": 3, "queue-timeout": 1}
    assert p["latency_breakdown"]["front_ms"] == pytest.approx(125.0)
    assert p["loadavg_after"] == [2.0] and p["rate_rps"] == 1.0 and len(p["window_rows"]) == 2
    assert pool_windows([a]) == a
    with pytest.raises(ValueError):
        pool_windows([])


def test_verdict() -> None:
    assert verdict(1.1, 1.0) == "gain"
    assert verdict(0.9, 1.0) == "loss"
    assert verdict(1.03, 1.0) == "no gain"
    assert verdict(0.5, 0.0) == "gain" and verdict(0.0, 0.0) == "no gain"


def test_write_profile_row_replaces_only_its_row(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from loadgen.vllm_bench import write_profile_row

    path = tmp_path / "derived.csv"
    header = ("model,gpu,tp,variant,a_ms,b_ms_per_new_token,c_ms_per_context_token,d_ms_per_request,"
              "e_ms_per_chunk_token_sq,r2,max_rel_err,mean_rel_err,n_batches,kv_bytes_per_token,kv_capacity_tokens_90pct")
    other = "Llama-3-8B,H100,1,all_batches,7.05154,0.0251028,4.87136e-05,,,0.925217,0.329745,0.0878887,0,131072,467291"
    path.write_text(f"{header}\n{other}\nbench-llama,CPU,1,all_batches,1,1,1,,,1,1,1,1,4096,1\n")
    fit = {"linear": {"a_ms": 9.5, "b_ms": 0.7, "c_ms": 0.004, "r2": 0.8, "max_rel_err": 0.7, "mean_rel_err": 0.2},
           "steps": 107, "kv": {"num_gpu_blocks": 2048, "block_size": 128}}
    write_profile_row(fit, path)
    lines = path.read_text().splitlines()
    assert lines[:2] == [header, other]
    # 2048 blocks x 128 tokens = 262144 tokens; 4 layers x 2 x 2 KV heads x 64 x 4 bytes = 4096 bytes per token
    assert lines[2:] == ["bench-llama,CPU,1,all_batches,9.5,0.7,0.004,,,0.8,0.7,0.2,107,4096,262144"]


def test_markdown_table_by_hand() -> None:
    from loadgen.vllm_bench import markdown_table

    def rows(atts: list[float]) -> list[dict[str, float]]:
        return [{"rate_rps": r, "offered_rps": r * 0.9, "slo_attainment": a} for r, a in zip((1.0, 2.0), atts, strict=True)]

    doc = {"mode": "quick", "slo": {"ttft_ms": 650.0, "tpot_ms": 80.0, "rule": "r"},
           "single": {"vllm-default": {"rows": rows([1.0, 0.8]), "capacity_rps": 1.5, "capacity_bound": "interpolated"},
                      "fairbatching": {"rows": rows([1.0, 0.85]), "capacity_rps": 1.52, "capacity_bound": "interpolated"}},
           "simulated": {"single": {"vllm-default": {"rows": rows([1.0, 1.0]), "capacity_rps": 2.0,
                                                     "capacity_bound": "at-least"}}},
           "simulated_front": {"single": {"vllm-default": {"rows": rows([1.0, 0.7]), "capacity_rps": 1.2,
                                                           "capacity_bound": "interpolated"}}},
           }
    doc["single"]["vllm-default"]["rows"][0].update(
        ttft_mean_ms=250.0, not_ok_reasons={"failed:timeout": 2},
        latency_breakdown={"ttft_mean_ms": 200.0, "queue_mean_ms": 25.0, "prefill_mean_ms": 100.0, "front_ms": 125.0,
                           "itl_mean_ms": 20.0})  # fmt: skip
    table = markdown_table(doc)
    # sim / measured 2.0 / 1.5 = 1.33; sim + front / measured 1.2 / 1.5 = 0.80
    assert ("| 1 replica | vllm-default | 1.00 (0.90) / 2.00 (1.80) | 1.00 / 0.80 | 1.00 / 1.00 | 1.00 / 0.70 | - | 1.50 "
            "| >= 2.00 | 1.33 | 0.80 | - |") in table
    assert "| single | vllm-default | 1.00 | 250 | 200 | 25 | 100 | 125 | 20.0 | failed:timeout 2 |" in table
    # 1.52 / 1.5 = 1.013: within 5 %
    assert "fairbatching vs vllm-default: **no gain** (1.52 vs 1.5, capacity)" in table
    assert "| 1 replica | fairbatching | 1.00 (0.90) / 2.00 (1.80) | 1.00 / 0.85 | - | - | - | 1.52 | - | - | - | - |" in table
    # the slowdown variant: the seeds' mean with its 10-90 % spread, capacity 0.9 / 1.5 = 0.60
    slow_rows = [{**r, "attainment_p10": p10, "attainment_p90": p90}
                 for r, p10, p90 in zip(rows([0.95, 0.6]), (0.9, 0.5), (1.0, 0.7), strict=True)]  # fmt: skip
    doc["simulated_slowdown"] = {"single": {"vllm-default": {"rows": slow_rows, "capacity_rps": 0.9,
                                                             "capacity_bound": "interpolated"}}}
    assert ("| 1.00 / 0.70 | 0.95 (0.90-1.00) / 0.60 (0.50-0.70) | 1.50 | >= 2.00 | 1.33 | 0.80 | 0.60 |"
            in markdown_table(doc))


def test_step_time_drift_is_measured_over_predicted() -> None:
    from loadgen.vllm_bench import step_time_drift

    items = _grid()
    # every step twice as slow as the model, one step 4x: median 2, p90 2, mean (2 * (n - 1) + 4) / n
    lines = [_line(it, 2.0 * engine_ms(TRUE, it)) for it in items[:-1]] + [_line(items[-1], 4.0 * engine_ms(TRUE, items[-1]))]
    d = step_time_drift(lines, TRUE)
    n = len(items)
    assert d["steps"] == n and d["median_ratio"] == 2.0 and d["p90_ratio"] == 2.0
    assert d["mean_ratio"] == pytest.approx((2.0 * (n - 1) + 4.0) / n, abs=1e-3)
    assert step_time_drift([], TRUE) == {"steps": 0}


def test_decide_by_capacity_or_by_attainment() -> None:
    from loadgen.vllm_bench import decide

    def pol(cap: float, bound: str, atts: list[float]) -> dict:  # type: ignore[type-arg]
        return {"capacity_rps": cap, "capacity_bound": bound, "rows": [{"slo_attainment": a} for a in atts]}

    assert decide(pol(2.2, "interpolated", [1, 0.8]), pol(2.0, "interpolated", [1, 0.7]))["verdict"] == "gain"
    # both below the sweep: mean attainment 0.75 vs 0.85 -> loss
    d = decide(pol(0.0, "below-sweep", [0.8, 0.7]), pol(0.0, "below-sweep", [0.9, 0.8]))
    assert d["verdict"] == "loss" and d["a"] == 0.75 and d["b"] == 0.85
    assert decide(pol(3.0, "at-least", [1.0, 0.95]), pol(3.0, "at-least", [1.0, 0.93]))["verdict"] == "no gain"


def test_plugin_env_names_the_policy_only_when_asked() -> None:
    from loadgen.vllm_bench import PluginSettings, plugin_env

    env = plugin_env((9.5, 0.25, 0.001), {"ttft_ms": 870.0, "tpot_ms": 40.0}, plugin=PluginSettings("fairbatching-pd"))
    assert env["FAIRBATCH_POLICY"] == "fairbatching-pd" and env["FAIRBATCH_COEFFICIENTS"] == "9.5,0.25,0.001"
    assert (env["FAIRBATCH_TTFT_MS"], env["FAIRBATCH_TPOT_MS"]) == ("870.0", "40.0")
    assert "FAIRBATCH_POLICY" not in plugin_env((9.5, 0.25, 0.001), None)
    assert plugin_env((1.0, 0.1, 0.0), None, plugin=PluginSettings(plan_model="point"))["FAIRBATCH_PLAN_MODEL"] == "point"
    assert "FAIRBATCH_PLAN_MODEL" not in plugin_env((1.0, 0.1, 0.0), None)
    assert plugin_env((1.0, 0.1, 0.0), None, plugin=PluginSettings(decode_guard_ms=20.0))["FAIRBATCH_DECODE_GUARD_MS"] == "20"
    assert "FAIRBATCH_DECODE_GUARD_MS" not in plugin_env((1.0, 0.1, 0.0), None)


def test_fit_run_slowdown_of_steps_twice_the_model(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json as _json

    from loadgen.vllm_bench import fit_run_slowdown, run_slowdowns

    grid = _grid() * 4
    # every step exactly 2x the fitted model: ln 2 at the mean, no variance, so no component and no white noise
    lines = [{**_line(it, 2.0 * engine_ms(TRUE, it)), "start_ms": 1000.0 + 40.0 * i} for i, it in enumerate(grid)]
    log = tmp_path / "stock-steps.jsonl"
    log.write_text("".join(_json.dumps(x) + "\n" for x in lines))
    fit = fit_run_slowdown([(log, 0)], TRUE)
    assert fit is not None
    assert fit["model"]["log_mean"] == pytest.approx(math.log(2.0), abs=1e-9)
    assert fit["model"]["components"] == [] and fit["white_sigma"] == 0.0 and fit["steps"] == len(grid)
    assert fit_run_slowdown([(log, len(grid) - 10)], TRUE) is None  # 10 steps: too few
    assert fit_run_slowdown([(tmp_path / "missing.jsonl", 0)], TRUE) is None
    both = run_slowdowns(tmp_path, TRUE)
    assert set(both) == {"single"} and both["single"]["logs"] == ["stock-steps.jsonl"]


def test_sweep_groups_side_by_side_or_one_after_the_other() -> None:
    from loadgen.vllm_bench import sweep_groups

    t = {"vllm-default": "http://a", "fairbatching": "http://b"}
    assert sweep_groups(t, ["e0", "e1"], False) == [(t, ["e0", "e1"])]
    assert sweep_groups(t, ["e0", "e1"], True) == [({"vllm-default": "http://a"}, ["e0"]), ({"fairbatching": "http://b"}, ["e1"])]
    with pytest.raises(ValueError):
        sweep_groups(t, ["e0"], True)


def test_merge_results_sorts_rows_and_reads_the_capacity_again() -> None:
    from loadgen.vllm_bench import merge_results

    def block(pairs: list[tuple[float, float]]) -> dict[str, object]:
        return {"rows": [{"rate_rps": r, "slo_attainment": a} for r, a in pairs], "capacity_rps": 0.0,
                "capacity_bound": "at-least", "core": 0}

    slo = {"ttft_ms": 870.0, "tpot_ms": 40.0}
    low = {"slo": slo, "windows": 2, "rates_rps": {"single": [1.0, 2.0]}, "wall_s": 100.0,
           "single": {"vllm-default": block([(2.0, 0.95), (1.0, 1.0)])},
           "simulated": {"seeds": 8, "single": {"vllm-default": block([(1.0, 1.0), (2.0, 1.0)])}, "pair": {}}}
    high = {"slo": slo, "windows": 2, "rates_rps": {"single": [3.0, 4.0]}, "wall_s": 50.0,
            "single": {"vllm-default": block([(3.0, 0.85), (4.0, 0.6)])},
            "simulated": {"seeds": 8, "single": {"vllm-default": block([(3.0, 0.95), (4.0, 0.7)])}, "pair": {}}}
    m = merge_results([low, high])
    v = m["single"]["vllm-default"]
    assert [r["rate_rps"] for r in v["rows"]] == [1.0, 2.0, 3.0, 4.0] and v["core"] == 0
    # measured crossing of 0.9 between 2 (0.95) and 3 (0.85): 2 + 0.05 / 0.10 = 2.5
    assert v["capacity_rps"] == pytest.approx(2.5) and v["capacity_bound"] == "interpolated"
    # simulated between 3 (0.95) and 4 (0.7): 3 + 0.05 / 0.25 = 3.2; sim / measured - 1 = 0.28
    s = m["simulated"]["single"]["vllm-default"]
    assert s["capacity_rps"] == pytest.approx(3.2)
    assert m["comparison"][0]["gap"] == pytest.approx(0.28) and m["wall_s"] == 150.0
    assert [x["rates_rps"] for x in m["merged_from"]] == [{"single": [1.0, 2.0]}, {"single": [3.0, 4.0]}]
    with pytest.raises(ValueError):
        merge_results([low])
    with pytest.raises(ValueError):
        merge_results([low, {**high, "windows": 1}])


def test_rate_key_and_guard_argument() -> None:
    import argparse

    from loadgen.vllm_bench import _nonnegative_ms, rate_key

    # the client log and the simulator key a rate the same way: 4 decimals, no trailing zeros
    assert (rate_key(4.715), rate_key(6.13), rate_key(1.88612345), rate_key(3.0)) == ("4.715", "6.13", "1.8861", "3")
    assert _nonnegative_ms("20") == 20.0 and _nonnegative_ms("0") == 0.0
    for bad in ("-1", "nan", "inf"):
        with pytest.raises(argparse.ArgumentTypeError):
            _nonnegative_ms(bad)
