"""Token progress from vLLM stream chunks (replica_agent/openai_stream.py)."""

from __future__ import annotations

from replica_agent.openai_stream import generated_tokens, requested_choices, usage_counts


def chunk(**choice) -> dict:
    return {"choices": [{"index": 0, "finish_reason": None, **choice}]}


def test_every_field_that_carries_a_token_counts() -> None:
    assert generated_tokens(chunk(text=" tok")) == 1
    assert generated_tokens(chunk(delta={"content": "a"})) == 1
    assert generated_tokens(chunk(delta={"reasoning_content": "hmm"})) == 1
    assert generated_tokens(chunk(delta={"reasoning": "hmm"})) == 1
    assert generated_tokens(chunk(delta={"tool_calls": [{"index": 0, "function": {"arguments": "{\""}}]})) == 1
    assert generated_tokens(chunk(delta={"tool_calls": [{"index": 0, "id": "x", "function": {"name": "f", "arguments": ""}}]})) == 1


def test_role_finish_and_usage_chunks_count_zero() -> None:
    assert generated_tokens(chunk(delta={"role": "assistant", "content": ""})) == 0
    assert generated_tokens(chunk(delta={}, finish_reason="stop")) == 0
    assert generated_tokens({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 5}}) == 0
    assert generated_tokens({"error": {"message": "x"}}) == 0


def test_logprobs_give_the_exact_count_even_with_empty_text() -> None:
    # a held-back stop-string prefix: text "" but two tokens sampled
    lp = {"content": [{"token": "a", "logprob": -1.0}, {"token": "b", "logprob": -2.0}]}
    assert generated_tokens(chunk(delta={"content": ""}, logprobs=lp)) == 2
    cl = {"tokens": [" a", " b", " c"], "token_logprobs": [-1, -1, -1], "text_offset": [0, 2, 4], "top_logprobs": []}
    assert generated_tokens(chunk(text="", logprobs=cl)) == 3


def test_n_greater_than_one_sums_choices() -> None:
    ev = {"choices": [{"index": 0, "text": "a"}, {"index": 1, "text": "b"}, {"index": 2, "text": ""}]}
    assert generated_tokens(ev) == 2
    assert requested_choices({"n": 3}) == 3 and requested_choices({}) == 1 and requested_choices({"n": True}) == 1


def test_usage_counts() -> None:
    assert usage_counts({"usage": {"prompt_tokens": 4, "completion_tokens": 9}}) == (4, 9)
    assert usage_counts({"usage": None}) is None
