"""Heterogeneous fleets in the fleet simulation and bench-fleet (issue 27 item 3): replica kinds
(loadgen/fleet/sim.py ``ReplicaKind``), ``--fleet`` parsing, the summed steady-state bound, and the
derived llama-3-8b-h100 profile (scripts/derive_gpu_profile.py)."""

from __future__ import annotations

import pytest

from loadgen.fleet.bench import kinds_steady_bound, parse_fleet
from loadgen.fleet.bound import steady_state_bound
from loadgen.fleet.sim import FleetConfig, FleetRequest, FleetSim, ReplicaKind, run_fleet
from loadgen.sim.engine_time import load_engine_time_model
from replica_agent.policy.time_model import TimeModel
from replica_agent.policy.profiles import load_profile

SLOW = TimeModel(10.0, 0.1, 0.0)  # a prompt of 1,000 tokens: a 110-ms prefill step
FAST = TimeModel(5.0, 0.05, 0.0)  # the same prompt: 55 ms


def two_kinds(policy: str = "round-robin") -> FleetConfig:
    kinds = (ReplicaKind("slow", 1, SLOW, 100_000, None, 2048, 256), ReplicaKind("fast", 1, FAST, 100_000, None, 8192, 1024))
    return FleetConfig(policy=policy, replicas=2, time_model=SLOW, kv_capacity_tokens=100_000, ttft_ms=1000.0,
                       tpot_ms=100.0, replica_kinds=kinds, online_time_model=False)  # fmt: skip


def test_each_kind_steps_at_its_own_model_and_batch_settings() -> None:
    sim = FleetSim(two_kinds(), [])
    assert [r.engine.config.max_num_batched_tokens for r in sim.replicas] == [2048, 8192]
    assert [r.engine.config.max_num_seqs for r in sim.replicas] == [256, 1024]
    # far-apart 1,000-token prompts, round-robin: r0 (slow) and r1 (fast) in turn; the first token comes one
    # prefill step after arrival plus the same network hops on both, so the TTFTs differ by 110 - 55 = 55 ms
    res = run_fleet(two_kinds(), [FleetRequest(i * 2000.0, 1000, 2) for i in range(4)])
    assert [r.replica for r in res.records] == ["r0", "r1", "r0", "r1"]
    ttft = [r.ttft_ms for r in res.records]
    assert ttft[0] - ttft[1] == pytest.approx(55.0, abs=1e-6)
    assert ttft[2] - ttft[3] == pytest.approx(55.0, abs=1e-6)
    assert ttft[1] >= 55.0


def test_kind_counts_must_sum_to_the_replicas() -> None:
    kinds = (ReplicaKind("slow", 1, SLOW, 100_000, None, 2048, 256),)
    with pytest.raises(ValueError, match="replica_kinds"):
        FleetConfig(policy="round-robin", replicas=2, time_model=SLOW, kv_capacity_tokens=1, ttft_ms=1.0,
                    tpot_ms=1.0, replica_kinds=kinds)  # fmt: skip
    with pytest.raises(ValueError, match="count"):
        ReplicaKind("none", 0, SLOW, 1, None, 1, 1)


def test_parse_fleet_takes_each_kinds_profile_engine_and_vllm_defaults() -> None:
    a, h = parse_fleet("8:llama-3-8b-a100, 8:llama-3-8b-h100")
    assert (a.count, a.name, a.max_num_batched_tokens, a.max_num_seqs) == (8, "llama-3-8b-a100", 2048, 256)
    assert (h.count, h.name, h.max_num_batched_tokens, h.max_num_seqs) == (8, "llama-3-8b-h100", 8192, 1024)
    assert a.engine_time is not None and h.engine_time is not None
    assert h.engine_time.a_ms < a.engine_time.a_ms
    # 'policy': the engines step at each kind's own profile (an oracle engine)
    assert all(k.engine_time is None for k in parse_fleet("1:llama-3-8b-a100,1:llama-3-8b-h100", "policy"))
    for bad in ("8", "x:llama-3-8b-a100", "8-llama-3-8b-a100"):
        with pytest.raises(ValueError):
            parse_fleet(bad)
    with pytest.raises(KeyError):
        parse_fleet("2:no-such-gpu")


def test_derived_h100_profile_is_the_a100_fit_times_the_70b_ratios() -> None:
    # fitted_coefficients.csv: Llama-2-70B TP4 A100 (32.6424, 0.185676, 3.5466e-05), H100 (23.3386, 0.0641382,
    # 2.17601e-05); Llama-3-8B A100 (9.8626, 0.0726711, 7.93966e-05)
    h = load_profile("llama-3-8b-h100")
    assert h.time_model.a_ms == pytest.approx(9.8626 * 23.3386 / 32.6424, rel=1e-5)
    assert h.time_model.b_ms_per_new_token == pytest.approx(0.0726711 * 0.0641382 / 0.185676, rel=1e-5)
    assert h.time_model.c_ms_per_context_token == pytest.approx(7.93966e-05 * 2.17601e-05 / 3.5466e-05, rel=1e-5)
    assert h.gpu == "H100" and h.kv_capacity_tokens == load_profile("llama-3-8b-a100").kv_capacity_tokens
    eng_a = load_engine_time_model(None, "llama-3-8b-a100")
    eng_h = load_engine_time_model(None, "llama-3-8b-h100")
    assert eng_h.b_ms == pytest.approx(eng_a.b_ms * 0.0641382 / 0.185676, rel=1e-4)
    assert eng_h.e_ms == pytest.approx(eng_a.e_ms * 2.17601e-05 / 3.5466e-05, rel=1e-4)


def test_heterogeneous_steady_bound_is_the_sum_over_kinds() -> None:
    prompts, outputs = [500, 1500, 3000, 200] * 10, [100, 50, 20, 300] * 10
    kinds = (ReplicaKind("slow", 3, SLOW, 100_000, None, 2048, 256), ReplicaKind("fast", 2, FAST, 100_000, None, 8192, 1024))
    want = (steady_state_bound(prompts, outputs, SLOW, 1000.0, 100.0, 3, 100_000, 256, 2048, 0.9).rps
            + steady_state_bound(prompts, outputs, FAST, 1000.0, 100.0, 2, 100_000, 1024, 8192, 0.9).rps)  # fmt: skip
    assert kinds_steady_bound(kinds, prompts, outputs, 1000.0, 100.0) == pytest.approx(want)
    assert want > 0
