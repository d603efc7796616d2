"""The simulated engine's tokenizer: one token per 4 bytes of UTF-8 (the usual ~4 characters per
token of BPE tokenizers on English text), so any client can build a prompt of exactly N tokens.

- ``count_tokens(text) = ceil(len(text.encode()) / 4)``; the empty string has 0 tokens.
- Chat messages are rendered with :func:`render_chat` before counting.
- Each generated token is the 4-byte text :data:`OUTPUT_TOKEN_TEXT`, so the output text of n
  tokens re-counts as n tokens.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

BYTES_PER_TOKEN = 4
OUTPUT_TOKEN_TEXT = " tok"
_WORDS = ("the ", "and ", "for ", "was ", "you ", "are ", "not ", "but ", "can ", "all ", "one ", "had ")


def count_tokens(text: str) -> int:
    """Tokens in ``text``: ceil(utf-8 bytes / 4)."""
    n = len(text.encode("utf-8"))
    return (n + BYTES_PER_TOKEN - 1) // BYTES_PER_TOKEN


def render_chat(messages: Iterable[Mapping[str, object]], continue_final_message: bool = False) -> str:
    """Render chat messages as ``<|role|>\\ncontent\\n`` blocks plus ``<|assistant|>\\n``.

    ``content`` may be a string or OpenAI's list of ``{"type": "text", "text": ...}`` parts.
    ``continue_final_message`` (vLLM's chat field of that name, with ``add_generation_prompt`` false):
    the last message is left open, ``<|role|>\\ncontent`` with no newline and no generation prompt
    after it, so the model continues its text (an assistant turn cut short: the same prompt as the
    turn's start plus its content).

    Raises:
        ValueError: if a message has no role or a content part is not text.
    """
    messages = list(messages)
    parts: list[str] = []
    for m in messages:
        role = m.get("role")
        if not isinstance(role, str):
            raise ValueError("every chat message needs a string 'role'")
        content = m.get("content", "")
        if isinstance(content, list):
            texts = []
            for p in content:
                if not (isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str)):
                    raise ValueError("only text content parts are supported")
                texts.append(p["text"])
            content = "".join(texts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise ValueError("message content must be a string or a list of text parts")
        parts.append(f"<|{role}|>\n{content}\n")
    if continue_final_message and messages:
        parts[-1] = parts[-1][:-1]  # the last turn stays open
        return "".join(parts)
    parts.append("<|assistant|>\n")
    return "".join(parts)


def make_prompt(n_tokens: int, seed: int = 0) -> str:
    """A text of exactly ``n_tokens`` tokens under :func:`count_tokens` (4-byte words, varied by ``seed``)."""
    if n_tokens < 0:
        raise ValueError("n_tokens must be >= 0")
    return "".join(_WORDS[(seed + i) % len(_WORDS)] for i in range(n_tokens))
