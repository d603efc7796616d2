"""Token progress from vLLM stream chunks (fairbatch_common/openai_stream.py)."""

from __future__ import annotations

import json

import pytest

from fairbatch_common.openai_stream import (
    fast_event_tokens,
    finish_reasons,
    generated_tokens,
    requested_choices,
    usage_counts,
)


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


# ---- fast_event_tokens: the byte-level count must agree with the full parse whenever it answers

def _compact(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _cmpl(text: str, finish: str | None = None, index: int = 0, logprobs: object = None,
          usage: object = None) -> dict:
    return {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish,
                         "stop_reason": None}], "usage": usage}


def _chat(delta: dict, finish: str | None = None) -> dict:
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}


FAST_CASES = [  # (event, what the fast path must answer: a count, or None = leave it to the parse)
    (_cmpl(" tok"), 1),
    (_cmpl(""), 0),
    (_cmpl('\\"usage\\":{"index":1,"finish_reason":"stop" \\"role\\"'), 1),  # markers inside the text
    (_cmpl("tok", index=1), 1),  # one choice of an n > 1 stream: still one index key
    (_chat({"content": " tok"}), 1),
    (_chat({"content": ""}), 0),
    (_cmpl(" tok", finish="length"), None),  # finish chunk
    (_cmpl(" tok", logprobs={"tokens": ["a", "b"], "token_logprobs": [0, 0]}), None),  # 2 tokens by logprobs
    (_cmpl("", usage={"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}), None),
    (_chat({"role": "assistant", "content": ""}), None),
    (_chat({"reasoning_content": "think"}), None),
    (_chat({"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]}), None),
    ({"choices": [{"index": 0, "text": "a", "finish_reason": None}, {"index": 1, "text": "b", "finish_reason": None}]},
     None),  # two choices in one chunk
    ({"error": {"message": "x"}}, None),
]


@pytest.mark.parametrize(("event", "expected"), FAST_CASES)
def test_fast_count_agrees_with_the_full_parse(event: dict, expected: int | None) -> None:
    payload = _compact(event)
    got = fast_event_tokens(payload)
    assert got == expected
    if got is not None:
        assert got == generated_tokens(event)
    spaced = json.dumps(event).encode()  # ", " and ": " spacing: never the fast path
    assert fast_event_tokens(spaced) is None


def test_sse_parser_payloads_across_chunk_boundaries() -> None:
    from replica_agent.proxy import SseParser

    stream = b'data: {"a":1}\n\ndata: {"b":2}\r\n\ndata: [DONE]\n\n'
    for cut in range(1, len(stream)):  # every split point gives the same events
        p = SseParser()
        got = p.feed_raw(stream[:cut]) + p.feed_raw(stream[cut:])
        assert got == [b'{"a":1}', b'{"b":2}'] and p.done
    p = SseParser()
    assert p.feed(b'data: {"a":1}\n\ndata: not json\n\n') == [{"a": 1}]


def test_sse_parser_hand_worked_reads() -> None:
    from replica_agent.proxy import SseParser

    p = SseParser()  # one whole event per read (the one-event fast path), a CRLF line end, an empty payload
    assert p.feed_raw(b'data: {"choices":[{"text":"a"}]}\n\n') == [b'{"choices":[{"text":"a"}]}']
    assert p.feed_raw(b'data:{"x":1}\r\n\n') == [b'{"x":1}']
    assert p.feed_raw(b"data: \n\n") == [] and not p.done
    # an event split across three reads: nothing until its blank line arrives
    assert p.feed_raw(b'data: {"choices":[{"te') == []
    assert p.feed_raw(b'xt":"b"}]}\n') == []
    assert p.feed_raw(b"\n") == [b'{"choices":[{"text":"b"}]}']
    # several events in one read, the second cut after its "data:"; a comment line and an event: line
    assert p.feed_raw(b': keep-alive\n\ndata: {"e":1}\n\nevent: x\ndata: {"e":2}\n\ndata:') == [b'{"e":1}', b'{"e":2}']
    # the rest of that event, the usage event and [DONE] in one read
    assert p.feed_raw(b' {"error":{"message":"m"}}\n\ndata: {"choices":[],"usage":{"prompt_tokens":3}}\n\n'
                      b"data: [DONE]\n\n") == [b'{"error":{"message":"m"}}', b'{"choices":[],"usage":{"prompt_tokens":3}}']
    assert p.done
    q = SseParser()  # [DONE] alone in a read
    assert q.feed_raw(b"data: [DONE]\n\n") == [] and q.done
    r = SseParser()  # a "data:" inside a JSON string is not a line start: one event
    assert r.feed_raw(b'data: {"text":"data: [DONE]"}\n\n') == [b'{"text":"data: [DONE]"}'] and not r.done


def test_finish_reasons_of_answers_and_chunks() -> None:
    # a whole answer with n = 2, a stream chunk whose first choice is still running, a usage chunk
    assert finish_reasons({"choices": [{"index": 0, "finish_reason": "stop"},
                                       {"index": 1, "finish_reason": "length"}]}) == ["stop", "length"]
    assert finish_reasons({"choices": [{"index": 0, "finish_reason": None},
                                       {"index": 1, "finish_reason": "tool_calls"}]}) == ["tool_calls"]
    assert finish_reasons({"choices": [], "usage": {"completion_tokens": 3}}) == []
    assert finish_reasons({"error": {"message": "x"}}) == []
