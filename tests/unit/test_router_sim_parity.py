"""The router (router/server.py) and a fleet simulation's router (loadgen/fleet/sim.py) take the same
decision on one built state: both drive one core (router/core.py) through their own ports.

Two replicas, time model a = 10 ms, b = 0.1 ms/token (prefill of P tokens: 10 + 0.1 P ms), horizon
900 ms; each router's book gets the same snapshots.
"""

from __future__ import annotations

import asyncio

import pytest

from loadgen.fleet.sim import FleetConfig, FleetRequest, FleetSim, _drive
from proto import admission_pb2
from replica_agent.policy.time_model import TimeModel
from router.admission_queue import WaitingRequest
from router.config import RouterConfig, hash_api_key
from router.core import CoreRequest, Queued, Refused
from router.server import Router
from router.work_shed import WorkShedSettings
from tests.fakes import FakeClock

TM = TimeModel(10.0, 0.1, 0.0)


def snapshot(rid: str, pab_ms: float, decode_ms: float = 0.0, prefix: tuple[int, int] = (0, 0)
             ) -> admission_pb2.BudgetSnapshot:
    return admission_pb2.BudgetSnapshot(
        replica_id=rid, seq=1, ttl_ms=10_000_000, healthy=True, max_prompt_tokens=32768,
        prefix_queries_tokens=prefix[0], prefix_hits_tokens=prefix[1],
        coefficients=admission_pb2.TimeModelCoefficients(a_ms=10.0, b_ms_per_new_token=0.1),
        classes=[admission_pb2.ClassBudget(slo_class="interactive", ttft_ms=1000.0, tpot_ms=100.0, horizon_ms=900.0,
                                           pab_ms=pab_ms, pab_tokens=int(max(0.0, pab_ms - 10.0) / 0.1),
                                           kv_free_tokens=100_000, kv_limited_tokens=100_000,
                                           decode_reservation_ms=decode_ms)],
        inline_admission=True,  # a proxy-mode agent, as the simulated ones
    )  # fmt: skip


def server_router(sheddable: bool = False, work_shed: dict[str, object] | None = None) -> Router:
    cfg = RouterConfig.model_validate({
        "slo_classes": {"interactive": {"ttft_ms": 1000, "tpot_ms": 100, "max_queue_ms": 5000,
                                        "sheddable": sheddable}},
        "tenants": {"t0": {"weight": 1, "slo_class": "interactive"}},
        "api_keys": {hash_api_key("k"): "t0"},
        "replicas": [{"id": f"r{i}", "http_url": f"http://127.0.0.1:{i + 1}", "grpc_target": f"127.0.0.1:{i + 1}"}
                     for i in range(2)],
        # one map key per 512 tokens, as the simulation's 512-token prefix blocks
        "admission": {"lease_mode": "inline", "start_window_steps": 0, "bytes_per_token": 4.0,
                      "work_shed": work_shed or {}},
        "placement": {"seed": 1, "prefix_cache": {"enabled": True, "chunk_chars": 2048}},
    })  # fmt: skip
    return Router(cfg, FakeClock(), "parity")  # type: ignore[arg-type]


def sim_router(policy: str, request: FleetRequest | list[FleetRequest],
               work_shed: WorkShedSettings | None = None) -> tuple[FleetSim, object]:
    cfg = FleetConfig(policy=policy, replicas=2, time_model=TM, kv_capacity_tokens=100_000, ttft_ms=1000.0,
                      tpot_ms=100.0, lease_mode="inline", start_window_steps=0.0, prefix_block_tokens=512,
                      work_shed=work_shed)
    sim = FleetSim(cfg, request if isinstance(request, list) else [request])
    return sim, sim.routers[0]


async def test_inline_placement_on_the_warm_replica_with_its_uncached_tokens() -> None:
    # a 2048-token prompt (4 prefix blocks) that r1 holds: the map caps a hit at P - 1 = 2047 cached,
    # so r1 is asked to admit 1 token (10.1 ms <= its 50 ms); r0 would need 10 + 204.8 > its 100 ms
    request = FleetRequest(0.0, 2048, 10, prefix_ids=(1, 2, 3, 4))
    sim, srouter = sim_router("pab-prefix", request)
    router = server_router()
    for rid, pab in (("r0", 100.0), ("r1", 50.0)):
        router.book.update(rid, snapshot(rid, pab))
        srouter.book.update(rid, snapshot(rid, pab))  # type: ignore[attr-defined]
    keys = sim.router_keys(0)
    assert router.prefix is not None and router.prefix.tokens_per_key == 512
    router.prefix.insert("r1", keys)
    srouter.prefix.insert("r1", keys)  # type: ignore[attr-defined]
    router.core.track_prefix(CoreRequest("0", "t0", "interactive", 2048, 10, 0.0, keys))
    srouter.core.track_prefix(srouter.core_request(0))  # type: ignore[attr-defined]

    grant = await router.core.place("interactive", 2048, 10, "0", frozenset(), 0.0)
    sgrant = _drive(srouter.core.place("interactive", 2048, 10, "0", frozenset(), 0.0))  # type: ignore[attr-defined]
    assert grant is not None and sgrant is not None
    assert (grant.replica_id, grant.inline, grant.prompt_tokens) == ("r1", True, 1)
    assert (sgrant.replica_id, sgrant.inline, sgrant.prompt_tokens) == ("r1", True, 1)
    # both books took the same 1-token prefill locally: 50 - (10 + 0.1) ms
    for book in (router.book, srouter.book):  # type: ignore[attr-defined]
        assert book.get("r1").classes["interactive"].pab_ms == pytest.approx(39.9)


async def test_queued_behind_others_a_late_sheddable_request_is_refused_by_both() -> None:
    # Someone waits already, so neither tries a placement. Both replicas: PAB 0, decodes hold the
    # whole 900 ms horizon; an 8000-token prompt needs 10 + 800 = 810 ms, freed at 1 ms/ms (no drain
    # measured yet) -> wait 810 ms (+ the waiting 1-token prompt ahead: 0.1 ms over 2 replicas' rate
    # 2 ms/ms = 0.05); 0 + 810.05 + 810 > 1000 - (1000 - 900) margin: refused slo-infeasible
    request = FleetRequest(0.0, 8000, 10)
    sim, srouter = sim_router("pab", request)
    router = server_router(sheddable=True)
    for rid in ("r0", "r1"):
        router.book.update(rid, snapshot(rid, 0.0, decode_ms=900.0))
        srouter.book.update(rid, snapshot(rid, 0.0, decode_ms=900.0))  # type: ignore[attr-defined]
    loop = asyncio.get_running_loop()
    for queue in (router.queue, srouter.queue):  # type: ignore[attr-defined]
        queue.push(WaitingRequest("w", "t0", "interactive", 1, 1, 0.0, 1e9, loop.create_future()))
    got = await router.core.acquire(CoreRequest("x", "t0", "interactive", 8000, 10, 0.0))
    assert isinstance(got, Refused) and got.reason == "slo-infeasible" and not got.queued
    assert got.wait_ms == pytest.approx(810.05)
    srouter.arrive(0)  # type: ignore[attr-defined]
    assert (sim.states[0].outcome, sim.states[0].reason) == ("rejected", "slo-infeasible")


async def test_both_price_the_warmest_replicas_uncached_tokens_when_shedding() -> None:
    # As above (PAB 0, decodes hold the whole 900 ms horizon), but r1's map holds the 8000-token
    # prompt (16 blocks; a hit is capped at P - 1 = 7999): the shedding rule prices 1 token, 10.1 ms,
    # which frees at 1 ms/ms in 10.1 ms (+ 0.05 for the 1-token prompt ahead): 10.15 + 10.1 <= 900:
    # queued by both, not refused (the whole prompt, 810 + 810.05 ms, was refused above)
    request = FleetRequest(0.0, 8000, 10, prefix_ids=tuple(range(1, 17)))
    sim, srouter = sim_router("pab-prefix", request)
    router = server_router(sheddable=True)
    for rid in ("r0", "r1"):
        router.book.update(rid, snapshot(rid, 0.0, decode_ms=900.0))
        srouter.book.update(rid, snapshot(rid, 0.0, decode_ms=900.0))  # type: ignore[attr-defined]
    keys = sim.router_keys(0)
    router.prefix.insert("r1", keys)  # type: ignore[union-attr]
    srouter.prefix.insert("r1", keys)  # type: ignore[attr-defined]
    router.core.track_prefix(CoreRequest("x", "t0", "interactive", 8000, 10, 0.0, keys))
    srouter.core.track_prefix(srouter.core_request(0))  # type: ignore[attr-defined]
    loop = asyncio.get_running_loop()
    for queue in (router.queue, srouter.queue):  # type: ignore[attr-defined]
        queue.push(WaitingRequest("w", "t0", "interactive", 1, 1, 0.0, 1e9, loop.create_future()))
    assert router.core.priced("x", 8000) == srouter.core.priced("0", 8000) == 1  # type: ignore[attr-defined]
    wait, prefill = router.predict("interactive", 0, router.core.priced("x", 8000))  # type: ignore[misc]
    assert (wait, prefill) == (pytest.approx(10.15), pytest.approx(10.1))
    assert srouter.core.predict("interactive", 0, 1) == (pytest.approx(10.15), pytest.approx(10.1))  # type: ignore[attr-defined]
    got = await router.core.acquire(CoreRequest("x", "t0", "interactive", 8000, 10, 0.0, keys))
    assert isinstance(got, Queued)  # queued (waiting for budget), not refused
    srouter.arrive(0)  # type: ignore[attr-defined]
    assert sim.states[0].outcome != "rejected"


async def test_work_shed_refuses_the_same_arrival_in_both() -> None:
    # admission.work_shed on (gain 10, max share 0.5, window 8, horizon 10, 1 sample); work priced on
    # the view's model a = 10, b = 0.1, c = 0: 0.1 * P + 0.1 * O ms. A (1000 + 10 tokens) = 101 ms,
    # nothing refused yet: kept. One slo-infeasible refusal: s = 0.1, q = min(0.5, 10 * 0.1) = 0.5,
    # threshold = the median of [101] = 101. B (2000 + 10) = 201 ms > 101: refused 429 work-shed;
    # C (500 + 10) = 51 ms: kept.
    ws = {"enabled": True, "gain": 10.0, "max_share": 0.5, "window": 8, "horizon": 10, "min_samples": 1}
    router = server_router(sheddable=True, work_shed=ws)
    reqs = [FleetRequest(0.0, 1000, 10), FleetRequest(0.0, 10, 1), FleetRequest(0.0, 2000, 10),
            FleetRequest(0.0, 500, 10)]  # fmt: skip
    sim, srouter = sim_router("pab", reqs, WorkShedSettings(10.0, 0.5, 8, 10, 1))
    for rid in ("r0", "r1"):
        router.book.update(rid, snapshot(rid, 5000.0))
        srouter.book.update(rid, snapshot(rid, 5000.0))  # type: ignore[attr-defined]
    def refused_by_work(prompt: int) -> bool:
        return router.core.refuse_by_work(CoreRequest("a", "t0", "interactive", prompt, 10, 0.0))

    assert refused_by_work(1000) is False
    srouter.arrive(0)  # type: ignore[attr-defined]
    assert sim.states[0].reason != "work-shed"
    # a budget refusal on each side: the server's answer path, the simulator's record
    assert router.work_shed is not None
    router.work_shed.budget_refused()
    sim.states[1].router = 0
    sim.reject(1, "slo-infeasible")
    assert router.work_shed.contention_share == pytest.approx(0.1)
    assert srouter.work_shed.contention_share == pytest.approx(0.1)  # type: ignore[attr-defined]
    assert refused_by_work(2000) is True
    srouter.arrive(2)  # type: ignore[attr-defined]
    assert (sim.states[2].outcome, sim.states[2].reason) == ("rejected", "work-shed")
    assert refused_by_work(500) is False
    srouter.arrive(3)  # type: ignore[attr-defined]
    assert sim.states[3].reason != "work-shed"


def test_work_shed_off_by_default_in_both() -> None:
    router = server_router(sheddable=True)
    assert router.work_shed is None
    sim, srouter = sim_router("pab", FleetRequest(0.0, 10, 1))
    assert srouter.work_shed is None  # type: ignore[attr-defined]


async def test_prefix_map_discounted_by_the_measured_hits_in_both() -> None:
    # r1 holds the 2048-token prompt by the map (2047 cached). Each router's correction has one placement
    # on r1 that predicted 1000 of 2000 tokens cached (p = 0.5); r1's engine measured 100 hits in 1000
    # queried (m = 0.1): factor 0.2, so 2047 -> floor(409.4) = 409 cached, 1639 to compute: 10 + 163.9 =
    # 173.9 ms, within r1's 200 ms (r0's 100 cannot take the whole prompt, 214.8 ms). Undiscounted it
    # would be the 1 token of test_inline_placement_on_the_warm_replica_with_its_uncached_tokens.
    request = FleetRequest(0.0, 2048, 10, prefix_ids=(1, 2, 3, 4))
    sim, srouter = sim_router("pab-prefix", request)
    router = server_router()
    for rid, pab in (("r0", 100.0), ("r1", 200.0)):
        snap = snapshot(rid, pab, prefix=(1000, 100) if rid == "r1" else (0, 0))
        router.book.update(rid, snap)
        srouter.book.update(rid, snap)  # type: ignore[attr-defined]
    keys = sim.router_keys(0)
    for r in (router, srouter):
        r.prefix.insert("r1", keys)  # type: ignore[attr-defined]
        r.prefix_correction.record("r1", 1000, 2000)  # type: ignore[attr-defined]
    router.core.track_prefix(CoreRequest("0", "t0", "interactive", 2048, 10, 0.0, keys))
    srouter.core.track_prefix(srouter.core_request(0))  # type: ignore[attr-defined]
    grant = await router.core.place("interactive", 2048, 10, "0", frozenset(), 0.0)
    sgrant = _drive(srouter.core.place("interactive", 2048, 10, "0", frozenset(), 0.0))  # type: ignore[attr-defined]
    assert grant is not None and sgrant is not None
    assert (grant.replica_id, grant.prompt_tokens) == ("r1", 1639)
    assert (sgrant.replica_id, sgrant.prompt_tokens) == ("r1", 1639)
    for book in (router.book, srouter.book):  # type: ignore[attr-defined]
        assert book.get("r1").classes["interactive"].pab_ms == pytest.approx(26.1)
    # both recorded this placement's undiscounted prediction: p = (1000 * (1 - 1/64) + 2047) / (2000 * (1 - 1/64) + 2048)
    p = (1000 * (63 / 64) + 2047) / (2000 * (63 / 64) + 2048)
    for r in (router, srouter):
        assert r.prefix_correction.predicted_ratio("r1") == pytest.approx(p)  # type: ignore[attr-defined]
