"""Named GPU profiles and the `vllm serve` batch defaults the benchmarks give vLLM's own scheduler."""

from __future__ import annotations

import pytest

from replica_agent.policy.profiles import ServeBatchDefaults, available_profiles, load_profile, vllm_serve_batch_defaults


def test_profile_rows_from_the_shared_fits() -> None:
    # shared profiles/fits.md: Llama-3-8B on A100-80GB, a = 9.86 ms, b = 0.0727 ms/token, 467,291 KV tokens
    p = load_profile("llama-3-8b-a100")
    assert p.gpu == "A100"
    assert p.time_model.a_ms == pytest.approx(9.86, abs=0.01)
    assert p.time_model.b_ms_per_new_token == pytest.approx(0.0727, abs=1e-4)
    assert p.kv_capacity_tokens == 467_291
    assert load_profile("llama-2-70b-h100-tp4").gpu == "H100"
    assert "llama-2-7b-h100" in available_profiles()
    with pytest.raises(KeyError, match="known"):
        load_profile("gpt-9-tpu")


def test_vllm_serve_defaults_follow_vllm_0_32_get_batch_defaults() -> None:
    # vllm/engine/arg_utils.py EngineArgs.get_batch_defaults, OPENAI_API_SERVER context:
    # A100 (80 GB, but excluded by name) -> 2048 / 256; H100-80GB (>= 70 GiB) -> 8192 / 1024; >= 160 GiB -> 16384 / 1024
    assert vllm_serve_batch_defaults("A100") == ServeBatchDefaults(2048, 256)
    assert vllm_serve_batch_defaults("h100") == ServeBatchDefaults(8192, 1024)
    assert vllm_serve_batch_defaults("H200") == ServeBatchDefaults(8192, 1024)
    assert vllm_serve_batch_defaults("B200") == ServeBatchDefaults(16384, 1024)
    # the CPU branch of the same function (world size 1): 2048 * 1 tokens, 128 * 1 sequences
    assert vllm_serve_batch_defaults("cpu") == ServeBatchDefaults(2048, 128)
    with pytest.raises(KeyError, match="unknown GPU"):
        vllm_serve_batch_defaults("MI300X")


def test_bench_flags_default_to_vllm_serve_and_the_trace_granularity() -> None:
    import argparse

    from loadgen.bench_args import add_engine_and_trace_args, resolve_engine_and_trace_args

    p = argparse.ArgumentParser()
    p.add_argument("--profile")
    p.add_argument("--trace")
    add_engine_and_trace_args(p)
    a = p.parse_args(["--profile", "llama-2-70b-h100-tp4", "--trace", "mooncake-conv"])
    assert resolve_engine_and_trace_args(a) == ServeBatchDefaults(8192, 1024)
    assert (a.max_num_batched_tokens, a.max_num_seqs, a.arrival_spread_ms) == (8192, 1024, 3000.0)
    # explicit values win, including 0
    a = p.parse_args(["--profile", "llama-3-8b-a100", "--trace", "mooncake-conv", "--max-num-batched-tokens", "8192",
                      "--arrival-spread-ms", "0"])  # fmt: skip
    resolve_engine_and_trace_args(a)
    assert (a.max_num_batched_tokens, a.max_num_seqs, a.arrival_spread_ms) == (8192, 256, 0.0)


def test_serve_defaults_resolve_keeps_given_flags() -> None:
    a100 = vllm_serve_batch_defaults("A100")  # 2048 / 256
    assert a100.resolve(None, None) == ServeBatchDefaults(2048, 256)
    assert a100.resolve(8192, None) == ServeBatchDefaults(8192, 256)
    assert a100.resolve(None, 64) == ServeBatchDefaults(2048, 64)
