"""Batch formation (replica_agent/policy/batching.py): vLLM's default, hand-worked batches."""

from __future__ import annotations

import pytest

from replica_agent.policy.batching import POLICIES, SchedRequest, SchedState, VllmDefaultPolicy, make_policy


def decode(rid: str, prompt: int, out: int) -> SchedRequest:
    """A running decode: prompt + out - 1 tokens in KV, the last sampled token still to compute."""
    return SchedRequest(rid, prompt_tokens=prompt, computed_tokens=prompt + out - 1, tokens_out=out, max_tokens=100)


def state(running: list[SchedRequest], waiting: list[SchedRequest], tokens: int = 8192, seqs: int = 256) -> SchedState:
    return SchedState(now_ms=0.0, running=running, waiting=waiting, max_num_batched_tokens=tokens, max_num_seqs=seqs,
                      kv_free_blocks=100_000)  # fmt: skip


def test_registry() -> None:
    assert POLICIES["vllm-default"] is VllmDefaultPolicy
    assert isinstance(make_policy("vllm-default"), VllmDefaultPolicy)
    with pytest.raises(KeyError, match="vllm-default"):
        make_policy("nope")


def test_request_token_views() -> None:
    r = SchedRequest("a", prompt_tokens=100, computed_tokens=40)
    # 100 - 40 = 60 prompt tokens left: a chunked prefill.
    assert (r.num_tokens, r.remaining_tokens, r.is_prefill) == (100, 60, True)
    d = decode("d", 100, 3)  # 102 in KV, 103 known
    assert (d.num_tokens, d.remaining_tokens, d.is_prefill) == (103, 1, False)


def test_empty_state_gives_empty_batch() -> None:
    b = VllmDefaultPolicy().form_batch(state([], []))
    assert b.items == [] and b.num_new_tokens == 0 and len(b) == 0


def test_running_first_then_fcfs_waiting() -> None:
    running = [decode("d1", 100, 1), decode("d2", 200, 5)]
    waiting = [SchedRequest("w1", 50), SchedRequest("w2", 30)]
    b = VllmDefaultPolicy().form_batch(state(running, waiting))
    # 1 + 1 decode tokens, then the whole 50- and 30-token prompts: 82 tokens.
    assert b.items == [("d1", 1), ("d2", 1), ("w1", 50), ("w2", 30)]
    assert b.num_new_tokens == 82


def test_last_waiting_prefill_chunked_to_budget() -> None:
    running = [decode("d1", 10, 2), decode("d2", 10, 2), decode("d3", 10, 2)]
    waiting = [SchedRequest("w1", 600), SchedRequest("w2", 100)]
    b = VllmDefaultPolicy().form_batch(state(running, waiting, tokens=503))
    # budget 503 - 3 decodes = 500 -> w1 gets a 500-token chunk, nothing left for w2.
    assert b.items == [("d1", 1), ("d2", 1), ("d3", 1), ("w1", 500)]
    assert b.num_new_tokens == 503


def test_unfinished_chunked_prefill_continues_in_running_order() -> None:
    # w1 ran its first 500-token chunk; it is running with 100 prompt tokens left.
    running = [decode("d1", 10, 2), SchedRequest("w1", 600, computed_tokens=500), decode("d2", 10, 2)]
    waiting = [SchedRequest("w2", 100)]
    b = VllmDefaultPolicy().form_batch(state(running, waiting, tokens=150))
    # 1 (d1) + 100 (w1's rest) + 1 (d2) = 102; w2 gets 150 - 102 = 48.
    assert b.items == [("d1", 1), ("w1", 100), ("d2", 1), ("w2", 48)]


def test_running_chunk_limited_by_budget_and_later_running_skipped() -> None:
    running = [SchedRequest("p", 1000, computed_tokens=0), decode("d", 10, 2)]
    b = VllmDefaultPolicy().form_batch(state(running, [SchedRequest("w", 5)], tokens=256))
    # p takes the whole 256-token budget; d and w wait for the next step.
    assert b.items == [("p", 256)]


def test_max_num_seqs_caps_admission() -> None:
    running = [decode("d1", 10, 2), decode("d2", 10, 2)]
    waiting = [SchedRequest("w1", 5), SchedRequest("w2", 5), SchedRequest("w3", 5)]
    b = VllmDefaultPolicy().form_batch(state(running, waiting, seqs=3))
    # 2 running + 1 admitted = 3 sequences.
    assert b.items == [("d1", 1), ("d2", 1), ("w1", 5)]
    full = VllmDefaultPolicy().form_batch(state(running, waiting, seqs=2))
    assert full.items == [("d1", 1), ("d2", 1)]


def test_preempted_request_recomputes_prompt_and_outputs() -> None:
    # Preempted after 7 output tokens: KV dropped, 100 + 7 = 107 tokens to recompute.
    w = SchedRequest("p", prompt_tokens=100, computed_tokens=0, tokens_out=7, max_tokens=20)
    b = VllmDefaultPolicy().form_batch(state([], [w]))
    assert b.items == [("p", 107)]


# ---- FairBatching and the other baselines (issue 4) ----------------------------------------------

from replica_agent.policy.batching import (  # noqa: E402
    FairBatchingPolicy,
    FcfsPolicy,
    PolicyConfig,
    PrefillFirstPolicy,
)
from replica_agent.policy.time_model import TimeModel  # noqa: E402

TM = TimeModel(10.0, 0.1, 0.001)  # a = 10 ms, b = 0.1 ms/new token, c = 0.001 ms/context token


def fb_state(running: list[SchedRequest], waiting: list[SchedRequest], now: float, tokens: int = 8192,
             seqs: int = 256, kv_blocks: int = 100_000) -> SchedState:  # fmt: skip
    return SchedState(now_ms=now, running=running, waiting=waiting, max_num_batched_tokens=tokens,
                      max_num_seqs=seqs, kv_free_blocks=kv_blocks, block_size=16, time_model=TM)  # fmt: skip


def slo_decode(rid: str, prompt: int, out: int, arrival: float, first: float) -> SchedRequest:
    """A running decode with TTFT 500 / TPOT 50 whose first token came at ``first``."""
    return SchedRequest(rid, prompt, computed_tokens=prompt + out - 1, tokens_out=out, max_tokens=1000,
                        arrival_ms=arrival, ttft_ms=500, tpot_ms=50, first_token_ms=first)  # fmt: skip


def seed_case(prompt_p: int) -> tuple[list[SchedRequest], list[SchedRequest]]:
    """The seed's scene at now = 990 ms (TTFT 500 ms, TPOT 50 ms for all):

    D1: arrived 0, first token at 500, 20 tokens out (100-token prompt, 119 in KV):
        next deadline = 0 + 500 + 50*20 = 1500 (= 500 + 50*20 from its first token) -> slack 510
        (it is 10 tokens ahead of its envelope).
    D2: arrived 450, first token at 950, 1 token out (100 in KV): deadline 450 + 500 + 50 = 1000
        -> slack 10 (little).
    P:  waiting prompt, arrived 600: first-token deadline 1100 -> slack 110 (near its TTFT).
    """
    d1 = slo_decode("D1", 100, 20, 0.0, 500.0)
    d2 = slo_decode("D2", 100, 1, 450.0, 950.0)
    p = SchedRequest("P", prompt_p, arrival_ms=600.0, ttft_ms=500, tpot_ms=50, max_tokens=100)
    return [d1, d2], [p]


def test_registry_has_all_five() -> None:
    assert set(POLICIES) == {"vllm-default", "fairbatching", "fairbatching-pd", "fcfs", "prefill-first"}
    fb = make_policy("fairbatching", PolicyConfig(default_ttft_ms=700, default_tpot_ms=70))
    assert isinstance(fb, FairBatchingPolicy) and (fb.default_ttft_ms, fb.default_tpot_ms) == (700, 70)
    assert make_policy("vllm-default", PolicyConfig(token_budget=2048)).token_budget == 2048  # type: ignore[attr-defined]


def test_seed_case_fairbatching_spends_d1_slack_on_the_8k_prefill() -> None:
    running, waiting = seed_case(8000)
    b = FairBatchingPolicy().form_batch(fb_state(running, waiting, now=990.0))
    # budget = max(min slack 10, min tpot 50) = 50 ms; urgent: slack < 50 + 50 = 100 -> D2 only.
    # Order D2 (10), P (110), D1 (510).
    # D2: t = 10 + 0.1 + 0.001*100 = 10.2 ms.
    # P: room = 50 - 10.2 = 39.8 ms -> floor(39.8 / 0.1) = 398-token chunk; t = 50.0 ms.
    # D1: 50 + 0.1 + 0.001*119 = 50.219 > 50 -> skipped (its 510 ms of slack is what P spent).
    assert b.items == [("D2", 1), ("P", 398)]
    assert b.num_new_tokens == 399
    assert TM.batch_ms(399, 100) == pytest.approx(50.0)


def test_seed_case_vllm_default_runs_decodes_first_then_the_whole_prompt() -> None:
    running, waiting = seed_case(8000)
    b = VllmDefaultPolicy().form_batch(fb_state(running, waiting, now=990.0))
    # D1, D2 (running order), then P whole (8000 <= 8192 - 2): 10 + 0.1*8002 + 0.001*219 = 810.4 ms,
    # 800 ms past D2's deadline.
    assert b.items == [("D1", 1), ("D2", 1), ("P", 8000)]
    assert TM.batch_ms(b.num_new_tokens, 219) == pytest.approx(810.419)


def test_seed_case_short_prompt_leaves_time_for_d1() -> None:
    running, waiting = seed_case(200)
    b = FairBatchingPolicy().form_batch(fb_state(running, waiting, now=990.0))
    # D2 -> 10.2 ms; P whole: 10.2 + 0.1*200 = 30.2 ms; D1: 30.2 + 0.219 = 30.419 <= 50 -> added.
    assert b.items == [("D2", 1), ("P", 200), ("D1", 1)]


def test_large_min_slack_gives_a_large_budget() -> None:
    # Both decodes far ahead at now = 990: D1 slack 510 (as above), D3 arrived 400, first token at 500,
    # 10 out -> deadline min(400 + 500 + 500, 500 + 500) = 1000... make it 12 out: min(1500, 1100) = 1100 -> 110.
    d1 = slo_decode("D1", 100, 20, 0.0, 500.0)
    d3 = slo_decode("D3", 100, 12, 400.0, 500.0)
    p = SchedRequest("P", 8000, arrival_ms=600.0, ttft_ms=500, tpot_ms=50)
    b = FairBatchingPolicy().form_batch(fb_state([d1, d3], [p], now=990.0))
    # budget = max(110, 50) = 110; urgent: slack < 160 -> D3 (110); D1 (510) non-urgent.
    # D3: t = 10 + 0.1 + 0.111 = 10.211; P: room 99.789 -> 997 tokens, t = 109.911;
    # D1: 109.911 + 0.219 = 110.13 > 110 -> skipped.
    assert b.items == [("D3", 1), ("P", 997)]


def test_seed_envelope_variant_lets_early_first_token_bank_slack() -> None:
    # D3 as above: the seed's envelope alone gives deadline 1500 -> slack 510, not 110.
    d3 = slo_decode("D3", 100, 12, 400.0, 500.0)
    seed = FairBatchingPolicy(tpot_from_first_token=False)
    p = SchedRequest("P", 8000, arrival_ms=600.0, ttft_ms=500, tpot_ms=50)
    b = seed.form_batch(fb_state([d3], [p], now=990.0))
    # budget = max(510, 50) = 510; urgent: slack < 560 -> D3. D3: 10.211; P: room 499.789 -> 4997 tokens.
    assert b.items == [("D3", 1), ("P", 4997)]


def test_prefills_ordered_by_slack_and_last_one_chunked() -> None:
    d = slo_decode("D", 100, 1, 450.0, 950.0)  # slack 10 at now 990 -> budget 50
    w_late = SchedRequest("late", 100, arrival_ms=500.0, ttft_ms=500, tpot_ms=50)  # deadline 1000 -> slack 10
    w_early = SchedRequest("early", 300, arrival_ms=900.0, ttft_ms=500, tpot_ms=50)  # deadline 1400 -> 410
    b = FairBatchingPolicy().form_batch(fb_state([d], [w_early, w_late], now=990.0))
    # D: 10.2; late (slack 10) whole: 10.2 + 10 = 20.2; early: room 29.8 -> 298 of 300 tokens (chunked).
    assert b.items == [("D", 1), ("late", 100), ("early", 298)]


def test_no_decodes_fills_the_token_cap() -> None:
    w1 = SchedRequest("w1", 5000, arrival_ms=0.0)
    w2 = SchedRequest("w2", 5000, arrival_ms=1.0)
    b = FairBatchingPolicy().form_batch(fb_state([], [w1, w2], now=10.0, tokens=8192))
    # no decode -> unbounded time budget; token cap 8192: 5000 + 3192 (default SLO 1000 ms: w1 slack 990 first).
    assert b.items == [("w1", 5000), ("w2", 3192)]


def test_never_empty_most_urgent_decode_alone() -> None:
    # Context 100 000 tokens: one decode alone costs 10 + 0.1 + 100 = 110.1 ms > budget max(10, 50) = 50.
    big = slo_decode("big", 99_950, 51, 0.0, 450.0)  # deadline min(500 + 2550, 450 + 2550) = 3000
    b = FairBatchingPolicy().form_batch(fb_state([big], [], now=2990.0))
    assert b.items == [("big", 1)]


def test_kv_limits_admission_and_max_num_seqs() -> None:
    d = slo_decode("D", 100, 1, 450.0, 950.0)  # 100 in KV: the new token fills slot 101, in block 7 (held).
    w = SchedRequest("w", 200, arrival_ms=600.0, ttft_ms=500, tpot_ms=50)
    # 200-token prompt needs 13 blocks; only 12 free -> not admitted.
    b = FairBatchingPolicy().form_batch(fb_state([d], [w], now=990.0, kv_blocks=12))
    assert b.items == [("D", 1)]
    # With 13 free it fits KV, but max_num_seqs = 1 (D runs) still keeps it out.
    assert FairBatchingPolicy().form_batch(fb_state([d], [w], now=990.0, kv_blocks=13, seqs=1)).items == [("D", 1)]
    assert FairBatchingPolicy().form_batch(fb_state([d], [w], now=990.0, kv_blocks=13)).items == [("D", 1), ("w", 200)]


def test_default_slo_for_requests_without_one() -> None:
    # No SLO on the decode: default TTFT 1000 / TPOT 100; arrival 0, 1 out, now 1090:
    # deadline 0 + 1000 + 100 = 1100 -> slack 10; budget max(10, 100) = 100 ms.
    d = SchedRequest("d", 100, computed_tokens=100, tokens_out=1, max_tokens=10, arrival_ms=0.0)
    w = SchedRequest("w", 5000, arrival_ms=1000.0)
    b = FairBatchingPolicy().form_batch(fb_state([d], [w], now=1090.0))
    # d: 10.2; w: room 89.8 -> 898 tokens.
    assert b.items == [("d", 1), ("w", 898)]
    b2 = FairBatchingPolicy(default_ttft_ms=1000, default_tpot_ms=50).form_batch(fb_state([d], [w], now=1090.0))
    # TPOT 50: deadline 1050 -> slack -40; budget 50; w: room 39.8 -> 398.
    assert b2.items == [("d", 1), ("w", 398)]


def test_fairbatching_needs_a_time_model() -> None:
    with pytest.raises(ValueError, match="time_model"):
        FairBatchingPolicy().form_batch(state([decode("d", 10, 2)], []))


def test_fcfs_arrival_order_prefill_and_decode_alike() -> None:
    d1 = SchedRequest("d1", 10, computed_tokens=11, tokens_out=2, arrival_ms=0.0)
    d2 = SchedRequest("d2", 10, computed_tokens=11, tokens_out=2, arrival_ms=200.0)
    w = SchedRequest("w", 300, arrival_ms=100.0)
    b = FcfsPolicy().form_batch(state([d1, d2], [w], tokens=200))
    # arrival order d1 (0), w (100), d2 (200): 1 + 199 tokens -> the budget is spent before d2.
    assert b.items == [("d1", 1), ("w", 199)]


def test_prefill_first_then_decodes_in_leftover() -> None:
    d1 = SchedRequest("d1", 10, computed_tokens=11, tokens_out=2, arrival_ms=0.0)
    p = SchedRequest("p", 600, computed_tokens=500, arrival_ms=50.0)  # running chunked prefill, 100 left
    w = SchedRequest("w", 100, arrival_ms=60.0)
    b = PrefillFirstPolicy().form_batch(state([d1, p], [w], tokens=150))
    # p 100, w 50 (chunked to the cap), nothing left for d1.
    assert b.items == [("p", 100), ("w", 50)]
    b2 = PrefillFirstPolicy().form_batch(state([d1, p], [w], tokens=300))
    # p 100 + w 100 = 200, then d1 1.
    assert b2.items == [("p", 100), ("w", 100), ("d1", 1)]


def test_fcfs_stops_admission_when_kv_is_short() -> None:
    d = SchedRequest("d", 10, computed_tokens=11, tokens_out=2, arrival_ms=0.0)  # 11 in KV: next slot in block 1
    w1 = SchedRequest("w1", 40, arrival_ms=1.0)  # 3 blocks
    w2 = SchedRequest("w2", 10, arrival_ms=2.0)  # 1 block
    st = SchedState(now_ms=0.0, running=[d], waiting=[w1, w2], max_num_batched_tokens=100, max_num_seqs=8,
                    kv_free_blocks=2, block_size=16)  # fmt: skip
    # d fits (no new block); w1 needs 3 > 2 free -> admission stops (w2 not admitted either, as vLLM).
    assert FcfsPolicy().form_batch(st).items == [("d", 1)]
    assert PrefillFirstPolicy().form_batch(st).items == [("d", 1)]


def test_vllm_default_fixed_token_budget() -> None:
    running = [decode("d1", 10, 2)]
    b = VllmDefaultPolicy(token_budget=2048).form_batch(state(running, [SchedRequest("w", 5000)], tokens=8192))
    assert b.items == [("d1", 1), ("w", 2047)]


def test_random_states_fairbatching_respects_budget_kv_and_caps() -> None:
    import random

    rng = random.Random(7)
    policy = FairBatchingPolicy()
    for _ in range(300):
        now = 10_000.0
        running = []
        for i in range(rng.randint(0, 40)):
            prompt, out = rng.randint(1, 3000), rng.randint(1, 50)
            running.append(SchedRequest(f"d{i}", prompt, computed_tokens=prompt + out - 1, tokens_out=out,
                                        arrival_ms=now - rng.uniform(0, 4000), ttft_ms=500, tpot_ms=50))  # fmt: skip
        waiting = [SchedRequest(f"w{i}", rng.randint(1, 6000), arrival_ms=now - rng.uniform(0, 600), ttft_ms=500,
                                tpot_ms=50) for i in range(rng.randint(0, 10))]  # fmt: skip
        st = fb_state(running, waiting, now, tokens=rng.choice([512, 2048, 8192]), seqs=rng.randint(len(running) or 1, 64),
                      kv_blocks=rng.randint(0, 2000))  # fmt: skip
        b = policy.form_batch(st)
        if running or waiting:
            assert len(b) >= 1  # never empty while work exists
        assert b.num_new_tokens <= st.max_num_batched_tokens
        if len(b) <= 1:
            continue  # the fallback item may exceed budget or KV (the engine preempts, as vLLM)
        by_id = {r.request_id: r for r in [*running, *waiting]}
        ctx = sum(by_id[rid].computed_tokens for rid, _ in b.items)
        decodes = [r for r in running if r.tokens_out > 0]
        if decodes:
            slack = min(min(r.arrival_ms + 500 + 50 * r.tokens_out - now for r in decodes), 50.0 * 10**9)
            assert TM.batch_ms(b.num_new_tokens, ctx) <= max(slack, 50.0) + 1e-6
        blocks = 0
        for rid, n in b.items:
            c = by_id[rid].computed_tokens
            blocks += -(-(c + n) // 16) - (-(-c // 16))
        assert blocks <= st.kv_free_blocks
        assert len(running) + sum(1 for rid, _ in b.items if rid.startswith("w")) <= st.max_num_seqs


def test_chunk_sq_term_shrinks_the_chunk_to_the_budget_by_hand() -> None:
    # the seed's scene with f = 1e-5 ms/token^2: budget 50, D2 first (t = 10.2), then P gets room 39.8 ms;
    # the largest n with 0.1*n + 1e-5*n^2 <= 39.8 is floor(2*39.8 / (0.1 + sqrt(0.01 + 4e-5*39.8))) = 383
    # (0.1*383 + 1e-5*383^2 = 39.76689; 384 would take 39.87456); D1 (+0.219 ms) no longer fits
    from replica_agent.policy.time_model import StepFeatures

    tmf = TimeModel(10.0, 0.1, 0.001, f_ms_per_chunk_sq=1e-5)
    running, waiting = seed_case(8000)
    st = SchedState(now_ms=990.0, running=running, waiting=waiting, max_num_batched_tokens=8192, max_num_seqs=256,
                    kv_free_blocks=100_000, block_size=16, time_model=tmf)  # fmt: skip
    b = FairBatchingPolicy().form_batch(st)
    assert b.items == [("D2", 1), ("P", 383)]
    # the step the engine would time: D2 at context 100, P's 383-token chunk at prefix 0
    assert tmf.step_ms(StepFeatures.from_items([(1, 100), (383, 0)])) == pytest.approx(49.96689)
    # f = 0 gives the linear chunk of test_seed_case_fairbatching_spends_d1_slack_on_the_8k_prefill
    assert FairBatchingPolicy().form_batch(fb_state(running, waiting, now=990.0)).items == [("D2", 1), ("P", 398)]


def test_decode_guard_plans_decode_deadlines_early_by_hand() -> None:
    # The scene of test_large_min_slack_gives_a_large_budget with a 40-ms guard: D1 slack 510 - 40 = 470,
    # D3 110 - 40 = 70; P (no first token) keeps 110. Budget = max(70, 50) = 70; urgent: slack < 120 -> D3.
    # D3: 10.211 ms; P: room 70 - 10.211 = 59.789 -> 597 tokens (t = 69.911); D1: 70.13 > 70 -> skipped.
    d1 = slo_decode("D1", 100, 20, 0.0, 500.0)
    d3 = slo_decode("D3", 100, 12, 400.0, 500.0)
    p = SchedRequest("P", 8000, arrival_ms=600.0, ttft_ms=500, tpot_ms=50)
    guarded = make_policy("fairbatching", PolicyConfig(decode_guard_ms=40.0))
    assert guarded.form_batch(fb_state([d1, d3], [p], now=990.0)).items == [("D3", 1), ("P", 597)]
    # a guard large enough to make D1 urgent (seed scene, g = 420: D1 90, D2 -410; budget max(-410, 50) = 50,
    # urgent < 100 -> both, by slack D2, D1): D2 10.2, D1 10.419, P room 39.581 -> 395 tokens.
    running, waiting = seed_case(8000)
    b = FairBatchingPolicy(decode_guard_ms=420.0).form_batch(fb_state(running, waiting, now=990.0))
    assert b.items == [("D2", 1), ("D1", 1), ("P", 395)]
    # without the guard D1 waits (test_seed_case_fairbatching_spends_d1_slack_on_the_8k_prefill)
    assert FairBatchingPolicy().form_batch(fb_state(running, waiting, now=990.0)).items == [("D2", 1), ("P", 398)]


def test_decode_guard_setting() -> None:
    from replica_agent.policy.batching import decode_guard_ms, plugin_policy

    assert decode_guard_ms(None) == 0.0 and decode_guard_ms(" ") == 0.0 and decode_guard_ms("12.5") == 12.5
    for bad in ("-1", "nan", "inf", "20ms"):
        with pytest.raises(ValueError, match="FAIRBATCH_DECODE_GUARD_MS"):
            decode_guard_ms(bad)
    with pytest.raises(ValueError, match="decode_guard_ms"):
        PolicyConfig(decode_guard_ms=-1.0)
    assert plugin_policy(None, 870.0, 40.0, 20.0).decode_guard_ms == 20.0  # type: ignore[attr-defined]
    assert plugin_policy("fairbatching-pd", 870.0, 40.0, 5.0).decode_guard_ms == 5.0  # type: ignore[attr-defined]
