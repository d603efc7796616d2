"""Autoscaling rules (router/autoscale.py) and the fleet simulation's autoscaler (loadgen/fleet/sim.py)."""

from __future__ import annotations

import pytest

from loadgen.fleet.autoscale_bench import ramp_rate, thin
from loadgen.fleet.sim import AutoscaleConfig, FleetConfig, FleetRequest, run_fleet
from replica_agent.policy.time_model import TimeModel
from router.autoscale import FleetSignal, Stabilizer, pab_desired, waiting_desired

TM = TimeModel(9.8626, 0.0726711, 7.93966e-05)  # llama-3-8b-a100
KV = 467_291
H_MS = 900.0  # one idle replica's PAB: ttft 1000 ms x (1 - 0.1)


@pytest.mark.parametrize(
    ("signal", "expected"),
    [
        (FleetSignal(3, 0.0, 5), 4),  # queue waits, no PAB anywhere: out
        (FleetSignal(3, 120.0, 5), 3),  # queue waits but some PAB left: the dispatcher will place it
        (FleetSignal(3, 400.0, 0, refused=2), 4),  # refused for capacity since the last look: out
        (FleetSignal(3, 901.0, 0), 2),  # more than one idle replica's worth to spare: in
        (FleetSignal(3, 900.0, 0), 3),  # exactly one replica's worth: hold
        (FleetSignal(3, 2000.0, 1), 3),  # spare but someone waits (held for a starving head): hold
    ],
)
def test_pab_rule(signal: FleetSignal, expected: int) -> None:
    assert pab_desired(signal, H_MS) == expected


def test_waiting_rule_is_the_hpa_average_value_formula() -> None:
    assert waiting_desired(FleetSignal(2, 0.0, 0, num_waiting=12), 5.0) == 3  # ceil(12 / 5)
    assert waiting_desired(FleetSignal(2, 0.0, 0, num_waiting=10), 5.0) == 2
    assert waiting_desired(FleetSignal(4, 0.0, 0, num_waiting=0), 5.0) == 0  # raised to the minimum by clamping
    with pytest.raises(ValueError):
        waiting_desired(FleetSignal(1, 0.0, 0), 0.0)


def test_stabilizer_scales_out_at_once_and_in_after_a_window() -> None:
    s = Stabilizer(300.0, 1, 6)
    assert s.recommend(0.0, 4) == 4
    assert s.recommend(15.0, 2) == 4  # the 4 of t=0 is inside the window
    assert s.recommend(290.0, 5) == 5  # up: at once
    assert s.recommend(301.0, 2) == 5  # t=290's 5 still inside [1, 301]
    assert s.recommend(591.0, 2) == 2  # [291, 591]: only 2s left
    assert s.recommend(600.0, 0) == 2  # t=301's and t=591's 2 (clamped raws) inside [300, 600]
    assert s.recommend(901.0, 0) == 1  # [601, 901]: the 0 alone, clamped to the minimum
    assert s.recommend(902.0, 99) == 6  # and to the maximum


def test_ramp_profile_by_hand() -> None:
    # 1000 s: low until 150 s, linear to the peak at 400 s, peak until 600 s, down to low at 850 s
    assert ramp_rate(100.0, 1000.0, 2.0, 10.0) == 2.0
    assert ramp_rate(275.0, 1000.0, 2.0, 10.0) == pytest.approx(6.0)  # half-way up
    assert ramp_rate(500.0, 1000.0, 2.0, 10.0) == 10.0
    assert ramp_rate(725.0, 1000.0, 2.0, 10.0) == pytest.approx(6.0)
    assert ramp_rate(900.0, 1000.0, 2.0, 10.0) == 2.0
    reqs = [FleetRequest(t * 10.0, 10, 2) for t in range(100_000)]  # 100 req/s for 1000 s
    kept = thin(reqs, 1000.0, 20.0, 100.0, seed=0)
    low = sum(1 for r in kept if r.arrival_ms < 150_000) / 150.0
    peak = sum(1 for r in kept if 400_000 <= r.arrival_ms < 600_000) / 200.0
    assert low == pytest.approx(20.0, rel=0.1) and peak == pytest.approx(100.0, rel=0.02)


def fleet(signal: str, **kw: object) -> FleetConfig:
    return FleetConfig(policy="pab" if signal == "pab" else "round-robin", replicas=3, time_model=TM,
                       kv_capacity_tokens=KV, ttft_ms=1000.0, tpot_ms=100.0, drain_ms=30_000.0,
                       autoscale=AutoscaleConfig(signal, 1, 1, startup_ms=10_000.0, eval_period_ms=5_000.0,
                                                 stabilization_ms=30_000.0, waiting_target=5.0), **kw)  # fmt: skip


@pytest.mark.parametrize("signal", ["pab", "num-waiting"])
def test_an_overload_scales_out_and_new_replicas_serve_only_after_start_up(signal: str) -> None:
    # 40 s of 2000-token prompts at 12 req/s: one replica prefills at most 1000 / (a + b * 2000) = 6.4 per s
    reqs = [FleetRequest(i * 1000.0 / 12, 2000, 20) for i in range(480)]
    res = run_fleet(fleet(signal), reqs)
    st = res.stats
    assert st.scale_outs >= 1
    first_out = next(t for (t, n), (_, prev) in zip(st.replica_timeline[1:], st.replica_timeline) if n > prev)
    assert first_out % 5_000.0 == 0.0  # decided at an evaluation
    for rec in res.records:
        if rec.replica in ("r1", "r2") and rec.token_times_ms:
            assert rec.token_times_ms[0] >= first_out + 10_000.0  # nothing served before the start-up ends
    # GPU time is the integral of allocated replicas over the run (worked from the timeline)
    timeline = [*st.replica_timeline, (st.end_ms, st.replica_timeline[-1][1])]
    integral = sum(n * (t1 - t0) for (t0, n), (t1, _) in zip(timeline, timeline[1:]))
    assert st.gpu_ms == pytest.approx(integral)
    assert st.gpu_ms < 3 * st.end_ms  # fewer GPU-ms than the fixed fleet of 3


def test_a_fixed_fleet_pays_every_replica_the_whole_run() -> None:
    reqs = [FleetRequest(i * 100.0, 500, 10) for i in range(50)]
    res = run_fleet(FleetConfig(policy="pab", replicas=3, time_model=TM, kv_capacity_tokens=KV, ttft_ms=1000.0,
                                tpot_ms=100.0), reqs)  # fmt: skip
    assert res.stats.gpu_ms == pytest.approx(3 * res.stats.end_ms)
    assert res.stats.scale_outs == res.stats.scale_ins == 0


def test_autoscale_config_is_checked() -> None:
    with pytest.raises(ValueError, match="pab policy"):
        FleetConfig(policy="round-robin", replicas=2, time_model=TM, kv_capacity_tokens=KV, ttft_ms=1000.0,
                    tpot_ms=100.0, autoscale=AutoscaleConfig("pab", 1, 1))  # fmt: skip
    with pytest.raises(ValueError, match="min_replicas"):
        FleetConfig(policy="pab", replicas=2, time_model=TM, kv_capacity_tokens=KV, ttft_ms=1000.0,
                    tpot_ms=100.0, autoscale=AutoscaleConfig("pab", 2, 3))  # fmt: skip
