"""Proxy-mode accounting of preempted requests (replica_agent/policy/preemption.py), worked by hand.

Time model a = 8 ms, b = 0.02 ms/token, c = 0.001 ms/context token (the CPU tiny model's); class
TTFT 2000 ms / TPOT 200 ms, margin 0.1, so H = 1800 ms and a decode's KV growth reserve over H is
min(remaining output, ceil(1800 / 200) + 1 = 10) tokens.
"""

from __future__ import annotations

from replica_agent.agent import Agent, AgentConfig
from fairbatch_common.clock import Clock
from replica_agent.engine_metrics import EngineMetrics
from replica_agent.policy.pab import DecodeState, PendingPrefill, ReplicaState, SloClass, class_budget
from replica_agent.policy.preemption import account_preempted
from replica_agent.policy.time_model import TimeModel

TM = TimeModel(8.0, 0.02, 0.001)
CLS = SloClass("interactive", 2000.0, 200.0)


def dec(ctx: int, out: int = 50, max_tokens: int | None = 900) -> DecodeState:
    return DecodeState(next_deadline_ms=100.0, tpot_ms=200.0, context_tokens=ctx, tokens_out=out, max_tokens=max_tokens)


def test_the_largest_contexts_become_recompute_prefills() -> None:
    d300, d1200, d700 = dec(300), dec(1200), dec(700)
    waiting_prompt = PendingPrefill(100)
    # engine: 3 waiting; the tracker holds 1 un-started prefill, so 2 of its decodes were preempted
    decodes, prefills, k = account_preempted([d300, d1200, d700], [waiting_prompt], 3)
    assert k == 2
    assert decodes == (d300,)
    assert prefills == (waiting_prompt, PendingPrefill(1200, 0), PendingPrefill(700, 0))


def test_nothing_moves_without_extra_waiting_requests() -> None:
    ds, ps = [dec(300), dec(700)], [PendingPrefill(100, 40)]
    for waiting in (None, 0, 1):
        assert account_preempted(ds, ps, waiting) == (tuple(ds), tuple(ps), 0)
    # never more than the tracked decodes (the scrape may count requests the tracker has not seen yet)
    decodes, prefills, k = account_preempted(ds, [], 10)
    assert (decodes, k) == ((), 2)
    assert prefills == (PendingPrefill(700, 0), PendingPrefill(300, 0))


def test_recompute_is_charged_in_time_and_kv() -> None:
    """One decode of 1000 tokens that vLLM preempted: it reserves no decode steps, its 1000 tokens
    of recompute cost b * 1000 = 20 ms of the horizon and 1000 tokens of the KV cache."""
    decodes, prefills, _ = account_preempted([dec(1000, out=900, max_tokens=1000)], [], 1)
    b = class_budget(ReplicaState(0.0, decodes, prefills, 2048, TM, 0.1), CLS)
    assert b.decode_reservation_ms == 0.0
    assert b.inflight_reservation_ms == 20.0
    assert b.pab_ms == 1780.0
    assert b.kv_limited_tokens == 2048 - 1000
    assert b.pab_tokens == 1048  # min(floor((1780 - 8) / 0.02) = 88600, 1048)
    # as a running decode instead: growth reserve min(1000 - 900, 10) = 10 tokens
    b = class_budget(ReplicaState(0.0, [dec(1000, out=900, max_tokens=1000)], [], 2048, TM, 0.1), CLS)
    assert b.kv_limited_tokens == 2038


def proxy_agent() -> Agent:
    cfg = AgentConfig(
        replica_id="r1", time_model=TM, slo_classes=(CLS,), default_slo_class="interactive", margin_frac=0.1,
        kv_capacity_tokens=2048, metrics_stale_ms=10**9,
    )
    return Agent(cfg, Clock(1.0), lease_id_prefix="t")


def test_agent_whose_whole_batch_was_preempted_has_no_budget() -> None:
    """The real-vLLM overload case: 31 requests (100-token prompts, 50 tokens out, max 900) on a replica
    with 2048 KV tokens; vLLM preempted them all (KV usage 0 %, 31 waiting). Before this correction the
    agent saw 31 decodes and free KV: kv_limited = 2048 - 31 * 10 = 1738 tokens of budget."""
    agent = proxy_agent()
    for i in range(31):
        agent.tracker.on_arrival(f"q{i}", "interactive", 2000.0, 200.0, 0.0, 100, max_tokens=900)
        agent.tracker.on_token(f"q{i}", 50.0, n=50)
    agent.on_engine_metrics(EngineMetrics(num_running=0, num_waiting=0, kv_usage=0.0), [], "", now_ms=60.0)
    assert agent.compute_budget(60.0).classes["interactive"].kv_limited_tokens == 1738
    agent.on_engine_metrics(EngineMetrics(num_running=0, num_waiting=31, kv_usage=0.0), [], "", now_ms=60.0)
    b = agent.compute_budget(60.0).classes["interactive"]
    assert b.pab_tokens == 0 and b.kv_limited_tokens == 0  # 2048 - 31 * 150 < 0
    assert b.inflight_reservation_ms == 31 * 150 * 0.02
    # two of three decodes running, one preempted; KV 10 % used: floor(0.9 * 2048) - 2 * 10 - 150
    agent = proxy_agent()
    for i in range(3):
        agent.tracker.on_arrival(f"q{i}", "interactive", 2000.0, 200.0, 0.0, 100, max_tokens=900)
        agent.tracker.on_token(f"q{i}", 50.0, n=50)
    agent.on_engine_metrics(EngineMetrics(num_running=2, num_waiting=1, kv_usage=0.1), [], "", now_ms=60.0)
    assert agent.compute_budget(60.0).classes["interactive"].kv_limited_tokens == 1843 - 2 * 10 - 150
