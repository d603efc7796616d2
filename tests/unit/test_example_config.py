"""The shipped example config (examples/fairbatch.yaml) loads with the router's model and the agent's,
its one key names the tenant its comment says, and its metrics are off the public port."""

from __future__ import annotations

from pathlib import Path

from router.auth import hash_api_key
from fairbatch_common.config_schema import load_agent_section
from router.config import load_config

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "fairbatch.yaml"


def test_example_config_loads_for_router_and_agent() -> None:
    cfg = load_config(EXAMPLE)
    assert cfg.model == "llama-3-8b-a100"
    assert [r.id for r in cfg.replicas] == ["r0"]
    assert cfg.api_keys == {hash_api_key("sk-my-key"): "acme"}
    assert cfg.http.metrics_port == 8090  # metrics (tenant names) off the public port 8080 (README)
    assert set(load_agent_section(EXAMPLE).slo_classes) == {"interactive", "batch"}
