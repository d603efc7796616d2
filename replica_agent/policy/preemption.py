"""Proxy-mode correction for requests the engine preempted (pure; no I/O).

In proxy mode the agent sees a request's stream, not the engine's queues: a request that has sent
its first token is a decode to the tracker. vLLM v1 preempts by recompute: when a step cannot
allocate a KV block it frees the blocks of the newest running request, resets its computed tokens
to 0 and puts it back at the head of the waiting queue (``Scheduler.schedule``, "preempt" branch).
Until it is scheduled again such a request

- decodes nothing (it reserves no decode time), and
- must recompute its whole context (prompt + tokens out) before any later prompt gets a first
  token, and take that many tokens of KV cache back.

The tracker cannot tell which requests those are, but the engine's ``vllm:num_requests_waiting``
counts them: every waiting request the tracker does not hold as an un-started prefill was
preempted. :func:`account_preempted` turns that many tracked decodes into pending prefills of
their full context, choosing the largest contexts (the agent cannot see which requests vLLM chose;
vLLM picks the newest, whose contexts are usually smaller, so the choice over-reserves, never
under-reserves). Plugin mode needs none of this: the plugin exports each request's queue and
computed tokens (replica_agent/plugin_mode.py).

Without it, a replica whose whole batch was preempted (KV usage 0 %, every request waiting) looked
almost empty: a real vLLM replica with 16 KV blocks and 31 waiting requests published a PAB of 208
tokens (tests/vllm/test_vllm_fleet.py, overload test).
"""

from __future__ import annotations

from collections.abc import Sequence

from replica_agent.policy.pab import DecodeState, PendingPrefill


def account_preempted(
    decodes: Sequence[DecodeState], prefills: Sequence[PendingPrefill], engine_waiting: int | None,
) -> tuple[tuple[DecodeState, ...], tuple[PendingPrefill, ...], int]:
    """Move the decodes the engine holds as preempted back to pending prefills.

    Args:
        decodes: tracked decodes (first token sent).
        prefills: tracked prefills without a first token (leases excluded: their requests are not
            in the engine yet, so the engine's waiting count does not include them).
        engine_waiting: ``vllm:num_requests_waiting`` of the last scrape; None when unknown.

    Returns:
        (decodes, prefills, k): ``k = min(len(decodes), max(0, engine_waiting - len(prefills)))``
        decodes with the largest ``context_tokens`` removed from ``decodes`` and appended to
        ``prefills`` as ``PendingPrefill(prompt_tokens=context_tokens, computed_tokens=0)``
        (tokens; the recompute covers prompt and output tokens). ``k = 0`` returns the inputs
        as tuples.
    """
    k = 0 if engine_waiting is None else min(len(decodes), max(0, int(engine_waiting) - len(prefills)))
    if k == 0:
        return tuple(decodes), tuple(prefills), 0
    order = sorted(range(len(decodes)), key=lambda i: decodes[i].context_tokens, reverse=True)
    moved = set(order[:k])
    kept = tuple(d for i, d in enumerate(decodes) if i not in moved)
    recompute = tuple(PendingPrefill(decodes[i].context_tokens, 0) for i in order[:k])
    return kept, (*prefills, *recompute), k
