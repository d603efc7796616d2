"""The drain's state in the agent and the router (issue 29 item 3): a draining agent's budget is zero,
its Reserve refused ``draining``, its snapshot says ``draining``; the router's book treats such a
replica as unhealthy (no placement policy picks it), and as usable again once a snapshot says otherwise
(a restarted agent)."""

from __future__ import annotations

from fairbatch_common.clock import Clock
from proto import admission_pb2
from replica_agent.admission_server import snapshot_pb
from replica_agent.agent import Agent, AgentConfig
from replica_agent.engine_metrics import EngineMetrics
from replica_agent.policy.pab import SloClass
from replica_agent.policy.time_model import TimeModel
from router.budgets import BudgetBook
from tests.fakes import FakeClock

TM = TimeModel(10.0, 0.1, 0.001)
CLASSES = (SloClass("interactive", 500.0, 50.0),)


def _agent() -> Agent:
    cfg = AgentConfig(replica_id="r0", time_model=TM, slo_classes=CLASSES, default_slo_class="interactive",
                      kv_capacity_tokens=10_000, metrics_stale_ms=1e9, proxy_step_estimates=False)
    agent = Agent(cfg, Clock(1.0))
    agent.on_engine_metrics(EngineMetrics(num_running=0, num_waiting=0, kv_usage=0.0), [], "", now_ms=0.0)
    return agent


def test_a_draining_agent_has_zero_budget_and_refuses_reserves() -> None:
    agent = _agent()
    idle = agent.compute_budget(0.0).classes["interactive"]
    # an idle replica: horizon 500 * (1 - 0.1) = 450 ms, all of it free
    assert idle.pab_ms == 450.0 and idle.pab_tokens > 0
    assert agent.reserve("interactive", 100, 8, "a", 0.0).granted
    assert agent.start_drain() and not agent.start_drain()  # once
    view = agent.compute_budget(0.0)
    b = view.classes["interactive"]
    assert (b.pab_ms, b.pab_tokens, view.draining, view.healthy) == (0.0, 0, True, True)
    res = agent.reserve("interactive", 100, 8, "b", 0.0)
    assert (res.granted, res.reason) == (False, "draining") and res.budget is not None and res.budget.pab_ms == 0.0
    snap = snapshot_pb(agent, view)
    assert snap.draining and snap.healthy and snap.classes[0].pab_ms == 0.0


def test_the_router_does_not_place_on_a_draining_replica() -> None:
    agent = _agent()
    book = BudgetBook(FakeClock(0.0), ["r0"])  # type: ignore[arg-type]
    assert book.update("r0", snapshot_pb(agent, agent.compute_budget(0.0)))
    assert book.views()[0].healthy and book.usable("r0", "interactive") is not None
    agent.start_drain()
    assert book.update("r0", snapshot_pb(agent, agent.compute_budget(0.0)))
    v = book.views()[0]
    assert not v.healthy and book.get("r0").status_detail == "draining"
    assert book.usable("r0", "interactive") is None
    # a restarted agent (seq from 1 again after the stream broke) is placeable again
    book.mark_disconnected("r0")
    fresh = _agent()
    assert book.update("r0", snapshot_pb(fresh, fresh.compute_budget(0.0)))
    assert book.views()[0].healthy and not book.get("r0").draining


def test_an_older_snapshot_without_the_field_is_not_draining() -> None:
    book = BudgetBook(FakeClock(0.0), ["r0"])  # type: ignore[arg-type]
    snap = admission_pb2.BudgetSnapshot(replica_id="r0", seq=1, ttl_ms=1000, healthy=True)
    assert book.update("r0", snap) and book.views()[0].healthy and not book.get("r0").draining
