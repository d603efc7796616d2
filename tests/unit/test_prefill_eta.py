"""replica_agent/policy/prefill_eta.py: when each in-flight prefill ends, worked by hand."""

from __future__ import annotations

import pytest

from replica_agent.policy.pab import DecodeState, PendingPrefill, ReplicaState
from replica_agent.policy.prefill_eta import inflight_schedule, prefill_completions_ms
from replica_agent.policy.time_model import TimeModel

TM = TimeModel(10.0, 0.1, 0.001)


def state(prefills, decodes=()) -> ReplicaState:
    return ReplicaState(now_ms=0.0, decodes=decodes, prefills=prefills, kv_free_tokens=10**6, time_model=TM)


def decode(ctx: int) -> DecodeState:
    return DecodeState(next_deadline_ms=1e9, tpot_ms=100.0, context_tokens=ctx, tokens_out=1)  # ctx matters here


def test_chunked_prefill_steps_by_hand() -> None:
    # budget 1024 - 1 decode = 1023 prompt tokens per step
    # step 1: 1023 of A: 10 + 0.1 * 1024 + 0.001 * 1000 = 113.4
    # step 2: 477 of A (prefix 1023) + 546 of B: 10 + 102.4 + 0.001 * (1001 + 1023) = 114.424 -> A at 227.824
    # step 3: 454 of B (prefix 546): 10 + 0.1 * 455 + 0.001 * (1002 + 546) = 57.048 -> B at 284.872
    s = state([PendingPrefill(1500), PendingPrefill(1000)], [decode(1000)])
    assert prefill_completions_ms(s, 1024) == pytest.approx((227.824, 284.872))
    # the head has run 100 ms already: both 100 ms sooner; never below 0
    assert prefill_completions_ms(s, 1024, head_elapsed_ms=100.0) == pytest.approx((127.824, 184.872))
    assert prefill_completions_ms(s, 1024, head_elapsed_ms=1000.0) == (0.0, 0.0)


def test_prompts_that_share_one_step_end_together() -> None:
    # 8192 tokens per step, no decodes: 4000 + 4000 in one step, 10 + 0.1 * 8000 = 810 ms for both
    s = state([PendingPrefill(4000), PendingPrefill(4000)])
    assert prefill_completions_ms(s, 8192) == pytest.approx((810.0, 810.0))
    # a partly computed prompt reads its prefix: 1000 left of 3000 -> 10 + 100 + 0.001 * 2000 = 112
    assert prefill_completions_ms(state([PendingPrefill(3000, 2000)]), 8192) == pytest.approx((112.0,))
    assert prefill_completions_ms(state([]), 8192) == ()


def test_beyond_max_steps_the_last_pace_extrapolates() -> None:
    # 1000 tokens per step, each step reads the prefix so far: 110, 111, 112, 113, 114 ms -> 560.
    # Cut after 2 steps (221 ms), the rest at the last step's 1000 tokens / 111 ms: 221 + 333 = 554
    assert prefill_completions_ms(state([PendingPrefill(5000)]), 1000) == pytest.approx((560.0,))
    assert prefill_completions_ms(state([PendingPrefill(5000)]), 1000, max_steps=2) == pytest.approx((554.0,))
    with pytest.raises(ValueError):
        prefill_completions_ms(state([PendingPrefill(5)]), 0)


def test_inflight_schedule_pairs_lumps_and_ends() -> None:
    # ten 100-token prompts, 1000 tokens per step, no decodes: all in one step of 10 + 100 = 110 ms;
    # lumps of b * 100 = 10 ms, the last 3 merged (8 entries at most), every end 110
    s = state([PendingPrefill(100) for _ in range(10)])
    lumps, ends = inflight_schedule(s, 1000)
    assert lumps == pytest.approx((10.0,) * 7 + (30.0,)) and ends == pytest.approx((110.0,) * 8)
    assert inflight_schedule(state([]), 1000) == ((), ())


def test_chunk_sq_term_in_each_step_by_hand() -> None:
    # 1024 tokens per step, no decodes, f = 1e-5: a 1500-token prompt runs as 1024 + 476:
    # step 1: 10 + 0.1 * 1024 + 1e-5 * 1024^2 = 122.88576; step 2: 10 + 47.6 + 0.001 * 1024 + 1e-5 * 476^2 = 60.88976
    tm = TimeModel(10.0, 0.1, 0.001, f_ms_per_chunk_sq=1e-5)
    s = ReplicaState(now_ms=0.0, decodes=(), prefills=(PendingPrefill(1500),), kv_free_tokens=10**6, time_model=tm)
    assert prefill_completions_ms(s, 1024) == pytest.approx((122.88576 + 60.88976,))
