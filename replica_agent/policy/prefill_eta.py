"""When each in-flight prefill ends (its first token), predicted from the replica state. PURE.

Why: a prefill holds its whole reservation (pab.py, item 2) until its first token, so a replica's
budget frees in lumps. The router's arrival-time ``slo-infeasible`` decision (router/shedding.py
``predict_start``, issue 18) must know when the lump that covers a new prompt's deficit frees;
assuming the reservation drains smoothly at 1 ms per ms queued requests that were then refused
at their last dispatch time (up to 115 ms after arrival, docs/bench/backlog_after_merges.json).

Model: vLLM v1's default scheduler with chunked prefill. Each step (iteration) runs every
decode one token and gives the rest of the step's token budget, ``step_tokens - |D|``
(``max_num_batched_tokens`` less one token per decode), to the waiting prompts first come, first
served, a prompt taking as much of the budget as it still needs. The step lasts, by the (planning,
i.e. conservative) time model::

    step_ms = a + b * (|D| + C) + c * (sum_d ctx_d + sum_i prefix_i) + e * sum_i chunk_i * prefix_i + d * |D|
              + f * sum_i chunk_i^2

with ``C = sum_i chunk_i`` the prefill tokens of the step and ``prefix_i`` the tokens of prompt i
already computed. A prompt's first token comes at the end of the step that computes its last
prompt token. Decode contexts grow by one token per step. The head prompt may already have run
for ``head_elapsed_ms`` (proxy mode: since the previous prefill ended or it arrived at an idle
replica): every completion is moved that much earlier, never below 0.

At most ``max_steps`` steps are simulated; prompts still unfinished then are extrapolated at the
last step's rate of prefill tokens per ms.
"""

from __future__ import annotations

from replica_agent.policy.pab import ReplicaState, inflight_lumps

MAX_STEPS = 64
"""Steps simulated per call (bounds the cost of one snapshot)."""


def prefill_completions_ms(
    state: ReplicaState, step_tokens: int, head_elapsed_ms: float = 0.0, max_steps: int = MAX_STEPS
) -> tuple[float, ...]:
    """ms from ``state.now_ms`` until each in-flight prefill of ``state.prefills`` ends (module docstring).

    Args:
        state: the replica now (``prefills`` in engine order; ``time_model``: the planning model).
        step_tokens: the engine's token budget per step (vLLM ``max_num_batched_tokens``), >= 1.
        head_elapsed_ms: ms the head prompt has already been served for (>= 0).
        max_steps: steps simulated before extrapolating (>= 1).

    Returns:
        One non-decreasing float per prefill (ms, >= 0); ``()`` without in-flight prefills.

    Raises:
        ValueError: if ``step_tokens`` or ``max_steps`` is below 1.

    Example (hand-worked in tests/unit/test_prefill_eta.py): a = 10, b = 0.1, c = 0.001, one decode
    with 1000 tokens of context, prompts of 1500 and 1000 tokens, 1024 tokens per step. The steps
    take 1023 prompt tokens (113.4 ms), 477 + 546 (the first prompt ends; 114.424 ms) and 454 (the
    second ends; 57.048 ms), so the completions are 227.824 and 284.872 ms.
    """
    if step_tokens < 1 or max_steps < 1:
        raise ValueError("step_tokens and max_steps must be >= 1")
    prefills = state.prefills
    if not prefills:
        return ()
    tm = state.time_model
    n_dec = len(state.decodes)
    dec_ctx = float(sum(d.context_tokens for d in state.decodes))
    remaining = [p.remaining_tokens for p in prefills]
    computed = [p.computed_tokens for p in prefills]
    budget = max(1, step_tokens - n_dec)
    out: list[float] = []
    t = 0.0
    i = 0  # first prompt not finished
    rate = 0.0  # prefill tokens per ms of the last step
    for _ in range(max_steps):
        if i >= len(remaining):
            break
        left = budget
        new = 0
        prefix = 0.0
        cross = 0.0
        sq = 0.0
        done: list[int] = []
        j = i
        while left > 0 and j < len(remaining):
            take = min(left, remaining[j])
            new += take
            prefix += computed[j]
            cross += take * computed[j]
            if take > 1:  # a 1-token chunk is a decode to the step features (StepFeatures.from_items)
                sq += take * take
            remaining[j] -= take
            computed[j] += take
            left -= take
            if remaining[j] > 0:
                break
            done.append(j)
            j += 1
        step = tm.batch_ms(n_dec + new, dec_ctx + prefix, cross, n_dec, sq)
        t += step
        rate = new / step if step > 0 else 0.0
        out.extend(t for _ in done)
        i = j
        dec_ctx += n_dec
    while i < len(remaining):  # beyond max_steps: the last step's pace
        t += remaining[i] / rate if rate > 0 else float("inf")
        out.append(t)
        i += 1
    head = max(0.0, head_elapsed_ms)
    return tuple(max(0.0, x - head) for x in out)


def inflight_schedule(
    state: ReplicaState, step_tokens: int, head_elapsed_ms: float = 0.0
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """What a budget snapshot lists of the in-flight prefills: (lumps, ends), equal lengths.

    ``lumps``: pab.py :func:`~replica_agent.policy.pab.inflight_lumps` (ms of reservation, engine
    order, at most ``MAX_INFLIGHT_LUMPS``, the rest summed into the last); ``ends``: ms from now
    until each frees (:func:`prefill_completions_ms`; the merged last lump ends with the last of
    its prefills). The agent and the fleet simulation both send this.
    """
    lumps = inflight_lumps(state)
    if not lumps:
        return (), ()
    done = prefill_completions_ms(state, step_tokens, head_elapsed_ms)
    if len(done) > len(lumps):
        done = done[: len(lumps) - 1] + (done[-1],)
    return lumps, done
