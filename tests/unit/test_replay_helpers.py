"""Pure helpers of loadgen.replay and loadgen.demo: flag parsing, SLOs from the router YAML, exact
prompts, and a demo router YAML that the router's own config loader accepts."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import yaml

from loadgen.demo import ReplicaPorts, router_config
from loadgen.replay import (
    DEFAULT_SLO,
    ReplayConfig,
    _BodyMaker,
    parse_api_keys,
    parse_tenants,
    resolve_tenants,
    tenants_from_config,
)
from loadgen.sim.tokenizer import count_tokens, make_prompt, render_chat
from loadgen.stats import Slo
from loadgen.traces import TraceRequest


def test_parse_tenants_and_keys() -> None:
    assert parse_tenants("acme:3, beta:1,gamma") == [("acme", 3.0), ("beta", 1.0), ("gamma", 1.0)]
    for bad in ("acme:0", "acme:x", ":3", "acme,acme", ""):
        with pytest.raises(ValueError):
            parse_tenants(bad)
    assert parse_api_keys(["acme=k1", "beta=a=b"]) == {"acme": "k1", "beta": "a=b"}
    with pytest.raises(ValueError, match="TENANT=KEY"):
        parse_api_keys(["acme"])


def _config(tmp_path: Path) -> Path:
    p = tmp_path / "fairbatch.yaml"
    p.write_text(yaml.safe_dump({
        "slo_classes": {"interactive": {"ttft_ms": 500, "tpot_ms": 50}, "batch": {"ttft_ms": 5000, "tpot_ms": 200}},
        "tenants": {"acme": {"weight": 3, "slo_class": "interactive"}, "beta": {"weight": 1, "slo_class": "batch"}},
    }))
    return p


def test_tenants_and_slos_from_config(tmp_path: Path) -> None:
    p = _config(tmp_path)
    weights, slos = tenants_from_config(p)
    assert weights == {"acme": 3.0, "beta": 1.0}
    assert slos == {"acme": Slo(500.0, 50.0), "beta": Slo(5000.0, 200.0)}
    tenants, slos2, source = resolve_tenants(None, {"acme": "k"}, p, None, None)
    assert [(t.name, t.weight, t.api_key) for t in tenants] == [("acme", 3.0, "k"), ("beta", 1.0, None)]
    assert slos2 == slos and source == "config"
    # flags override one target for every tenant; --tenants overrides the config's weights
    tenants, slos3, source = resolve_tenants("beta:2", {}, p, None, 100.0)
    assert [(t.name, t.weight) for t in tenants] == [("beta", 2.0)]
    assert slos3 == {"beta": Slo(5000.0, 100.0)} and source == "config+flags"
    tenants, slos4, source = resolve_tenants(None, {}, None, None, None)
    assert [t.name for t in tenants] == ["default"] and slos4 == {"default": DEFAULT_SLO} and source == "default"


def test_config_with_unknown_class_is_an_error(tmp_path: Path) -> None:
    p = tmp_path / "bad.yaml"
    p.write_text("slo_classes: {a: {ttft_ms: 1, tpot_ms: 1}}\ntenants: {acme: {slo_class: b}}\n")
    with pytest.raises(ValueError, match="tenants.acme.slo_class"):
        tenants_from_config(p)


def test_prompts_have_exact_token_counts() -> None:
    maker = _BodyMaker("completions", "text", "m")
    for n, seed in ((0, 0), (1, 5), (374, 13), (5000, 11), (20_000, 3)):
        text = maker.prompt_text(n, seed)
        assert count_tokens(text) == n
        # make_prompt's text but for the first word: the request's tag (base 36 of the seed, 4 characters)
        assert text[4:] == make_prompt(n, seed % 12)[4:]
    assert maker.prompt_text(3, 13)[:4] == "000d" and maker.prompt_text(3, 36**4 + 37)[:4] == "0011"
    # two requests' prompts differ in their first 16-token block: no prefix-cache hit between them
    a, b = maker.prompt_text(64, 1), maker.prompt_text(64, 13)
    assert a[4:] == b[4:] and a[:64] != b[:64]
    overhead = count_tokens(render_chat([{"role": "user", "content": ""}]))
    chat = _BodyMaker("chat", "text", "m", chat_overhead_tokens=overhead)
    body = json.loads(chat.body(TraceRequest(0.0, 300, 0), 7))
    assert count_tokens(render_chat(body["messages"])) == 300
    assert body["max_tokens"] == 1 and body["ignore_eos"] and body["stream"]
    assert body["stream_options"] == {"include_usage": True}
    tok = json.loads(_BodyMaker("completions", "tokens", None).body(TraceRequest(0.0, 50, 9), 1))
    assert len(tok["prompt"]) == 50 and tok["max_tokens"] == 9 and "model" not in tok


def test_replay_config_validation() -> None:
    with pytest.raises(ValueError):
        ReplayConfig(target="http://x", endpoint="chat", prompt_format="tokens")
    with pytest.raises(ValueError):
        ReplayConfig(target="http://x", time_scale=0)
    with pytest.raises(ValueError):
        ReplayConfig(target="http://x", tenants=[])


def test_demo_router_yaml_is_accepted_by_the_router(tmp_path: Path) -> None:
    config = pytest.importorskip("router.config")
    keys = {"acme": "fb-acme-secret", "beta": "fb-beta-secret"}
    doc = router_config([ReplicaPorts("r0", 1, 8101, 9101), ReplicaPorts("r1", 2, 8102, 9102)], keys,
                        Slo(500.0, 50.0), "llama-3-8b-a100")
    assert doc["api_keys"] == {hashlib.sha256(b"fb-acme-secret").hexdigest(): "acme",
                               hashlib.sha256(b"fb-beta-secret").hexdigest(): "beta"}
    assert "fb-acme-secret" not in yaml.safe_dump(doc)
    p = tmp_path / "fairbatch.yaml"
    p.write_text(yaml.safe_dump(doc, sort_keys=False))
    cfg = config.load_config(p)
    assert [r.id for r in cfg.replicas] == ["r0", "r1"]
    # loadgen reads the same file for its SLOs and weights
    weights, slos = tenants_from_config(p)
    assert weights == {"acme": 3.0, "beta": 1.0} and slos["beta"] == Slo(500.0, 50.0)
