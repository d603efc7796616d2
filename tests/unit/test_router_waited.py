"""The router plans a queued (or retried) request with its age: ``waited_ms = now - arrival at the
router`` reaches placement (``PlacementRequest.waited_ms``: on time first, then the normal fit,
pab.py "Work conservation") and the agent's Reserve (``ReserveRequest.waited_ms``).

Hand-worked: one replica, time model a = 10 ms, b = 0.1 ms/token, c = 0; class interactive with
horizon H = 450 ms, PAB_ms = 250 ms, PAB_tokens 2400. A prompt of 1000 tokens takes 110 ms.
"""

from __future__ import annotations

import asyncio

from proto import admission_pb2
from router.admission_queue import WaitingRequest
from router.budget_client import ReserveResult
from router.config import RouterConfig, hash_api_key
from router.server import Router
from tests.fakes import FakeClock




def make_router(clock: FakeClock) -> tuple[Router, list[tuple]]:
    config = RouterConfig.model_validate({
        "slo_classes": {"interactive": {"ttft_ms": 500, "tpot_ms": 50, "max_queue_ms": 100_000}},
        "tenants": {"acme": {"weight": 1, "slo_class": "interactive"}},
        "api_keys": {hash_api_key("k"): "acme"},
        "replicas": [{"id": "r0", "http_url": "http://127.0.0.1:1", "grpc_target": "127.0.0.1:1"}],
        "admission": {"lease_mode": "reserve"},  # these tests watch the Reserve calls
    })  # fmt: skip
    router = Router(config, clock, "test-router")  # type: ignore[arg-type]
    calls: list[tuple] = []

    async def reserve(replica_id, slo_class, prompt_tokens, request_id, max_tokens=0, waited_ms=0.0,
                      on_time_only=False):
        calls.append((replica_id, prompt_tokens, request_id, waited_ms))
        return ReserveResult(True, f"lease-{request_id}", "", 140.0, 1300)

    router.budgets.reserve = reserve  # type: ignore[method-assign]
    snap = admission_pb2.BudgetSnapshot(
        replica_id="r0", seq=1, ttl_ms=10_000_000, healthy=True,
        coefficients=admission_pb2.TimeModelCoefficients(a_ms=10.0, b_ms_per_new_token=0.1),
        classes=[admission_pb2.ClassBudget(slo_class="interactive", ttft_ms=500, tpot_ms=50, horizon_ms=450.0,
                                           pab_ms=250.0, pab_tokens=2400, kv_free_tokens=100_000,
                                           kv_limited_tokens=100_000)],
    )  # fmt: skip
    assert router.book.update("r0", snap)
    return router, calls


def waiting(request_id: str, arrival_ms: float, enqueued_ms: float) -> WaitingRequest:
    return WaitingRequest(
        request_id=request_id, tenant="acme", slo_class="interactive", prompt_tokens=1000, max_tokens=4,
        enqueued_ms=enqueued_ms, deadline_ms=1e9, future=asyncio.get_running_loop().create_future(),
        arrival_ms=arrival_ms,
    )  # fmt: skip


async def test_queued_request_is_placed_with_its_age() -> None:
    clock = FakeClock()
    router, calls = make_router(clock)
    # arrived at 0, queued at 5. At t = 100 it has waited 100 ms: the router's bound is
    # 250 - 100 = 150 ms >= 110 (and 1000 <= floor((150 - 10) / 0.1) = 1400) -> placed on r0,
    # and the Reserve carries waited_ms = 100.
    entry = waiting("q1", arrival_ms=0.0, enqueued_ms=5.0)
    assert entry.waited_ms(100.0) == 100.0
    router.queue.push(entry)
    clock.t = 100.0
    stats = await router.dispatcher.dispatch_once()
    assert stats.admitted == 1 and entry.future.result().replica_id == "r0"
    assert calls == [("r0", 1000, "q1", 100.0)]


async def test_request_past_its_ttft_is_placed_by_the_normal_fit() -> None:
    clock = FakeClock(t=200.0)
    router, calls = make_router(clock)
    # waited 200 ms: 250 - 200 = 50 ms < 110 ms -> not on time on r0 (phase 1 places nothing);
    # phase 2, the normal fit (110 <= 250, 1000 <= 2400), places it at once, Reserve with its age
    old = waiting("old", arrival_ms=0.0, enqueued_ms=0.0)
    router.queue.push(old)
    stats = await router.dispatcher.dispatch_once()
    assert stats.admitted == 1 and old.future.result().replica_id == "r0"
    assert calls == [("r0", 1000, "old", 200.0)]


async def test_entry_without_arrival_ages_from_its_enqueue_time() -> None:
    e = waiting("q", arrival_ms=0.0, enqueued_ms=40.0)
    e.arrival_ms = None
    assert e.waited_ms(100.0) == 60.0 and e.waited_ms(10.0) == 0.0
