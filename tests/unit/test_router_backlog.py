"""Router state for admission under backlog (issue 18): tie-break seed from the YAML, per-replica
load (leases granted, not ended), the contention cap, the hold choice and the per-replica gauges.

Two replicas with a fake Reserve (always granted, no budget in its answer); time model a = 10 ms, b = 0.1 ms/token.
"""

from __future__ import annotations

import asyncio

from proto import admission_pb2
from router.admission_queue import WaitingRequest
from router.budget_client import ReserveResult
from router.config import RouterConfig, hash_api_key
from router.server import Grant, Router
from tests.fakes import FakeClock




def config(**extra: object) -> RouterConfig:
    return RouterConfig.model_validate({
        "slo_classes": {"loose": {"ttft_ms": 20000, "tpot_ms": 200, "max_queue_ms": 100_000}},
        "tenants": {"A": {"weight": 3, "slo_class": "loose"}, "B": {"weight": 1, "slo_class": "loose"}},
        "api_keys": {hash_api_key("a"): "A", hash_api_key("b"): "B"},
        "replicas": [{"id": "r0", "http_url": "http://127.0.0.1:1", "grpc_target": "127.0.0.1:1"},
                     {"id": "r1", "http_url": "http://127.0.0.1:2", "grpc_target": "127.0.0.1:2"}],
        **extra,
    })  # fmt: skip


def snapshot(rid: str, inflight: float = 0.0, waiting: int = 0) -> admission_pb2.BudgetSnapshot:
    return admission_pb2.BudgetSnapshot(
        replica_id=rid, seq=1, ttl_ms=10_000_000, healthy=True, num_waiting=waiting,
        coefficients=admission_pb2.TimeModelCoefficients(a_ms=10.0, b_ms_per_new_token=0.1),
        classes=[admission_pb2.ClassBudget(slo_class="loose", horizon_ms=18000.0, pab_ms=18000.0 - inflight,
                                           pab_tokens=100_000, kv_free_tokens=100_000, kv_limited_tokens=100_000,
                                           inflight_reservation_ms=inflight)],
    )  # fmt: skip


def make_router(cfg: RouterConfig) -> Router:
    router = Router(cfg, FakeClock(), "test-router")  # type: ignore[arg-type]
    n = iter(range(10**6))

    async def reserve(replica_id, slo_class, prompt_tokens, request_id, max_tokens=0, waited_ms=0.0,
                      on_time_only=False):
        return ReserveResult(True, f"lease-{next(n)}")  # no budget in the answer: the view stays as pushed

    router.budgets.reserve = reserve  # type: ignore[method-assign]
    router.book.update("r0", snapshot("r0"))
    router.book.update("r1", snapshot("r1", inflight=50.0, waiting=3))
    return router


def waiting(rid: str, tenant: str) -> WaitingRequest:
    return WaitingRequest(rid, tenant, "loose", 1000, 10, 0.0, 1e9, asyncio.get_running_loop().create_future())


async def test_seed_from_yaml_and_random_by_default() -> None:
    assert Router(config(placement={"seed": 7}), FakeClock()).seed == 7  # type: ignore[arg-type]
    seeds = {Router(config(), FakeClock()).seed for _ in range(3)}  # type: ignore[arg-type]
    assert len(seeds) == 3  # a random seed per router


async def test_replica_load_and_contention_cap() -> None:
    router = make_router(config(admission={"contention_max_inflight": 1, "start_window_steps": 0}))
    # r0 has the larger headroom (nothing reserved) -> the first grant goes there
    g = await router.core.place("loose", 1000, 10, "x", frozenset(), 0.0)
    assert g is not None and g.replica_id == "r0" and router.replica_load("r0") == 1
    # no contention (queue empty): no replica is capped
    assert router.core.contention_excluded() == frozenset()
    a, b = waiting("a", "A"), waiting("b", "B")
    router.queue.push(a)
    router.queue.push(b)
    # two tenants waiting: r0 runs 1 >= cap 1 -> excluded, so the dispatcher places on r1 only
    assert router.core.contention_excluded() == frozenset({"r0"})
    await router.dispatcher.dispatch_once()
    assert a.future.result().replica_id == "r1"
    # b: r0 and r1 capped (1 each), one tenant left waiting -> no contention any more, r0 again
    assert b.future.done() and b.future.result().replica_id == "r0"
    # every end of a request frees its slot, once
    router.core.lease_done(g)
    router.core.lease_done(g)
    assert router.replica_load("r0") == 1
    router._release(Grant("r0", b.future.result().lease_id), "test")
    assert router.replica_load("r0") == 0
    await asyncio.gather(*router._background, return_exceptions=True)


async def test_hold_goes_to_the_least_reserved_replica_and_gauges() -> None:
    router = make_router(config())
    e = waiting("h", "A")
    assert router.core._hold_for(e) == "r0"  # r1 has 50 ms in flight
    e.exclude = frozenset({"r0"})
    assert router.core._hold_for(e) == "r1"
    body = (await router.handle_metrics(None)).body.decode()  # type: ignore[arg-type]
    assert 'fairbatch_router_replica_queued_requests{replica="r1"} 3.0' in body
    assert 'fairbatch_router_replica_inflight_requests{replica="r0"} 0.0' in body
