"""The simulated engine's sampling (loadgen/sim/sampling.py): values worked out by hand from the
module's rules (greedy = " tok", id 100; stop strings cut before the match; min_tokens masks EOS
and stop ids; structured output = JSON cut in 4-byte tokens then EOS)."""

from __future__ import annotations

import json
import math

import pytest

from loadgen.sim.sampling import (EOS_ID, VOCAB, VOCAB_LOGPROBS, SamplingError, chat_logprob_entry,
                                  completion_logprobs, generate, parse_sampling)  # fmt: skip


def run(body: dict, max_tokens: int = 8, chat: bool = False):
    return generate(parse_sampling(body, chat, max_tokens))


def test_distribution_is_normalised_and_ranked() -> None:
    total = math.exp(math.log(0.01)) + sum(math.exp(lp) for lp in VOCAB_LOGPROBS)
    assert total == pytest.approx(1.0, abs=1e-12)
    assert VOCAB[0] == " tok" and all(a > b for a, b in zip(VOCAB_LOGPROBS, VOCAB_LOGPROBS[1:]))
    assert all(len(w.encode()) == 4 for w in VOCAB)


def test_greedy_is_tok_and_n_choices_equal() -> None:
    outs = run({"n": 2}, max_tokens=3)
    assert [o.text for o in outs] == [" tok tok tok"] * 2
    assert [o.finish_reason for o in outs] == ["length", "length"]
    assert all(t.id == 100 for o in outs for t in o.tokens)


def test_stop_string_cuts_before_the_match_and_holds_back_in_streams() -> None:
    # raw after 2 tokens " tok tok": "k t" starts at index 3 -> text " to"; 2 tokens generated
    (o,) = run({"stop": ["k t"]})
    assert (o.text, o.finish_reason, o.stop_reason, len(o.tokens)) == (" to", "stop", "k t", 2)
    # hold-back of len("k t") - 1 = 2 chars: token 1 shows " t" (4 - 2), token 2 shows the rest "o"
    assert o.deltas == [" t", "o"]
    (o,) = run({"stop": ["k t"], "include_stop_str_in_output": True})
    assert (o.text, o.deltas) == (" tok t", [" tok", " t"])


def test_min_tokens_defers_stop_strings_and_stop_ids() -> None:
    # stop " tok" is checked only from token 4 on (more than min_tokens=3); found at index 12
    (o,) = run({"stop": " tok", "min_tokens": 3})
    assert (o.text, len(o.tokens), o.stop_reason) == (" tok tok tok", 4, " tok")
    (o,) = run({"stop_token_ids": [100]})
    assert (o.text, o.finish_reason, o.stop_reason, len(o.tokens)) == (" tok", "stop", 100, 1)
    # with min_tokens=2 id 100 is masked for tokens 1-2: greedy takes the next word " the" (id 101)
    (o,) = run({"stop_token_ids": [100], "min_tokens": 2}, max_tokens=4)
    assert (o.text, o.stop_reason, len(o.tokens)) == (" the the tok", 100, 3)


def test_seed_reproducible_and_choices_differ() -> None:
    a = run({"seed": 11, "n": 2}, max_tokens=12)
    b = run({"seed": 11, "n": 2}, max_tokens=12)
    c = run({"seed": 12, "n": 2}, max_tokens=12)
    assert [o.text for o in a] == [o.text for o in b]
    assert a[0].text != a[1].text and [o.text for o in a] != [o.text for o in c]
    assert run({"seed": 11, "temperature": 0}, max_tokens=2)[0].text == " tok tok"


def test_ignore_eos_and_eos_in_sampled_text() -> None:
    # some seed in 0..199 draws EOS within 60 tokens (p = 1 - 0.99**60 = 0.45 per seed)
    seed = next(s for s in range(200) if run({"seed": s}, max_tokens=60)[0].finish_reason == "stop")
    (o,) = run({"seed": seed}, max_tokens=60)
    assert o.tokens[-1].id == EOS_ID and o.tokens[-1].text == "" and o.stop_reason is None
    (o,) = run({"seed": seed, "ignore_eos": True}, max_tokens=60)
    assert len(o.tokens) == 60 and o.finish_reason == "length" and all(t.id != EOS_ID for t in o.tokens)


def test_structured_output_json_then_eos_or_padding() -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer", "enum": [7]}, "ok": {"const": True}}}
    body = {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    (o,) = run(body, max_tokens=20, chat=True)
    # '{"n": 7, "ok": true}' = 20 chars = 5 tokens, then EOS
    assert o.text == '{"n": 7, "ok": true}' and len(o.tokens) == 6 and o.finish_reason == "stop"
    (o,) = run({**body, "min_tokens": 8}, max_tokens=20, chat=True)
    assert o.text == '{"n": 7, "ok": true}' + "    " * 3 and len(o.tokens) == 9
    (o,) = run({**body, "ignore_eos": True}, max_tokens=7, chat=True)
    assert o.text == '{"n": 7, "ok": true}' + "    " * 2 and o.finish_reason == "length"
    (o,) = run({"response_format": {"type": "json_object"}, "seed": 3}, max_tokens=30, chat=True)
    assert isinstance(json.loads(o.text), dict)


def test_forced_tool_and_tool_errors() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"properties": {"u": {"enum": ["c"]}}}}}]
    sp = parse_sampling({"tools": tools, "tool_choice": {"type": "function", "function": {"name": "f"}}}, True, 10)
    assert sp.tool_name == "f"
    (o,) = generate(sp)
    assert o.text == '{"u": "c"}'  # 10 chars = 3 tokens, then EOS
    assert len(o.tokens) == 4
    with pytest.raises(SamplingError) as e:
        parse_sampling({"tools": tools}, True, 10)
    assert e.value.param == "tool_choice"
    with pytest.raises(SamplingError, match="has not been passed"):
        parse_sampling({"tools": tools, "tool_choice": {"type": "function", "function": {"name": "g"}}}, True, 10)


@pytest.mark.parametrize(
    ("body", "chat", "param"),
    [({"n": 0}, False, "n"), ({"top_logprobs": 2}, True, "top_logprobs"), ({"logprobs": 21}, False, "logprobs"),
     ({"min_tokens": 9}, False, "min_tokens"), ({"stop": 3}, False, "stop"), ({"seed": "x"}, False, "seed"),
     ({"response_format": {"type": "yaml"}}, True, "response_format")],
)  # fmt: skip
def test_invalid_params_name_the_field(body: dict, chat: bool, param: str) -> None:
    with pytest.raises(SamplingError) as e:
        parse_sampling(body, chat, 8)
    assert e.value.param == param


def test_logprob_shapes() -> None:
    (o,) = run({"logprobs": 2}, max_tokens=2)
    lp = completion_logprobs(o.tokens, 2, 0)
    assert lp["text_offset"] == [0, 4] and lp["tokens"] == [" tok", " tok"]
    assert lp["top_logprobs"][0] == {" tok": VOCAB_LOGPROBS[0], " the": VOCAB_LOGPROBS[1]}
    e = chat_logprob_entry(o.tokens[0], 1)
    assert e == {"token": " tok", "logprob": VOCAB_LOGPROBS[0], "bytes": [32, 116, 111, 107],
                 "top_logprobs": [{"token": " tok", "logprob": VOCAB_LOGPROBS[0], "bytes": [32, 116, 111, 107]}]}
