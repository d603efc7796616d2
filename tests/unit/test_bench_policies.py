"""Capacity from a sweep (DistServe's definition, interpolated) under either attainment yardstick."""

from __future__ import annotations

from loadgen.bench_policies import capacity


def test_capacity_interpolates_where_attainment_crosses_the_target() -> None:
    rows = [
        {"rate_rps": 1.0, "slo_attainment": 1.00, "envelope_attainment": 1.00},
        {"rate_rps": 2.0, "slo_attainment": 0.95, "envelope_attainment": 0.99},
        {"rate_rps": 3.0, "slo_attainment": 0.85, "envelope_attainment": 0.93},
        {"rate_rps": 4.0, "slo_attainment": 0.50, "envelope_attainment": 0.80},
    ]
    # TTFT/TPOT: crosses 0.9 between 2 (0.95) and 3 (0.85): 2 + (0.95 - 0.9) / (0.95 - 0.85) * 1 = 2.5
    cap, bound = capacity(rows, 0.9)
    assert bound == "interpolated" and abs(cap - 2.5) < 1e-9
    # envelope: crosses between 3 (0.93) and 4 (0.80): 3 + 0.03 / 0.13 = 3.2308
    cap, bound = capacity(rows, 0.9, "envelope_attainment")
    assert bound == "interpolated" and abs(cap - (3 + 0.03 / 0.13)) < 1e-9


def test_capacity_bounds() -> None:
    assert capacity([{"rate_rps": 1.0, "slo_attainment": 0.5}], 0.9) == (0.0, "below-sweep")
    assert capacity([{"rate_rps": 1.0, "slo_attainment": 0.95}, {"rate_rps": 2.0, "slo_attainment": 0.91}], 0.9) == (
        2.0, "at-least")


def test_trace_start_skips_the_gap_at_the_start_of_azure_code(tmp_path) -> None:
    import json

    from loadgen.bench_policies import main
    from loadgen.traces import load_trace, resolve_trace

    arrivals_s = [r.arrival_ms / 1000.0 for r in load_trace(resolve_trace("azure-code"))]
    # the data: 63 requests in the first 39.3 s, then nothing until 183.06 s
    assert sum(a < 183.0 for a in arrivals_s) == 63 and 39.0 < arrivals_s[62] < 39.5 and 183.0 < arrivals_s[63] < 183.1
    native = len(arrivals_s) / (arrivals_s[-1] - arrivals_s[0])
    out = tmp_path / "b.json"
    assert main(["--trace", "azure-code", "--ttft-ms", "1000", "--tpot-ms", "100", "--policies", "vllm-default",
                 "--rates", "1.0", "--duration-s", "60", "--trace-start-s", "183", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    # rate 1.0 scales arrival times by native / 1.0, so a 60 s window covers 60 * 1.0 / native s of
    # trace from 183 s on
    end_s = 183.0 + 60.0 * 1.0 / native
    expected = sum(183.0 <= a < end_s for a in arrivals_s)
    assert result["trace_start_s"] == 183.0
    assert result["policies"]["vllm-default"]["rows"][0]["requests"] == expected
    # the rate label is the trace's long-run average (gaps included): this dense segment offers
    # about three times the labelled rate
    assert expected > 2.5 * 60


def test_hash_ids_reach_the_engines_prefix_cache() -> None:
    from dataclasses import replace

    from loadgen.bench_policies import BenchSetup, run_point
    from loadgen.traces import TraceRequest

    # three 1024-token prompts far apart (each done before the next): the second repeats the first
    # (ids 1, 2), the third shares only its first 512-token block (ids 1, 3). vLLM hits at most
    # prompt - 1 tokens, in whole 16-token blocks: 1023 // 16 * 16 = 1008 for the second, 512 for the
    # third; queried 3 * 1024. Hit ratio (0 + 1008 + 512) / 3072.
    trace = (TraceRequest(0.0, 1024, 4, (1, 2)), TraceRequest(10_000.0, 1024, 4, (1, 2)),
             TraceRequest(20_000.0, 1024, 4, (1, 3)))  # fmt: skip
    setup = BenchSetup(trace, 1.0, "llama-3-8b-a100", "all_batches", 1000.0, 100.0, 60.0, 2048, 64, 16, 32768, None)
    row = run_point(setup, "vllm-default", 1.0)
    assert row["requests"] == 3 and row["slo_attainment"] == 1.0
    assert row["prefix_hit_ratio"] == (1008 + 512) / 3072
    assert run_point(replace(setup, prefix_caching=False), "vllm-default", 1.0)["prefix_hit_ratio"] == 0.0
    no_ids = replace(setup, trace=tuple(TraceRequest(r.arrival_ms, r.prompt_tokens, r.output_tokens) for r in trace))
    assert run_point(no_ids, "vllm-default", 1.0)["prefix_hit_ratio"] == 0.0


def test_engine_front_delay_adds_to_the_ttft_of_a_lone_request() -> None:
    from dataclasses import replace

    import pytest

    from loadgen.bench_policies import BenchSetup, run_point
    from loadgen.traces import TraceRequest

    # one request a minute: each alone on the engine, which sees it 50 ms after its arrival; TTFT counts from
    # the arrival, so its p50 is 50 ms longer; a TTFT target between the two TTFTs turns the hit into a miss
    trace = tuple(TraceRequest(i * 60_000.0, 512, 4) for i in range(3))
    setup = BenchSetup(trace, 1.0, "llama-3-8b-a100", "all_batches", 1000.0, 100.0, 180.0, 2048, 64, 16, 32768, None)
    base = run_point(setup, "vllm-default", 1.0)
    late = run_point(replace(setup, engine_front_ms=50.0), "vllm-default", 1.0)
    assert late["ttft_p50_ms"] - base["ttft_p50_ms"] == pytest.approx(50.0)
    ttft = base["ttft_p50_ms"]
    tight = replace(setup, ttft_ms=ttft + 25.0)
    assert run_point(tight, "vllm-default", 1.0)["slo_attainment"] == 1.0
    assert run_point(replace(tight, engine_front_ms=50.0), "vllm-default", 1.0)["slo_attainment"] == 0.0
