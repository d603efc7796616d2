"""router/tokens.py: prompt-token estimates (hand-worked)."""

from __future__ import annotations

import pytest

from router.tokens import PromptError, estimate_prompt_tokens, text_tokens


def test_text_is_ceil_of_utf8_bytes() -> None:
    assert text_tokens("", 4.0) == 0
    assert text_tokens("abcd", 4.0) == 1
    assert text_tokens("abcde", 4.0) == 2
    assert text_tokens("é", 4.0) == 1  # 2 bytes
    assert text_tokens("éééé", 4.0) == 2  # 8 bytes
    assert text_tokens("abcdef", 3.0) == 2


def test_completion_prompts() -> None:
    assert estimate_prompt_tokens({"prompt": "x" * 10}, False, 4.0) == 3
    assert estimate_prompt_tokens({"prompt": ["x" * 8]}, False, 4.0) == 2
    assert estimate_prompt_tokens({"prompt": ["x" * 5, "y" * 5]}, False, 4.0) == 4
    assert estimate_prompt_tokens({"prompt": [1, 2, 3, 4, 5]}, False, 4.0) == 5
    assert estimate_prompt_tokens({"prompt": [[1, 2, 3]]}, False, 4.0) == 3


def test_chat_adds_four_per_message() -> None:
    body = {"messages": [{"role": "system", "content": "abcd"}, {"role": "user", "content": "abcdefgh"}]}
    assert estimate_prompt_tokens(body, True, 4.0) == (1 + 4) + (2 + 4)
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "abcdefgh"}, {"type": "image_url"}]}]}
    assert estimate_prompt_tokens(parts, True, 4.0) == 2 + 4
    assert estimate_prompt_tokens({"messages": [{"role": "assistant", "content": None}]}, True, 4.0) == 4


@pytest.mark.parametrize(
    "body, chat",
    [({}, False), ({"prompt": 3}, False), ({"prompt": []}, False), ({"prompt": [1, "a"]}, False),
     ({}, True), ({"messages": []}, True), ({"messages": ["hi"]}, True), ({"messages": [{"content": 5}]}, True)],
)
def test_missing_or_bad_prompt(body: dict, chat: bool) -> None:
    with pytest.raises(PromptError):
        estimate_prompt_tokens(body, chat, 4.0)


def test_prompt_is_exact_only_for_token_ids() -> None:
    from router.tokens import prompt_is_exact

    assert prompt_is_exact({"prompt": [1, 2, 3]}, chat=False)
    assert prompt_is_exact({"prompt": [[1, 2], [3]]}, chat=False)
    assert not prompt_is_exact({"prompt": "hello"}, chat=False)
    assert not prompt_is_exact({"prompt": ["a", [1, 2]]}, chat=False)  # mixed: the text part is estimated
    assert not prompt_is_exact({"prompt": []}, chat=False)
    assert not prompt_is_exact({"prompt": [True, 2]}, chat=False)  # bools are not token ids
    assert not prompt_is_exact({"messages": [{"role": "user", "content": "hi"}]}, chat=True)


def test_prompt_text_is_prefix_stable_across_chat_turns() -> None:
    from router.tokens import prompt_text

    turn1 = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}
    turn2 = {"messages": [*turn1["messages"], {"role": "assistant", "content": [{"type": "text", "text": "hello"}]},
                          {"role": "user", "content": "more"}]}
    t1, t2 = prompt_text(turn1, True), prompt_text(turn2, True)
    assert t1 == "<|system|>\nbe brief\n<|user|>\nhi\n"
    assert t2 == t1 + "<|assistant|>\nhello\n<|user|>\nmore\n"
    assert prompt_text({"prompt": "abc"}, False) == "abc"
    assert prompt_text({"prompt": [1, 22]}, False) == "1 22 "
    assert prompt_text({"prompt": [[1], "x"]}, False) == "1 x"
