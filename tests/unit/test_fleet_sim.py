"""Fleet simulation (loadgen/fleet): hand-worked small cases."""

from __future__ import annotations

import math

import pytest

from loadgen.fleet.bench import analytic_bound
from loadgen.fleet.sim import FleetConfig, FleetRequest, FleetSim, replica_state, run_fleet, step_view
from loadgen.sim.engine import EngineConfig, SimEngine
from loadgen.traces import TraceRequest
from replica_agent.policy.leases import LeaseTable
from replica_agent.policy.pab import PendingPrefill
from replica_agent.policy.time_model import TimeModel
from router.placement import PlacementRequest, ReplicaView, RouterLoad, default_registry

TM = TimeModel(9.8626, 0.0726711, 7.93966e-05)  # llama-3-8b-a100
KV = 467_291


def cfg(policy: str, replicas: int = 2, **kw: object) -> FleetConfig:
    return FleetConfig(policy=policy, replicas=replicas, time_model=TM, kv_capacity_tokens=KV,
                       ttft_ms=1000.0, tpot_ms=100.0, **kw)  # type: ignore[arg-type]  # fmt: skip


def test_round_robin_alternates() -> None:
    # Far-apart short requests: each finishes before the next; replicas are taken in turn.
    reqs = [FleetRequest(i * 1000.0, 100, 2) for i in range(4)]
    res = run_fleet(cfg("round-robin"), reqs)
    assert [r.replica for r in res.records] == ["r0", "r1", "r0", "r1"]
    assert all(r.outcome == "ok" for r in res.records)


def test_least_outstanding_picks_emptier_replica() -> None:
    load = RouterLoad({"r0": 2, "r1": 0, "r2": 1}, {})
    policy = default_registry().build("least-outstanding", load=load, seed=0)
    views = [ReplicaView(rid, True, True, TM, {}, 32768) for rid in ("r0", "r1", "r2")]
    assert policy.place(PlacementRequest("interactive", 100), views).candidates == ("r1", "r2", "r0")


def test_least_outstanding_in_the_fleet_avoids_the_busy_replica() -> None:
    # A long request occupies one replica; the next two short ones both go to the other one
    # (the first short one finishes before the second arrives).
    reqs = [FleetRequest(0.0, 100, 500), FleetRequest(10.0, 100, 2), FleetRequest(500.0, 100, 2)]
    res = run_fleet(cfg("least-outstanding"), reqs)
    first = res.records[0].replica
    assert res.records[1].replica != first and res.records[2].replica != first


def test_pab_refuses_a_replica_whose_budget_a_lease_took() -> None:
    # H = 1000 * 0.9 = 900 ms. A 7000-token prompt costs a + b*7000 = 518.56 ms <= 900: granted.
    # The lease reserves b*7000 = 508.70 ms, leaving PAB 391.30 ms < 518.56 ms: the same prompt is refused.
    sim = FleetSim(cfg("pab", replicas=1), [])
    granted, lease_id, after = sim.reserve(0, 7000, 0.0)
    assert granted and lease_id
    assert after is not None and after.pab_ms == pytest.approx(900.0 - 0.0726711 * 7000)
    granted2, _, before2 = sim.reserve(0, 7000, 0.0)
    assert not granted2
    assert before2 is not None and before2.pab_ms == pytest.approx(391.3023)
    assert sim.stats.grants == 1 and sim.stats.refusals == 1 and sim.stats.double_spends == 0


def test_pab_reserve_plans_over_the_horizon_minus_the_wait() -> None:
    # Idle replica, H = 900 ms. A 7000-token prompt costs 518.56 ms. Aged 300 ms: H_w = 600 >= 518.56
    # and PAB_ms(H_w) = 600 (nothing reserved) -> granted; the answer is the fresh budget,
    # 900 - 508.70 = 391.30 ms. A second one aged 300 ms: H_w = 600, PAB_ms = 600 - 508.70 = 91.30
    # < 518.56 -> refused (a fresh one would be refused too: 391.30 < 518.56). A 2000-token prompt
    # (155.20 ms): fresh 155.20 <= 391.30 -> fits; aged 300 ms it is no longer on time (155.20 >
    # 91.30) but it takes the fresh budget all the same (pab.py "Work conservation") -> granted.
    sim = FleetSim(cfg("pab", replicas=1), [])
    granted, _, after = sim.reserve(0, 7000, 0.0, waited_ms=300.0)
    assert granted and after is not None and after.pab_ms == pytest.approx(391.3023)
    assert not sim.reserve(0, 7000, 0.0, waited_ms=300.0)[0]
    assert sim.reserve(0, 2000, 0.0, waited_ms=300.0)[0]
    assert sim.reserve(0, 2000, 0.0)[0]


def _burst() -> list[FleetRequest]:
    # 48 prompts of 3000 tokens within 40 ms, 8 routers, 2 replicas: each replica can take
    # floor(900 / (b * 3000)) = 4 at once, so budgets run out while views are 200 ms stale.
    return [FleetRequest(t * 0.8 + 300.0, 3000, 20, f"t{t % 2}") for t in range(48)]


def test_eight_routers_with_push_delay_no_double_spend_with_leases() -> None:
    c = cfg("pab", routers=8, push_period_ms=200.0, net_delay_ms=5.0)
    res = run_fleet(c, _burst())
    assert res.stats.double_spends == 0
    assert res.stats.refusals > 0  # the leases did refuse stale-view placements
    assert res.stats.grants == sum(1 for r in res.records if r.replica is not None)


def test_eight_routers_inline_admission_no_double_spend() -> None:
    # No Reserve round trip: each router places on its stale view and forwards at once; the agent
    # decides on arrival. The burst overruns the budgets (without leases it double-spends, below),
    # so routers do collide: the agents refuse those arrivals and the routers re-place them.
    c = cfg("pab", routers=8, push_period_ms=200.0, net_delay_ms=5.0, lease_mode="inline")
    res = run_fleet(c, _burst())
    assert res.stats.double_spends == 0
    assert res.stats.refusals > 0
    assert res.stats.reserve_answers == 0  # no Reserve call at all
    assert res.stats.grants == sum(1 for r in res.records if r.replica is not None)
    assert sum(r.outcome == "ok" for r in res.records) == sum(r.outcome == "ok" for r in run_fleet(
        cfg("pab", routers=8, push_period_ms=200.0, net_delay_ms=5.0), _burst()).records)


def test_change_pushes_coalesce_to_one_per_min_interval() -> None:
    # One replica, period 1000 ms (first push at a random phase < 1000 ms), requests every 30 ms from
    # t = 1100 ms on. Each request changes the budget at its grant (t) and its arrival (t + 0.5 ms,
    # one hop), then at its first token and its finish: with a snapshot per change (interval 0)
    # that is at least 2 pushes per request; with 20 ms the arrival's change waits for the grant's
    # push + 20 ms and takes the later changes of that window with it: fewer; periodic only: fewest.
    reqs = [FleetRequest(1100.0 + 30.0 * i, 500, 4) for i in range(10)]
    every = run_fleet(cfg("pab", replicas=1, push_period_ms=1000.0, min_push_interval_ms=0.0), reqs)
    coalesced = run_fleet(cfg("pab", replicas=1, push_period_ms=1000.0, min_push_interval_ms=20.0), reqs)
    periodic = run_fleet(cfg("pab", replicas=1, push_period_ms=1000.0), reqs)
    assert every.stats.pushes >= 2 * len(reqs)
    assert periodic.stats.pushes < coalesced.stats.pushes < every.stats.pushes
    assert all(r.outcome == "ok" for r in coalesced.records)


def test_eight_routers_without_leases_double_spend() -> None:
    c = cfg("pab", routers=8, push_period_ms=200.0, net_delay_ms=5.0, leases=False)
    res = run_fleet(c, _burst())
    assert res.stats.double_spends > 0


def test_analytic_bound_hand_computed() -> None:
    # a=10, b=0.1, c=0; P=100, O=11: W = 0.1 * 110 = 11 ms. At T = tpot = 100 ms:
    # time 1000 * (1 - 10/100) / 11 = 81.818 req/s; KV, seqs (232.7) and tokens (738) are looser.
    trace = [TraceRequest(0.0, 100, 11)] * 3
    b = analytic_bound(trace, TimeModel(10.0, 0.1, 0.0), 10**9, 100.0, replicas=2)
    assert b.limit == "time" and b.iteration_ms == pytest.approx(100.0)
    assert b.per_replica_rps == pytest.approx(900.0 / 11.0)
    assert b.rps == pytest.approx(2 * 900.0 / 11.0)


def test_analytic_bound_kv_limited() -> None:
    # KV 11000 tokens, K = 11*100 + 55 = 1155 token-iterations: kv(T) = 1000*11000/(1155 T),
    # time(T) = 1000 (1 - 10/T) / 11; they cross where 11e6 * 11 / 1155 = 1000 (T - 10) -> T = 114.76 > 100,
    # so T = 100 and kv = 95.24 > time = 81.8 -> still time-limited; with KV 5000: kv(100) = 43.29.
    trace = [TraceRequest(0.0, 100, 11)]
    b = analytic_bound(trace, TimeModel(10.0, 0.1, 0.0), 5000, 100.0, replicas=1)
    # time(T) = kv(T): 1000 (T - 10) / (11 T) = 5e6 / (1155 T) -> T = 10 + 47.619 = 57.62 ms.
    # The grid (T = 10 + k * 0.045) has 57.610 just left of the crossing (time 75.129 < kv 75.142:
    # time binds) and 57.655 just right (kv 75.084 < time 75.137: kv binds); 75.129 > 75.084, so
    # the left point wins and the limit named is "time", with kv within 0.02 % of it (both bind).
    assert b.limit == "time"
    assert b.iteration_ms == pytest.approx(57.61, abs=1e-6)
    kv_at = 5e6 / (1155 * b.iteration_ms)
    assert b.per_replica_rps == pytest.approx(1000 * (1 - 10 / b.iteration_ms) / 11, rel=1e-9)
    assert kv_at == pytest.approx(b.per_replica_rps, rel=2e-4) and kv_at > b.per_replica_rps
    assert b.per_replica_rps == pytest.approx(5e6 / (1155 * 57.619), rel=2e-3)


def test_deterministic() -> None:
    reqs = [FleetRequest(i * 7.0, 500 + 37 * i, 5 + i % 7, f"t{i % 3}") for i in range(60)]
    a = run_fleet(cfg("pab+fairbatching", replicas=3, routers=2), reqs)
    b = run_fleet(cfg("pab+fairbatching", replicas=3, routers=2), reqs)
    assert [r.token_times_ms for r in a.records] == [r.token_times_ms for r in b.records]
    assert all(r.outcome in ("ok", "rejected") for r in a.records)


def test_queued_request_retried_on_the_next_snapshot_not_only_at_its_deadline() -> None:
    # H = 900 ms. A (6000 tokens, prefill a + b*6000 = 445.9 ms) is granted at 100 ms; its lease
    # leaves PAB 900 - b*6000 = 463.97 ms < B's prefill a + b*6500 = 482.2 ms, so B (110 ms) waits
    # in the router queue with shed deadline 110 + 1000 - 482.2 = 627.8 ms. A's prefill ends at
    # ~546 ms; the next snapshot (push every 20 ms) shows the budget back and must trigger a
    # dispatcher pass that admits B. (Bug: a pass scheduled for the queue's earliest deadline
    # swallowed every wake-up before it, so B was only looked at when it expired: rejected.)
    # Not sheddable: B waits (max queue 2000 ms). Sheddable, the router's own rule refuses B at arrival:
    # it cannot start before A's prefill has freed its lease, 110 + 445.9 + 482.2 = 1038.1 ms, later
    # than its first-token deadline less the agents' margin, 1110 - 100 = 1010 ms (router/shedding.py).
    reqs = [FleetRequest(100.0, 6000, 2), FleetRequest(110.0, 6500, 2)]
    res = run_fleet(cfg("pab", replicas=1, push_period_ms=20.0, sheddable=False), reqs)
    a, b = res.records
    assert a.outcome == "ok" and b.outcome == "ok", (a.reason, b.reason)
    assert res.stats.grants == 2
    assert b.token_times_ms[0] - b.arrival_ms <= 1000.0
    shed = run_fleet(cfg("pab", replicas=1, push_period_ms=20.0), reqs)
    assert shed.records[0].outcome == "ok"
    assert (shed.records[1].outcome, shed.records[1].reason) == ("rejected", "slo-infeasible")


def test_request_arriving_before_any_snapshot_waits_for_the_first_one() -> None:
    # No budget is known at 0 ms (first pushes land within 100 ms); the queued request must be
    # placed once they arrive, not shed at its deadline 1000 - 445.9 ms.
    res = run_fleet(cfg("pab", replicas=2), [FleetRequest(0.0, 6000, 2)])
    assert res.records[0].outcome == "ok"
    assert res.records[0].token_times_ms[0] < 1000.0


@pytest.mark.timeout(600)  # three bench-fleet runs (each a steady-state bound over 10,108 prompts): ~40 s idle
def test_bench_fleet_merge_joins_policies_and_rows(tmp_path) -> None:
    import json

    from loadgen.fleet.bench import main as bench_main

    out = tmp_path / "fleet.json"
    common = ["--trace", "azure-conv", "--replicas", "2", "--duration-s", "4", "--drain-s", "20", "--out", str(out)]
    assert bench_main([*common, "--policies", "round-robin", "--rates", "1", "2"]) == 0
    assert bench_main([*common, "--policies", "pab", "--rates", "1", "--merge"]) == 0
    d = json.loads(out.read_text())
    assert list(d["policies"]) == ["round-robin", "pab"]  # POLICIES order, the first run's policy kept
    assert [r["rate_rps"] for r in d["policies"]["round-robin"]["rows"]] == [1.0, 2.0]
    row = d["policies"]["round-robin"]["rows"][0]  # every row carries the stream's bounds
    assert (row["interval_bound_grid_s"], row["interval_bound_max_span_s"]) == (1.0, 120.0)
    assert 0.0 <= row["interval_attainment_bound"] <= 1.0 and 0.0 <= row["attainment_bound"] <= 1.0
    rr_cap = d["policies"]["round-robin"]["capacity_rps"]
    assert d["policies"]["pab"]["x_round_robin"] == round(d["policies"]["pab"]["capacity_rps"] / rr_cap, 3)
    # the per-token floor's bound beside the per-request one: 90 % of the tokens cost more than the
    # cheapest 90 % of the requests (azure-conv's long prompts hold a larger share of its tokens)
    tb = d["token_steady_state_bound"]
    assert tb["served_by"] == "tokens" and 0.0 < tb["rps"] < d["steady_state_bound"]["rps"]
    rr = d["policies"]["round-robin"]
    assert rr["token_floor_of_token_bound"] == round(rr["capacity_token_floor_rps"] / tb["rps"], 3)
    # a rerun policy gets the union of its rows by rate
    assert bench_main([*common, "--policies", "round-robin", "--rates", "3", "--merge"]) == 0
    d = json.loads(out.read_text())
    assert [r["rate_rps"] for r in d["policies"]["round-robin"]["rows"]] == [1.0, 2.0, 3.0]
    assert d["rates"] == [1.0, 2.0, 3.0]
    # another fleet size is refused, the file is kept
    with pytest.raises(SystemExit, match=r"another replicas \(2 against 3\)"):
        bench_main([*common[:3], "3", *common[4:], "--policies", "pab", "--rates", "1", "--merge"])
    # the agents' horizon margin is recorded, and rows of another margin are not joined
    assert d["pab_margin_frac"] == 0.1
    with pytest.raises(SystemExit, match="another --pab-margin"):
        bench_main([*common, "--policies", "pab", "--rates", "1", "--merge", "--pab-margin", "0.05"])
    assert [r["rate_rps"] for r in json.loads(out.read_text())["policies"]["round-robin"]["rows"]] == [1.0, 2.0, 3.0]


def test_build_arrivals_window_offset_takes_other_trace_segments() -> None:
    from loadgen.fleet.bench import build_arrivals
    from loadgen.traces import TraceRequest

    # arrivals 0, 100, 200, 300 ms (span 300), prompt = 1..4 to tell them apart; one window, rate = native
    trace = [TraceRequest(100.0 * i, i + 1, 1) for i in range(4)]
    # offset 0.5: the window starts at 150 ms; t = ((a - 150) mod 300) / 1 -> 150, 250, 50, 150
    got = build_arrivals(trace, 2.0, 2.0, 10.0, 1, 0, window_offset=0.5)
    assert [(r.arrival_ms, r.prompt_tokens) for r in got] == [(50.0, 3), (150.0, 1), (150.0, 4), (250.0, 2)]
    # offset 0: starts at 0; a = 300 wraps to 0
    got0 = build_arrivals(trace, 2.0, 2.0, 10.0, 1, 0)
    assert [(r.arrival_ms, r.prompt_tokens) for r in got0] == [(0.0, 1), (0.0, 4), (100.0, 2), (200.0, 3)]
    with pytest.raises(ValueError, match="window_offset"):
        build_arrivals(trace, 2.0, 2.0, 10.0, 1, 0, window_offset=1.0)


def test_offered_capacity_uses_requests_in_the_window() -> None:
    from loadgen.bench_policies import capacity
    from loadgen.fleet.bench import capacity_text, offered_rows

    # labels 1, 2, 3 req/s; the 60 s windows hold 120, 150 and 300 requests = 2.0, 2.5, 5.0 req/s offered
    rows = [{"rate_rps": 1.0, "requests": 120, "slo_attainment": 0.95},
            {"rate_rps": 2.0, "requests": 150, "slo_attainment": 0.93},
            {"rate_rps": 3.0, "requests": 300, "slo_attainment": 0.80}]
    off = offered_rows(rows, 60.0)
    assert [r["rate_rps"] for r in off] == [2.0, 2.5, 5.0] and [r["label_rps"] for r in off] == [1.0, 2.0, 3.0]
    # label: 2 + (0.93 - 0.9) / (0.93 - 0.80) * 1 = 2.2308; offered: 2.5 + 0.03 / 0.13 * 2.5 = 3.0769
    assert capacity(rows, 0.9) == (pytest.approx(2.2308, abs=1e-4), "interpolated")
    assert capacity(off, 0.9) == (pytest.approx(3.0769, abs=1e-4), "interpolated")
    assert capacity_text(3.0769, "interpolated", off) == "3.08"
    assert capacity_text(0.0, "below-sweep", off) == "<2.00"
    assert capacity_text(5.0, "at-least", off) == ">=5.00"


def test_replica_state_counts_a_preempted_request_as_a_recompute_prefill() -> None:
    """tests/unit/test_sim_engine.py's preemption case: 4 blocks of 4 tokens, a and b with 8-token
    prompts; a's 2nd decode preempts b (1 token out, KV freed). PAB must see a as the only decode
    (context 9) and b as a prefill of its 9 tokens with nothing computed, as the plugin exports it;
    b counted as a decode reserved decode time and no KV for its recompute."""
    eng = SimEngine(EngineConfig(TimeModel(10.0, 0.1, 0.001), 4, 4, 8192, 256, 32768))
    eng.add_request("a", 8, max_tokens=5, arrival_ms=0.0, ttft_ms=1000.0, tpot_ms=100.0)
    eng.add_request("b", 8, max_tokens=5, arrival_ms=1.0, ttft_ms=1000.0, tpot_ms=100.0)
    eng.step(1.0)
    st = replica_state(eng, LeaseTable(), 20.0, 0.1)
    assert [d.context_tokens for d in st.decodes] == [9, 9] and st.prefills == []
    s = eng.step(20.0)
    assert s.preempted == ["b"]
    st = replica_state(eng, LeaseTable(), s.end_ms, 0.1)
    assert [(d.context_tokens, d.tokens_out) for d in st.decodes] == [(10, 2)]
    assert st.prefills == [PendingPrefill(9, 0)]
    assert st.kv_free_tokens == 4  # a holds 3 blocks of 4, one block free


def test_while_a_step_runs_the_agent_sees_the_engine_as_of_its_start() -> None:
    """A 1,000-token prompt runs as one step of 10 + 0.1 * 1,000 = 110 ms. The simulated engine applies a
    step's tokens when it starts, so at 50 ms, mid-step, it already shows the prompt computed and its first
    token out (due at 110). The plugin's state record of that step, which the agent reads, still counts the
    prompt as to do (replica_agent/plugin_mode.py), and so does the step's view: one pending prefill of
    1,000 tokens; with a 300-token prompt that came mid-step, in-flight reservation b * 1,300 = 130 ms and
    PAB 900 - 130 = 770 ms. Without the view PAB saw a decode whose next token is due at 110 + 100 = 210:
    floor((50 + 900 - 210) / 100) + 1 = 8 iterations of 10 + 0.1 = 10.1 ms, PAB 900 - 80.8 - 30 = 789.2
    ms, as if the prefill were done."""
    from replica_agent.policy.pab import SloClass, class_budget

    eng = SimEngine(EngineConfig(TimeModel(10.0, 0.1, 0.0), 1000, 16, 2048, 256, 32768))
    eng.add_request("p", 1000, max_tokens=5, arrival_ms=0.0, ttft_ms=1000.0, tpot_ms=100.0)
    view = step_view(eng)
    assert eng.step(0.0).end_ms == pytest.approx(110.0)
    eng.add_request("q", 300, max_tokens=5, arrival_ms=40.0, ttft_ms=1000.0, tpot_ms=100.0)  # came mid-step
    cls = SloClass("c", 1000.0, 100.0)
    mid = replica_state(eng, LeaseTable(), 50.0, 0.1, view=view)
    assert mid.decodes == [] and mid.prefills == [PendingPrefill(1000, 0), PendingPrefill(300, 0)]
    b = class_budget(mid, cls)
    assert b.inflight_reservation_ms == pytest.approx(130.0) and b.pab_ms == pytest.approx(770.0)
    # free KV as the record gives it, before the step took 63 blocks of 16 for the prompt's 1,000 tokens
    assert mid.kv_free_tokens == 1000 * 16 and eng.kv.free_blocks == 1000 - 63
    after = replica_state(eng, LeaseTable(), 50.0, 0.1)
    assert [(d.next_deadline_ms, d.tokens_out) for d in after.decodes] == [(210.0, 1)]
    assert after.prefills == [PendingPrefill(300, 0)]
    b = class_budget(after, cls)
    assert b.decode_iterations == 8 and b.pab_ms == pytest.approx(900.0 - 80.8 - 30.0)


def test_a_reserve_during_a_running_prefill_step_sees_that_prefill() -> None:
    """The fleet's wiring of the step view: one replica (TM, H = 900 ms, 8,192-token steps), a 7,000-token
    prompt whose one prefill step has started. A Reserve of another 7,000 tokens during that step must see
    the first as still to do: PAB 900 - b * 7000 = 391.30 ms < 518.56, refused (the figures of
    test_pab_refuses_a_replica_whose_budget_a_lease_took, there with a lease). Read after the step's
    tokens were applied, the first prompt would be a decode with one token due and the Reserve granted."""
    sim = FleetSim(cfg("pab", replicas=1, max_num_batched_tokens=8192), [])
    rep = sim.replicas[0]
    rep.engine.add_request("x", 7000, max_tokens=4, arrival_ms=0.0, ttft_ms=1000.0, tpot_ms=100.0)
    sim._start_step(0, 0.0)
    assert rep.stepping and rep.step_view is not None and rep.engine.running[0].tokens_out == 1
    granted, _, before = sim.reserve(0, 7000, 1.0)
    assert not granted and before is not None and before.pab_ms == pytest.approx(391.3023, abs=0.01)


def test_simulated_agent_pab_equals_the_real_plugin_path() -> None:
    """One engine state (16 requests with 4 different SLOs, 6 steps of FairBatching): the fleet
    simulation's PAB inputs equal what the real path computes from the plugin's export record
    (plugin_export.state_record -> plugin_mode.replica_state_from_record), budget for budget."""
    from replica_agent.plugin_export import state_record
    from replica_agent.plugin_mode import replica_state_from_record
    from replica_agent.policy.batching import PolicyConfig, SchedState, make_policy
    from replica_agent.policy.pab import SloClass, class_budget

    eng = SimEngine(EngineConfig(TM, 4000, 16, 2048, 256, 32768), make_policy("fairbatching", PolicyConfig(1000, 100)))
    slos = [(300.0, 30.0), (1000.0, 100.0), (2000.0, 50.0), (500.0, 200.0)]
    for i in range(16):
        ttft, tpot = slos[i % 4]
        eng.add_request(f"q{i}", 200 + 300 * i, max_tokens=40, arrival_ms=5.0 * i, ttft_ms=ttft, tpot_ms=tpot)
    t = 80.0
    for _ in range(6):
        t = eng.step(t).end_ms
    assert eng.num_running > 0 and any(r.first_token_ms is not None for r in eng.running)
    leases = LeaseTable(8, "x")
    leases.grant(500, "interactive", None, t, 5000.0)
    sim = replica_state(eng, leases, t, 0.1)
    state = SchedState(t, list(eng.running), list(eng.waiting), 2048, 256, eng.kv.free_blocks, 16, TM)
    rec = state_record(7, t, None, state, None, {}, 0, 0, None, 4000, 16, 1000.0, 100.0, TM, 0)
    real = replica_state_from_record(rec, t, TM, 0.1, [500])
    assert len(sim.decodes) == len(real.decodes) > 0 and len(sim.prefills) == len(real.prefills) > 1
    for a, b in zip(sim.decodes, real.decodes, strict=True):  # the record rounds deadlines to 1 us
        assert a.next_deadline_ms == pytest.approx(b.next_deadline_ms, abs=1e-3)
        assert (a.tpot_ms, a.context_tokens, a.tokens_out, a.max_tokens) == (b.tpot_ms, b.context_tokens,
                                                                             b.tokens_out, b.max_tokens)
    assert list(sim.prefills) == list(real.prefills) and sim.kv_free_tokens == real.kv_free_tokens
    for ttft, tpot in slos:
        cls = SloClass("c", ttft, tpot)
        bs, br = class_budget(sim, cls), class_budget(real, cls)
        assert bs.pab_ms == pytest.approx(br.pab_ms, abs=1e-6) and bs.pab_tokens == br.pab_tokens
        assert bs.decode_iterations == br.decode_iterations


def test_least_outstanding_tokens_weighs_prompts() -> None:
    # r0 holds one 10k-token request, r1 three 100-token ones: by count r0 wins, by tokens r1
    load = RouterLoad({}, {})
    load.add("r0", 10_000)
    for _ in range(3):
        load.add("r1", 100)
    views = [ReplicaView(rid, True, True, TM, {}, 32768) for rid in ("r0", "r1")]
    reg = default_registry()
    assert reg.build("least-outstanding", load=load, seed=0).place(PlacementRequest("i", 50), views).candidates[0] == "r0"
    assert reg.build("least-outstanding-tokens", load=load, seed=0).place(PlacementRequest("i", 50), views).candidates == ("r1", "r0")
    load.add("r1", -100)  # one finished
    assert (load.outstanding["r1"], load.outstanding_tokens["r1"]) == (2, 200)


def test_baseline_router_in_front_of_fairbatching_replicas() -> None:
    # least-outstanding+fairbatching: the same placement as least-outstanding, replicas batch by FairBatching
    reqs = [FleetRequest(i * 1000.0, 100, 2) for i in range(4)]
    sim = FleetSim(cfg("least-outstanding+fairbatching"), reqs)
    assert all(r.engine.policy.name == "fairbatching" for r in sim.replicas)
    res = sim.run()
    assert all(r.outcome == "ok" for r in res.records)


def test_snapshots_carry_the_engines_prefix_counters_to_the_router() -> None:
    # four 2048-token prompts of one conversation prefix (4 ids of 512 tokens; 40 decodes: pushes go on
    # after the last prompt is looked up), arriving after the
    # agents' first push, on one replica: every queried token reaches the router's book through the
    # agent's window (replica_agent/engine_metrics.py PrefixHitWindow), which the prefix correction reads
    reqs = [FleetRequest(500.0 + 300.0 * i, 2048, 40, prefix_ids=(7, 8, 9, 10)) for i in range(4)]
    cfg = FleetConfig(policy="pab-prefix", replicas=1, time_model=TM, kv_capacity_tokens=100_000, ttft_ms=1000.0,
                      tpot_ms=100.0, max_num_batched_tokens=2048)
    sim = FleetSim(cfg, reqs)
    res = sim.run()
    assert all(r.outcome == "ok" for r in res.records)
    eng = sim.replicas[0].engine
    assert eng.prefix_cache_hits > 0
    assert sim.routers[0].book.prefix_measured("r0") == (eng.prefix_cache_queries, eng.prefix_cache_hits)
    assert sim.routers[0].prefix_correction is not None


def _issue25_backlog(two_tenants: bool) -> FleetConfig:
    """Issue 25's fleet: 2 small replicas (2,000 blocks of 16 tokens, 16 sequences, 2,048 batched
    tokens), a non-sheddable class (TTFT 1 s, TPOT 100 ms, max queue 60 s), the router's start
    window (4 steps)."""
    return FleetConfig(policy="pab", replicas=2, time_model=TM, kv_capacity_tokens=2000 * 16, ttft_ms=1000.0,
                       tpot_ms=100.0, max_num_seqs=16, max_num_batched_tokens=2048, sheddable=False,
                       max_queue_ms=60_000.0, start_window_steps=4.0,
                       tenant_weights=(("acme", 1.0), ("beta", 1.0)) if two_tenants else (("acme", 1.0),))  # fmt: skip


@pytest.mark.parametrize("two_tenants", [False, True])
def test_a_burst_of_200_late_prompts_drains_and_the_watchdog_sees_no_stall(two_tenants: bool) -> None:
    # 200 x 1,000-token prompts at t = 0 (200 out): most of them lose their TTFT while they wait,
    # so the queue holds far more than one pass's 64 calls of late requests. Before issue 25's fix
    # the dispatcher spent every pass in phase 1 and the backlog stopped draining; now every one is
    # served, and the watchdog never saw a queue that did not move while a head could be placed.
    reqs = [FleetRequest(0.0, 1000, 200, "beta" if two_tenants and i % 4 == 0 else "acme") for i in range(200)]
    res = run_fleet(_issue25_backlog(two_tenants), reqs)
    assert [r.outcome for r in res.records].count("ok") == 200
    assert res.stats.dispatch_stalled_ms == 0.0
    # the scenario does exercise late starts: at most 2 x 16 sequences run at once and each holds
    # its slot for 200 decode steps of >= a = 9.86 ms (>= 1.97 s), so the 33rd prompt cannot have its
    # first token before 1.97 s, nearly twice its 1-s TTFT
    firsts = sorted(r.token_times_ms[0] - r.arrival_ms for r in res.records)
    assert firsts[32] > 1970.0


def test_four_router_copies_serve_a_sheddable_burst_on_time() -> None:
    # issue 27, item 3: 64 x 1,000-token prompts (50 out) 0.1 ms apart on 2 replicas, a sheddable
    # class (TTFT 500 / TPOT 50 ms), 4 router copies with inline admission (the default): each
    # router places on a view that lacks the others' latest placements. The agent is now asked for
    # an on-time start (x-fairbatch-on-time), so a sheddable request is refused, not started late:
    # before, 12 were served and one had its first token at 575 ms (> 500).
    def run(routers: int) -> list[float]:
        c = FleetConfig(policy="pab", replicas=2, time_model=TM, kv_capacity_tokens=KV, ttft_ms=500.0, tpot_ms=50.0,
                        routers=routers, sheddable=True, max_queue_ms=2000.0, lease_mode="inline",
                        start_window_steps=4.0, max_num_batched_tokens=2048, min_push_interval_ms=5.0)
        res = run_fleet(c, [FleetRequest(i * 0.1, 1000, 50) for i in range(64)])
        return [r.token_times_ms[0] - r.arrival_ms for r in res.records if r.outcome == "ok"]

    one, four = run(1), run(4)
    assert max(four) <= 500.0 and max(one) <= 500.0
    # the copies serve no more than one router does (they no longer serve late what one refuses)
    assert len(four) <= len(one) + 1 and len(four) >= len(one) - 2


@pytest.mark.parametrize("policy", ["round-robin", "pab"])
def test_engine_front_delay_adds_to_every_ttft_on_an_idle_fleet(policy: str) -> None:
    # far-apart requests, each alone on the fleet: the engine sees each one 40 ms later, so each TTFT is
    # exactly 40 ms longer (the engine's steps and the hops unchanged)
    reqs = [FleetRequest(i * 2000.0, 200 + 100 * i, 3) for i in range(4)]
    base = run_fleet(cfg(policy), reqs)
    late = run_fleet(cfg(policy, engine_front_ms=40.0), reqs)
    for a, b in zip(base.records, late.records, strict=True):
        assert a.outcome == b.outcome == "ok"
        assert b.token_times_ms[0] - a.token_times_ms[0] == pytest.approx(40.0)
    with pytest.raises(ValueError):
        cfg(policy, engine_front_ms=-1.0)


def test_fleet_config_carries_the_pab_margin_to_the_agents() -> None:
    import dataclasses

    from loadgen.fleet.bench import fleet_config, headline_setup

    setup = headline_setup((), 1.0, 2, "llama-3-8b-a100", 1000.0, 100.0, 10.0, 10.0, 0.0, None)
    assert fleet_config(setup, "pab").margin_frac == 0.1  # the agent's --margin-frac default
    cfg = fleet_config(dataclasses.replace(setup, margin_frac=0.05, margin_cap_tpots=2.5), "pab")
    assert (cfg.margin_frac, cfg.margin_cap_tpots) == (0.05, 2.5)


@pytest.mark.parametrize("cap,horizon", [(1.0, 4900.0), (math.inf, 4500.0), (2.5, 4750.0)])
def test_simulated_agents_plan_over_the_capped_horizon(cap: float, horizon: float) -> None:
    """TTFT 5 s / TPOT 100 ms, margin 0.1: H = 5000 - min(500, cap x 100). The Reserve's answer and the
    pushed snapshot (what the routers see) both carry it."""
    from loadgen.fleet.sim import _DELIVER

    c = FleetConfig(policy="pab", replicas=1, time_model=TM, kv_capacity_tokens=KV, ttft_ms=5000.0, tpot_ms=100.0,
                    margin_cap_tpots=cap)
    sim = FleetSim(c, [])
    granted, _, after = sim.reserve(0, 100, 0.0)
    assert granted and after is not None and after.horizon_ms == horizon
    sim._heap.clear()
    sim._on_push(0.0, 0, periodic=False)
    (snap,) = [payload[1] for _, _, kind, _, payload in sim._heap if kind == _DELIVER]
    assert snap.classes[0].horizon_ms == horizon


@pytest.mark.timeout(600)
def test_bench_fleet_bounds_a_prefix_trace_on_the_streams_it_offers(tmp_path) -> None:
    """mooncake-conv has prefix ids: fleet.json's per-token bound is taken on the streams the run offers
    (loadgen/fleet/bench.py ``stream_steady_bound``), below the trace-wide one it keeps beside it, and each
    policy's share of the bound is against it."""
    import json

    from loadgen.fleet.bench import main as bench_main

    out = tmp_path / "fleet.json"
    assert bench_main(["--trace", "mooncake-conv", "--replicas", "2", "--duration-s", "40", "--warmup-s", "10",
                       "--drain-s", "30", "--ttft-ms", "5000", "--rates", "1", "2", "--policies", "round-robin",
                       "--out", str(out)]) == 0
    d = json.loads(out.read_text())
    tb = d["token_steady_state_bound"]
    assert tb["on"] == "stream" and "error" not in tb and tb["grid_points"] > 10
    assert 0.0 < tb["rps"] < tb["trace_wide_rps"]
    rr = d["policies"]["round-robin"]
    if rr["token_floor_of_token_bound"] is not None:
        assert rr["token_floor_of_token_bound"] == round(rr["capacity_token_floor_rps"] / tb["rps"], 3)
    # per request too: the bound on the same streams (before, it charged every prompt token, so on a trace
    # whose engines skip cached prefixes it was not a bound), checked against a recomputation from the
    # stream's own requests: the grid rate below the figure passes (its stream's bound, credited with its
    # own prefixes, covers its offered rate) and the figure's own rate does not
    from loadgen.fleet.bench import PREFIX_BLOCK_TOKENS, build_arrivals, trace_rows
    from loadgen.fleet.bound import shared_prefix_tokens, steady_state_bound
    from loadgen.sim.engine_time import load_engine_time_model
    from replica_agent.policy.profiles import load_profile

    sb = d["steady_state_bound"]
    assert sb["on"] == "stream" and "error" not in sb and sb["grid_points"] > 10
    assert 0.0 < sb["rps"] < sb["trace_wide_rps"]
    assert sb["without_prefix_credit_rps"] > 0.0
    kept, native, _ = trace_rows("mooncake-conv", d["arrival_spread_ms"], 0, 32768)
    prof = load_profile("llama-3-8b-a100")
    engine = load_engine_time_model(None, prof.name)

    def passes(rate: float) -> bool:
        reqs = build_arrivals(kept, native, rate, 40.0, 2, 0, 0.0)
        h = shared_prefix_tokens([r.prefix_ids for r in reqs], [r.prompt_tokens for r in reqs], PREFIX_BLOCK_TOKENS,
                                 [r.arrival_ms for r in reqs], 5000.0)  # fmt: skip
        idx = [i for i, r in enumerate(reqs) if r.arrival_ms >= 10_000.0]
        b = steady_state_bound([reqs[i].prompt_tokens for i in idx], [reqs[i].output_tokens for i in idx],
                               engine if engine is not None else prof.time_model, 5000.0, 100.0, 2,
                               prof.kv_capacity_tokens, d["engine"]["max_num_seqs"],
                               d["engine"]["max_num_batched_tokens"], 0.9, cached_tokens=h[idx])  # fmt: skip
        return b.rps >= len(idx) / 30.0

    assert not passes(sb["rps"])
    assert passes(sb["rps"] / sb["grid_factor"])
    assert rr["fraction_of_steady_bound"] is None or rr["fraction_of_steady_bound"] == round(
        rr["capacity_rps"] / sb["rps"], 3)


def test_bench_fleet_bounds_only_recomputes_the_bounds_and_keeps_the_rows(tmp_path) -> None:
    """``--bounds-only --merge`` runs no policy: the file's rows stay as they are, and its bounds are what a
    fresh run with the same settings computes; a merge with another TTFT target (rows of another SLO) is
    refused."""
    import json

    from loadgen.fleet.bench import main as bench_main

    common = ["--trace", "azure-code", "--replicas", "2", "--duration-s", "30", "--warmup-s", "10", "--drain-s", "20",
              "--policies", "round-robin"]
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    assert bench_main([*common, "--rates", "1", "--out", str(first)]) == 0
    assert bench_main([*common, "--rates", "1", "--tpot-ms", "150", "--out", str(second)]) == 0  # other bounds
    a, b = json.loads(first.read_text()), json.loads(second.read_text())
    assert a["steady_state_bound"]["rps"] != b["steady_state_bound"]["rps"]
    # the file of the TPOT-150 run, its bounds recomputed at TPOT 100, would mix SLOs: refused
    with pytest.raises(SystemExit, match="tpot_ms"):
        bench_main([*common, "--bounds-only", "--merge", "--out", str(second)])
    # so would a plain merge of rows run with another drain, before running anything
    before = second.read_text()
    with pytest.raises(SystemExit, match="drain_s"):
        bench_main([*common, "--tpot-ms", "150", "--drain-s", "25", "--merge", "--out", str(second)])
    assert second.read_text() == before
    # the bounds (and the shares) of a doctored file come back as a fresh run computes them; the rows and the
    # file's own fields (run time, rates, search) stay
    rr_a = a["policies"]["round-robin"]
    doctored = dict(a, steady_state_bound={**a["steady_state_bound"], "rps": 1.0},
                    token_steady_state_bound={**a["token_steady_state_bound"], "rps": 1.0},
                    policies={"round-robin": {**rr_a, "fraction_of_steady_bound": -1.0,
                                              "token_floor_of_token_bound": -1.0}},
                    wall_s=12345.0)
    first.write_text(json.dumps(doctored))
    assert bench_main([*common, "--rates", "1", "3", "--bounds-only", "--merge", "--out", str(first)]) == 0
    c = json.loads(first.read_text())
    assert c["steady_state_bound"] == a["steady_state_bound"]
    assert c["token_steady_state_bound"] == a["token_steady_state_bound"]
    rr_c = c["policies"]["round-robin"]
    assert rr_c["rows"] == rr_a["rows"]
    assert rr_c["fraction_of_steady_bound"] == rr_a["fraction_of_steady_bound"] != -1.0
    assert rr_c["token_floor_of_token_bound"] == rr_a["token_floor_of_token_bound"]
    assert (c["wall_s"], c["rates"], c["search"]) == (12345.0, a["rates"], a["search"])
    with pytest.raises(SystemExit, match="bounds-only"):
        bench_main([*common, "--bounds-only", "--out", str(tmp_path / "none.json")])
