"""router/migration.py: which streams migrate, the event accounting, the continuation, the decision
(hand-worked values)."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from fairbatch_common.config_schema import MigrationConfig
from router.migration import (
    StreamResume,
    client_usage,
    continuation_body,
    decide,
    migratable,
    prompt_of,
    remaining_tokens,
)


def ev(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def tok(text: str, finish: str | None = None, rid: str = "cmpl-a", created: int = 100, **extra) -> bytes:
    return ev({"id": rid, "object": "text_completion", "created": created, "model": "m",
               "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish, **extra}]})


def test_migratable_requests() -> None:
    base = {"model": "m", "prompt": "abcd", "max_tokens": 8, "stream": True}
    assert migratable(base, chat=False, stream=True)
    assert not migratable(base, chat=True, stream=True)  # chat: not yet (needs the chat template)
    assert not migratable(base, chat=False, stream=False)  # non-stream: re-issued whole instead
    assert not migratable({**base, "n": 2}, chat=False, stream=True)
    assert not migratable({**base, "best_of": 3}, chat=False, stream=True)
    assert not migratable({**base, "echo": True}, chat=False, stream=True)
    assert not migratable({**base, "prompt": ["a", "b"]}, chat=False, stream=True)  # batched
    assert migratable({**base, "prompt": [[1, 2, 3]]}, chat=False, stream=True)
    assert prompt_of({"prompt": ["abcd"]}) == "abcd" and prompt_of({"prompt": [1, True]}) is None
    assert prompt_of({"prompt": ""}) is None


def test_feed_relays_first_attempt_bytes_unchanged_and_counts_tokens() -> None:
    s = StreamResume({"prompt": "abcd", "max_tokens": 5})
    a, b = tok(" tok"), tok(" the")
    # one event split across reads: nothing until it is complete
    assert s.feed(a + b[:7]) == a
    assert s.feed(b[7:]) == b
    assert (s.tokens, s.text(), s.response_id, s.created, s.token_ids) == (2, " tok the", "cmpl-a", 100, None)
    # the agent's error event is held back and marks the attempt failed; the rest is dropped
    err = b'data: {"error": {"message": "engine stream failed", "code": 502}}\n\ndata: [DONE]\n\n'
    assert s.feed(err) == b"" and s.error and not s.done
    assert s.error_message == "engine stream failed"
    assert s.feed(tok(" and")) == b""


def test_continuation_events_get_the_first_id_and_the_clients_usage() -> None:
    s = StreamResume({"prompt": "abcd", "max_tokens": 5, "stream_options": {"include_usage": True}})
    s.feed(tok(" tok") + tok(" the"))
    s.next_attempt()
    assert (s.migrations, s.base_tokens, s.error) == (1, 2, False)
    out = s.feed(tok(" and", rid="cmpl-b", created=200) + tok(" for") + tok(" was", "length", rid="cmpl-b"))
    events = [json.loads(e[6:]) for e in out.split(b"\n\n") if e]
    assert [e["id"] for e in events] == ["cmpl-a"] * 3 and {e["created"] for e in events} == {100}
    assert s.tokens == 5 and s.finish_reason == "length"
    # the continuation's prompt was 1 + 2 tokens longer... its usage: prompt 3 (1 + 2 sent), completion 3
    out = s.feed(ev({"id": "cmpl-b", "created": 200, "choices": [],
                     "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}}) + b"data: [DONE]\n\n")
    usage_event, done = [e for e in out.split(b"\n\n") if e]
    assert json.loads(usage_event[6:])["usage"] == {"prompt_tokens": 1, "completion_tokens": 5, "total_tokens": 6}
    assert done == b"data: [DONE]" and s.done and s.events == 6


def test_token_count_rules() -> None:
    s = StreamResume({"prompt": [1, 2], "max_tokens": 9})
    s.feed(tok(" tok", token_ids=[100]) + tok(" the and", token_ids=[101, 102]))
    assert s.tokens == 3 and s.token_ids == [100, 101, 102]
    s = StreamResume({"prompt": "abcd", "max_tokens": 9})
    s.feed(tok("") + tok(" tok") + tok("", "stop"))  # a held-back byte counts; an empty final event does not
    assert s.tokens == 2 and s.finish_reason == "stop"


def test_client_usage_worked() -> None:
    # original prompt 10, 8 tokens sent before the continuation, which reports prompt 18, completion 4
    assert client_usage({"prompt_tokens": 18, "completion_tokens": 4, "total_tokens": 22}, 8) == {
        "prompt_tokens": 10, "completion_tokens": 12, "total_tokens": 22}
    assert client_usage({"prompt_tokens": None}, 8) == {"prompt_tokens": None}


def test_continuation_body_worked() -> None:
    body = {"model": "m", "prompt": "abcd", "max_tokens": 8, "min_tokens": 2, "seed": 7, "temperature": 0.5,
            "echo": False, "stream": True}
    s = StreamResume(body)
    s.feed(tok(" tok") + tok(" tok") + tok(" tok"))
    got = continuation_body(body, s)
    assert got == {"model": "m", "prompt": "abcd tok tok tok", "max_tokens": 5, "min_tokens": 0, "seed": 7,
                   "temperature": 0.5, "stream": True}
    assert body["prompt"] == "abcd" and body["max_tokens"] == 8  # the client's body is not changed
    # token ids: prompt ids + the engine's ids
    ids = {"prompt": [[5, 6]], "max_tokens": 4}
    s = StreamResume(ids)
    s.feed(tok("x", token_ids=[9]))
    assert continuation_body(ids, s) == {"prompt": [5, 6, 9], "max_tokens": 3}
    # a token-id prompt without token ids from the engine: cannot continue exactly
    s = StreamResume(ids)
    s.feed(tok("x"))
    assert continuation_body(ids, s) is None
    # no max_tokens: left out (the engine's default, context - prompt, shrinks with the prompt)
    s = StreamResume({"prompt": "ab"})
    s.feed(tok("c"))
    assert continuation_body({"prompt": "ab"}, s) == {"prompt": "abc"}
    assert remaining_tokens({"prompt": "ab"}, 3) is None and remaining_tokens({"max_tokens": 2}, 3) == 0


def test_decide_order_and_bounds() -> None:
    body = {"prompt": "abcd", "max_tokens": 4}
    s = StreamResume(body)
    s.feed(tok(" tok") + tok(" tok"))
    assert decide(s, 3, 1, None).reason == "resume" and decide(s, 3, 1, None).go
    assert decide(s, 0, 1, None).reason == "limit"  # migration off
    assert decide(s, 3, 1, 3).reason == "resume"  # prompt 1 + 2 sent = 3 <= 3
    assert decide(s, 3, 2, 3).reason == "context"  # 2 + 2 = 4 > 3
    s.next_attempt()
    s.next_attempt()
    s.next_attempt()
    assert decide(s, 3, 1, None).reason == "limit"
    s.feed(tok(" tok") + tok(" tok", "length"))
    assert decide(s, 3, 1, None) == decide(s, 0, 1, None)  # complete before the limit
    assert decide(s, 3, 1, None).reason == "complete" and not decide(s, 3, 1, None).go
    ids = {"prompt": [1, 2], "max_tokens": 4}
    s = StreamResume(ids)
    s.feed(tok("x"))
    assert decide(s, 3, 2, None).reason == "not-continuable"


def test_migration_config_bounds() -> None:
    assert MigrationConfig().max_migrations == 3
    assert MigrationConfig(max_migrations=0).max_migrations == 0
    for bad in (-1, 17):
        with pytest.raises(ValidationError):
            MigrationConfig(max_migrations=bad)


def chat_ev(content: str | None, finish: str | None = None, role: bool = False, rid: str = "chatcmpl-a") -> bytes:
    delta: dict = {"content": content} if content is not None else {}
    if role:
        delta["role"] = "assistant"
    return ev({"id": rid, "object": "chat.completion.chunk", "created": 100, "model": "m",
               "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]})


def test_chat_migratable_and_constraints() -> None:
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    assert migratable(base, chat=True, stream=True)
    assert not migratable({**base, "messages": []}, chat=True, stream=True)
    assert not migratable({**base, "tools": [{"type": "function"}]}, chat=True, stream=True)
    assert not migratable({**base, "response_format": {"type": "json_object"}}, chat=True, stream=True)
    assert migratable({**base, "response_format": {"type": "text"}}, chat=True, stream=True)
    assert not migratable({"prompt": "abcd", "guided_json": {"type": "object"}}, chat=False, stream=True)


def test_chat_feed_counts_content_and_drops_the_continuations_role_event() -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5, "max_tokens": 9}
    s = StreamResume(body, chat=True)
    role = chat_ev("", role=True)
    assert s.feed(role + chat_ev(" tok") + chat_ev(" the")) == role + chat_ev(" tok") + chat_ev(" the")
    assert s.tokens == 2 and s.text() == " tok the"  # the role event is no token
    got = continuation_body(body, s)
    assert got == {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " tok the"}],
                   "max_completion_tokens": 3, "max_tokens": 7, "continue_final_message": True,
                   "add_generation_prompt": False}
    s.next_attempt()
    out = s.feed(chat_ev("", role=True, rid="chatcmpl-b") + chat_ev(" and", rid="chatcmpl-b"))
    assert [json.loads(e[6:])["choices"][0]["delta"] for e in out.split(b"\n\n") if e] == [{"content": " and"}]
    assert s.tokens == 3 and remaining_tokens(body, s.tokens) == 2  # max_completion_tokens wins


def test_chat_continues_the_clients_own_open_turn() -> None:
    body = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure,"}],
            "continue_final_message": True, "add_generation_prompt": False, "max_tokens": 4}
    s = StreamResume(body, chat=True)
    s.feed(chat_ev(" tok"))
    assert continuation_body(body, s)["messages"][-1] == {"role": "assistant", "content": "Sure, tok"}


def test_logprobs_count_tokens_and_opaque_chat_output_is_not_continued() -> None:
    s = StreamResume({"prompt": "abcd", "max_tokens": 9, "logprobs": 1})
    s.feed(tok(" tok the", logprobs={"tokens": [" tok", " the"], "token_logprobs": [-0.1, -0.2]}))
    assert s.tokens == 2  # two tokens in one engine step (speculative decoding)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 9}
    s = StreamResume(body, chat=True)
    s.feed(ev({"id": "c", "choices": [{"index": 0, "delta": {"role": "assistant", "reasoning_content": "hm"},
                                        "finish_reason": None}]}))
    assert s.opaque and s.tokens == 1
    assert continuation_body(body, s) is None and decide(s, 3, 1, None).reason == "not-continuable"


def test_opaque_state_is_not_continuable_for_completions_too() -> None:
    s = StreamResume({"prompt": "abcd", "max_tokens": 9})
    s.feed(tok(" tok"))
    s.opaque = True  # what the relay sets when the accounting itself failed
    assert decide(s, 3, 1, None).reason == "not-continuable"


def test_a_retry_before_the_first_byte_starts_clean() -> None:
    s = StreamResume({"prompt": "abcd", "max_tokens": 9})
    assert s.feed(b'data: {"error": {"message": "x", "code": 502}}\n\ndata: [DONE]\n\n') == b"" and s.error
    s.new_attempt()  # the relay does this at every attempt's start
    assert not s.error and s.feed(tok(" tok")) == tok(" tok") and s.migrations == 0


@pytest.mark.parametrize("chat", [False, True])
def test_fast_path_agrees_with_the_full_parse(chat: bool) -> None:
    """The first attempt's plain token events are read from their bytes (fast_token_text); on every
    shape the state equals what the full parse gives (a first event, escapes, unicode, logprobs,
    finish, usage, a role event)."""
    from router.migration import fast_token_text

    def compact(obj: dict) -> bytes:
        return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"

    def choice(text: str, finish=None, **kw) -> dict:
        base = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
        return {**base, "logprobs": None, "finish_reason": finish, **kw}

    head = {"id": "x-1", "object": "o", "created": 5, "model": "m"}
    texts = [" tok", 'a "quoted" \\ back', "\u00e9\u4e2d\U0001f600", "\n\t", "", " end"]
    events = [compact({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                             "logprobs": None, "finish_reason": None}]})] if chat else []
    events += [compact({**head, "choices": [choice(t)]}) for t in texts]
    events.append(compact({**head, "choices": [choice(" lp", logprobs={"tokens": [" lp"], "content": [{}]})]}))
    events.append(compact({**head, "choices": [choice(" last", "length")]}))
    events.append(compact({**head, "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 9}}))
    body = {"messages": [{"role": "user", "content": "q"}]} if chat else {"prompt": "q"}
    fast = StreamResume(body, chat=chat)
    out = fast.feed(b"".join(events))
    assert out == b"".join(events)  # the first attempt's bytes unchanged
    parsed = StreamResume(body, chat=chat)
    for e in events:
        parsed._account(json.loads(e[6:]))
    assert (fast.tokens, fast.text(), fast.finish_reason) == (parsed.tokens, parsed.text(), parsed.finish_reason)
    assert fast.text() == "".join(texts) + " lp last"
    assert fast_token_text(events[-3][6:-2], chat) is None  # logprobs: the full parse
    plain = compact({**head, "choices": [choice(" tok")]})
    assert fast_token_text(plain[6:-2], chat) == b" tok"
    s = StreamResume(body, chat=chat)
    s.feed(plain + plain)  # the first event parsed (its id), the second read from its bytes
    assert s._pending == [b" tok"] and s.tokens == 2 and s.text() == " tok tok"


# ---- text continuations: a cut inside a UTF-8 character, stop strings across the cut (hand-worked) ----

ERR = b'data: {"error": {"message": "engine stream failed", "code": 502}}\n\ndata: [DONE]\n\n'


def events_of(out: bytes) -> list[dict | str]:
    """The SSE events of relayed bytes: parsed JSON objects, "[DONE]" as the string."""
    res: list[dict | str] = []
    for block in out.split(b"\n\n"):
        if block.startswith(b"data: "):
            payload = block[6:]
            res.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return res


def test_cut_inside_a_utf8_character_is_resumed_whole() -> None:
    """A token ending in the first byte of "é" (vLLM sends "" for it) then the cut: the continuation is
    rolled back over it (prompt + " caf", max_tokens 5 - 1 = 4, not 3), regenerates it (swallowed: the
    client has its empty event) and relays "é"; one client event per token, 5 in all."""
    body = {"prompt": "abcd", "max_tokens": 5}
    s = StreamResume(body, prompt_tokens=1)
    s.feed(tok(" caf") + tok(""))
    assert s.feed(ERR) == b"" and s.tokens == 2
    assert s.rolled_back() == (1, 1)
    cont = continuation_body(body, s)
    assert cont is not None and (cont["prompt"], cont["max_tokens"]) == ("abcd caf", 4)
    s.next_attempt()
    assert (s.tokens, s.base_tokens, s.replay) == (1, 1, 1)
    assert s.feed(tok("", rid="cmpl-b")) == b""  # the regenerated byte: counted, not relayed
    assert s.tokens == 2
    out = events_of(s.feed(tok("\u00e9", rid="cmpl-b") + tok(" au", rid="cmpl-b")
                           + tok(" lait", finish="length", rid="cmpl-b")))
    assert [e["choices"][0]["text"] for e in out] == ["\u00e9", " au", " lait"]
    assert {e["id"] for e in out} == {"cmpl-a"}
    assert s.tokens == 5 and s.text() == " caf\u00e9 au lait" and s.finish_reason == "length"
    # the continuation's usage (prompt 1 + 1 resumed, 4 generated) as the client counts it: 1 + 5
    assert client_usage({"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6}, s.base_tokens) == {
        "prompt_tokens": 1, "completion_tokens": 5, "total_tokens": 6}


def test_cut_inside_a_four_byte_character_held_text_goes_with_the_next_event() -> None:
    """"😀" over three tokens (3 bytes held: "", "" then the cut): rolled back 2, max_tokens 6 - 1 = 5; the
    continuation's first two events are swallowed, the second's text held and put before the third's."""
    body = {"prompt": "abcd", "max_tokens": 6}
    s = StreamResume(body)
    s.feed(tok(" hi") + tok("") + tok("") + ERR)
    cont = continuation_body(body, s)
    assert cont is not None and (cont["prompt"], cont["max_tokens"]) == ("abcd hi", 5)
    s.next_attempt()
    # an engine whose detokenizer releases the character with the second regenerated token
    assert s.feed(tok("", rid="b") + tok("\U0001f600", rid="b")) == b""
    out = events_of(s.feed(tok(" x", rid="b")))
    assert [e["choices"][0]["text"] for e in out] == ["\U0001f600 x"]
    assert s.tokens == 4 and s.text() == " hi\U0001f600 x"


def test_token_id_prompt_is_not_rolled_back() -> None:
    """A token-id continuation resumes from the ids (exact): no roll-back over an empty-text event."""
    body = {"prompt": [1, 2], "max_tokens": 5}
    s = StreamResume(body)
    s.feed(tok("a", token_ids=[7]) + tok("", token_ids=[8]) + ERR)
    assert s.rolled_back() == (0, 0)
    cont = continuation_body(body, s)
    assert cont is not None and (cont["prompt"], cont["max_tokens"]) == ([1, 2, 7, 8], 3)


def stop_body(**extra) -> dict:
    return {"prompt": "abcd", "max_tokens": 10, "stop": ["END"], "stream_options": {"include_usage": True}, **extra}


def test_stop_string_across_the_cut_ends_the_stream_there() -> None:
    """Stop "END": "x", " E" relayed, cut; the continuation's "ND" completes " END" with "E" before the
    cut: the event's text is cut before "END" (""), finish "stop", stop_reason "END", the usage event
    (prompt 1, completion 3 = 2 + the "ND" token), [DONE]; the stream is done and the upstream closed."""
    s = StreamResume(stop_body(), prompt_tokens=1)
    s.feed(tok("x") + tok(" E") + ERR)
    s.next_attempt()
    assert s.stop_tail == " E"  # len("END") - 1 = 2 characters
    out = events_of(s.feed(tok("ND", rid="b") + tok(" more", rid="b")))
    assert out[0]["choices"][0]["text"] == "" and out[0]["choices"][0]["finish_reason"] == "stop"
    assert out[0]["choices"][0]["stop_reason"] == "END" and out[0]["id"] == "cmpl-a"
    assert out[1]["choices"] == [] and out[1]["usage"] == {"prompt_tokens": 1, "completion_tokens": 3,
                                                           "total_tokens": 4}
    assert out[2] == "[DONE]" and len(out) == 3  # " more" is not relayed
    assert s.done and s.cut and s.finish_reason == "stop"


def test_stop_string_across_the_cut_kept_with_include_stop_str_in_output() -> None:
    s = StreamResume(stop_body(include_stop_str_in_output=True, stream_options=None))
    s.feed(tok("x") + tok(" E") + ERR)
    s.next_attempt()
    out = events_of(s.feed(tok("ND!", rid="b")))
    # joined " END!": the stop ends at 4, the continuation's text starts at 2 -> "ND" kept, "!" cut
    assert out[0]["choices"][0]["text"] == "ND" and out[0]["choices"][0]["finish_reason"] == "stop"
    assert out[1] == "[DONE]" and len(out) == 2  # no usage asked for


def test_stop_string_spread_over_two_continuation_events() -> None:
    """Stop "ENDS" (tail of 3): relayed "x", "E"; the continuation sends "N" (joined "xEN": no stop yet,
    relayed) then "DS" (joined "xENDS": "ENDS" at 1, before the cut at 2) -> ends there with ""."""
    s = StreamResume(stop_body(stop=["ENDS", "zz"], stream_options=None))
    s.feed(tok("x") + tok("E") + ERR)
    s.next_attempt()
    assert s.stop_tail == "xE"
    first = events_of(s.feed(tok("N", rid="b")))
    assert first[0]["choices"][0]["text"] == "N" and first[0]["choices"][0]["finish_reason"] is None
    out = events_of(s.feed(tok("DS", rid="b")))
    assert out[0]["choices"][0]["text"] == "" and out[0]["choices"][0]["stop_reason"] == "ENDS"
    assert out[-1] == "[DONE]" and s.text() == "xEN"


def test_no_stop_across_the_cut_relays_the_continuation_unchanged_in_text() -> None:
    """Stop "END", relayed "x E", continuation "Nx" then "END y": the joined "x ENx" has no stop
    starting before the cut, and once the continuation has 2 characters no stop can straddle: the
    later "END" (wholly the continuation's own) is the engine's to find, relayed as sent."""
    s = StreamResume(stop_body(stream_options=None))
    s.feed(tok("x") + tok(" E") + ERR)
    s.next_attempt()
    out = events_of(s.feed(tok("Nx", rid="b") + tok("END y", rid="b")))
    assert [e["choices"][0]["text"] for e in out] == ["Nx", "END y"] and not s.done
    assert s.stop_tail == ""


def test_chat_cut_inside_a_character_and_stop_across_the_cut() -> None:
    """Chat: the same two repairs on ``delta.content``. "ca" + "" (a held byte) cut, stop "af": the
    continuation is rolled back one token (max_completion_tokens 6 - 1 = 5, not 4), its role event and
    its first event "" (the regenerated byte) are not relayed; its "fé" makes the joined "a" + "fé",
    where "af" starts inside the tail: the stream ends there with "" and finish "stop"."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 6, "stop": ["af"]}
    s = StreamResume(body, chat=True)
    s.feed(chat_ev("", role=True) + chat_ev("ca") + chat_ev("") + ERR)
    got = continuation_body(body, s)
    assert got is not None and got["max_completion_tokens"] == 5
    assert got["messages"][-1] == {"role": "assistant", "content": "ca"}
    s.next_attempt()
    assert s.stop_tail == "a" and s.replay == 1
    assert s.feed(chat_ev("", role=True, rid="b") + chat_ev("", rid="b")) == b""  # role dropped, replay swallowed
    out = events_of(s.feed(chat_ev("f\u00e9", rid="b") + chat_ev("!", rid="b")))
    # joined "a" + "fé": "af" starts at 0, inside the tail -> the stream ends with "" and finish stop
    assert out[0]["choices"][0]["delta"]["content"] == "" and out[0]["choices"][0]["finish_reason"] == "stop"
    assert out[0]["id"] == "chatcmpl-a" and out[-1] == "[DONE]" and s.cut and s.text() == "ca"
