"""Continuous-batching core (loadgen/sim/engine.py): step times, tokens, preemption, abort.

Time model in every test: TimeModel(a=10, b=0.1, c=0.001), so a step costs
10 + 0.1 * new_tokens + 0.001 * context_tokens ms (values worked out by hand in comments).
"""

from __future__ import annotations

import pytest

from loadgen.sim.engine import EngineConfig, RequestStatus, SimEngine
from replica_agent.policy.time_model import TimeModel

TM = TimeModel(10.0, 0.1, 0.001)


def make(num_blocks: int = 1000, block_size: int = 16, tokens: int = 8192, seqs: int = 256, max_len: int = 32768):
    return SimEngine(EngineConfig(TM, num_blocks, block_size, tokens, seqs, max_len))


def test_chunked_prefill_under_token_cap_and_first_token() -> None:
    eng = make(tokens=503)
    for rid, p in (("d1", 100), ("d2", 200), ("d3", 300)):
        eng.add_request(rid, p, max_tokens=10, arrival_ms=0.0)
    # Step 1: the three prompts, 600 tokens > 503 cap -> d1 100, d2 200, d3 chunked to 203.
    s1 = eng.step(0.0)
    assert s1.batch.items == [("d1", 100), ("d2", 200), ("d3", 203)]
    # 10 + 0.1 * 503 + 0.001 * 0 = 60.3 ms; d3's prefill is unfinished -> no token for it.
    assert s1.duration_ms == pytest.approx(60.3)
    assert [o.request_id for o in s1.outputs] == ["d1", "d2"]
    # Step 2: d1, d2 decode (contexts 100, 200); d3's last 97 prompt tokens (context 203).
    s2 = eng.step(s1.end_ms)
    assert s2.batch.items == [("d1", 1), ("d2", 1), ("d3", 97)]
    # new 99, context 100 + 200 + 203 = 503 -> 10 + 9.9 + 0.503 = 20.403 ms
    assert s2.duration_ms == pytest.approx(20.403)
    assert s2.context_tokens == 503
    first = [o for o in s2.outputs if o.request_id == "d3"][0]
    # First token at prefill completion: 60.3 + 20.403 = 80.703 ms after arrival 0.
    assert first.tokens_out == 1 and first.ttft_ms == pytest.approx(80.703)


def test_three_decodes_plus_prefill_chunk() -> None:
    # The architecture's example: decodes at contexts 100, 200, 300 plus a 500-token prefill chunk.
    eng = make(tokens=503)
    for rid, p in (("d1", 99), ("d2", 199), ("d3", 300)):
        eng.add_request(rid, p, max_tokens=10, arrival_ms=0.0)
    # Step 1: 99 + 199 + 205 (chunk) = 503 tokens -> 10 + 50.3 = 60.3 ms.
    s = eng.step(0.0)
    assert s.batch.items == [("d1", 99), ("d2", 199), ("d3", 205)]
    # Step 2: two decodes (contexts 99, 199) + d3's last 95 (context 205):
    # new 97, context 503 -> 10 + 9.7 + 0.503 = 20.203 ms, ends at 80.503.
    s = eng.step(s.end_ms)
    assert s.duration_ms == pytest.approx(20.203) and s.end_ms == pytest.approx(80.503)
    eng.add_request("w", 600, max_tokens=10, arrival_ms=80.503)
    s = eng.step(s.end_ms)
    assert s.batch.items == [("d1", 1), ("d2", 1), ("d3", 1), ("w", 500)]
    # 10 + 0.1 * 503 + 0.001 * (100 + 200 + 300) = 10 + 50.3 + 0.6 = 60.9 ms
    assert s.context_tokens == 600
    assert s.duration_ms == pytest.approx(60.9)
    assert s.end_ms == pytest.approx(141.403)
    assert "w" not in [o.request_id for o in s.outputs]  # prefill not complete: no token yet
    # Next: decodes at contexts 101, 201, 301 and w's last 100 tokens at context 500:
    # new 103, context 1103 -> 10 + 10.3 + 1.103 = 21.403 ms; w's first token at 162.806.
    s = eng.step(s.end_ms)
    assert s.duration_ms == pytest.approx(21.403)
    w_out = [o for o in s.outputs if o.request_id == "w"][0]
    assert w_out.tokens_out == 1
    assert w_out.ttft_ms == pytest.approx(162.806 - 80.503)  # 82.303
    # Prompt tokens counted once each at prefill completion: 99 + 199 + 300 + 600.
    assert eng.counters.prompt_tokens == 1198
    # Tokens: 2 (step 1) + 3 (step 2) + 3 (step 3) + 4 (step 4).
    assert eng.counters.generation_tokens == 12


def test_decode_until_max_tokens_then_finished_and_freed() -> None:
    eng = make(num_blocks=10, block_size=16)
    eng.add_request("r", 20, max_tokens=3, arrival_ms=5.0)
    s1 = eng.step(5.0)  # prefill 20: 10 + 2 = 12 ms -> token 1 at 17
    assert s1.duration_ms == pytest.approx(12.0)
    assert eng.kv.blocks_of("r") == 2  # ceil(20/16)
    s2 = eng.step(s1.end_ms)  # decode, context 20: 10 + 0.1 + 0.02 = 10.12 ms -> token 2 at 27.12
    assert s2.duration_ms == pytest.approx(10.12)
    assert s2.outputs[0].itl_ms == pytest.approx(10.12)
    s3 = eng.step(s2.end_ms)  # decode, context 21: 10.121 ms -> token 3 at 37.241, finished
    out = s3.outputs[0]
    assert (out.tokens_out, out.finished) == (3, True)
    assert out.e2e_ms == pytest.approx(37.241 - 5.0)
    assert eng.kv.free_blocks == 10 and not eng.has_work()
    assert "r" not in eng.requests
    assert eng.counters.request_success == 1 and eng.counters.generation_tokens == 3
    empty = eng.step(50.0)
    assert empty.batch.items == [] and empty.duration_ms == 0.0 and empty.end_ms == 50.0


def test_max_tokens_one_finishes_at_prefill() -> None:
    eng = make()
    eng.add_request("r", 10, max_tokens=1, arrival_ms=0.0)
    out = eng.step(0.0).outputs[0]
    assert out.finished and out.ttft_ms == pytest.approx(11.0)  # 10 + 0.1 * 10
    assert out.e2e_ms == pytest.approx(11.0)


def test_fcfs_and_max_num_seqs() -> None:
    eng = make(seqs=2)
    eng.add_request("a", 10, max_tokens=2, arrival_ms=0.0)
    eng.add_request("b", 10, max_tokens=2, arrival_ms=1.0)
    eng.add_request("c", 10, max_tokens=2, arrival_ms=2.0)
    s1 = eng.step(2.0)
    # Only 2 sequences may run: a and b in arrival order; c waits.
    assert s1.batch.items == [("a", 10), ("b", 10)]
    assert (eng.num_running, eng.num_waiting) == (2, 1)
    s2 = eng.step(s1.end_ms)  # a and b decode their 2nd (last) token; c still capped out
    assert s2.batch.items == [("a", 1), ("b", 1)]
    assert all(o.finished for o in s2.outputs)
    s3 = eng.step(s2.end_ms)
    assert s3.batch.items == [("c", 10)]


def test_preemption_by_recompute_when_kv_full() -> None:
    # 4 blocks of 4 tokens = 16 slots; two 8-token prompts fill them exactly.
    eng = make(num_blocks=4, block_size=4)
    eng.add_request("a", 8, max_tokens=5, arrival_ms=0.0)
    eng.add_request("b", 8, max_tokens=5, arrival_ms=1.0)
    eng.step(1.0)
    assert eng.kv.free_blocks == 0
    # a's decode writes its 9th token: needs a 3rd block, none free -> preempt the newest (b).
    s = eng.step(20.0)
    assert s.preempted == ["b"]
    assert s.batch.items == [("a", 1)]
    assert s.context_tokens == 8
    b = eng.requests["b"]
    assert (b.status, b.computed_tokens, b.tokens_out) == (RequestStatus.WAITING, 0, 1)
    assert eng.waiting[0] is b and eng.counters.num_preemptions == 1
    assert eng.kv.blocks_of("b") == 0 and eng.kv.blocks_of("a") == 3
    # a decodes tokens 3, 4, 5 in its 3rd block (slots 10..12); b needs ceil(9/4) = 3 blocks > 1 free.
    for expect in (3, 4, 5):
        s = eng.step(s.end_ms)
        assert s.batch.items == [("a", 1)] and s.outputs[0].tokens_out == expect
    assert "a" not in eng.requests and eng.kv.free_blocks == 4
    # b recomputes prompt + its 1 output = 9 tokens from scratch: 10 + 0.9 + 0 = 10.9 ms; samples token 2.
    s = eng.step(s.end_ms)
    assert s.batch.items == [("b", 9)] and s.context_tokens == 0
    assert s.duration_ms == pytest.approx(10.9)
    assert s.outputs[0].tokens_out == 2 and s.outputs[0].ttft_ms is None
    # prompt tokens were counted once, at b's first prefill: 8 + 8.
    assert eng.counters.prompt_tokens == 16


def test_newest_request_preempts_itself() -> None:
    # a: 7 tokens -> 2 blocks with one free slot; b: 8 tokens -> 2 full blocks. Pool full.
    eng = make(num_blocks=4, block_size=4)
    eng.add_request("a", 7, max_tokens=4, arrival_ms=0.0)
    eng.add_request("b", 8, max_tokens=4, arrival_ms=1.0)
    eng.step(1.0)
    s = eng.step(30.0)
    # a's 8th slot fits its 2nd block; b needs a 3rd block, b is the newest -> b preempts itself.
    assert s.batch.items == [("a", 1)] and s.preempted == ["b"]
    assert eng.kv.free_blocks == 2


def test_self_preemption_does_not_stop_the_running_pass() -> None:
    # Added a then b, but b arrived earlier (arrival_ms 0 < 5): a is the "most recently arrived".
    eng = make(num_blocks=4, block_size=4)
    eng.add_request("a", 8, max_tokens=4, arrival_ms=5.0)
    eng.add_request("b", 7, max_tokens=4, arrival_ms=0.0)
    eng.step(5.0)  # running order [a, b], pool full (2 + 2 blocks)
    eng.add_request("c", 4, max_tokens=2, arrival_ms=6.0)
    s = eng.step(20.0)
    # a needs a 3rd block -> preempt newest arrival = a itself; b (8th slot fits) runs; c not
    # admitted in a step that preempted.
    assert s.preempted == ["a"] and s.batch.items == [("b", 1)]
    assert [r.request_id for r in eng.waiting] == ["a", "c"]


def test_victim_accepted_earlier_in_the_step_loses_its_slot() -> None:
    # Running order [a, b]; a arrived last. a fits (7 -> 8 slots), b (8 -> 9) does not: the
    # victim is a, already accepted, so it is removed from the batch and b gets a's blocks.
    eng = make(num_blocks=4, block_size=4)
    eng.add_request("a", 7, max_tokens=4, arrival_ms=5.0)
    eng.add_request("b", 8, max_tokens=4, arrival_ms=0.0)
    eng.step(5.0)
    s = eng.step(20.0)
    assert s.preempted == ["a"] and s.batch.items == [("b", 1)]
    assert s.context_tokens == 8
    assert eng.kv.blocks_of("a") == 0 and eng.kv.blocks_of("b") == 3


def test_abort_frees_blocks_running_and_waiting() -> None:
    eng = make(num_blocks=10, block_size=16, tokens=32)
    eng.add_request("p", 100, max_tokens=5, arrival_ms=0.0)
    eng.add_request("w", 10, max_tokens=5, arrival_ms=0.0)
    s = eng.step(0.0)  # p: first 32-token chunk (2 blocks); budget spent, w waits
    assert s.batch.items == [("p", 32)] and s.outputs == []
    assert eng.kv.used_blocks == 2
    assert eng.abort("p") is True
    assert eng.kv.used_blocks == 0 and eng.num_running == 0
    assert eng.abort("p") is False
    assert eng.abort("w") is True and not eng.has_work()
    assert eng.counters.num_aborted == 2
    # A fresh request with a reused id is accepted after the abort.
    eng.add_request("p", 10, max_tokens=1, arrival_ms=1.0)
    assert eng.step(1.0).outputs[0].finished


def test_add_request_validation() -> None:
    eng = make(num_blocks=4, block_size=4, max_len=100)
    eng.add_request("a", 5, max_tokens=5, arrival_ms=0.0)
    with pytest.raises(ValueError, match="already"):
        eng.add_request("a", 5, max_tokens=5, arrival_ms=0.0)
    with pytest.raises(ValueError):
        eng.add_request("b", 0, max_tokens=5, arrival_ms=0.0)
    with pytest.raises(ValueError):
        eng.add_request("b", 5, max_tokens=0, arrival_ms=0.0)
    with pytest.raises(ValueError, match="maximum context length"):
        eng.add_request("b", 95, max_tokens=6, arrival_ms=0.0)  # 101 > 100
    # KV holds 16 slots; 10 + 7 - 1 = 16 fits (the last token is never written), 10 + 8 - 1 does not.
    eng.add_request("c", 10, max_tokens=7, arrival_ms=0.0)
    with pytest.raises(ValueError, match="KV"):
        eng.add_request("d", 10, max_tokens=8, arrival_ms=0.0)
    assert eng.max_request_tokens() == 17


def test_config_validation() -> None:
    with pytest.raises(ValueError):
        EngineConfig(TM, num_gpu_blocks=0)
    with pytest.raises(ValueError):
        EngineConfig(TM, num_gpu_blocks=10, max_num_seqs=0)


def test_engine_time_model_sets_duration_and_features_policy_keeps_its_model() -> None:
    """With an EngineTimeModel the step takes its time; StepResult.features describes the step; the
    policy still plans with config.time_model (TM)."""
    from loadgen.sim.engine_time import EngineTimeModel
    from replica_agent.policy.time_model import StepFeatures

    etm = EngineTimeModel(a_ms=5.0, b_ms=0.2, c_ms=0.01, d_ms=1.0, e_ms=1e-4, f_ms=1e-5)
    eng = SimEngine(EngineConfig(TM, 1000, 16, 503, 256, 32768, engine_time=etm))
    for rid, p in (("d1", 100), ("d2", 200), ("d3", 300)):
        eng.add_request(rid, p, max_tokens=10, arrival_ms=0.0)
    s1 = eng.step(0.0)  # d1 100, d2 200, d3 203 (chunked), all with prefix 0
    assert s1.features == StepFeatures(503, 0, 0, 100**2 + 200**2 + 203**2, 3, 0, 0, 100**2 + 200**2 + 203**2)
    # 5 + 0.2 * 503 (100.6) + 1.0 * 3 + 1e-5 * (10000 + 40000 + 41209 = 91209 -> 0.91209) = 109.51209
    assert s1.duration_ms == pytest.approx(109.51209)
    s2 = eng.step(s1.end_ms)  # decodes d1 (ctx 100), d2 (ctx 200); d3's last 97 over its 203 prefix
    # chunk*prefix: 100 + 200 + 97 * 203 (19691) = 19991; chunk^2: 1 + 1 + 9409 = 9411
    # prefill chunks only (the policy model's e and f): 97 * 203 = 19691, 97^2 = 9409; decodes: 2
    assert s2.features == StepFeatures(99, 503, 19991, 9411, 3, 19691, 2, 9409)
    # 5 + 0.2 * 99 (19.8) + 0.01 * 503 (5.03) + 3 + 1e-4 * 19991 (1.9991) + 1e-5 * 9411 (0.09411) = 34.92321
    assert s2.duration_ms == pytest.approx(34.92321)
    assert eng.policy_time_model is TM


def test_policy_engine_time_is_the_time_model_and_noise_streams_differ() -> None:
    from loadgen.sim.engine_time import EngineTimeModel

    eng = make(tokens=503)
    eng.add_request("a", 300, max_tokens=2, arrival_ms=0.0)
    s = eng.step(0.0)
    assert s.duration_ms == pytest.approx(TM.step_ms(s.features))  # 10 + 0.1 * 300 = 40
    assert s.duration_ms == pytest.approx(40.0)
    noisy = EngineTimeModel(a_ms=10.0, b_ms=0.1, noise_sigma=0.1, seed=1)
    times = []
    for stream in (0, 0, 1):
        e = SimEngine(EngineConfig(TM, 1000, 16, 503, 256, 32768, engine_time=noisy), noise_stream=stream)
        e.add_request("a", 300, max_tokens=2, arrival_ms=0.0)
        times.append(e.step(0.0).duration_ms)
    assert times[0] == times[1] != times[2]  # reproducible per (seed, stream); streams independent
    assert 40.0 * 0.6 < times[0] < 40.0 / 0.6


def test_step_log_record_carries_the_features() -> None:
    from loadgen.sim.step_log import step_record

    eng = make(tokens=503)
    eng.add_request("a", 300, max_tokens=3, arrival_ms=0.0)
    eng.add_request("b", 400, max_tokens=3, arrival_ms=0.0)
    s1 = eng.step(0.0)  # a 300, b chunked to 203
    s2 = eng.step(s1.end_ms)  # a decodes at context 300; b's last 197 over its 203 prefix
    rec = step_record(s2)
    # chunk*prefix = 300 + 197 * 203 (39991) = 40291; chunk^2 = 1 + 38809 = 38810
    assert rec["new_tokens"] == 198 and rec["context_tokens"] == 503 and rec["batch_size"] == 2
    assert (rec["chunk_prefix_tokens"], rec["chunk_sq_tokens"]) == (40291, 38810)
    # 10 + 0.1 * 198 + 0.001 * 503 = 30.303 ms
    assert rec["measured_ms"] == pytest.approx(30.303)
