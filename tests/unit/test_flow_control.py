"""llm-d-flow-control (router/placement/saturation.py, router/placement/flow_control.py, router/core.py
``RouterCore.dispatch_held``), hand-worked.

Detector defaults (llm-d v0.8 = GIE v1.5.0 utilization detector): queueDepthThreshold Q = 5,
kvCacheUtilThreshold KV = 0.8, metricsStalenessThreshold 200 ms; pool saturation = mean over replicas
of max(waiting / Q, kv / KV) (1 for a replica without fresh metrics); saturated at >= 1.
"""

from __future__ import annotations

import asyncio
import collections

import pytest

from loadgen.fleet.sim import FleetConfig, FleetRequest, FleetSim
from replica_agent.policy.time_model import TimeModel
from router.admission_queue import QueueTimeout
from router.answers import flow_control
from router.core import Placed, Queued, Refused
from router.placement import MetricsSample, default_registry
from router.placement.flow_control import FlowControlQueue, FlowControlSettings, FlowItem, band_key
from router.placement.saturation import UtilizationDetector
from tests.unit.test_placement_profiles import make_core, request, snapshot

D = UtilizationDetector()


def sample(waiting: int, kv: float, at: float = 0.0) -> MetricsSample:
    return MetricsSample(0, waiting, kv, at)


# ---------------------------------------------------------------- the saturation detector


def test_detector_defaults_are_llm_ds() -> None:
    assert (D.queue_depth_threshold, D.kv_cache_util_threshold, D.metrics_staleness_ms, D.rule) == (5, 0.8, 200.0,
                                                                                                   "gradient")
    s = FlowControlSettings()
    assert (s.fairness, s.ttl_ms, s.band_max_bytes, s.band_max_requests, s.max_bytes, s.max_requests,
            s.reject_sheddable) == ("global-strict", None, 1_000_000_000, 0, 0, 0, False)  # fmt: skip


@pytest.mark.parametrize(("waiting", "kv", "score", "saturated"), [
    (4, 0.0, 0.8, False),      # 4 / 5
    (5, 0.0, 1.0, True),       # 5 / 5: at the threshold is saturated (>= 1)
    (0, 0.79, 0.9875, False),  # 0.79 / 0.8
    (0, 0.8, 1.0, True),       # 0.8 / 0.8
    (3, 0.6, 0.75, False),     # max(0.6, 0.75)
    (6, 0.2, 1.2, True),
])  # fmt: skip
def test_one_replica_roofline_score_at_the_boundary(waiting: int, kv: float, score: float, saturated: bool) -> None:
    samples = {"r0": sample(waiting, kv)}
    assert D.endpoint_score(samples["r0"], 0.0) == pytest.approx(score)
    assert D.saturated(samples, ["r0"], 0.0) is saturated


def test_pool_saturation_is_the_mean_over_replicas() -> None:
    # r0 waiting 10 (score 2), r1 idle (0): mean 1.0 -> saturated although r1 has room
    assert D.saturation({"r0": sample(10, 0.0), "r1": sample(0, 0.0)}, ["r0", "r1"], 0.0) == 1.0
    assert D.saturated({"r0": sample(10, 0.0), "r1": sample(0, 0.0)}, ["r0", "r1"], 0.0)
    # waiting 9 (1.8) and 0: mean 0.9 -> not saturated
    assert not D.saturated({"r0": sample(9, 0.0), "r1": sample(0, 0.0)}, ["r0", "r1"], 0.0)
    # a replica never heard from scores 1: idle r0 (0) + unknown r1 (1) = 0.5
    assert D.saturation({"r0": sample(0, 0.0)}, ["r0", "r1"], 0.0) == 0.5
    assert D.saturation({}, [], 0.0) == 1.0  # no replica at all: saturated


def test_stale_metrics_score_one() -> None:
    s = {"r0": sample(0, 0.0, at=100.0), "r1": sample(0, 0.0, at=0.0)}
    # at t = 200 both are at most 200 ms old (an age equal to the threshold is fresh): 0
    assert D.saturation(s, ["r0", "r1"], 200.0) == 0.0
    # at t = 200.5 r1 is 200.5 ms old: stale, scores 1 -> mean 0.5
    assert D.saturation(s, ["r0", "r1"], 200.5) == 0.5
    # at t = 301 both stale: 1 -> saturated although both engines are idle
    assert D.saturated(s, ["r0", "r1"], 301.0)


def test_headroom_rule_of_gie_v1_0() -> None:
    h = UtilizationDetector(rule="headroom")
    # a pod has headroom while waiting <= 5 and kv <= 0.8 (fresh); saturated only when none has
    assert not h.saturated({"r0": sample(5, 0.8), "r1": sample(50, 1.0)}, ["r0", "r1"], 0.0)
    assert h.saturated({"r0": sample(6, 0.0), "r1": sample(0, 0.81)}, ["r0", "r1"], 0.0)
    assert h.saturated({"r0": sample(0, 0.0, at=0.0)}, ["r0"], 201.0)  # stale: no headroom


@pytest.mark.parametrize("kwargs", [{"queue_depth_threshold": 0}, {"kv_cache_util_threshold": 0.0},
                                    {"kv_cache_util_threshold": 1.01}, {"metrics_staleness_ms": 0.0},
                                    {"rule": "other"}])  # fmt: skip
def test_detector_rejects_bad_thresholds(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        UtilizationDetector(**kwargs)  # type: ignore[arg-type]


# ---------------------------------------------------------------- the flow-control queue


def item(flow: str, at: float, band: tuple[int, int] = (0, 0), size: int = 10, deadline: float = float("inf"),
         name: str = "") -> FlowItem:  # fmt: skip
    return FlowItem(flow, band, size, at, deadline, name or f"{flow}{at:g}")


def drain(q: FlowControlQueue) -> list[str]:
    out = []
    while (i := q.pop()) is not None:
        out.append(i.payload)
    return out


def test_bands_strictly_by_priority_sheddable_last() -> None:
    q = FlowControlQueue()
    assert band_key(0, True) > band_key(5, False) > band_key(0, False)
    q.push(item("a", 1.0, band_key(0, True), name="shed"))
    q.push(item("a", 2.0, band_key(1, False), name="band1"))
    q.push(item("b", 3.0, band_key(0, False), name="band0"))
    assert drain(q) == ["band0", "band1", "shed"]  # the newest, in band 0, first


def test_global_strict_is_fcfs_over_the_band_and_within_a_flow() -> None:
    q = FlowControlQueue()
    for flow, at in (("a", 1.0), ("a", 3.0), ("b", 2.0), ("c", 4.0), ("b", 5.0)):
        q.push(item(flow, at))
    assert drain(q) == ["a1", "b2", "a3", "c4", "b5"]


def test_round_robin_between_flows_fcfs_within() -> None:
    q = FlowControlQueue(FlowControlSettings(fairness="round-robin"))
    for flow, at in (("a", 1.0), ("a", 2.0), ("a", 3.0), ("b", 4.0), ("c", 5.0)):
        q.push(item(flow, at))
    # flows in sorted id order, the next after the last served: a, b, c, then a's rest FCFS
    assert drain(q) == ["a1", "b4", "c5", "a2", "a3"]
    # the cursor survives its flows emptying: a was served last, so b (the flow after a) goes first
    # although a's request is older
    q.push(item("a", 6.0))
    q.push(item("b", 7.0))
    assert drain(q) == ["b7", "a6"]


def test_round_robin_cursor_after_the_last_flow_served() -> None:
    q = FlowControlQueue(FlowControlSettings(fairness="round-robin"))
    q.push(item("b", 1.0))
    assert drain(q) == ["b1"]  # cursor: b
    q.push(item("a", 2.0))
    q.push(item("c", 3.0))
    assert drain(q) == ["c3", "a2"]  # after b comes c, then wrap to a


def test_capacity_limits_reject_the_push() -> None:
    q = FlowControlQueue(FlowControlSettings(band_max_requests=2))
    assert q.push(item("a", 1.0)) and q.push(item("b", 2.0))
    assert not q.push(item("c", 3.0))  # band (0, 0) holds 2
    assert q.push(item("c", 3.0, band=(0, 1)))  # another band has room
    q = FlowControlQueue(FlowControlSettings(band_max_bytes=25))
    assert q.push(item("a", 1.0, size=10)) and q.push(item("a", 2.0, size=15))
    assert not q.push(item("a", 3.0, size=1))  # 10 + 15 + 1 > 25
    q = FlowControlQueue(FlowControlSettings(max_requests=1))
    assert q.push(item("a", 1.0)) and not q.push(item("b", 2.0, band=(0, 1)))  # global limit over all bands
    assert len(q) == 1


def test_expire_and_remove() -> None:
    q = FlowControlQueue()
    a, b, c = item("a", 0.0, deadline=100.0), item("a", 1.0, deadline=101.0), item("b", 2.0)
    for i in (a, b, c):
        q.push(i)
    assert q.next_deadline_ms() == 100.0
    assert q.remove(a) and not q.remove(a)
    assert q.next_deadline_ms() == 101.0
    assert q.expire(100.5) == [] and q.expire(101.0) == [b]
    assert q.next_deadline_ms() is None and len(q) == 1 and drain(q) == ["b2"]


# ---------------------------------------------------------------- the router core


FC = "{profile: llm-d-flow-control, params: {ttl_ms: 500}}"
SATURATED = {"r0": (3, 5, 0.25), "r1": (1, 5, 0.75)}  # waiting 5 and 5: scores 1, 1 -> mean 1


async def test_not_saturated_places_at_once_with_llm_d_prefix_scorers() -> None:
    # waiting 2 and 2, KV 0.25 / 0.75: scores max(0.4, 0.3125) = 0.4 and max(0.4, 0.9375) = 0.9375 -> mean 0.67
    core, _, _ = make_core(FC)
    got = await core.acquire(request(1))
    assert isinstance(got, Placed) and got.grant.direct
    assert got.grant.replica_id == "r0"  # queues equal; KV 0.25 beats 0.75 (llm-d-prefix weights 3 / 2 / 2)


async def test_saturated_queues_then_dispatches_when_headroom_returns() -> None:
    core, clock, _ = make_core(FC, SATURATED)
    core.new_future = asyncio.get_running_loop().create_future  # type: ignore[method-assign]
    got = await core.acquire(request(1))
    assert isinstance(got, Queued) and len(core.held_queue) == 1  # type: ignore[arg-type]
    assert got.entry.deadline_ms == 500.0  # TTL 500 ms from t = 0
    clock.t = 50.0
    core.book.update("r0", snapshot("r0", 2, 3, 4, 0.25))  # r0 waiting 4: 0.8, r1 still 1 -> mean 0.9
    assert got.entry.future.done() and got.entry.future.result().replica_id == "r0"
    assert len(core.held_queue) == 0  # type: ignore[arg-type]


async def test_ttl_expiry_is_a_503() -> None:
    core, clock, _ = make_core(FC, SATURATED)
    core.new_future = asyncio.get_running_loop().create_future  # type: ignore[method-assign]
    got = await core.acquire(request(1))
    assert isinstance(got, Queued)
    assert core.held_next_deadline_ms() == 500.0
    clock.t = 499.0
    core.dispatch_held()
    assert not got.entry.future.done()
    clock.t = 500.0
    core.dispatch_held()
    exc = got.entry.future.exception()
    assert isinstance(exc, QueueTimeout) and exc.reason == "flow-control-ttl"
    assert (flow_control(exc.reason).status, flow_control("flow-control-capacity").status) == (503, 429)


async def test_sheddable_refused_429_only_with_reject_sheddable() -> None:
    # the test class "i" is sheddable; llm-d v0.8 queues it (default), reject_sheddable refuses it at once
    core, _, _ = make_core("{profile: llm-d-flow-control, params: {reject_sheddable: true}}", SATURATED)
    got = await core.acquire(request(1))
    assert isinstance(got, Refused) and got.reason == "flow-control-shed"
    assert flow_control(got.reason).status == 429
    core, _, _ = make_core("{profile: llm-d-flow-control, params: {reject_sheddable: true}}")  # not saturated
    assert isinstance(await core.acquire(request(2)), Placed)


async def test_capacity_refusal_and_client_gone() -> None:
    core, _, _ = make_core("{profile: llm-d-flow-control, params: {band_max_requests: 1}}", SATURATED)
    core.new_future = asyncio.get_running_loop().create_future  # type: ignore[method-assign]
    first = await core.acquire(request(1))
    assert isinstance(first, Queued)
    got = await core.acquire(request(2))
    assert isinstance(got, Refused) and got.reason == "flow-control-capacity"
    core.leave_queue(first.entry)  # the client left: out of the queue, room again
    core.leave_queue(first.entry)  # idempotent
    assert len(core.held_queue) == 0  # type: ignore[arg-type]
    assert isinstance(await core.acquire(request(3)), Queued)


def test_profile_is_registered_with_llm_d_prefix_scorers() -> None:
    p = default_registry().build("llm-d-flow-control", seed=1, ttl_ms=1000, fairness="round-robin")
    assert p.prefix_map and [w for _, w in p.scorers] == [3.0, 2.0, 2.0]
    assert p.direct is not None and p.direct.flow_control is not None
    assert (p.direct.flow_control.ttl_ms, p.direct.flow_control.fairness) == (1000.0, "round-robin")


# ---------------------------------------------------------------- the fleet simulation

TM = TimeModel(9.8626, 0.0726711, 7.93966e-05)


def test_fleet_burst_queues_at_the_router_and_drains() -> None:
    # One replica of at most 8 running sequences; 120 requests of 2000 prompt tokens, one every 5 ms:
    # the engine's waiting queue passes 5 within the first scrapes, later arrivals wait at the router
    # and leave as scrapes show the queue shorter again; every request is served exactly once.
    cfg = FleetConfig(policy="llm-d-flow-control", replicas=1, time_model=TM, kv_capacity_tokens=200_000,
                      ttft_ms=1000.0, tpot_ms=100.0, max_num_batched_tokens=2048, max_num_seqs=8)  # fmt: skip
    sim = FleetSim(cfg, [FleetRequest(i * 5.0, 2000, 50) for i in range(120)])
    core = sim.routers[0].core
    most = 0
    scrape = sim._on_scrape

    def watched(t: float, ri: int) -> None:
        nonlocal most
        most = max(most, len(core.held_queue))  # type: ignore[arg-type]
        scrape(t, ri)

    sim._on_scrape = watched  # type: ignore[method-assign]
    res = sim.run()
    assert most >= 20  # a burst waited at the router
    assert len(core.held_queue) == 0  # type: ignore[arg-type]
    assert collections.Counter(r.outcome for r in res.records) == {"ok": 120}
    assert res.stats.replica_requests == [120]
