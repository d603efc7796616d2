"""Proxy mode's step-time samples from token gaps (replica_agent/policy/step_estimate.py), the
tracker's running aggregates they read, and an agent that learns a slower engine from them."""

from __future__ import annotations

import pytest

from replica_agent.agent import Agent, AgentConfig
from fairbatch_common.clock import Clock
from replica_agent.engine_metrics import EngineMetrics
from replica_agent.policy.calibration import CalibratorConfig
from replica_agent.policy.pab import SloClass
from replica_agent.policy.step_estimate import StepStride, decode_step_features, decode_step_gap
from replica_agent.policy.time_model import StepFeatures, TimeModel
from replica_agent.tracker import Tracker


def test_sample_rules_by_hand():
    # 4 decodes with 8,000 context tokens in all, no prefill since t = 90; a token at 130 after one at 100
    assert decode_step_gap(100.0, 130.0, 1, 4, 90.0) == 30.0
    assert decode_step_features(4, 8000) == StepFeatures(4, 8000, 8000, 4, 4, 0, 4)
    assert decode_step_gap(100.0, 160.0, 2, 4, 90.0) == 30.0  # a 2-token chunk spans 2 steps
    assert decode_step_gap(100.0, 130.0, 1, 4, 110.0) is None  # a prefill ended inside the gap
    assert decode_step_gap(100.0, 130.0, 1, 4, None) is None  # a prefill is running
    assert decode_step_gap(None, 130.0, 1, 4, 90.0) is None  # first token: a prefill's time
    assert decode_step_gap(100.0, 100.0, 1, 4, 90.0) is None  # no gap
    assert decode_step_gap(100.0, 130.0, 1, 0, 90.0) is None  # no decode tracked


def test_stride_keeps_one_sample_per_step_worth():
    s = StepStride()
    assert [s.take(0.25) for _ in range(8)] == [False, False, False, True] * 2  # 4 streams: one gap in 4
    kept = [s.take(1 / 3) for _ in range(9)]  # 3 streams: 1/3 three times sums to 1 within rounding
    assert kept == [False, False, True] * 3
    s = StepStride()
    # k changes between steps: 2 streams (0.5 + 0.5), then 4 (0.25 x 4), then one gap of 1
    assert [s.take(w) for w in (0.5, 0.5, 0.25, 0.25, 0.25, 0.25, 1.0)] == [False, True, False, False, False, True, True]
    s = StepStride()
    assert [s.take(w) for w in (0.4, 0.4, 0.4, 0.4, 0.4)] == [False, False, True, False, True]  # 1.2 -> 0.2 owed
    assert s.owed == pytest.approx(0.0)


def test_tracker_aggregates_follow_every_event():
    t = Tracker()
    assert t.prefill_idle_since_ms == float("-inf")
    t.on_arrival("a", "c", 500, 50, 0.0, 100)
    t.on_arrival("b", "c", 500, 50, 0.0, 300)
    assert (t.num_prefills, t.num_decodes, t.prefill_idle_since_ms) == (2, 0, None)
    t.on_token("a", 10.0)  # a: 100 + 1
    assert (t.num_prefills, t.num_decodes, t.decode_context_tokens, t.prefill_idle_since_ms) == (1, 1, 101, None)
    t.on_token("b", 20.0, 3)  # b: 300 + 3
    assert (t.num_prefills, t.num_decodes, t.decode_context_tokens, t.prefill_idle_since_ms) == (0, 2, 404, 20.0)
    t.on_usage("b", 310, 5)  # corrected: 310 + 5
    assert t.decode_context_tokens == 101 + 315
    t.on_finish("a", 30.0)
    assert (t.num_decodes, t.decode_context_tokens) == (1, 315)
    t.on_arrival("c", "c", 500, 50, 40.0, 50)
    t.on_abort("c", 45.0)  # a prefill that left: idle again from 45
    assert (t.num_prefills, t.prefill_idle_since_ms) == (0, 45.0)
    assert t.decode_context_tokens == sum(r.context_tokens for r in t._requests.values())


def test_tracker_knows_since_when_the_head_prefill_runs():
    t = Tracker()
    assert t.prefill_head_since_ms is None
    # queued 30 ms at the router (arrival 70), reached the idle engine at 100: the head runs from 100
    t.on_arrival("a", "c", 500, 50, 70.0, 100, now_ms=100.0)
    t.on_arrival("b", "c", 500, 50, 110.0, 100, now_ms=110.0)  # waits behind a
    assert t.prefill_head_since_ms == 100.0
    t.on_token("a", 150.0)  # a's prefill ended: b is the head from 150
    assert t.prefill_head_since_ms == 150.0
    t.on_token("b", 190.0)
    assert t.prefill_head_since_ms is None
    t.on_arrival("c", "c", 500, 50, 200.0, 10)  # without now_ms: its arrival
    assert t.prefill_head_since_ms == 200.0


PRIOR = TimeModel(10.0, 0.07, 1e-4)
ENGINE = TimeModel(14.0, 0.07, 2e-4, 0.0, -0.03)  # decodes cost 14 + 0.04 per decode + 2e-4 per context token


def test_proxy_agent_learns_decode_steps_from_token_gaps():
    cls = SloClass("interactive", 1000.0, 100.0)
    cfg = AgentConfig(replica_id="r", time_model=PRIOR, slo_classes=(cls,), default_slo_class="interactive",
                      kv_capacity_tokens=10**6, metrics_stale_ms=10**9,
                      calibration=CalibratorConfig(min_samples=8))  # fmt: skip
    agent = Agent(cfg, Clock(1.0))
    agent.on_engine_metrics(EngineMetrics(num_running=0, num_waiting=0, kv_usage=0.0), [], "", now_ms=0.0)
    # batches of k streams with contexts k * 1000; every stream gets one token per step, all at the step's end
    t = 0.0
    for k in (2, 4, 8, 16, 32, 3, 12, 24):
        ids = [f"{k}-{i}" for i in range(k)]
        for i in ids:
            agent.request_arrived(i, "interactive", 1000 * (1 + ids.index(i) % 3), 40, t)
        t += 100.0  # the prefills (not sampled: a prefill runs in that gap)
        for i in ids:
            agent.request_tokens(i, t)
        for _ in range(30):
            tr = agent.tracker
            f = StepFeatures(tr.num_decodes, tr.decode_context_tokens, tr.decode_context_tokens, tr.num_decodes,
                             tr.num_decodes, 0, tr.num_decodes)  # fmt: skip
            t += ENGINE.step_ms(f)
            for i in ids:
                agent.request_tokens(i, t)
        for i in ids:
            agent.request_done(i, t, "ok")
    m = agent.calibrator.model()
    # 8 x 30 steps, each seen by k streams at weight 1/k, of which StepStride keeps one: 240 observations
    assert agent.metrics.time_model_steps.labels("proxy")._value.get() == 240
    for k in (5, 20):
        f = StepFeatures(k, 2000 * k, 2000 * k, k, k, 0, k)
        assert m.step_ms(f) == pytest.approx(ENGINE.step_ms(f), rel=0.03)  # was 25-38 % low with the prior
        assert PRIOR.step_ms(f) < 0.8 * ENGINE.step_ms(f)
    # the prefill token's price was not touched by decode-only data
    assert m.b_ms_per_new_token == pytest.approx(PRIOR.b_ms_per_new_token)
