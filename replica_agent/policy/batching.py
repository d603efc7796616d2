"""Batch-formation policies: which requests an engine iteration computes, and how many tokens each.

A policy is pure: it reads a :class:`SchedState` (plain data, time passed in as ``now_ms``) and
returns one :class:`Batch`. It only *proposes*; KV-cache allocation and preemption stay with the
engine, as in vLLM v1 where ``Scheduler.schedule()`` asks the KV-cache manager for slots and
preempts when it answers None. The engine may therefore run a subset of the proposal.

Token accounting (same as vLLM v1, ``num_new_tokens = num_tokens - num_computed_tokens``):
a request's known tokens are ``prompt_tokens + tokens_out``; ``computed_tokens`` of them are in
the KV cache. A prefill (or a recompute after preemption) has many tokens left, a decode exactly
one (the token sampled last step). The step that brings ``computed_tokens`` up to the known tokens
samples the next output token.

Policies live in :data:`POLICIES` (name -> class); :func:`make_policy` builds one by name.
FairBatching (DESIGN section 3) is meant to be added as another class reading the deadline fields
(``arrival_ms``, ``ttft_ms``, ``tpot_ms``), ``time_model``, ``kv_free_blocks`` and ``now_ms``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

from replica_agent.policy.time_model import TimeModel


@dataclass(slots=True)
class SchedRequest:
    """Scheduling view of one request.

    Attributes:
        request_id: engine-unique id.
        prompt_tokens: prompt length (tokens).
        computed_tokens: tokens already in the KV cache (tokens); 0 when new or preempted.
        tokens_out: output tokens sampled so far.
        max_tokens: output length at which the request finishes (tokens, >= 1).
        arrival_ms: arrival time (simulated ms).
        ttft_ms: TTFT target (ms), None when unknown.
        tpot_ms: TPOT target (ms), None when unknown.
    """

    request_id: str
    prompt_tokens: int
    computed_tokens: int = 0
    tokens_out: int = 0
    max_tokens: int = 16
    arrival_ms: float = 0.0
    ttft_ms: float | None = None
    tpot_ms: float | None = None

    @property
    def num_tokens(self) -> int:
        """Known tokens of the sequence: prompt + sampled outputs."""
        return self.prompt_tokens + self.tokens_out

    @property
    def remaining_tokens(self) -> int:
        """Tokens still to compute before the next output token (1 for a decode)."""
        return self.prompt_tokens + self.tokens_out - self.computed_tokens

    @property
    def is_prefill(self) -> bool:
        """True while more than the last sampled token is missing from the KV cache (prefill or recompute)."""
        return self.prompt_tokens + self.tokens_out - self.computed_tokens > 1 or self.tokens_out == 0


@dataclass(slots=True)
class SchedState:
    """Everything a policy may read for one iteration (read-only: the engine passes its live queues).

    Attributes:
        now_ms: current time (simulated ms).
        running: requests holding KV blocks, in running order (order they were first scheduled).
        waiting: requests not yet scheduled (or preempted), queue order, head first.
        max_num_batched_tokens: token cap of one iteration (tokens).
        max_num_seqs: cap on running requests (sequences).
        kv_free_blocks: free KV blocks before this iteration (blocks).
        block_size: tokens per KV block.
        time_model: batch-time model of this engine (ms), None when the policy needs none.
    """

    now_ms: float
    running: Sequence[SchedRequest]
    waiting: Sequence[SchedRequest]
    max_num_batched_tokens: int
    max_num_seqs: int
    kv_free_blocks: int = 0
    block_size: int = 16
    time_model: TimeModel | None = None


@dataclass(slots=True)
class Batch:
    """A proposed (or, from the engine, executed) iteration.

    Attributes:
        items: (request_id, num_new_tokens) in schedule order, each num_new_tokens >= 1.
        num_new_tokens: sum of num_new_tokens over items (tokens).
    """

    items: list[tuple[str, int]] = field(default_factory=list)
    num_new_tokens: int = 0

    def add(self, request_id: str, num_new_tokens: int) -> None:
        """Append one request with its token count."""
        self.items.append((request_id, num_new_tokens))
        self.num_new_tokens += num_new_tokens

    def __len__(self) -> int:
        return len(self.items)


class BatchingPolicy(Protocol):
    """Interface of a batch-formation policy (pure; see module docstring)."""

    name: ClassVar[str]

    def form_batch(self, state: SchedState) -> Batch:
        """Propose the next iteration's batch."""
        ...


class VllmDefaultPolicy:
    """vLLM v1's default schedule with chunked prefill (Sarathi-style decode-first token budget).

    Source: ``vllm/v1/core/sched/scheduler.py`` ``Scheduler.schedule()`` (FCFS policy):

    1. Running requests first, in running order: each gets min(remaining_tokens, budget) tokens
       (1 for a decode; the next chunk for an unfinished chunked prefill); stop when the token
       budget (max_num_batched_tokens) is spent.
    2. Then waiting requests FCFS while the budget lasts and running + admitted < max_num_seqs;
       each gets min(remaining_tokens, budget), so the last one is chunked to what is left.
    """

    name: ClassVar[str] = "vllm-default"

    def form_batch(self, state: SchedState) -> Batch:
        """Propose running-first, then FCFS waiting, under the token and sequence caps."""
        batch = Batch()
        budget = state.max_num_batched_tokens
        for req in state.running:
            if budget <= 0:
                break
            n = min(req.prompt_tokens + req.tokens_out - req.computed_tokens, budget)
            if n <= 0:
                continue
            batch.add(req.request_id, n)
            budget -= n
        seqs_left = state.max_num_seqs - len(state.running)
        for req in state.waiting:
            if budget <= 0 or seqs_left <= 0:
                break
            n = min(req.prompt_tokens + req.tokens_out - req.computed_tokens, budget)
            if n <= 0:
                continue
            batch.add(req.request_id, n)
            budget -= n
            seqs_left -= 1
        return batch


POLICIES: dict[str, type[BatchingPolicy]] = {
    VllmDefaultPolicy.name: VllmDefaultPolicy,
}


def make_policy(name: str) -> BatchingPolicy:
    """Build the policy registered under ``name``.

    Raises:
        KeyError: with the known names when ``name`` is not registered.
    """
    try:
        cls = POLICIES[name]
    except KeyError:
        raise KeyError(f"unknown batching policy {name!r}; known: {', '.join(sorted(POLICIES))}") from None
    return cls()
