"""The agent's horizon-margin flags reach its config, and the config refuses values PAB cannot plan with."""

from __future__ import annotations

import math

import pytest

from replica_agent.agent import AgentConfig
from replica_agent.cli import build_parser, config_from_args
from replica_agent.policy.pab import SloClass
from replica_agent.policy.time_model import TimeModel

BASE = ["serve", "--engine-url", "http://127.0.0.1:8000", "--replica-id", "r0", "--slo-class", "interactive:5000:100"]


def test_margin_flags_reach_the_config() -> None:
    cfg = config_from_args(build_parser().parse_args(BASE))
    assert (cfg.margin_frac, cfg.margin_cap_tpots) == (0.1, 1.0)
    cfg = config_from_args(build_parser().parse_args([*BASE, "--margin-frac", "0.2", "--margin-cap-tpots", "3"]))
    assert (cfg.margin_frac, cfg.margin_cap_tpots) == (0.2, 3.0)
    assert math.isinf(config_from_args(build_parser().parse_args([*BASE, "--margin-cap-tpots", "inf"])).margin_cap_tpots)


@pytest.mark.parametrize("field,value", [("margin_cap_tpots", 0.0), ("margin_cap_tpots", math.nan),
                                         ("margin_frac", 1.0), ("margin_frac", -0.1)])
def test_config_refuses_a_margin_pab_cannot_plan_with(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        AgentConfig("r0", TimeModel(10.0, 0.1, 0.0), (SloClass("interactive", 1000.0, 100.0),), "interactive",
                    **{field: value})
