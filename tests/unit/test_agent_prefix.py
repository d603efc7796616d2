"""The engine's measured prefix-cache hits, from the agent's scrape to the router's discount:
agent (replica_agent/agent.py, engine_metrics.PrefixHitWindow) -> BudgetSnapshot
(admission_server.snapshot_pb) -> router book (router/budgets.py) -> router/prefix_correction.py."""

from __future__ import annotations

import pytest

from replica_agent.admission_server import snapshot_pb
from replica_agent.agent import Agent, AgentConfig
from replica_agent.engine_metrics import EngineMetrics
from replica_agent.policy.pab import SloClass
from replica_agent.policy.time_model import TimeModel
from router.budgets import BudgetBook
from router.core import CoreRequest
from router.prefix_correction import PrefixCorrection
from tests.fakes import FakeClock


def test_the_snapshot_carries_the_windowed_counters_and_the_router_discounts_by_them() -> None:
    cfg = AgentConfig(replica_id="r0", time_model=TimeModel(10.0, 0.1, 0.0),
                      slo_classes=(SloClass("interactive", 1000.0, 100.0),), default_slo_class="interactive",
                      kv_capacity_tokens=100_000, metrics_stale_ms=10**9)  # fmt: skip
    clock = FakeClock()
    agent = Agent(cfg, clock)  # type: ignore[arg-type]
    assert agent.compute_budget(0.0).prefix_queries_tokens == 0  # nothing scraped yet: unknown
    metrics = EngineMetrics(kv_usage=0.1, block_size=16, num_gpu_blocks=1000)
    agent.on_engine_metrics(EngineMetrics(**{**_fields(metrics), "prefix_queries": 1000.0, "prefix_hits": 900.0}),
                            [], "", now_ms=0.0)  # fmt: skip
    agent.on_engine_metrics(EngineMetrics(**{**_fields(metrics), "prefix_queries": 5000.0, "prefix_hits": 1900.0}),
                            [], "", now_ms=1000.0)  # fmt: skip
    view = agent.compute_budget(1000.0)
    # the window's deltas, not the lifetime totals: 4000 queried, 1000 hit
    assert (view.prefix_queries_tokens, view.prefix_hits_tokens) == (4000, 1000)
    snap = snapshot_pb(agent, view)
    assert (snap.prefix_queries_tokens, snap.prefix_hits_tokens) == (4000, 1000)

    book = BudgetBook(clock, ["r0"])  # type: ignore[arg-type]
    assert book.prefix_measured("r0") == (0, 0)
    assert book.update("r0", snap)
    assert book.prefix_measured("r0") == (4000, 1000)
    # the map predicted half of each prompt cached on r0 (0.5); the engine found 0.25: factor 0.5
    correction = PrefixCorrection()
    correction.record("r0", 512, 1024)
    assert correction.discount({"r0": 2000}, book.prefix_measured) == {"r0": 1000}
    clock.t = 10**9 + 1.0  # the snapshot went stale: nothing measured any more, no discount
    assert book.prefix_measured("r0") == (0, 0)
    assert correction.discount({"r0": 2000}, book.prefix_measured) == {"r0": 2000}


def _fields(m: EngineMetrics) -> dict[str, object]:
    return {name: getattr(m, name) for name in EngineMetrics.__slots__}  # type: ignore[attr-defined]


async def _place(r0_pab: float, r1_hits: int, routers: list[object] | None = None) -> tuple[str, int] | None:
    """Place a 2048-token prompt that the map says r1 (PAB 50 ms) holds, r1's engine having hit
    ``r1_hits`` of 4000 queried tokens lately while the map predicted half of its prompts cached."""
    from tests.unit.test_router_sim_parity import server_router, snapshot

    router = server_router()
    r1 = snapshot("r1", 50.0)
    r1.prefix_queries_tokens, r1.prefix_hits_tokens = 4000, r1_hits
    router.book.update("r0", snapshot("r0", r0_pab))
    router.book.update("r1", r1)
    keys = [11, 12, 13, 14]
    assert router.prefix is not None
    router.prefix.insert("r1", keys)
    router.core.track_prefix(CoreRequest("q", "t0", "interactive", 2048, 10, 0.0, keys))
    router.prefix_correction.record("r1", 1024, 2048)
    grant = await router.core.place("interactive", 2048, 10, "q", frozenset(), 0.0)
    if routers is not None:
        routers.append(router)
    return None if grant is None else (grant.replica_id, grant.prompt_tokens)


async def test_the_router_prices_a_warm_replica_by_the_discounted_map() -> None:
    # The map: r1 holds the prompt (2047 of 2048 cached, 1 token to compute: 10.1 ms <= 50 ms).
    # The engine confirms it (2000 of 4000 hit = the predicted 0.5): factor 1, r1 takes it for 1
    # token (r0, PAB 100 ms, cannot take the whole 10 + 204.8 ms prefill)
    routers: list[object] = []
    assert await _place(100.0, 2000, routers) == ("r1", 1)
    # the grant is recorded with the map's own estimate (2047), not a discounted one; the earlier
    # record weighs 1 - 1/64: (1024 * 63/64 + 2047) / (2048 * 63/64 + 2048) = 3055 / 4064
    assert routers[0].prefix_correction.predicted_ratio("r1") == pytest.approx(3055 / 4064)  # type: ignore[attr-defined]
    # The engine found nothing of it (0 of 4000): factor 0, r1 would need the whole 214.8 ms too:
    # nobody fits now (the request would queue) ...
    assert await _place(100.0, 0) is None
    # ... and with r0 at 300 ms the whole prompt goes there
    assert await _place(300.0, 0) == ("r0", 2048)
    # a quarter of the promise found (1000 of 4000 = 0.25 against 0.5): factor 0.5, r1 would need
    # 2048 - floor(0.5 * 2047) = 1025 tokens, 112.5 ms > 50 ms: not r1 either
    assert await _place(100.0, 1000) is None
