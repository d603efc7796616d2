"""Virtual-clock replay (loadgen/sim/virtual.py): a hand-computed timeline and no starvation."""

from __future__ import annotations

import io
import json
import random

import pytest

from loadgen.sim.engine import EngineConfig, SimEngine
from loadgen.sim.virtual import LivelockError, VirtualRequest, run_virtual
from replica_agent.policy.batching import POLICIES, PolicyConfig, make_policy
from replica_agent.policy.calibration import CalibratorConfig, OnlineTimeModel
from replica_agent.policy.time_model import StepFeatures, TimeModel

TM = TimeModel(10.0, 0.1, 0.001)


def engine(policy: str = "vllm-default", blocks: int = 1000) -> SimEngine:
    return SimEngine(EngineConfig(TM, num_gpu_blocks=blocks, block_size=16), make_policy(policy))


def test_two_request_timeline() -> None:
    reqs = [VirtualRequest("r1", 0.0, 100, 2), VirtualRequest("r2", 5.0, 50, 1)]
    log = io.StringIO()
    run = run_virtual(reqs, engine(), step_log=log)
    # t=0: r1 prefill 100 tokens, context 0: 10 + 0.1*100 = 20 ms -> r1 token 1 at 20.
    # t=20: r2 (arrived at 5) queued. Batch r1 decode (100 in KV) + r2 prefill 50:
    #       10 + 0.1*51 + 0.001*100 = 15.2 ms -> r1 token 2 and r2 token 1 at 35.2.
    r1, r2 = run.records
    assert r1.token_times_ms == pytest.approx([20.0, 35.2])
    assert r2.token_times_ms == pytest.approx([35.2])
    assert r1.ttft_ms == pytest.approx(20.0) and r2.ttft_ms == pytest.approx(30.2)
    assert r1.tpot_ms == pytest.approx(15.2) and r2.tpot_ms is None
    assert (run.steps, run.end_ms) == (2, pytest.approx(35.2))
    lines = [json.loads(x) for x in log.getvalue().splitlines()]
    assert [(x["new_tokens"], x["context_tokens"]) for x in lines] == [(100, 0), (51, 100)]
    assert [x["measured_ms"] for x in lines] == pytest.approx([20.0, 15.2])


def test_idle_gap_jumps_to_next_arrival() -> None:
    run = run_virtual([VirtualRequest("a", 0.0, 10, 1), VirtualRequest("b", 1000.0, 10, 1)], engine())
    # each: 10 + 0.1*10 = 11 ms from its arrival.
    assert [r.token_times_ms for r in run.records] == [[pytest.approx(11.0)], [pytest.approx(1011.0)]]


def test_too_long_request_is_rejected_not_run() -> None:
    run = run_virtual([VirtualRequest("x", 0.0, 20_000, 1)], engine(blocks=100))  # 1600 KV slots
    assert run.records[0].rejected and run.records[0].token_times_ms == []


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_long_random_run_finishes_every_request(policy: str) -> None:
    rng = random.Random(3)
    reqs, t = [], 0.0
    for i in range(400):
        t += rng.expovariate(1 / 60.0)  # ~16 req/s: overloaded bursts on 300 KV blocks
        reqs.append(VirtualRequest(str(i), t, rng.randint(1, 1500), rng.randint(1, 60), 500.0, 50.0))
    eng = SimEngine(EngineConfig(TM, num_gpu_blocks=300, block_size=16, max_num_batched_tokens=1024,
                                 max_num_seqs=32), make_policy(policy, PolicyConfig(500, 50)))  # fmt: skip
    run = run_virtual(reqs, eng)
    for rec in run.records:
        assert rec.rejected is None
        assert len(rec.token_times_ms) == rec.request.output_tokens
        assert rec.token_times_ms == sorted(rec.token_times_ms)
        assert rec.token_times_ms[0] > rec.request.arrival_ms
    assert not eng.has_work()


def test_calibrator_learns_a_policy_model_2x_too_fast() -> None:
    # The policy believes a model 2x too fast: the engine runs TM, the prior is TM / 2.
    reqs = [VirtualRequest(str(i), 50.0 * i, 200, 5) for i in range(20)]
    half = TimeModel(TM.a_ms / 2, TM.b_ms_per_new_token / 2, TM.c_ms_per_context_token / 2)
    cal = OnlineTimeModel(half, CalibratorConfig(min_samples=4))
    eng = engine("fairbatching")
    run = run_virtual(reqs, eng, calibrator=cal, policy_time_model=half)
    assert cal.count == run.steps
    # the first step is predicted 2x too fast: measured / predicted = 2
    assert max(cal._ratios) == pytest.approx(2.0)
    # noise-free steps of the engine's own form; the ridge prior (kappa = 5 steps against the run's 60) keeps
    # 5 / 65 of the prior's 50 % error, 3.8 %: the fit ends within 5 % of TM on the two step shapes the
    # run has (1-2 decodes at ~200 context each; a 200-token prompt beside a decode). Further out the data
    # cannot tell a, c and d apart (every batch holds 1-2 sequences of ~200 tokens): no claim there.
    m = cal.model()
    for f in (StepFeatures.from_items([(1, 201)] * 2), StepFeatures.from_items([(200, 0), (1, 201)])):
        assert m.step_ms(f) == pytest.approx(TM.step_ms(f), rel=0.05)
        assert half.step_ms(f) < 0.51 * TM.step_ms(f)
    assert eng.policy_time_model is cal.conservative()


def test_prefill_first_livelock_is_reported_not_spun_forever() -> None:
    # 20 blocks of 16 = 320 KV slots; three 100-token prompts need 7 blocks each (21 > 20).
    # prefill-first gives the whole 32-token budget to the waiting prefill every step, so r0 and r1
    # (prefilled, 14 blocks) never decode and never free KV; r2's prefill grows to 6 blocks, needs a
    # 7th, is preempted (newest), is re-admitted when its 6 blocks are free again, and so on: steps
    # run forever, no token comes out.
    reqs = [VirtualRequest(f"r{i}", float(i), 100, 20) for i in range(3)]

    def eng(policy: str) -> SimEngine:
        cfg = EngineConfig(TM, num_gpu_blocks=20, block_size=16, max_num_batched_tokens=32, max_num_seqs=32)
        return SimEngine(cfg, make_policy(policy, PolicyConfig(500, 50)))

    with pytest.raises(LivelockError, match=r"livelock: 1000 steps in a row emitted no token \(policy prefill-first"):
        run_virtual(reqs, eng("prefill-first"), max_steps_without_token=1000)
    # decode-first (vLLM's order) finishes the same work: decodes run, finish and free their blocks
    run = run_virtual(reqs, eng("vllm-default"), max_steps_without_token=1000)
    assert [len(r.token_times_ms) for r in run.records] == [20, 20, 20]
    with pytest.raises(ValueError, match="max_steps_without_token"):
        run_virtual(reqs, eng("vllm-default"), max_steps_without_token=0)
