"""Prompt-token estimate for placement (before any tokenizer runs).

- token-id arrays (``prompt: [1, 2, 3]`` or ``[[1, 2, 3]]``): exact (their length);
- text: ceil(UTF-8 bytes / bytes_per_token) per string;
- chat: the sum over messages of the estimate of their text content, plus 4 tokens per message
  (role and template framing).

Matches loadgen/sim/tokenizer.py (1 token = 4 bytes) with the default bytes_per_token = 4.0.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from fairbatch_common.api_schema import is_token_ids

CHAT_TOKENS_PER_MESSAGE = 4


class PromptError(ValueError):
    """The request has no usable prompt (missing or of the wrong type); the message says which field."""


def text_tokens(text: str, bytes_per_token: float) -> int:
    """ceil(UTF-8 bytes / bytes_per_token) tokens for ``text`` (0 for an empty string).

    Never raises: a lone surrogate (refused earlier by :mod:`fairbatch_common.api_schema`) counts its
    3 bytes (``surrogatepass``).
    """
    if not text:
        return 0
    return math.ceil(len(text.encode("utf-8", "surrogatepass")) / bytes_per_token)


def _is_token_ids(value: list[Any]) -> bool:
    return is_token_ids(value)  # C-level passes (fairbatch_common/api_schema.py), not a loop per id


def _ids_text(ids: list[int]) -> str:
    """Token ids as decimal numbers, one space after each (``"1 2 "``)."""
    return " ".join(map(str, ids)) + " " if ids else ""


def completion_prompt_tokens(prompt: Any, bytes_per_token: float) -> int:
    """Estimate for a ``/v1/completions`` ``prompt``: string, list of strings, token ids, or list of token-id lists.

    Raises:
        PromptError: missing or of another type.
    """
    if isinstance(prompt, str):
        return text_tokens(prompt, bytes_per_token)
    if isinstance(prompt, list) and prompt:
        if _is_token_ids(prompt):
            return len(prompt)
        total = 0
        for item in prompt:
            if isinstance(item, str):
                total += text_tokens(item, bytes_per_token)
            elif isinstance(item, list) and _is_token_ids(item):
                total += len(item)
            else:
                raise PromptError("'prompt' must be a string, a list of strings or a list of token ids")
        return total
    raise PromptError("'prompt' is required (a string, a list of strings or a list of token ids)")


def _content_tokens(content: Any, bytes_per_token: float) -> int:
    if content is None:
        return 0
    if isinstance(content, str):
        return text_tokens(content, bytes_per_token)
    if isinstance(content, list):
        total = 0
        for part in content:
            if isinstance(part, Mapping):
                text = part.get("text")
                if isinstance(text, str):
                    total += text_tokens(text, bytes_per_token)
            elif isinstance(part, str):
                total += text_tokens(part, bytes_per_token)
        return total
    raise PromptError("message 'content' must be a string or a list of content parts")


def chat_prompt_tokens(messages: Any, bytes_per_token: float) -> int:
    """Estimate for ``/v1/chat/completions`` ``messages``: contents + 4 tokens per message.

    Raises:
        PromptError: ``messages`` missing, empty, or not a list of objects.
    """
    if not isinstance(messages, list) or not messages:
        raise PromptError("'messages' is required (a non-empty list of messages)")
    total = 0
    for msg in messages:
        if not isinstance(msg, Mapping):
            raise PromptError("each entry of 'messages' must be an object")
        total += _content_tokens(msg.get("content"), bytes_per_token) + CHAT_TOKENS_PER_MESSAGE
    return total


def prompt_is_exact(body: Mapping[str, Any], chat: bool) -> bool:
    """True when :func:`estimate_prompt_tokens` is an exact count: a completion prompt of token ids only
    (``[1, 2]`` or ``[[1, 2], [3]]``). Text and chat prompts are estimates (no tokenizer runs here)."""
    if chat:
        return False
    prompt = body.get("prompt")
    if not isinstance(prompt, list) or not prompt:
        return False
    return _is_token_ids(prompt) or all(isinstance(p, list) and _is_token_ids(p) for p in prompt)


def estimate_prompt_tokens(body: Mapping[str, Any], chat: bool, bytes_per_token: float) -> int:
    """Prompt tokens of an OpenAI request body (``chat`` selects ``messages`` over ``prompt``).

    Raises:
        PromptError: no usable prompt.
    """
    if chat:
        return chat_prompt_tokens(body.get("messages"), bytes_per_token)
    return completion_prompt_tokens(body.get("prompt"), bytes_per_token)


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p if isinstance(p, str) else str(p.get("text", "")) if isinstance(p, Mapping) else ""
                       for p in content)  # fmt: skip
    return ""


def prompt_text(body: Mapping[str, Any], chat: bool) -> str:
    """The prompt as one string for the prefix map's keys (router/prefix_index.py): a completion's
    ``prompt`` text (token ids as decimal numbers, one space after each), or the chat messages as
    ``<|role|>\\ncontent\\n`` in order, so that a conversation's next turn starts with the text of
    the turn before. Call after :func:`estimate_prompt_tokens` accepted the body (never raises)."""
    if chat:
        msgs = body.get("messages")
        if not isinstance(msgs, list):
            return ""
        return "".join(f"<|{m.get('role', '')}|>\n{_content_text(m.get('content'))}\n" for m in msgs
                       if isinstance(m, Mapping))  # fmt: skip
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        if _is_token_ids(prompt):
            return _ids_text(prompt)
        return "".join(p if isinstance(p, str) else _ids_text(p) if isinstance(p, list) else ""
                       for p in prompt)  # fmt: skip
    return ""
