"""loadgen/delivery.py: the delivery delay of real tokens, matched by request id, and its use in the
simulator (hand-worked values)."""

from __future__ import annotations

import dataclasses

import pytest

from loadgen.bench_policies import BenchSetup, run_point
from loadgen.delivery import centred_pairs, delivery_pairs, request_key, shift_token_times, summarize_delivery
from loadgen.sim.engine_time import EngineTimeModel
from loadgen.traces import TraceRequest


def test_request_key_is_the_replays_id_inside_vllms() -> None:
    assert request_key("cmpl-lg-1a2b3c4d-17-0-9f8e7d6c") == "lg-1a2b3c4d-17"
    assert request_key("cmpl-lg-1a2b3c4d-17") == "lg-1a2b3c4d-17"
    assert request_key("chatcmpl-abc") is None


def test_pairs_match_by_key_and_subtract_the_engine_times() -> None:
    engine = [{"rid": "cmpl-lg-aa-1-0-x", "first_mono_ms": 1000.0, "last_mono_ms": 1300.0},
              {"rid": "cmpl-lg-aa-2-0-y", "first_mono_ms": 2000.0, "last_mono_ms": 2100.0},
              {"rid": "grid-warmup", "first_mono_ms": 5.0, "last_mono_ms": 6.0}]  # fmt: skip
    client = [{"key": "lg-aa-2", "first_mono_ms": 2012.0, "last_mono_ms": 2140.0},  # 12 ms, then 40 ms
              {"key": "lg-aa-1", "first_mono_ms": 1020.0, "last_mono_ms": 1310.0},  # 20, 10
              {"key": "lg-aa-3", "first_mono_ms": 1.0, "last_mono_ms": 2.0}]  # never reached the engine's log
    assert delivery_pairs(client, engine) == [(12.0, 40.0), (20.0, 10.0)]
    # mean d_first 16: centred (12 - 16, 40 - 16), (20 - 16, 10 - 16)
    assert centred_pairs([(12.0, 40.0), (20.0, 10.0)]) == [(-4.0, 24.0), (4.0, -6.0)]
    s = summarize_delivery([(12.0, 40.0), (20.0, 10.0)])
    assert s["requests"] == 2 and s["d_first_ms"]["mean"] == 16.0 and s["d_last_minus_first_ms"]["p50"] == 9.0
    assert s["centred_pairs_ms"] == [[-4.0, 24.0], [4.0, -6.0]]
    assert summarize_delivery([]) == {"requests": 0}
    assert len(summarize_delivery([(float(i), 0.0) for i in range(50)], max_samples=10)["centred_pairs_ms"]) == 10


def test_shift_moves_first_and_last_and_keeps_order() -> None:
    # 4 tokens 10 ms apart; first +0, last +30: shifts 0, 10, 20, 30 -> gaps 20 ms
    assert shift_token_times([0.0, 10.0, 20.0, 30.0], (0.0, 30.0)) == [0.0, 20.0, 40.0, 60.0]
    # the last earlier than the first by more than the gaps: held at the token before (never out of order)
    assert shift_token_times([0.0, 1.0, 2.0], (10.0, 0.0)) == [10.0, 10.0, 10.0]
    assert shift_token_times([5.0], (-2.0, 7.0)) == [3.0]
    assert shift_token_times([], (1.0, 1.0)) == []


def test_the_simulator_delivers_with_the_pairs() -> None:
    """One request, 11 tokens; an engine with a constant 10-ms step (a = 10): TPOT 10 ms at the engine.
    With a single pair (0, +30 ms) every simulated request's TPOT at the client is 10 + 30 / 10 = 13 ms
    (over a 12-ms target: attainment 0), and TTFT is unchanged."""
    trace = (TraceRequest(0.0, 16, 11),)
    engine = EngineTimeModel(a_ms=10.0, b_ms=0.0)
    base = BenchSetup(trace, 1.0, "llama-3-8b-a100", "all_batches", 1000.0, 12.0, 1.0, 2048, 256, 16, 4096, None,
                      engine, online_time_model=False)  # fmt: skip
    plain = run_point(base, "vllm-default", 1.0)
    late = run_point(dataclasses.replace(base, delivery_ms=((0.0, 30.0),)), "vllm-default", 1.0)
    assert plain["tpot_p50_ms"] == pytest.approx(10.0)
    assert late["tpot_p50_ms"] == pytest.approx(13.0)
    assert plain["ttft_p50_ms"] == pytest.approx(late["ttft_p50_ms"])
    assert plain["slo_attainment"] == 1.0 and late["slo_attainment"] == 0.0


def test_bench_joins_the_client_and_engine_logs_per_policy_and_rate(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json

    from loadgen.vllm_bench import run_delivery

    def write(name: str, rows: list[dict]) -> None:
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))

    write("single-client-tokens.jsonl", [
        {"target": "vllm-default", "rate": 1.5, "key": "lg-a-0", "first_mono_ms": 105.0, "last_mono_ms": 210.0},
        {"target": "vllm-default", "rate": 3.0, "key": "lg-b-0", "first_mono_ms": 302.0, "last_mono_ms": 420.0},
        {"target": "fairbatching", "rate": 1.5, "key": "lg-c-0", "first_mono_ms": 110.0, "last_mono_ms": 250.0},
    ])
    write("stock-requests.jsonl", [{"rid": "cmpl-lg-a-0-0-x", "first_mono_ms": 100.0, "last_mono_ms": 200.0, "tokens": 5},
                                   {"rid": "cmpl-lg-b-0-0-y", "first_mono_ms": 300.0, "last_mono_ms": 400.0, "tokens": 5}])
    write("single-fairbatching-requests.jsonl", [{"rid": "cmpl-lg-c-0-0-z", "first_mono_ms": 100.0,
                                                  "last_mono_ms": 200.0, "tokens": 9}])  # fmt: skip
    got = run_delivery(tmp_path)
    d = got["vllm-default"]
    # pairs (5, 10) at 1.5 rps and (2, 20) at 3 rps; pooled mean d_first 3.5
    assert d["delivery"]["requests"] == 2 and "centred_pairs_ms" not in d["delivery"]  # quantiles only
    assert d["delivery"]["d_first_ms"]["mean"] == 3.5 and d["delivery"]["d_last_minus_first_ms"]["p50"] == 11.5
    assert set(d["delivery_by_rate"]) == {"1.5", "3"}
    assert d["delivery_by_rate"]["3"]["centred_pairs_ms"] == [[0.0, 18.0]]  # one pair: centred on itself
    assert got["fairbatching"]["delivery_by_rate"]["1.5"]["d_last_minus_first_ms"]["p50"] == 40.0  # 50 - 10


def test_a_truncated_log_line_is_left_out(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from loadgen.vllm_bench import _read_log

    p = tmp_path / "requests.jsonl"
    p.write_text('{"rid": "a", "tokens": 3}\n\n{"rid": "b", "tok')  # the writer was killed mid-line
    assert _read_log(p) == [{"rid": "a", "tokens": 3}]
    assert _read_log(tmp_path / "missing.jsonl") == []


def test_the_http_sim_engine_plans_with_the_decode_guard() -> None:
    import argparse

    from loadgen.sim.server import SimServer, add_arguments, config_from_args

    ap = argparse.ArgumentParser()
    add_arguments(ap)
    cfg = config_from_args(ap.parse_args(["--policy", "fairbatching", "--decode-guard-ms", "15"]))
    assert cfg.decode_guard_ms == 15.0
    assert SimServer(cfg).engine.policy.decode_guard_ms == 15.0  # type: ignore[attr-defined]
    assert config_from_args(ap.parse_args([])).decode_guard_ms == 0.0
