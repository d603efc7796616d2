"""Batch formation (replica_agent/policy/batching.py): vLLM's default, hand-worked batches."""

from __future__ import annotations

import pytest

from replica_agent.policy.batching import POLICIES, SchedRequest, SchedState, VllmDefaultPolicy, make_policy


def decode(rid: str, prompt: int, out: int) -> SchedRequest:
    """A running decode: prompt + out - 1 tokens in KV, the last sampled token still to compute."""
    return SchedRequest(rid, prompt_tokens=prompt, computed_tokens=prompt + out - 1, tokens_out=out, max_tokens=100)


def state(running: list[SchedRequest], waiting: list[SchedRequest], tokens: int = 8192, seqs: int = 256) -> SchedState:
    return SchedState(now_ms=0.0, running=running, waiting=waiting, max_num_batched_tokens=tokens, max_num_seqs=seqs)


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
