"""The ``static-queue-cap`` admission rule of a replica (pure): a vLLM-style ``max-num-queued-tokens``
cap on the prompt tokens waiting for their prefill.

A router running the ``static-queue-cap`` placement profile (router/placement/baselines.py) sends
``x-fairbatch-queue-cap: <tokens>`` with each request; the agent refuses the request (409
``x-fairbatch-refused: queue-cap``, replica_agent/proxy.py) when :func:`over_queue_cap` holds, and the
router tries its next candidate. The fleet simulation's replica applies the same rule
(loadgen/fleet/sim.py ``_on_forward``) on the engine's exact state; the agent counts what it
tracks: the prompt tokens still to compute of its requests without a first token yet (their whole
prompts in proxy mode, where chunked-prefill progress is not seen).
"""

from __future__ import annotations

from collections.abc import Iterable

from replica_agent.policy.pab import PendingPrefill

QUEUE_CAP_REASON = "queue-cap"
"""The refusal's reason (``x-fairbatch-refused``)."""


def queued_prompt_tokens(prefills: Iterable[PendingPrefill]) -> int:
    """Prompt tokens still to compute of the prefills waiting or running (tokens)."""
    return sum(p.remaining_tokens for p in prefills)


def over_queue_cap(queued_tokens: int, prompt_tokens: int, cap_tokens: int, busy: bool) -> bool:
    """True when a replica with work (``busy``) must refuse a prompt of ``prompt_tokens``: its
    ``queued_tokens`` plus this prompt exceed ``cap_tokens``. An idle replica takes any prompt (else
    a prompt above the cap could never run)."""
    return busy and queued_tokens + prompt_tokens > cap_tokens
