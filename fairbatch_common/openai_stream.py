"""What the agent reads from OpenAI-shaped engine answers: generated tokens and usage.

Pure functions over parsed JSON (no I/O). vLLM's stream chunks carry one choice each (``index`` =
the choice of an ``n > 1`` request), and a chunk's generated tokens may sit in any of these fields:

- completions: ``text``; chat: ``delta.content``, ``delta.reasoning_content`` (or ``reasoning``,
  the newer name), ``delta.refusal``, ``delta.tool_calls[*].function.arguments`` / ``.name``;
- ``logprobs`` (one entry per token: chat ``logprobs.content[*]`` / ``.refusal[*]``,
  completions ``logprobs.tokens[*]``), which is also the only exact count when one chunk
  carries several tokens (the detokenizer held text back, a stop string was being matched).

A chunk whose only payload is ``role`` or ``finish_reason`` counts 0. The final ``usage`` (when the
client or the agent asked for it) corrects the total, so an undercount here (a chunk carrying 2
tokens without logprobs) only delays the correction, never leaves it wrong at the end.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

_DELTA_TEXT_FIELDS = ("content", "reasoning_content", "reasoning", "refusal")
# Keys whose presence sends an event to the full parse (a token may be counted differently there):
# tool_calls, role, reasoning*, refusal, error, and a usage or logprobs that is not null. One scan.
_SLOW_EVENT = re.compile(rb'"(?:tool_calls"|role"|reasoning|refusal"|error")|"usage"(?!:null)|"logprobs"(?!:null)')


def fast_event_tokens(payload: bytes) -> int | None:
    """Generated tokens of one SSE event's JSON (``payload``, the bytes after ``data:``) read from
    its bytes alone, or None when the event needs the full parse (:func:`generated_tokens`).

    Recognised: the compact one-choice token chunk vLLM sends for nearly every token, completions
    ``{"choices":[{"index":0,"text":"...","logprobs":null,"finish_reason":null,...}],...}`` or chat
    ``{"choices":[{"index":0,"delta":{"content":"..."},"logprobs":null,"finish_reason":null}]}``:
    exactly one ``"index"`` key, ``"finish_reason":null``, no (or null) ``usage`` and ``logprobs``,
    none of ``tool_calls``, ``role``, ``reasoning*``, ``refusal``, ``error``; 1 token when the text
    is non-empty, else 0. Everything else (the first chat chunk, the finish chunk, usage, logprobs,
    n > 1 chunks, tools, any other spacing) returns None. Sound because inside a JSON string
    every ``"`` is escaped (``\"``), so none of the quoted keys searched for can match text the
    model generated; a test checks it against the full parse on every shape.
    """
    if payload.count(b'"index"') != 1 or b'"finish_reason":null' not in payload or _SLOW_EVENT.search(payload):
        return None
    if b'"text":"' in payload:
        return 0 if b'"text":""' in payload else 1
    if b'"delta":{"content":"' in payload:
        return 0 if b'"content":""' in payload else 1
    return None


def _tool_call_payload(tool_calls: Any) -> bool:
    """True when a ``delta.tool_calls`` list carries a function name or non-empty arguments."""
    if not isinstance(tool_calls, list):
        return False
    for tc in tool_calls:
        fn = tc.get("function") if isinstance(tc, Mapping) else None
        if isinstance(fn, Mapping) and (fn.get("arguments") or fn.get("name")):
            return True
    return False


def logprob_tokens(logprobs: Any) -> int:
    """Tokens described by one choice's ``logprobs`` object (chat or completions shape); 0 when absent."""
    if not isinstance(logprobs, Mapping):
        return 0
    n = 0
    for key in ("content", "refusal"):  # chat: one entry per token
        entries = logprobs.get(key)
        if isinstance(entries, list):
            n += len(entries)
    tokens = logprobs.get("tokens")  # completions: parallel lists, one entry per token
    if isinstance(tokens, list):
        n += len(tokens)
    return n


def choice_tokens(choice: Mapping[str, Any]) -> int:
    """Generated tokens carried by one stream choice (see the module docstring)."""
    n = logprob_tokens(choice.get("logprobs"))
    if n:
        return n
    if choice.get("text"):
        return 1
    delta = choice.get("delta")
    if not isinstance(delta, Mapping):
        return 0
    if any(delta.get(f) for f in _DELTA_TEXT_FIELDS) or _tool_call_payload(delta.get("tool_calls")):
        return 1
    return 0


def generated_tokens(event: Mapping[str, Any]) -> int:
    """Generated tokens in one parsed SSE chunk, summed over all its choices (every ``index``)."""
    choices = event.get("choices")
    if not isinstance(choices, list):
        return 0
    return sum(choice_tokens(ch) for ch in choices if isinstance(ch, Mapping))


def usage_counts(obj: Mapping[str, Any]) -> tuple[int | None, int | None] | None:
    """``(prompt_tokens, completion_tokens)`` of an answer's or chunk's ``usage``; None without one."""
    usage = obj.get("usage")
    if not isinstance(usage, Mapping):
        return None
    p, c = usage.get("prompt_tokens"), usage.get("completion_tokens")
    return (p if isinstance(p, int) else None, c if isinstance(c, int) else None)


def finish_reasons(obj: Mapping[str, Any]) -> list[str]:
    """The ``finish_reason`` of every choice of an answer or stream chunk that has one (choice order;
    ``[]`` while none has finished): what ``gen_ai.response.finish_reasons`` reports."""
    choices = obj.get("choices")
    if not isinstance(choices, list):
        return []
    return [r for ch in choices if isinstance(ch, Mapping) and isinstance(r := ch.get("finish_reason"), str)]


def requested_choices(body: Mapping[str, Any]) -> int:
    """``n`` of a request body (sequences the engine runs for it), 1 when absent or malformed."""
    n = body.get("n")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1
