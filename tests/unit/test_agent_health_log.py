"""The agent says in its log when its engine comes back, as it says when it goes (a user's trial:
the unhealthy warning had no matching line)."""

from __future__ import annotations

import logging

import pytest

from replica_agent.agent import Agent, AgentConfig
from replica_agent.engine_metrics import EngineMetrics
from replica_agent.policy.pab import SloClass
from replica_agent.policy.time_model import TimeModel
from tests.fakes import FakeClock


GOOD = EngineMetrics(kv_usage=0.1, block_size=16, num_gpu_blocks=1000)
"""A scrape that answered."""
TIMED_OUT = "engine /metrics unreachable: TimeoutError"
"""The scraper's error for a scrape that timed out (replica_agent/engine_metrics.py)."""


def _agent(metrics_stale_ms: float) -> Agent:
    """An agent on a fake clock whose engine metrics go stale after ``metrics_stale_ms``."""
    cfg = AgentConfig(replica_id="r0", time_model=TimeModel(10.0, 0.1, 0.0),
                      slo_classes=(SloClass("interactive", 1000.0, 100.0),), default_slo_class="interactive",
                      kv_capacity_tokens=100_000, metrics_stale_ms=metrics_stale_ms)  # fmt: skip
    return Agent(cfg, FakeClock())  # type: ignore[arg-type]


def test_recovery_is_logged_once_and_not_at_start(caplog: pytest.LogCaptureFixture) -> None:
    agent = _agent(10**9)
    with caplog.at_level(logging.WARNING, logger="replica_agent.agent"):
        agent.on_engine_metrics(GOOD, [], "", 0.0)  # the first scrape: not a recovery
        assert not [r for r in caplog.records if "answers again" in r.getMessage()]
        agent.on_engine_metrics(GOOD, [], "", 50.0)  # healthy and healthy: nothing
        agent.engine_stalled("engine stalled: no byte for 3 s")
        assert not agent.health(60.0)[0]
        agent.on_engine_metrics(GOOD, [], "", 100.0)
        agent.on_engine_metrics(GOOD, [], "", 150.0)
    lines = [r.getMessage() for r in caplog.records if "answers again" in r.getMessage()]
    assert lines == ["engine answers again (engine stalled: no byte for 3 s); agent healthy"]
    assert agent.health(150.0)[0]


def test_a_failed_scrape_that_takes_the_agent_out_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    """A healthy agent whose scrape fails goes unhealthy and says so once (the router places nothing
    there meanwhile: an operator must see when and why); further failures add nothing, and the
    recovery is logged with the failure's reason."""
    agent = _agent(10**9)
    with caplog.at_level(logging.WARNING, logger="replica_agent.agent"):
        agent.on_engine_metrics(None, [], TIMED_OUT, 0.0)  # at start: not a going
        agent.on_engine_metrics(GOOD, [], "", 50.0)
        agent.on_engine_metrics(None, [], TIMED_OUT, 100.0)
        assert not agent.health(100.0)[0]
        agent.on_engine_metrics(None, [], TIMED_OUT, 150.0)
        agent.on_engine_metrics(GOOD, [], "", 200.0)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["engine /metrics unreachable: TimeoutError; agent unhealthy until the engine answers",
                     "engine answers again (engine /metrics unreachable: TimeoutError); agent healthy"]


def test_a_timed_out_scrape_of_an_agent_already_stale_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    """The scrape timeout is ``max(0.5 s, stale_after_ms)``: a scrape that times out ends after the
    metrics went stale, so the agent is already unhealthy (by age) when its failure arrives. Its going
    must still be logged (real vLLM on 2 cores: 19 recoveries logged in 60 s, no going)."""
    agent = _agent(1000.0)
    with caplog.at_level(logging.WARNING, logger="replica_agent.agent"):
        agent.on_engine_metrics(GOOD, [], "", 0.0)
        assert not agent.health(1050.0)[0]  # the next scrape (from 50 ms) is still in flight: stale
        agent.on_engine_metrics(None, [], TIMED_OUT, 1050.0)
        agent.on_engine_metrics(None, [], TIMED_OUT, 2100.0)
        agent.on_engine_metrics(GOOD, [], "", 2300.0)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["engine /metrics unreachable: TimeoutError; agent unhealthy until the engine answers",
                     "engine answers again (engine /metrics unreachable: TimeoutError); agent healthy"]


def test_metrics_stale_ms_flag() -> None:
    """``--metrics-stale-ms`` sets the staleness (and so the scrape timeout) of a CPU fleet's agents."""
    from replica_agent.cli import build_parser, config_from_args

    base = ["serve", "--engine-url", "http://127.0.0.1:1", "--replica-id", "r0"]
    assert config_from_args(build_parser().parse_args(base)).stale_after_ms == 1000.0
    cfg = config_from_args(build_parser().parse_args([*base, "--metrics-stale-ms", "5000"]))
    assert cfg.stale_after_ms == 5000.0
