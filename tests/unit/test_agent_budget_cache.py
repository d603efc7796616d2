"""The agent's budget never sees a stale kept list (replica_agent/tracker.py keeps its decode and
prefill lists between calls): after every kind of event, Agent.compute_budget equals PAB computed
on a replica state built afresh from the tracked requests, the leases and the last scrape."""

from __future__ import annotations

import math

from replica_agent.agent import Agent, AgentConfig
from fairbatch_common.clock import Clock
from replica_agent.engine_metrics import EngineMetrics
from replica_agent.policy.pab import DecodeState, PendingPrefill, ReplicaState, SloClass, compute_budgets
from replica_agent.policy.time_model import TimeModel
from replica_agent.tracker import Phase

TM = TimeModel(10.0, 0.1, 0.001)
CLASSES = (SloClass("interactive", 500.0, 50.0), SloClass("batch", 5000.0, 200.0))


def _agent() -> Agent:
    cfg = AgentConfig(replica_id="r", time_model=TM, slo_classes=CLASSES, default_slo_class="interactive",
                      kv_capacity_tokens=10_000, metrics_stale_ms=1e9, proxy_step_estimates=False)
    agent = Agent(cfg, Clock(1.0))
    agent.on_engine_metrics(EngineMetrics(num_running=0, num_waiting=0, kv_usage=0.0), [], "", now_ms=0.0)
    return agent


def _fresh(agent: Agent, now_ms: float, kv_usage: float) -> dict:
    """PAB of every class on a state built from scratch (no engine preemption in these cases)."""
    reqs = agent.tracker._requests.values()
    decodes = tuple(DecodeState(r.next_deadline_ms(), r.envelope.tpot_ms, r.context_tokens, r.tokens_out, r.max_tokens)
                    for r in reqs if r.phase is Phase.DECODE)
    prefills = tuple(PendingPrefill(r.prompt_tokens, r.computed_tokens) for r in reqs if r.phase is Phase.PREFILL)
    prefills += tuple(PendingPrefill(lease.prompt_tokens) for lease in agent.leases.active())
    kv_free = math.floor((1.0 - kv_usage) * 10_000)
    return compute_budgets(ReplicaState(now_ms, decodes, prefills, kv_free, agent.time_model(), 0.1), CLASSES)


def test_budget_follows_every_event_through_the_kept_lists() -> None:
    agent = _agent()
    kv = 0.0
    steps = []

    def check(now: float) -> None:
        got = agent.compute_budget(now).classes
        assert got == _fresh(agent, now, kv)
        steps.append(got["interactive"].pab_ms)

    check(0.0)
    agent.request_arrived("a", "interactive", 1000, 8, 0.0)  # arrival: in-flight b * 1000 = 100 ms
    check(1.0)
    assert steps[-1] == 450.0 - 100.0
    lease = agent.reserve("interactive", 500, None, "b", 2.0, answer_budget=False)  # lease grant: + 50 ms
    check(2.0)
    assert lease.granted and steps[-1] == 450.0 - 150.0
    agent.request_tokens("a", 120.0)  # first token of a: a decode now
    check(120.0)
    agent.request_tokens("a", 170.0)  # a token: its deadline and context move
    check(170.0)
    check(260.0)  # time passing alone (the decode's iterations over the horizon)
    agent.release(lease.lease_id)  # lease release
    check(261.0)
    agent.on_engine_metrics(EngineMetrics(num_running=1, num_waiting=0, kv_usage=0.5), [], "", now_ms=262.0)
    kv = 0.5  # engine metrics: the free KV halves
    check(262.0)
    agent.request_usage("a", 1004, 3)  # usage corrects a's counts
    check(263.0)
    agent.request_arrived("c", "batch", 300, None, 264.0)
    check(264.0)
    agent.request_done("a", 300.0, "ok")  # finish of a decode
    check(300.0)
    agent.request_done("c", 301.0, "client_disconnect")  # finish of a prefill
    check(301.0)
    assert steps[-1] == 450.0
    assert len(set(steps)) > 6  # the budget did move with the events


def test_an_on_time_reserve_is_refused_where_only_a_late_start_fits() -> None:
    # idle replica, interactive H = 450 ms; a 3000-token prompt costs 10 + 300 = 310 ms. Waited
    # 200 ms it can no longer start in time (310 > 450 - 200 = 250), but it fits a fresh arrival's
    # budget: the work-conserving Reserve grants it, the on-time one (x-fairbatch-on-time, proto
    # ReserveRequest.on_time_only) refuses it "not-on-time"; waited 100 ms (310 <= 350) both grant.
    agent = _agent()
    late = agent.reserve("interactive", 3000, None, "x", 1.0, waited_ms=200.0, on_time_only=True)
    assert not late.granted and late.reason == "not-on-time"
    assert agent.reserve("interactive", 3000, None, "y", 1.0, waited_ms=200.0).granted
    agent2 = _agent()
    assert agent2.reserve("interactive", 3000, None, "z", 1.0, waited_ms=100.0, on_time_only=True).granted
