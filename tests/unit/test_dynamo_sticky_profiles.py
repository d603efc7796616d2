"""The ``dynamo-kv`` and ``llm-d-sticky`` baseline profiles (router/placement/dynamo_kv.py,
router/placement/sticky.py), hand-worked: Dynamo's cost, its softmax pick, busy thresholds and
their 529, its router queue; llm-d's affinity threshold, saturation bound tau and token-load
fallback; both in a small fleet simulation.

Block size 16 unless a test says otherwise; costs are in KV blocks.
"""

from __future__ import annotations

import json
import math
import random
from typing import Any

import pytest

from loadgen.fleet.sim import FleetConfig, FleetRequest, profile_params, run_fleet
from replica_agent.policy.time_model import TimeModel
from router.answers import overloaded
from router.core import CoreRequest, Placed, Queued, Refused, RouterCore
from router.endpoints import answer_response
from router.placement import (
    DynamoQueueGate,
    MetricsSample,
    PlacementRequest,
    ReplicaView,
    RouterLoad,
    default_registry,
    sticky_tau_tokens,
)
from router.placement.filters.dynamo_busy import DynamoBusyFilter
from router.placement.pickers.softmax import SoftmaxPicker, softmax_probabilities
from tests.fakes import FakeClock
from tests.unit.test_placement_profiles import NoReserve, snapshot, yaml_config

TM = TimeModel(9.8626, 0.0726711, 7.93966e-05)
IDS = ("A", "B", "C")


def views(ids: tuple[str, ...] = IDS) -> list[ReplicaView]:
    return [ReplicaView(rid, True, True, TM, {}, 32768) for rid in ids]


def three_workers() -> tuple[RouterLoad, PlacementRequest]:
    """P = 320 tokens (20 blocks).
    A: prefill 0, prompts in flight 640, holds 160 -> prefill (0 + 320 - 160) / 16 = 10, decode (640 + 320) / 16 = 60: 70
    B: prefill 160, prompts 160, holds 0        -> prefill (160 + 320) / 16 = 30,     decode (160 + 320) / 16 = 30: 60
    C: prefill 0, prompts 320, holds 330 (20 whole blocks = 320) -> prefill 0,       decode (320 + 320) / 16 = 40: 40
    """
    load = RouterLoad(prompt_tokens={"A": 640, "B": 160, "C": 320}, prefill_tokens={"B": 160})
    return load, PlacementRequest("i", 320, cached_tokens={"A": 160, "C": 330})


# ---------------------------------------------------------------- dynamo-kv: cost and pick


def test_dynamo_cost_on_three_workers_with_overlaps() -> None:
    load, req = three_workers()
    policy = default_registry().build("dynamo-kv", load=load, seed=1)
    scorer = policy.scorers[0][0]
    assert [scorer.cost(req, rid) for rid in IDS] == [70.0, 60.0, 40.0]
    # temperature 0: the lowest cost first, the rest by cost (the fallbacks)
    assert policy.place(req, views()).candidates == ("C", "B", "A")
    # overlap weight 0.5 halves the prefill term: A 5 + 60 = 65, B 15 + 30 = 45, C 0 + 40 = 40
    half = default_registry().build("dynamo-kv", load=load, seed=1, overlap_score_weight=0.5)
    assert [half.scorers[0][0].cost(req, rid) for rid in IDS] == [65.0, 45.0, 40.0]
    # block size 32: C holds 10 whole blocks (320): A (160 + 960) / 32 = 35, B (480 + 480) / 32 = 30, C 640 / 32 = 20
    big = default_registry().build("dynamo-kv", load=load, seed=1, block_size=32)
    assert [big.scorers[0][0].cost(req, rid) for rid in IDS] == [35.0, 30.0, 20.0]


def test_temperature_zero_breaks_ties_at_random_with_the_seed() -> None:
    vs = views()
    picks = {tuple(SoftmaxPicker(0.0, seed).order([(v, -5.0) for v in vs]))[0] for seed in range(20)}
    assert picks == set(IDS)  # equal costs: any of them first
    assert SoftmaxPicker(0.0).order([(v, -5.0) for v in vs]) == list(IDS)  # no seed: lowest id


def test_softmax_draw_follows_the_normalised_probabilities() -> None:
    # costs 70, 60, 40 at T = 1: normalised (c - 40) / 30 = 1, 2/3, 0 -> weights e^-1, e^-2/3, 1
    costs = [70.0, 60.0, 40.0]
    w = [math.exp(-1.0), math.exp(-2.0 / 3.0), 1.0]
    expected = [x / sum(w) for x in w]  # 0.1955, 0.2729, 0.5315
    assert softmax_probabilities(costs, 1.0) == pytest.approx(expected)
    assert softmax_probabilities([5.0, 5.0], 0.3) == [0.5, 0.5]
    vs = views()
    scored = [(v, -c) for v, c in zip(vs, costs, strict=True)]
    # one seeded draw: the picker draws one tie-break number per replica, then u
    rng = random.Random(7)
    _ = [rng.random() for _ in vs]
    u = rng.random()
    first = next(i for i in range(3) if u <= sum(expected[: i + 1]))
    order = SoftmaxPicker(1.0, 7).order(scored)
    assert order[0] == IDS[first]
    assert order[1:] == [rid for rid in ("C", "B", "A") if rid != IDS[first]]  # the rest by cost
    # and over many draws the frequencies are the probabilities
    picker, n = SoftmaxPicker(1.0, 11), 20_000
    counts = {rid: 0 for rid in IDS}
    for _ in range(n):
        counts[picker.order(scored)[0]] += 1
    assert [counts[rid] / n for rid in IDS] == pytest.approx(expected, abs=0.012)


# ---------------------------------------------------------------- dynamo-kv: busy thresholds, 529, router queue


def test_busy_thresholds_at_the_boundary() -> None:
    load = RouterLoad(prefill_tokens={"A": 1000, "B": 1001})
    load.scraped = {"A": MetricsSample(0, 0, 0.5), "B": MetricsSample(0, 0, 0.2), "C": MetricsSample(0, 0, 0.51)}
    req = PlacementRequest("i", 10)
    tokens = DynamoBusyFilter(load, active_prefill_tokens_threshold=1000)
    assert [r.replica_id for r in tokens.filter(req, views())] == ["A", "C"]  # 1000 is not over 1000
    blocks = DynamoBusyFilter(load, active_decode_blocks_threshold=0.5)
    assert [r.replica_id for r in blocks.filter(req, views())] == ["A", "B"]  # 0.5 is not over 0.5
    both = DynamoBusyFilter(load, 0.5, 1000)
    assert [r.replica_id for r in both.filter(req, views())] == ["A"]
    assert DynamoBusyFilter(load).filter(req, views()) == views()  # Dynamo's default: both off
    with pytest.raises(ValueError):
        DynamoBusyFilter(load, active_decode_blocks_threshold=1.5)


class Future:
    """The part of a future the core's hold queue uses."""

    def __init__(self) -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        self._done = False

    def done(self) -> bool:
        return self._done

    def set_result(self, value: Any) -> None:
        self._done, self.result = True, value

    def set_exception(self, exc: BaseException) -> None:
        self._done, self.error = True, exc


def dynamo_core(params: str) -> RouterCore:
    """Two replicas r0 (KV usage 0.25) and r1 (0.75), fresh snapshots, the dynamo-kv profile."""
    core = RouterCore(yaml_config(f"{{profile: dynamo-kv, seed: 1, params: {params}}}"), FakeClock(), NoReserve(),
                      Future, seed=1, replica_ids=["r0", "r1"])  # type: ignore[arg-type]
    core.book.update("r0", snapshot("r0", 1, 3, 2, 0.25))
    core.book.update("r1", snapshot("r1", 1, 1, 2, 0.75))
    return core


def req(n: int, prompt: int) -> CoreRequest:
    return CoreRequest(f"q{n}", "t", "i", prompt, 10, 0.0)


async def test_every_worker_busy_is_answered_529_overloaded() -> None:
    core = dynamo_core("{active_decode_blocks_threshold: 0.2}")  # both over 0.2 (0.25, 0.75)
    got = await core.acquire(req(1, 100))
    assert got == Refused("overloaded", detail="dynamo-busy")
    core = dynamo_core("{active_decode_blocks_threshold: 0.5}")  # r1 busy: r0 takes it
    got = await core.acquire(req(2, 100))
    assert isinstance(got, Placed) and got.grant.replica_id == "r0"
    answer = overloaded()
    resp = answer_response(answer)
    assert (resp.status, resp.headers["Retry-After"], resp.headers["x-fairbatch-reason"]) == (529, "1", "overloaded")
    body = json.loads(resp.body)  # type: ignore[arg-type]
    assert body["error"]["code"] == "overloaded" and body["error"]["type"] == "service_unavailable"


async def test_router_queue_holds_requests_while_every_worker_is_saturated() -> None:
    # bound = 0.5 * 1000 = 500 active prefill tokens per worker
    core = dynamo_core("{router_queue_threshold: 0.5, max_num_batched_tokens: 1000}")
    a = await core.acquire(req(1, 600))
    b = await core.acquire(req(2, 600))
    assert isinstance(a, Placed) and isinstance(b, Placed)
    assert {a.grant.replica_id, b.grant.replica_id} == {"r0", "r1"}  # the second avoids the first's prefill
    assert core.load.prefill_tokens == {"r0": 600, "r1": 600}
    assert core.load.prompt_tokens == {"r0": 600, "r1": 600}
    c = await core.acquire(req(3, 100))
    d = await core.acquire(req(4, 100))  # queued behind c although nothing changed: first come, first served
    assert isinstance(c, Queued) and isinstance(d, Queued) and core.held() == 2
    # a's first token: its 600 prefill tokens leave; its replica has room (0 <= 500): c, then d, are placed
    core.prefill_done(a.grant)
    assert core.held() == 0
    assert c.entry.future.result.replica_id == a.grant.replica_id
    assert d.entry.future.result.replica_id == a.grant.replica_id  # 100 <= 500: still room there
    core.prefill_done(a.grant)  # idempotent
    assert core.load.prefill_tokens == {a.grant.replica_id: 200, b.grant.replica_id: 600}
    core.lease_done(b.grant)
    assert core.load.prompt_tokens == {a.grant.replica_id: 800}
    # None disables the queue (every request placed at once)
    free = dynamo_core("{router_queue_threshold: null, max_num_batched_tokens: 1000}")
    for i in range(4):
        assert isinstance(await free.acquire(req(i, 600)), Placed)


def test_queue_gate_counts_only_healthy_workers() -> None:
    load = RouterLoad(prefill_tokens={"A": 33, "B": 33})
    gate = DynamoQueueGate(load, 16.0, 2)  # bound 32
    assert gate.saturated(views(("A", "B")))
    assert not gate.saturated(views(("A", "B", "C")))  # C has room
    sick = [ReplicaView("C", False, True, TM, {}, 32768)]
    assert gate.saturated(views(("A", "B")) + sick)
    assert not gate.saturated([])


# ---------------------------------------------------------------- llm-d-sticky


def sticky(load: RouterLoad, tau: int = 1000, **kw: Any) -> Any:
    return default_registry().build("llm-d-sticky", load=load, seed=2, tau_tokens=tau, exploration_probability=0.0,
                                    **kw)  # fmt: skip


def test_affinity_threshold_at_079_and_080() -> None:
    # A holds the prompt but carries the most outstanding tokens; B is the least loaded
    load = RouterLoad(outstanding_tokens={"A": 5000, "B": 100, "C": 2000})
    below = PlacementRequest("i", 1000, cached_tokens={"A": 790})
    at = PlacementRequest("i", 1000, cached_tokens={"A": 800})
    policy = sticky(load)
    assert policy.place(below, views()).candidates == ("B", "C", "A")  # 0.79 < 0.8: token load
    assert policy.place(at, views()).candidates == ("A", "B", "C")  # 0.8 keeps it, then by token load
    # two sticky replicas: the less loaded of them
    both = PlacementRequest("i", 1000, cached_tokens={"A": 900, "C": 850})
    assert policy.place(both, views()).candidates == ("C", "B", "A")


def test_tau_exceeded_falls_back_to_token_load() -> None:
    load = RouterLoad(outstanding_tokens={"A": 5000, "B": 100, "C": 2000}, prefill_tokens={"A": 1000})
    req = PlacementRequest("i", 1000, cached_tokens={"A": 1000})
    assert sticky(load, tau=1000).place(req, views()).candidates[0] == "A"  # 1000 in flight, not over tau
    load.prefill_tokens["A"] = 1001
    assert sticky(load, tau=1000).place(req, views()).candidates == ("B", "C", "A")  # saturated


def test_exploration_skips_the_gate() -> None:
    load = RouterLoad(outstanding_tokens={"A": 5000, "B": 100})
    req = PlacementRequest("i", 1000, cached_tokens={"A": 1000})
    always = default_registry().build("llm-d-sticky", load=load, seed=2, tau_tokens=10**6, exploration_probability=1.0)
    assert always.place(req, views(("A", "B"))).candidates[0] == "B"


def test_tau_from_the_profile_by_hand() -> None:
    # llama-3-8b-a100: a = 9.8626 ms, b = 0.0726711 ms/token; vllm serve on an A100: 2048 tokens per step.
    # A full 2048-token prefill step: 9.8626 + 0.0726711 * 2048 = 158.6930 ms -> 12,905.4 tok/s;
    # x 5 s (prefix-cache-affinity-filter's maxTTFTPenaltyMs) = 64,527 tokens; x 14 s (the blog's) = 180,675.9
    assert sticky_tau_tokens("llama-3-8b-a100") == 64_527
    assert sticky_tau_tokens("llama-3-8b-a100", 14_000.0) == 180_675  # floored
    # 8192-token steps: 9.8626 + 595.3217 = 605.1843 ms -> 13,536.3 tok/s x 5 s = 67,681
    assert sticky_tau_tokens("llama-3-8b-a100", 5000.0, 8192) == 67_681
    assert default_registry().build("llm-d-sticky", seed=1).tau_tokens == 64_527  # the profile's default
    # the fleet simulation calibrates it from its own time model and step budget
    cfg = FleetConfig(policy="llm-d-sticky", replicas=2, time_model=TM, kv_capacity_tokens=467_291,
                      ttft_ms=1000.0, tpot_ms=100.0, max_num_batched_tokens=2048)  # fmt: skip
    assert profile_params(cfg, "llm-d-sticky") == {"tau_tokens": 64_527}
    assert profile_params(cfg, "dynamo-kv") == {"block_size": cfg.block_size, "max_num_batched_tokens": 2048}


# ---------------------------------------------------------------- both in the fleet simulation


@pytest.mark.parametrize("policy", ["dynamo-kv", "llm-d-sticky", "dynamo-kv+fairbatching"])
def test_conversations_stay_on_their_replica_in_the_fleet(policy: str) -> None:
    # Conversations A (ids 100, 200) and B (101, 201), two 512-token blocks, three turns each, 2 s apart.
    # A's first turn takes one replica; B's (1 ms later) finds it loaded (A's prompt in flight) and takes
    # the other; each later turn finds its prefix on its conversation's replica (dynamo: prefill 0 there;
    # sticky: 1024 / 1024 >= 0.8, nothing in flight) and returns there.
    times = [0.0, 1.0, 2000.0, 2001.0, 4000.0, 4001.0]
    reqs = [FleetRequest(t, 1024, 2, "t0", (100 + i % 2, 200 + i % 2)) for i, t in enumerate(times)]
    cfg = FleetConfig(policy=policy, replicas=2, time_model=TM, kv_capacity_tokens=467_291, ttft_ms=1000.0,
                      tpot_ms=100.0)  # fmt: skip
    res = run_fleet(cfg, reqs)
    assert [r.outcome for r in res.records] == ["ok"] * 6
    homes = [r.replica for r in res.records]
    assert homes[0] != homes[1] and homes == homes[:2] * 3
    assert res.stats.prefix_cache_hits == 4 * 1008  # every repeat hits all but the last token's block
