"""Inline admission only where the agent is on the HTTP path: the agent's snapshot says so
(admission_server.snapshot_pb ``inline_admission``), the router's book keeps it (router/budgets.py),
router/admission.py ``use_inline`` decides (an integration test drives it through a real router:
tests/integration/test_router_fake_agents.py)."""

from __future__ import annotations

from proto import admission_pb2
from replica_agent.admission_server import snapshot_pb
from replica_agent.agent import Agent, AgentConfig
from replica_agent.policy.pab import SloClass
from replica_agent.policy.time_model import TimeModel
from router.admission import use_inline
from router.budgets import BudgetBook
from tests.fakes import FakeClock


def _agent(proxy: bool) -> Agent:
    cfg = AgentConfig(replica_id="r0", time_model=TimeModel(10.0, 0.1, 0.0),
                      slo_classes=(SloClass("interactive", 1000.0, 100.0),), default_slo_class="interactive",
                      kv_capacity_tokens=100_000, metrics_stale_ms=10**9, proxy_tracking=proxy,
                      plugin_mode=not proxy)  # fmt: skip
    return Agent(cfg, FakeClock())  # type: ignore[arg-type]


def test_the_snapshot_says_whether_the_agent_is_on_the_http_path_and_the_book_keeps_it() -> None:
    book = BudgetBook(FakeClock(), ["r0", "r1"])  # type: ignore[arg-type]
    assert not book.inline_admission("r0")  # nothing received yet: not known, so not inline
    proxy, no_proxy = _agent(True), _agent(False)
    snap = snapshot_pb(proxy, proxy.compute_budget(0.0))
    assert snap.inline_admission
    assert book.update("r0", snap) and book.inline_admission("r0")
    snap = snapshot_pb(no_proxy, no_proxy.compute_budget(0.0))  # --no-proxy: the router sends to vLLM directly
    assert not snap.inline_admission
    assert book.update("r1", snap) and not book.inline_admission("r1")
    # an agent older than the field sends none (proto3 default false): Reserve leases there
    old = admission_pb2.BudgetSnapshot(replica_id="r0", seq=99, ttl_ms=500, healthy=True)
    assert book.update("r0", old) and not book.inline_admission("r0")
    assert not book.inline_admission("rX")  # not a replica of the config


def test_use_inline_needs_both_the_mode_and_the_agent() -> None:
    assert use_inline("inline", True)
    assert not use_inline("inline", False)
    assert not use_inline("reserve", True) and not use_inline("reserve", False)
