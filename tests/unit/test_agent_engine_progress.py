"""``Agent.engine_queue_moving``: requests wait in the engine's queue (the last scrape) and the engine
works (a scrape's inter-token count or prefix-cache query count moved since the scrape before): the
stall rule's test that a silent request is queued, not stalled (replica_agent/proxy.py ``StallWatch``)."""

from __future__ import annotations

from replica_agent.agent import Agent, AgentConfig
from replica_agent.engine_metrics import EngineMetrics
from replica_agent.policy.pab import SloClass
from replica_agent.policy.time_model import TimeModel
from tests.fakes import FakeClock


def _agent() -> Agent:
    cfg = AgentConfig(replica_id="r0", time_model=TimeModel(10.0, 0.1, 0.0),
                      slo_classes=(SloClass("interactive", 1000.0, 100.0),), default_slo_class="interactive",
                      kv_capacity_tokens=100_000, metrics_stale_ms=10**9)  # fmt: skip
    return Agent(cfg, FakeClock())  # type: ignore[arg-type]


def _m(itl_count: float, prefix_queries: float | None = None, waiting: int = 1) -> EngineMetrics:
    return EngineMetrics(num_waiting=waiting, kv_usage=0.5, block_size=16, num_gpu_blocks=1000, itl_count=itl_count,
                         prefix_queries=prefix_queries)


def test_progress_is_a_moved_counter_between_two_scrapes() -> None:
    agent = _agent()
    assert not agent.engine_queue_moving(1e9, 0.0)  # nothing scraped yet
    agent.on_engine_metrics(_m(100.0), [], "", 0.0)
    assert not agent.engine_queue_moving(1e9, 0.0)  # one scrape: nothing to compare with
    agent.on_engine_metrics(_m(100.0), [], "", 50.0)
    assert not agent.engine_queue_moving(1e9, 50.0)  # the count did not move: an idle (or frozen) engine
    agent.on_engine_metrics(_m(104.0), [], "", 100.0)  # four decode tokens since 50 ms
    assert agent.engine_queue_moving(0.0, 100.0)
    assert agent.engine_queue_moving(40.0, 140.0)  # 40 ms since the move: within 40
    assert not agent.engine_queue_moving(39.0, 140.0)  # 40 > 39
    agent.on_engine_metrics(_m(104.0), [], "", 150.0)  # frozen from here: the last move stays at 100 ms
    agent.on_engine_metrics(_m(104.0), [], "", 400.0)
    assert not agent.engine_queue_moving(250.0, 400.0) and agent.engine_queue_moving(300.0, 400.0)


def test_a_scheduled_prompt_is_progress_and_a_failed_scrape_is_not() -> None:
    agent = _agent()
    agent.on_engine_metrics(_m(7.0, 0.0), [], "", 0.0)
    agent.on_engine_metrics(_m(7.0, 2048.0), [], "", 50.0)  # a prefill scheduled, no decode token yet
    assert agent.engine_queue_moving(0.0, 50.0)
    agent.on_engine_metrics(None, [], "connection refused", 100.0)
    assert not agent.engine_queue_moving(49.0, 100.0)  # the failed scrape moved nothing


def test_nothing_waiting_means_a_silent_request_is_stuck_not_queued() -> None:
    agent = _agent()
    agent.on_engine_metrics(_m(10.0, waiting=0), [], "", 0.0)
    agent.on_engine_metrics(_m(30.0, waiting=0), [], "", 50.0)  # decoding for others, nobody waits
    assert not agent.engine_queue_moving(1e9, 50.0)
    agent.on_engine_metrics(_m(50.0, waiting=2), [], "", 100.0)  # two wait: a silent request may be one
    assert agent.engine_queue_moving(0.0, 100.0)
