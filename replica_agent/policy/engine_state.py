"""PAB inputs from an engine's own request state: the one rule the plugin export, plugin mode and
the fleet simulation share (pure).

The vLLM scheduler plugin exports each step's requests (replica_agent/plugin_export.py
``state_record``) and the agent turns them back into PAB inputs (replica_agent/plugin_mode.py);
the fleet simulation (loadgen/fleet/sim.py) reads its simulated engines directly. All three call
:func:`next_token_deadline` and :func:`is_decode` here, so none can drift from the others (the
fleet simulation once used ``arrival + ttft + n x tpot`` alone, 14 % more PAB on one 16-request
state than the real path).

- Deadline of the next token, as PAB reserves for it: ``arrival + ttft`` before the first token
  (the design's envelope, section 2), and ``first + tpot * n`` after it, with ``n`` = tokens out.
  SLO attainment judges TPOT from the first token (loadgen/stats.py ``meets_slo``, as vLLM's
  benchmarks do), so TTFT slack left over at an early first token is not spendable on decodes,
  and a first token that came late has failed its TTFT already: the tokens such a request is
  behind its arrival-based envelope (``arrival + ttft + tpot * n``) cannot be won back for any
  SLO, and PAB does not hold new prefills back for it to catch up. It did (the earlier of the
  two deadlines): in a burst of 60 prompts of 1,000 tokens on one replica every late decode then
  reserved up to H / step iterations, PAB stayed 0 and the router served the burst in 1.5-2.3x
  the engine's own makespan under load; paced from their first tokens, 0.95-0.99x
  (scripts/bench_backlog.py burst, issue 18). Batch formation keeps the earlier of the two
  (replica_agent/policy/batching.py, FairBatchingPolicy: a late decode is still served first).
  Proxy mode (replica_agent/tracker.py ``next_deadline_ms``) takes the later of the envelope and
  this pace, as its early first tokens always kept the envelope there.
- A decode is a running request with its first token and one token to compute; every other
  request (waiting, chunked prefill, preempted and recomputing) is a pending prefill of its whole
  context (prompt + tokens out) with its computed tokens.
"""

from __future__ import annotations

from collections.abc import Iterable

from replica_agent.policy.batching import SchedRequest
from replica_agent.policy.pab import DecodeState, PendingPrefill


def next_token_deadline(arrival_ms: float, ttft_ms: float, tpot_ms: float, tokens_out: int,
                        first_token_ms: float | None) -> float:  # fmt: skip
    """Deadline (ms) of token ``tokens_out`` (0-based: the next one) for PAB: module docstring."""
    if first_token_ms is not None:
        return first_token_ms + tpot_ms * tokens_out
    return arrival_ms + ttft_ms + tpot_ms * tokens_out


def is_decode(r: SchedRequest, running: bool) -> bool:
    """Whether ``r`` counts as a decode for PAB (running, first token out, one token to compute)."""
    return running and r.tokens_out > 0 and r.remaining_tokens == 1


def pab_inputs(running: Iterable[SchedRequest], waiting: Iterable[SchedRequest], default_ttft_ms: float,
               default_tpot_ms: float) -> tuple[list[DecodeState], list[PendingPrefill]]:  # fmt: skip
    """Decodes and pending prefills of an engine's requests (module docstring).

    Args:
        running, waiting: the engine's queues.
        default_ttft_ms, default_tpot_ms: targets of requests that carry none (ms).
    """
    decodes: list[DecodeState] = []
    prefills: list[PendingPrefill] = []
    for is_running, group in ((True, running), (False, waiting)):
        for r in group:
            ctx = r.prompt_tokens + r.tokens_out
            if is_decode(r, is_running):
                tpot = r.tpot_ms or default_tpot_ms
                dl = next_token_deadline(r.arrival_ms, r.ttft_ms or default_ttft_ms, tpot, r.tokens_out,
                                         r.first_token_ms)  # fmt: skip
                decodes.append(DecodeState(dl, tpot, ctx, r.tokens_out, r.max_tokens))
            else:
                prefills.append(PendingPrefill(ctx, min(ctx, r.computed_tokens)))
    return decodes, prefills
