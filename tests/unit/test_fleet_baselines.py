"""Baseline placement profiles of the fleet benchmark (router/placement/baselines.py), hand-worked.

llm-d scores: queue ``(max_q - q) / (max_q - min_q)`` (1 when all equal), KV ``1 - usage``, prefix
``cached / prompt``; SGLang / vllm-router cache-aware rule; power-of-two; static-queue-cap in the fleet.
"""

from __future__ import annotations

import random

import pytest

from loadgen.fleet.sim import FleetConfig, FleetRequest, run_fleet
from replica_agent.policy.time_model import TimeModel
from router.placement import (
    SGLANG_CACHE_AWARE,
    VLLM_ROUTER_CACHE_AWARE,
    MetricsSample,
    PlacementRequest,
    PowerOfTwoPicker,
    ReplicaView,
    RouterLoad,
    default_registry,
)

TM = TimeModel(9.8626, 0.0726711, 7.93966e-05)
IDS = ("r0", "r1", "r2")


def views(ids: tuple[str, ...] = IDS) -> list[ReplicaView]:
    return [ReplicaView(rid, True, True, TM, {}, 32768) for rid in ids]


def scraped(waiting: tuple[int, ...], kv: tuple[float, ...]) -> RouterLoad:
    load = RouterLoad({rid: 0 for rid in IDS}, {})
    for rid, q, u in zip(IDS, waiting, kv, strict=True):
        load.scraped[rid] = MetricsSample(0, q, u, 0.0)
    load.version += 1
    return load


def test_llmd_scorer_queue_and_kv() -> None:
    # waiting 4, 0, 2 -> queue scores (4-4)/4 = 0, 1, (4-2)/4 = 0.5; KV usage 0.2, 0.9, 0.5 -> 0.8, 0.1, 0.5
    # sums: r0 0.8, r1 1.1, r2 1.0 -> r1, r2, r0
    policy = default_registry().build("llm-d-scorer", load=scraped((4, 0, 2), (0.2, 0.9, 0.5)), seed=3)
    assert policy.place(PlacementRequest("interactive", 100), views()).candidates == ("r1", "r2", "r0")
    # all queues equal: queue scores all 1, KV decides: r0 (0.8) first
    policy = default_registry().build("llm-d-scorer", load=scraped((1, 1, 1), (0.2, 0.9, 0.5)), seed=3)
    assert policy.place(PlacementRequest("interactive", 100), views()).candidates == ("r0", "r2", "r1")


def test_llmd_prefix_weights_three_two_two() -> None:
    # as above plus prefix 3 * cached / P with P = 1000: r0 holds 900 (2.7), r2 holds 100 (0.3)
    #   r0: 2.7 + 2 * 0 + 2 * 0.8 = 4.3;  r1: 0 + 2 * 1 + 2 * 0.1 = 2.2;  r2: 0.3 + 2 * 0.5 + 2 * 0.5 = 2.3
    policy = default_registry().build("llm-d-prefix", load=scraped((4, 0, 2), (0.2, 0.9, 0.5)), seed=3)
    req = PlacementRequest("interactive", 1000, cached_tokens={"r0": 900, "r2": 100})
    assert policy.place(req, views()).candidates == ("r0", "r2", "r1")
    # without any cached prefix it is the llm-d-scorer order with doubled weights: r1 (2.2), r2 (2.0), r0 (1.6)
    assert policy.place(PlacementRequest("interactive", 1000), views()).candidates == ("r1", "r2", "r0")


def load_of(counts: tuple[int, ...]) -> RouterLoad:
    return RouterLoad(dict(zip(IDS, counts, strict=True)), {})


def test_vllm_router_cache_aware_rule() -> None:
    reg = default_registry()
    req60 = PlacementRequest("interactive", 1000, cached_tokens={"r2": 600})
    req40 = PlacementRequest("interactive", 1000, cached_tokens={"r2": 400})
    # balanced (max - min = 5 <= 32): r2 holds 60 % > 0.5 -> r2; then the rest by load (r1 0, r0 5)
    pol = reg.build("vllm-router-cache-aware", load=load_of((5, 0, 3)))
    assert pol.place(req60, views()).candidates == ("r2", "r1", "r0")
    # 40 % <= 0.5: least loaded, r1
    assert pol.place(req40, views()).candidates == ("r1", "r2", "r0")
    # imbalanced: 40 - 2 = 38 > 32 and 40 > 1.1 * 2 -> least loaded even with 90 % cached on r0
    pol = reg.build("vllm-router-cache-aware", load=load_of((40, 2, 10)))
    assert pol.place(PlacementRequest("interactive", 1000, cached_tokens={"r0": 900}), views()).candidates[0] == "r1"
    # gap 33 > 32 but 40 <= 1.1 * 37 = 40.7: balanced, cache affinity wins
    pol = reg.build("vllm-router-cache-aware", load=load_of((40, 37, 38)))
    assert pol.place(PlacementRequest("interactive", 1000, cached_tokens={"r0": 900}), views()).candidates[0] == "r0"
    assert VLLM_ROUTER_CACHE_AWARE == {"cache_threshold": 0.5, "balance_abs": 32, "balance_rel": 1.1}


def test_sglang_cache_aware_defaults() -> None:
    reg = default_registry()
    req40 = PlacementRequest("interactive", 1000, cached_tokens={"r2": 400})
    # threshold 0.3: 40 % is enough for affinity (vllm-router's 0.5 is not)
    assert reg.build("sglang-cache-aware", load=load_of((5, 0, 3))).place(req40, views()).candidates[0] == "r2"
    # gap 60 <= 64: balanced although 61 > 1.5 * 1
    assert reg.build("sglang-cache-aware", load=load_of((61, 1, 3))).place(req40, views()).candidates[0] == "r2"
    # gap 65 > 64 and 66 > 1.5: imbalanced -> least loaded r1
    assert reg.build("sglang-cache-aware", load=load_of((66, 1, 3))).place(req40, views()).candidates[0] == "r1"
    assert SGLANG_CACHE_AWARE == {"cache_threshold": 0.3, "balance_abs": 64, "balance_rel": 1.5}


def test_power_of_two_picks_the_shorter_engine_queue_of_two_drawn() -> None:
    load = RouterLoad({}, {"r0": MetricsSample(3, 2, 0.0), "r1": MetricsSample(1, 0, 0.0)})
    pol = default_registry().build("power-of-two", load=load, seed=1)
    vs = views(("r0", "r1"))
    # two replicas: both drawn; engine queue running + waiting 5 vs 1 -> r1 first
    for _ in range(5):
        assert pol.place(PlacementRequest("interactive", 10), vs).candidates == ("r1", "r0")
    # 4 replicas with queues 0, 1, 2, 3: the answer is the better of the two drawn, never the worst one
    # (r3 only comes second); over 200 draws every pair shows up, so each of r0, r1, r2 leads sometimes
    load4 = RouterLoad({}, {f"r{i}": MetricsSample(i, 0, 0.0) for i in range(4)})
    pol4 = default_registry().build("power-of-two", load=load4, seed=7)
    vs4 = views(tuple(f"r{i}" for i in range(4)))
    firsts = set()
    for _ in range(200):
        c = pol4.place(PlacementRequest("interactive", 10), vs4).candidates
        assert len(c) == 2 and c[0] < c[1]  # lower index = shorter queue here
        firsts.add(c[0])
    assert firsts == {"r0", "r1", "r2"}


def test_power_of_two_tie_keeps_the_first_drawn() -> None:
    picker = PowerOfTwoPicker(seed=11)
    vs = views(("a", "b", "c"))
    draw = random.Random(11).sample(range(3), 2)  # the pair the picker draws first
    assert picker.order([(v, 0.0) for v in vs]) == [vs[draw[0]].replica_id, vs[draw[1]].replica_id]


def test_static_queue_cap_refuses_past_the_cap() -> None:
    # One replica, cap 1000 waiting prompt tokens, four 600-token prompts at t = 0.
    # #1: the engine is idle -> taken, its whole prefill runs in the first step (600 <= 2048).
    # #2: queued prompt tokens 0 (#1 is past its prefill) + 600 <= 1000 -> taken, waits.
    # #3: 600 (#2 waiting) + 600 > 1000 -> refused (429) and no other replica: rejected "queue-cap".
    # #4: the same.
    cfg = FleetConfig(policy="static-queue-cap", replicas=1, time_model=TM, kv_capacity_tokens=467_291,
                      ttft_ms=1000.0, tpot_ms=100.0, queue_cap_tokens=1000, max_num_batched_tokens=2048)  # fmt: skip
    res = run_fleet(cfg, [FleetRequest(0.0, 600, 3) for _ in range(4)])
    assert [r.outcome for r in res.records] == ["ok", "ok", "rejected", "rejected"]
    assert [r.reason for r in res.records[2:]] == ["queue-cap", "queue-cap"]


def test_cache_aware_router_learns_its_own_placements() -> None:
    # Two conversations A (ids 100, 200) and B (101, 201) of two 512-token blocks, three turns each:
    # A's first turn at 0 goes to r0 (loads equal: the first least loaded); B's at 1 ms finds r0
    # busy (load 1) and goes to r1. Later turns (2 s apart, each finished by then) match their
    # conversation's replica fully (rate min(1024, 1023) / 1024 > 0.5, loads balanced): affinity.
    times = [0.0, 1.0, 2000.0, 2001.0, 4000.0, 4001.0]
    reqs = [FleetRequest(t, 1024, 2, "t0", (100 + i % 2, 200 + i % 2)) for i, t in enumerate(times)]
    cfg = FleetConfig(policy="vllm-router-cache-aware", replicas=2, time_model=TM, kv_capacity_tokens=467_291,
                      ttft_ms=1000.0, tpot_ms=100.0)  # fmt: skip
    res = run_fleet(cfg, reqs)
    assert [r.replica for r in res.records] == ["r0", "r1"] * 3
    # each repeat hits both 512-token blocks but the last token: 1023 // 16 = 63 blocks = 1008 tokens
    assert res.stats.prefix_cache_queries == 6 * 1024
    assert res.stats.prefix_cache_hits == 4 * 1008
    assert res.stats.replica_requests == [3, 3]


@pytest.mark.parametrize("policy", ["pab", "pab-prefix"])
def test_pab_prefix_prices_the_uncached_prompt(policy: str) -> None:
    # One replica, H = 900 ms, engine steps of 8192 tokens. A 10,000-token prompt costs
    # a + b * 10000 = 736.6 ms. Its repeat (same 20 prefix ids of 512 tokens) arrives 0.5 ms later,
    # while the first one's lease holds b * 10000 = 726.7 ms of the budget.
    # - pab prices the whole prompt: it would start after the first prefill and end past the
    #   1000 ms TTFT, so the router's shedding rule refuses it (slo-infeasible).
    # - pab-prefix reads 10000 - min(20 * 512, 9999) = 1 uncached token from its prefix map
    #   (a + b = 9.9 ms fits) and reserves at once; the engine then hits what the first request has
    #   cached so far (its first 8192-token chunk: 512 blocks), so the repeat computes 1808 tokens.
    ids = tuple(range(20))
    reqs = [FleetRequest(500.0, 10_000, 2, "t0", ids), FleetRequest(500.5, 10_000, 2, "t0", ids)]
    cfg = FleetConfig(policy=policy, replicas=1, time_model=TM, kv_capacity_tokens=467_291, ttft_ms=1000.0,
                      tpot_ms=100.0)  # fmt: skip
    res = run_fleet(cfg, reqs)
    if policy == "pab":
        assert [r.outcome for r in res.records] == ["ok", "rejected"]
        assert res.records[1].reason == "slo-infeasible"
        assert res.stats.prefix_cache_hits == 0
    else:
        assert [r.outcome for r in res.records] == ["ok", "ok"]
        assert res.stats.grants == 2 and res.stats.refusals == 0
        assert res.stats.prefix_cache_hits == 8192
