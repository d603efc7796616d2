"""The YAML ``placement`` section (router/config.py PlacementConfig, router/placement/registry.py):
profiles, custom chains with weights, validation, discovery, post-decision hooks and hot reload.

Hand-worked with time model a = 10 ms, b = 0.1 ms/token; horizon H = 450 ms; P = 1000 tokens
(prefill a + b P = 110 ms).
"""

from __future__ import annotations

import importlib
import pkgutil

import pytest
from pydantic import ValidationError

from replica_agent.policy.pab import ClassBudget
from replica_agent.policy.time_model import TimeModel
from fairbatch_common.config_schema import PLACEMENT_PLUGINS, ConfigError, parse_agent_section
from router.config import PlacementConfig, parse_config
from router.placement import FusedPabPolicy, PlacementPolicy, PlacementRequest, ReplicaView, default_registry
from router.placement.registry import plugin_name
from router.server import Router
from tests.fakes import FakeClock
from tests.unit.test_router_backlog import config

TM = TimeModel(10.0, 0.1, 0.0)


def view(rid: str, pab_ms: float, kv: int) -> ReplicaView:
    return ReplicaView(rid, True, True, TM, {"i": ClassBudget("i", 450.0, pab_ms, kv, kv, kv_free_tokens=kv)})


# r0: headroom (400 - 110) / 450 = 0.6444, kv-headroom (5000 - 1000) / 5000 = 0.8
# r1: headroom (300 - 110) / 450 = 0.4222, kv-headroom (100000 - 1000) / 100000 = 0.99
VIEWS = [view("r0", 400.0, 5000), view("r1", 300.0, 100_000)]
REQ = PlacementRequest("i", 1000)


def test_default_section_is_the_fused_profile() -> None:
    pol = PlacementConfig().build(seed=1)
    assert isinstance(pol, FusedPabPolicy)
    # the default chain written out in full is the fused profile too
    chain = PlacementConfig.model_validate({
        "filters": ["exclude", "healthy", "fresh", "max-prompt", "fits", "on-time", "window"],
        "scorers": [{"name": "headroom", "weight": 1}, {"name": "kv-headroom", "weight": 1}],
        "picker": {"name": "highest"},
    }).build(seed=1)  # fmt: skip
    assert isinstance(chain, FusedPabPolicy)
    # weights 1 + 1: r0 0.6444 + 0.8 = 1.444 beats r1 0.4222 + 0.99 = 1.412
    assert pol.place(REQ, VIEWS).candidates == ("r0", "r1")
    assert PlacementConfig(profile="pab-chain").build(seed=1).place(REQ, VIEWS).candidates == ("r0", "r1")


def test_weights_chosen_in_yaml_change_the_order() -> None:
    # kv-headroom weight 3: r0 0.6444 + 2.4 = 3.044, r1 0.4222 + 2.97 = 3.392 -> r1 first
    pol = PlacementConfig.model_validate(
        {"scorers": [{"name": "headroom", "weight": 1}, {"name": "kv-headroom", "weight": 3}]}).build(seed=None)
    assert type(pol) is PlacementPolicy
    assert pol.place(REQ, VIEWS).candidates == ("r1", "r0")
    # headroom alone: r0 first; without the fits filter a replica whose budget is too small stays in
    only_headroom = PlacementConfig.model_validate(
        {"filters": ["healthy", "fresh"], "scorers": [{"name": "headroom"}]}).build(seed=None)
    small = [view("r2", 50.0, 100_000), *VIEWS]  # 110 ms > 50 ms: does not fit, but no fits filter here
    assert only_headroom.place(REQ, small).candidates == ("r0", "r1", "r2")
    assert PlacementConfig().build(seed=None).place(REQ, small).candidates == ("r0", "r1")


def test_unknown_names_are_refused() -> None:
    with pytest.raises(ValidationError, match="unknown plugin 'nope'"):
        PlacementConfig.model_validate({"scorers": [{"name": "nope"}]})
    with pytest.raises(ValidationError, match="placement.profile 'fast'"):
        PlacementConfig(profile="fast")
    with pytest.raises(ValidationError, match="placement.hooks: unknown plugin 'x'"):
        PlacementConfig(hooks=["x"])


def test_every_plugin_module_is_discovered() -> None:
    reg = default_registry()
    for kind, table in (("filters", reg.filters), ("scorers", reg.scorers), ("pickers", reg.pickers),
                        ("hooks", reg.hooks)):  # fmt: skip
        pkg = importlib.import_module(f"router.placement.{kind}")
        mods = [m.name for m in pkgutil.iter_modules(pkg.__path__)]
        assert mods, kind
        for m in mods:
            cls = importlib.import_module(f"router.placement.{kind}.{m}").PLUGIN
            assert table[plugin_name(cls)] is cls
            assert cls.__doc__ and importlib.import_module(f"router.placement.{kind}.{m}").__doc__


def test_the_schema_knows_the_registered_names() -> None:
    # fairbatch_common/config_schema.py checks placement names without router code (the agent
    # checks a router file as the router does): its table is the registry's, name for name
    reg = default_registry()
    assert {kind: set(names) for kind, names in PLACEMENT_PLUGINS.items()} == {
        "policies": set(reg.policies), "filters": set(reg.filters), "scorers": set(reg.scorers),
        "pickers": set(reg.pickers), "hooks": set(reg.hooks),
    }  # fmt: skip


def test_router_and_agent_refuse_an_unknown_plugin_in_a_router_file() -> None:
    text = ("slo_classes: {i: {ttft_ms: 500, tpot_ms: 50}}\n"
            "replicas: [{id: r0, http_url: 'http://127.0.0.1:1', grpc_target: '127.0.0.1:2'}]\n"
            "placement: {scorers: [{name: nope}]}\n")  # fmt: skip
    for parse in (parse_config, parse_agent_section):
        with pytest.raises(ConfigError, match="fairbatch.yaml:3: placement: .*unknown plugin 'nope'"):
            parse(text, "fairbatch.yaml")


def test_post_decision_hook_sees_granted_placements() -> None:
    pol = PlacementConfig(hooks=["decision-count"]).build(seed=0)
    (hook,) = pol.hooks
    pol.after_decision(REQ, "r1")
    pol.after_decision(PlacementRequest("i", 300), "r1")
    assert hook.counts == {"r1": 2} and hook.tokens == {"r1": 1300}  # type: ignore[attr-defined]


def test_router_reloads_the_placement_section() -> None:
    router = Router(config(placement={"seed": 3}), FakeClock())  # type: ignore[arg-type]
    assert isinstance(router.policy, FusedPabPolicy)
    before = router.policy
    router.apply_config(config(placement={"seed": 3, "prefix_cache": {"enabled": True}}))
    assert router.policy is before and router.prefix is not None  # only the prefix map changed
    router.apply_config(config(placement={"seed": 3, "scorers": [{"name": "headroom", "weight": 2}]}))
    assert type(router.policy) is PlacementPolicy and router.seed == 3
    assert [w for _, w in router.policy.scorers] == [2.0]
    router.apply_config(config(placement={"seed": 3}))
    assert isinstance(router.policy, FusedPabPolicy) and router.prefix is None
