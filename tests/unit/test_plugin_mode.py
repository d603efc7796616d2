"""Plugin mode, pure parts: export record -> PAB inputs, staleness rule, the learned margin in the agent.

The record is built by replica_agent/plugin_export.py's ``state_record`` (the plugin's own code).

Hand-worked state (T = record time, unix ms): time model a = 10, b = 0.1, c = 0.001 ms; class
interactive TTFT 1000 / TPOT 100, margin 0.1 -> H = 900 ms.

- D (running decode): prompt 100, 4 tokens out, 103 computed (remaining 1), max_tokens 50, own TPOT
  200; arrival T - 1000, first token T - 900 -> next deadline min(T - 1000 + 1000 + 4*200,
  T - 900 + 4*200) = T - 100; context 104.
- P (running chunked prefill): prompt 2000, 512 computed -> PendingPrefill(2000, 512).
- W (waiting): prompt 1000, 0 computed -> PendingPrefill(1000, 0).
- KV: 300 free blocks x 16 = 4800 tokens.

At now = T: N = floor((T + 900 - (T - 100)) / 200) + 1 = 6;
decode reservation = 6 * (10 + 0.1 * 1 + 0.001 * 104) = 61.224 ms;
in-flight = 0.1 * 1488 + 0.001 * 512 + 0.1 * 1000 = 249.312 ms;
PAB_ms = 900 - 61.224 - 249.312 = 589.464 ms; time tokens = floor((589.464 - 10) / 0.1) = 5794;
growth(D) = min(50 - 4, ceil(900 / 200) + 1) = 6; kv_limited = 4800 - 6 - 1488 - 1000 = 2306;
PAB_tokens = min(5794, 2306) = 2306.
"""

from __future__ import annotations

import json
import math

import pytest

from replica_agent.policy.calibration import CalibratorConfig
from replica_agent.agent import Agent, AgentConfig
from fairbatch_common.clock import Clock
from replica_agent.engine_metrics import EngineMetrics
from replica_agent.plugin_export import state_record, step_record
from replica_agent.plugin_mode import (
    IDLE,
    PLUGIN,
    STALE,
    export_mode,
    lease_matches,
    parse_export_target,
    parse_record,
    record_decodes_prefills,
    replica_state_from_record,
)
from replica_agent.policy.batching import Batch, SchedRequest, SchedState
from replica_agent.policy.pab import DecodeState, PendingPrefill, SloClass, class_budget
from replica_agent.policy.time_model import TimeModel

TM = TimeModel(10.0, 0.1, 0.001)
CLS = SloClass("interactive", 1000.0, 100.0)
T = 1_700_000_000_000.0


def hand_record(t_ms: float = T, kv_free_blocks: int = 300) -> dict:
    """The hand-worked state (module docstring) as the plugin exports it."""
    d = SchedRequest("cmpl-D-0-ab", prompt_tokens=100, computed_tokens=103, tokens_out=4, max_tokens=50,
                     arrival_ms=t_ms - 1000.0, ttft_ms=1000.0, tpot_ms=200.0, first_token_ms=t_ms - 900.0)
    p = SchedRequest("cmpl-P-0-cd", prompt_tokens=2000, computed_tokens=512, max_tokens=16,
                     arrival_ms=t_ms - 100.0, ttft_ms=1000.0, tpot_ms=100.0)
    w = SchedRequest("cmpl-W-0-ef", prompt_tokens=1000, max_tokens=16, arrival_ms=t_ms - 10.0)
    state = SchedState(now_ms=t_ms, running=[d, p], waiting=[w], max_num_batched_tokens=2048, max_num_seqs=256,
                       kv_free_blocks=kv_free_blocks, block_size=16, time_model=TM)
    batch = Batch(items=[("cmpl-D-0-ab", 1), ("cmpl-P-0-cd", 1488)], num_new_tokens=1489)
    sched = dict(batch.items)
    rec = state_record(7, t_ms, None, state, batch, sched, 1489, 103 + 512, True, 1000, 16, 1000.0, 100.0, TM, 0)
    return json.loads(json.dumps(rec))  # exactly what travels in the datagram


def test_record_to_pab_inputs_hand_worked() -> None:
    rec = hand_record()
    decodes, prefills = record_decodes_prefills(rec)
    assert decodes == (DecodeState(next_deadline_ms=T - 100.0, tpot_ms=200.0, context_tokens=104, tokens_out=4,
                                   max_tokens=50),)
    assert prefills == (PendingPrefill(2000, 512), PendingPrefill(1000, 0))
    state = replica_state_from_record(rec, T, TM, 0.1, lease_prompts=[300])
    assert state.kv_free_tokens == 4800 and state.prefills[-1] == PendingPrefill(300, 0)
    b = class_budget(replica_state_from_record(rec, T, TM, 0.1), CLS)
    assert b.horizon_ms == pytest.approx(900.0)
    assert b.decode_iterations == 6
    assert b.decode_reservation_ms == pytest.approx(61.224)
    assert b.inflight_reservation_ms == pytest.approx(249.312)
    assert b.pab_ms == pytest.approx(589.464)
    assert b.kv_free_tokens == 4800 and b.kv_limited_tokens == 2306 and b.pab_tokens == 2306
    # the scheduler's own sequence cap (256) wins over the agent's; 3 requests there: a slot is free
    assert state.max_seqs == 256 and b.slot_wait_ms == 0.0
    assert replica_state_from_record({**rec, "max_seqs": None}, T, TM, 0.1, max_seqs=64).max_seqs == 64
    # a cap of 3 with D, P and W holding it: D must end first, its last token (50th) due at
    # T - 100 + (50 - 4 - 1) * 200 = T + 8900 -> 8,900 ms, past the horizon: no budget
    full = class_budget(replica_state_from_record({**rec, "max_seqs": 3}, T, TM, 0.1), CLS)
    assert full.slot_wait_ms == pytest.approx(8900.0) and full.pab_ms == 0.0 and full.pab_tokens == 0


def test_record_ageing_and_inflated_model() -> None:
    rec = hand_record()
    # 150 ms later the decode needs floor((900 + 250) / 200) + 1 = 6 iterations still; at 200 ms, 7
    assert class_budget(replica_state_from_record(rec, T + 150.0, TM, 0.1), CLS).decode_iterations == 6
    assert class_budget(replica_state_from_record(rec, T + 200.0, TM, 0.1), CLS).decode_iterations == 7
    # a, b, c doubled: 6 * 20.408 = 122.448; 2 * 249.312 = 498.624; PAB 278.928 ms; floor(258.928 / 0.2) = 1294
    b = class_budget(replica_state_from_record(rec, T, TimeModel(20.0, 0.2, 0.002), 0.1), CLS)
    assert b.pab_ms == pytest.approx(278.928) and b.pab_tokens == 1294


def test_parse_record_and_helpers() -> None:
    assert parse_record(b'{"v":1,"kind":"step"}') == {"v": 1, "kind": "step"}
    assert parse_record(b"not json") is None and parse_record(b"[1]") is None and parse_record(b'{"v":2}') is None
    assert parse_record(b"\xff\xfe") is None
    assert lease_matches("cmpl-req-1-0-1a2b", "req-1") and lease_matches("chatcmpl-req-1-0", "req-1")
    assert lease_matches("req-1", "req-1")
    assert not lease_matches("cmpl-req-10-0", "req-1") and not lease_matches("cmpl-x-0", "")
    assert parse_export_target("unix:/tmp/a.sock") == "/tmp/a.sock"
    with pytest.raises(ValueError):
        parse_export_target("/tmp/a.jsonl")
    rec = step_record(1000.0, 100, 1000, 42.0, 3)
    assert rec["kind"] == "step" and rec["measured_ms"] == 42.0


def test_staleness_rule() -> None:
    assert export_mode(10.0, 500.0, True) == PLUGIN
    assert export_mode(500.0, 500.0, None) == PLUGIN
    assert export_mode(501.0, 500.0, True) == STALE  # busy engine, no record: the plugin stopped exporting
    assert export_mode(501.0, 500.0, None) == STALE  # no scrape to say otherwise
    assert export_mode(501.0, 500.0, False) == IDLE  # vLLM does not step while idle
    assert export_mode(None, 500.0, False) == IDLE
    assert export_mode(None, 500.0, True) == STALE


def make_agent(proxy_tracking: bool = True) -> Agent:
    cfg = AgentConfig(
        replica_id="r", time_model=TM, slo_classes=(CLS,), default_slo_class="interactive", margin_frac=0.1,
        kv_capacity_tokens=100_000, metrics_stale_ms=10**9, plugin_mode=True, plugin_stale_ms=300.0,
        proxy_tracking=proxy_tracking,
        # a prior so strong the point model stays at TM: the plan is TM x the margin, the p95 of the ratios
        calibration=CalibratorConfig(prior_weight=1e12, min_samples=1, window=8, initial_margin=1.0,
                                     margin_quantile=0.95),
    )
    return Agent(cfg, Clock(1.0), lease_id_prefix="t")


@pytest.mark.parametrize("proxy_tracking", [True, False])
def test_agent_fallback_to_proxy_state(proxy_tracking: bool) -> None:
    agent = make_agent(proxy_tracking)
    agent.on_engine_metrics(EngineMetrics(num_running=2, num_waiting=1, kv_usage=0.5), [], "", now_ms=0.0)
    healthy, detail = agent.health(0.0)
    assert "no plugin record yet" in detail and healthy == proxy_tracking
    agent.on_plugin_datagram(json.dumps(hand_record()).encode(), now_ms=1000.0)
    view = agent.compute_budget(1000.0)
    assert view.healthy and view.status_detail == ""
    b = view.classes["interactive"]
    assert b.pab_ms == pytest.approx(589.464) and b.pab_tokens == 2306
    assert (view.num_running, view.num_waiting, view.kv_usage, view.kv_capacity_tokens) == (2, 1, 0.7, 16_000)
    assert agent.metrics.plugin_export_stale._value.get() == 0.0
    # the record ages with the agent's clock: 200 ms later N = 7
    assert agent.compute_budget(1200.0).classes["interactive"].decode_iterations == 7
    # no record for > 300 ms while the engine reports requests: proxy-mode state, flagged
    agent.on_engine_metrics(EngineMetrics(num_running=2, num_waiting=1, kv_usage=0.5), [], "", now_ms=1301.0)
    view = agent.compute_budget(1301.0)
    assert "plugin export stale (301 ms old)" in view.status_detail
    assert view.healthy == proxy_tracking
    assert view.classes["interactive"].kv_free_tokens == 50_000  # (1 - 0.5) * 100 000: proxy-mode estimate
    assert agent.metrics.plugin_export_stale._value.get() == 1.0
    assert agent.metrics.plugin_fallbacks._value.get() == 1.0
    # an idle engine exports nothing: not stale
    agent.on_engine_metrics(EngineMetrics(num_running=0, num_waiting=0, kv_usage=0.0), [], "", now_ms=1400.0)
    view = agent.compute_budget(1400.0)
    assert view.healthy and view.status_detail == ""
    assert agent.metrics.plugin_export_stale._value.get() == 0.0
    # a fresh record: exact state again
    agent.on_plugin_datagram(json.dumps(hand_record()).encode(), now_ms=1500.0)
    assert agent.compute_budget(1500.0).classes["interactive"].pab_tokens == 2306


def _coefs(tm: TimeModel) -> tuple[float, ...]:
    return (tm.a_ms, tm.b_ms_per_new_token, tm.c_ms_per_context_token, tm.d_ms_per_decode, tm.e_ms_per_chunk_prefix)


def test_agent_learned_margin_and_consume_leases() -> None:
    agent = make_agent(proxy_tracking=False)
    agent.on_engine_metrics(EngineMetrics(num_running=0, num_waiting=0, kv_usage=0.0), [], "", now_ms=0.0)
    assert math.isnan(agent.metrics.time_model_abs_error._value.get())
    assert agent.calibrator.margin() == 1.0
    # predicted with the agent's model: 10 + 0.1 * 100 + 0.001 * 1000 = 21 ms; measured 42 -> ratio 2.0
    agent.on_plugin_datagram(json.dumps(step_record(0.0, 100, 1000, 42.0, 2)).encode(), now_ms=0.0)
    assert agent.calibrator.mean_abs_rel_error() == pytest.approx(1.0)
    assert agent.calibrator.margin() == pytest.approx(2.0)
    assert _coefs(agent.time_model()) == pytest.approx(_coefs(TimeModel(20.0, 0.2, 0.002)), abs=1e-9)
    agent.on_plugin_datagram(json.dumps(hand_record()).encode(), now_ms=10.0)
    b = agent.compute_budget(10.0).classes["interactive"]
    assert b.pab_ms == pytest.approx(278.928) and b.pab_tokens == 1294
    # exact steps: p95 of [1, 2] = 1.95, of [1, 1, 2] = 1.9, of [1, 1, 1, 2] = 1.85 (linear interpolation)
    for expected in (1.95, 1.9, 1.85):
        agent.on_plugin_datagram(json.dumps(step_record(0.0, 100, 1000, 21.0, 2)).encode(), now_ms=10.0)
        assert agent.calibrator.margin() == pytest.approx(expected)
    for _ in range(5):  # the slow step leaves the 8-step window: margin 1, the plan is TM again
        agent.on_plugin_datagram(json.dumps(step_record(0.0, 100, 1000, 21.0, 2)).encode(), now_ms=10.0)
    assert agent.calibrator.margin() == 1.0
    assert _coefs(agent.time_model()) == pytest.approx(_coefs(TM), abs=1e-9)
    assert agent.metrics.time_model_steps.labels("plugin")._value.get() == 9.0
    # late = measured over the plan made before the step: only the first (42 ms against 21 x margin 1.0);
    # the 21 ms steps come at ratio 1.0 against margins 2.0 .. 1.0, never over
    assert agent.metrics.time_model_late_steps.labels("plugin")._value.get() == 1.0
    # a lease counts until its request shows up in the engine's record (--no-proxy)
    res = agent.reserve("interactive", 100, None, "W", 20.0)
    assert res.granted and len(agent.leases) == 1
    view = agent.compute_budget(20.0)
    assert view.classes["interactive"].pab_tokens == 2306 - 100
    # the snapshot lists the in-flight reservation per prefill, the lease last: b * 100 = 10 ms
    assert view.inflight_prefill_ms[-1] == pytest.approx(10.0)
    assert sum(view.inflight_prefill_ms) == pytest.approx(view.classes["interactive"].inflight_reservation_ms)
    assert len(view.inflight_prefill_done_ms) == len(view.inflight_prefill_ms)
    agent.on_plugin_datagram(json.dumps(hand_record()).encode(), now_ms=30.0)  # lists cmpl-W-0-ef
    assert len(agent.leases) == 0
    # bad datagrams are counted, never raise
    agent.on_plugin_datagram(b"garbage", now_ms=40.0)
    agent.on_plugin_datagram(b'{"v":1,"reqs":[]}', now_ms=40.0)  # state record without KV fields
    assert agent.metrics.plugin_records.labels("bad")._value.get() == 2.0


def test_plugin_mode_agent_learns_the_chunk_x_prefix_and_decode_terms_from_step_records() -> None:
    """Step records of an engine that costs 3.6e-6 ms per chunk x prefix token pair and 0.05 ms per
    decode (the agent's prior has neither): the agent's fit prices a 2048-token chunk over a 16k
    prefix within 3 % and a 64-decode step at the short end of the contexts seen within 5 % (the ridge's
    pull along the direction batch size and summed context share) of that engine, where the prior is 38 %
    and 16 % off
    (chunk: 10 + 204.8 + 16.384 + 120.8 = 352.0 ms against 231.2; decodes: 10 + 0.05 * 64 + 6.4 = 19.6
    against 22.8)."""
    import random

    from replica_agent.policy.time_model import StepFeatures

    engine = TimeModel(10.0, 0.1, 0.001, 3.6e-6, -0.05)
    agent = make_agent(proxy_tracking=False)
    agent.calibrator = type(agent.calibrator)(TM)  # the default settings (make_agent's prior is frozen)
    rng = random.Random(1)
    for _ in range(600):
        items = [(1, rng.randint(100, 3000)) for _ in range(rng.randint(1, 64))]
        if rng.random() < 0.5:
            items.append((rng.randint(64, 2048), rng.choice([0, 2048, 8192, 16384])))
        f = StepFeatures.from_items(items)
        rec = step_record(0.0, f.new_tokens, f.context_tokens, engine.step_ms(f), f.num_seqs,
                          f.prefill_chunk_prefix_tokens, f.num_decodes)
        agent.on_plugin_datagram(json.dumps(rec).encode(), now_ms=0.0)
    m = agent.calibrator.model()
    for f, off, rel in ((StepFeatures.from_items([(2048, 16384)]), 0.3, 0.03),
                        (StepFeatures.from_items([(1, 100)] * 64), 0.15, 0.05)):
        assert m.step_ms(f) == pytest.approx(engine.step_ms(f), rel=rel)
        assert abs(TM.step_ms(f) / engine.step_ms(f) - 1) > off


def test_a_request_the_proxy_forwarded_after_the_record_counts_until_the_record_lists_it() -> None:
    """The hand-worked record arrives at agent time 1000 (PAB 589.464 ms). The proxy then forwards Q
    (300 tokens, its lease consumed at once) at 1100: the record does not list it until the engine's next
    ``schedule()``, so the agent adds it as a pending prefill: in-flight 249.312 + 0.1 * 300 = 279.312 ms,
    and at 1100 (100 ms later N is still floor(1100 / 200) + 1 = 6) PAB = 900 - 61.224 - 279.312 =
    559.464 ms. W, tracked at 990 (within the 50-ms lookback) but listed by the record as cmpl-W-0-ef, is
    not counted twice; a request tracked at 500 is outside the lookback and left to the record."""
    from replica_agent.plugin_mode import UNLISTED_LOOKBACK_MS, unlisted_prefills

    agent = make_agent(proxy_tracking=True)
    agent.on_engine_metrics(EngineMetrics(num_running=2, num_waiting=1, kv_usage=0.5), [], "", now_ms=0.0)
    agent.request_arrived("old", "interactive", 700, 16, 500.0)
    agent.request_arrived("W", "interactive", 1000, 16, 990.0)
    agent.on_plugin_datagram(json.dumps(hand_record()).encode(), now_ms=1000.0)
    assert agent.compute_budget(1000.0).classes["interactive"].pab_ms == pytest.approx(589.464)
    agent.request_arrived("Q", "interactive", 300, 16, 1100.0)
    b = agent.compute_budget(1100.0).classes["interactive"]
    assert b.decode_iterations == 6 and b.pab_ms == pytest.approx(559.464)
    # the rule alone: a repeated id carries the proxy's "#n" suffix; vLLM's ids carry the router's id
    rec = hand_record()
    recent = [("W", PendingPrefill(1000)), ("Q#2", PendingPrefill(300)), ("D", PendingPrefill(100))]
    assert unlisted_prefills(rec, recent) == (PendingPrefill(300),)
    assert agent.tracker.recent_prefills(1000.0 - UNLISTED_LOOKBACK_MS) == [("Q", PendingPrefill(300)),
                                                                           ("W", PendingPrefill(1000))]


@pytest.mark.parametrize("cap,horizon", [(1.0, 4900.0), (math.inf, 4500.0)])
def test_agent_plans_a_long_ttft_class_over_the_capped_horizon_in_both_modes(cap: float, horizon: float) -> None:
    """A class of TTFT 5 s / TPOT 100 ms, margin 0.1: H = 5000 - min(500, cap x 100), in proxy mode (no
    record yet) and in plugin mode (a record), so the cap reaches both ways the agent builds its state."""
    long = SloClass("long", 5000.0, 100.0)
    cfg = AgentConfig(replica_id="r", time_model=TM, slo_classes=(CLS, long), default_slo_class="interactive",
                      margin_frac=0.1, margin_cap_tpots=cap, kv_capacity_tokens=100_000, metrics_stale_ms=10**9,
                      plugin_mode=True, plugin_stale_ms=300.0)
    agent = Agent(cfg, Clock(1.0), lease_id_prefix="t")
    agent.on_engine_metrics(EngineMetrics(num_running=0, num_waiting=0, kv_usage=0.0), [], "", now_ms=0.0)
    proxy = agent.compute_budget(0.0)
    assert agent.plugin_mode_now(0.0) != PLUGIN
    assert proxy.classes["long"].horizon_ms == horizon
    assert proxy.classes["interactive"].horizon_ms == 900.0  # min(100, cap x 100) = 100 for both caps
    agent.on_plugin_datagram(json.dumps(hand_record()).encode(), now_ms=1000.0)
    assert agent.plugin_mode_now(1000.0) == PLUGIN
    assert agent.compute_budget(1000.0).classes["long"].horizon_ms == horizon
