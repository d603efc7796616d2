"""Prefill Admission Budget (PAB): how much new prefill a replica can still take per SLO class.

Source: docs/design.md section 4 and docs/architecture.md section "PAB" (our own definition; the
FairBatching preprint, arXiv 2510.14392, gives the idea, not a formula we could confirm). This
module is PURE: plain data in (time passed in as ``now_ms``), one :class:`ClassBudget` out per
class; no I/O, no clock reads.

Derivation
----------
Let a request of SLO class k (``ttft_k``, ``tpot_k``) arrive at time t. It meets its TTFT target
when its prefill has run by t + ttft_k. We keep a safety margin for scheduling jitter and plan
within the horizon::

    H = ttft_k - min(margin_frac * ttft_k, margin_cap_tpots * tpot_k)      (planning_horizon_ms)

The margin is a share of the TTFT (10 % by default) but at most one TPOT (``margin_cap_tpots`` = 1):
what it covers does not grow with the TTFT target. A first token comes out at the end of the step
that completes its prefill, and FairBatching bounds a step by the running decodes' slack, about one
TPOT; the router's view is one budget push old. Model error is not the margin's job: the time model
PAB plans with is the online fit times its own learned margin (a high quantile of its relative errors,
replica_agent/agent.py). At TTFT 1 s / TPOT 100 ms both give 100 ms; at TTFT 5 s the share alone gave
500 ms, which refused prompts that met their TTFT (docs/evaluation.md, "The horizon margin").
``margin_cap_tpots = inf`` is the share alone (releases before 2026-12-07).

Inside [t, t + H] the replica's time is claimed, before any new prompt, by two kinds of work that
were admitted earlier and whose promises we must keep:

1. Running decodes. Decode d (first token already emitted, ``tokens_out`` tokens so far) has a
   deadline for its next token ``ddl_d = arrival_d + ttft_d + tokens_out_d * tpot_d`` (FairBatching's (arXiv 2510.14392)
   latency envelope) and one more every ``tpot_d`` after that. The tokens whose deadlines fall at
   or before t + H are those j = 0, 1, ... with ``ddl_d + j * tpot_d <= t + H``, so their number is::

       n_d = max(0, floor((t + H - ddl_d) / tpot_d) + 1)

   (a decode already behind its envelope, ddl_d < t, needs even more, which the formula counts).
   Continuous batching runs all decodes together, one token each per iteration, so the replica
   needs ``N = max_d n_d`` iterations, each predicted by the batch-time model (TimeModel, FairBatching arXiv 2510.14392
   section 4) with |D| new tokens and the decodes' contexts read::

       decode_reservation = N * (a + (b + d) * |D| + c * sum_d ctx_d)   (0 when D is empty)

   ``ctx_d`` is the decode's tokens in the KV cache (prompt + tokens out). Context growth during
   the N iterations is ignored (c * |D| * N^2 / 2 is small next to the rest for the sizes we run).

2. In-flight prefills. Requests admitted but without a first token yet (and leases granted to a
   router whose request has not arrived) will run their remaining prompt tokens inside the same
   horizon. They ride in the decode iterations (chunked prefill), so they add only their token
   terms, not another fixed cost ``a``::

       inflight_reservation = sum_p (b' * r_p + c * computed_p + e * (r_p * computed_p + cross(r_p))),
                              r_p = prompt_p - computed_p

   (``d`` and ``e``: the decode and chunk x prefix terms of replica_agent/policy/time_model.py, 0 in
   the profiles' linear fits; the online calibrator learns them. ``b' = b + f * K``, the model's
   ``prompt_ms_per_token``: a prompt's chunks are not known when it is priced, so its tokens are
   charged at the learned mean chunk length K, the chunk^2 term ``f`` included; ``b' = b`` when f = 0.
   Every prompt price below uses b'; a decode's own token costs ``b + d``. ``cross(r)``: the pairs
   between a prompt's own chunks of K tokens, ``(r^2 - sum chunk^2) / 2``, whose attention costs ``e``
   each (time_model.py ``chunk_cross_tokens``; 0 for a prompt in one chunk). The router
   receives the model linearized, ``(a, b', c, e, K)``, so it prices prompts with the same numbers.)

What remains is the prefill time a new prompt may use::

    PAB_ms(k) = max(0, H - decode_reservation - inflight_reservation)

A fresh prompt of P tokens costs ``price(P) = a + b' * P + e * cross(P)`` (``TimeModel.prefill_ms``), so
the largest prompt that time allows is the largest P with ``price(P) <= PAB_ms``
(``TimeModel.tokens_within_ms``; ``floor((PAB_ms - a) / b')`` without the cross term, 0 when PAB_ms <= a).
Below, ``a + b' * P`` stands for ``price(P)`` and ``floor((X - a) / b')`` for that largest P: the price
grows with P and does not depend on the horizon, which is all the arguments below use.

KV cache. The new prompt's P tokens must also fit in the KV cache next to what the existing work
will still write within the horizon::

    kv_free_tokens    = capacity - used      (proxy mode: floor((1 - kv_usage) * capacity))
    growth_d          = min(remaining_output_d, ceil(H / tpot_d) + 1)
                        (remaining_output_d = max_tokens - tokens_out, or ceil(H / tpot_d) + 1 if unknown)
    kv_limited_tokens = max(0, kv_free_tokens - sum_d growth_d - sum_p (prompt_p - computed_p))
    PAB_tokens(k)     = min(floor((PAB_ms - a) / b'), kv_limited_tokens)

Fit rule (:func:`fits`, shared by agent and router): a prompt of P tokens fits class k when
``a + b' * P <= PAB_ms(k)`` and ``P <= PAB_tokens(k)``. A prompt so long that ``a + b' * P > H``
cannot meet its TTFT on any replica; rather than starve it, it fits only on a replica with nothing
reserved (PAB_ms = H: zero decode and in-flight reservation) whose KV cache holds it
(``P <= kv_limited_tokens``; the time part of PAB_tokens is necessarily smaller than such P), so
it takes a whole idle replica.

Sequence slots
--------------
The engine runs at most ``max_seqs`` requests at once (vLLM ``max_num_seqs``; 256 on an A100 by
``vllm serve``'s defaults); a request admitted past it waits in the engine's queue for a running one
to finish, whatever the time budget says. Every admitted request holds or waits for a slot ahead of a
new one (the engine serves its queue first come, first served), so with ``U = |D| + |pending|`` the new
request needs ``k = U - max_seqs + 1`` decodes to finish first (none when ``k <= 0``). A decode on
time finishes by its last token's deadline, ``ddl_d + (max_tokens_d - tokens_out_d - 1) * tpot_d``
(FairBatching paces decodes to their deadlines, so this is also about when it does finish, where
``max_tokens`` is the output's length; a decode already behind its envelope still needs one step of
at least ``a`` per token left, so its end is never taken sooner than ``(max_tokens_d - tokens_out_d -
1) * a`` from now), and the k-th earliest of those, less now, is the slot wait ``s`` (inf when fewer
than k decodes have a known ``max_tokens``: no finish can be promised). In real serving ``max_tokens``
is only a cap (vLLM fills in ``max_model_len - prompt`` when the client leaves it out) and that
deadline can be minutes away while, with hundreds of requests running, one ends every few tens of
ms; so when the agent has seen requests end (``finish_rate_per_s`` r, its last 5 s), ``s`` is at most
the expected wait for k of them, ``1000 * k / r`` ms. (The fleet simulation's requests carry their
exact output length as ``max_tokens`` and it passes no rate: there the deadline is the finish.) The
prompt's prefill must then fit in what is left of the horizon after ``s``; the decode and in-flight
reservations are kept whole, which counts any of their work done during ``s`` twice (conservative)::

    PAB_ms(k) = max(0, H - s - decode_reservation - inflight_reservation)

Without this rule a fleet at ``max_num_seqs`` admitted prompts that then waited in the engines'
queues: ServeGen m-large on 16 x 8B A100 at 200 req/s, TTFT misses 20 % (attainment 0.740; 0.950 with
``max_num_seqs`` 1024), docs/evaluation.md. The aged rules below hold unchanged: ``s`` does not
depend on the horizon.

Aged requests
-------------
A request that already spent ``w`` ms between its arrival at the router and the decision (queued
at the router, or retried after a failed replica) must have its prefill run by
``arrival + ttft_k``, i.e. within ``H - w`` of now (the margin is kept: the deadline is the same as
for a fresh arrival, w ms nearer). Two rules, one exact and one conservative:

*Exact (agent side, :func:`class_budget` with ``waited_ms = w``):* plan over the shortened horizon::

    H_w = max(0, H - w)

and every formula above with H_w in place of H: N and the decode reservation count the tokens
due by t + H_w, the KV growth reserve counts growth over H_w; the in-flight reservation does not
depend on the horizon. The fields of the returned :class:`ClassBudget` (``horizon_ms``,
``pab_ms``, ``pab_tokens``, ``kv_limited_tokens``, ...) then describe the shortened horizon H_w.
The fit rule is :func:`fits` on that budget, except the prefill-alone case (below).

*Conservative (router side, :func:`fits` with ``waited_ms = w`` on the budget of a fresh arrival,
horizon H, as a snapshot carries it):* the router has no replica state, only PAB_ms(H),
PAB_tokens(H) and kv_limited_tokens(H). Write dec(H) for the decode reservation over H and infl
for the in-flight reservation. Then:

- dec is non-decreasing in the horizon: n_d = max(0, floor((t + H - ddl_d) / tpot_d) + 1) only
  shrinks as H shrinks, so N(H - w) <= N(H) and dec(H - w) <= dec(H) (the cost of one iteration,
  a + (b + d)*|D| + c*sum ctx_d, does not depend on H);
- infl does not depend on H (nor does b' = b + f*K: K is a property of the model, not of the
  horizon, so every step below holds for the chunk^2 term as it did for the linear model);

hence (and also when the max(0, .) clamps, since PAB_ms(H_w) >= 0)::

    PAB_ms(H - w) = H - w - dec(H - w) - infl >= H - w - dec(H) - infl = PAB_ms(H) - w

So the router's test "can it still meet its TTFT here" (:func:`on_time`) is
``a + b'*P <= PAB_ms(H) - w``, ``P <= floor((PAB_ms(H) - w - a) / b')`` (the time-based token count
on PAB_ms(H) - w, <= the same count on PAB_ms(H_w) because the count is non-decreasing), and
``P <= PAB_tokens(H)``, whose KV part kv_limited_tokens(H) is for horizon H: the growth reserve
``min(remaining_d, ceil(H / tpot_d) + 1)`` only shrinks with the horizon, so kv_limited_tokens(H)
<= kv_limited_tokens(H_w) and that bound is conservative too. Every prompt :func:`on_time` admits,
the exact rule over H_w admits (up to float rounding of one ulp between PAB_ms(H) - w and
PAB_ms(H_w)).

Work conservation (issue 18)
----------------------------
Whether it can still meet its TTFT or not, a prompt that is not too long on its own
(``a + b'*P <= H``) FITS wherever a fresh arrival of its size fits (:func:`fits`: ``a + b'*P <=
PAB_ms(H)``, ``P <= PAB_tokens(H)``). A late request (its TTFT lost: :func:`on_time` is False on
every replica) therefore takes only budget a fresh arrival could take, which by construction
leaves every admitted request's deadline and every running decode's TPOT covered, and it starts
as soon as some replica has that budget. The old rule (a late request fits only a replica with
nothing reserved) made the fleet run one late request per replica at a time: with 60 prompts of
1,000 tokens on one replica (TTFT 1000 ms) 17 of 60 were refused at their queue timeout where the
engine alone served all 60 in 7.1 s. The router serves requests that are still on time first
(:class:`router.admission_queue.Dispatcher`), late ones after them in the same pass.

Only a prompt whose prefill alone exceeds the FULL horizon H keeps the idle rule: it fits only
where nothing is reserved over H and ``P <= kv_limited_tokens(H)``. The agent (:func:`admits`)
admits the union of :func:`fits` on the full-horizon budget and the exact fit over H_w, so it
never refuses what the router's rule admitted on a current view.

Floating point: floors and ceils are taken with a 1e-9 tolerance so that exact multiples (e.g.
(t + H - ddl) / tpot = 3.0 computed as 2.9999999) round as the arithmetic intends.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from replica_agent.policy.time_model import TimeModel

_EPS = 1e-9


@dataclass(frozen=True, slots=True)
class DecodeState:
    """A running decode (its first token was emitted).

    Attributes:
        next_deadline_ms: deadline of its next token (ms, same origin as ``now_ms``).
        tpot_ms: its TPOT target (ms), > 0.
        context_tokens: tokens in its KV cache (prompt + tokens out).
        tokens_out: output tokens emitted so far.
        max_tokens: requested output tokens, None when unknown.
    """

    next_deadline_ms: float
    tpot_ms: float
    context_tokens: int
    tokens_out: int
    max_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class PendingPrefill:
    """An admitted prefill without a first token yet, or a lease whose request has not arrived.

    Attributes:
        prompt_tokens: prompt length (tokens).
        computed_tokens: prompt tokens already in the KV cache (chunked prefill; 0 in proxy mode).
    """

    prompt_tokens: int
    computed_tokens: int = 0

    @property
    def remaining_tokens(self) -> int:
        """Prompt tokens still to compute (>= 0)."""
        return max(0, self.prompt_tokens - self.computed_tokens)


@dataclass(frozen=True, slots=True)
class SloClass:
    """An SLO class as PAB needs it.

    Attributes:
        name: class name, e.g. ``interactive``.
        ttft_ms: time-to-first-token target (ms), > 0.
        tpot_ms: time-per-output-token target (ms), > 0.
    """

    name: str
    ttft_ms: float
    tpot_ms: float

    def __post_init__(self) -> None:
        if not (self.ttft_ms > 0 and self.tpot_ms > 0):
            raise ValueError(f"SLO class {self.name!r} needs ttft_ms > 0 and tpot_ms > 0")


@dataclass(frozen=True, slots=True)
class ReplicaState:
    """Everything PAB reads about one replica at one instant.

    Attributes:
        now_ms: the instant t (ms).
        decodes: running decodes.
        prefills: in-flight prefills and un-arrived leases.
        kv_free_tokens: free KV cache (tokens, not blocks), >= 0.
        time_model: batch-time coefficients a, b, c (ms).
        margin_frac: safety margin as a share of the TTFT, 0 <= margin_frac < 1 (:func:`planning_horizon_ms`).
        margin_cap_tpots: the margin is at most this many TPOTs of the class (> 0; inf = no cap).
        max_seqs: the engine's cap on running requests (vLLM ``max_num_seqs``), None = not limited
            (module docstring, "Sequence slots").
        finish_rate_per_s: requests leaving the replica per second, recently observed (None = unknown):
            the expected slot wait when the decodes' ``max_tokens`` are only caps (same section).
    """

    now_ms: float
    decodes: Sequence[DecodeState]
    prefills: Sequence[PendingPrefill]
    kv_free_tokens: int
    time_model: TimeModel
    margin_frac: float = 0.1
    max_seqs: int | None = None
    finish_rate_per_s: float | None = None
    margin_cap_tpots: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.margin_frac < 1.0:
            raise ValueError(f"margin_frac must be in [0, 1), got {self.margin_frac}")
        if not self.margin_cap_tpots > 0.0:  # also NaN
            raise ValueError(f"margin_cap_tpots must be > 0, got {self.margin_cap_tpots}")
        if self.max_seqs is not None and self.max_seqs < 1:
            raise ValueError(f"max_seqs must be >= 1 or None, got {self.max_seqs}")


@dataclass(frozen=True, slots=True)
class ClassBudget:
    """PAB of one SLO class with its components (mirrors proto ClassBudget).

    The first five fields are all :func:`fits` reads (the router builds this type from a
    snapshot with just those); the components after them default to 0 for such views.

    Attributes:
        slo_class: class name.
        horizon_ms: H (:func:`planning_horizon_ms`); for an aged request (``class_budget`` with
            ``waited_ms = w``) H_w = max(0, H - w), and every field below is over that horizon.
        pab_ms: max(0, H - slot_wait_ms - decode_reservation_ms - inflight_reservation_ms).
        pab_tokens: min(the largest P whose ``prefill_ms(P)`` fits pab_ms, kv_limited_tokens).
        kv_limited_tokens: kv_free minus decode growth reserve minus pending prompt tokens, >= 0.
        ttft_ms, tpot_ms: the class's targets (ms).
        decode_reservation_ms: N * (a + (b + d)*|D| + c*sum ctx).
        inflight_reservation_ms: sum of b'*r + e*cross(r) + c*computed + e*r*computed over prefills and leases
            (r = remaining tokens; b' = the time model's ``prompt_ms_per_token``; cross: module docstring).
        kv_free_tokens: free KV cache (tokens).
        decode_iterations: N = max_d n_d.
        slot_wait_ms: ms until a sequence slot frees for a new request (0 when one is free; module
            docstring, "Sequence slots"; inf = no finish can be promised).
    """

    slo_class: str
    horizon_ms: float
    pab_ms: float
    pab_tokens: int
    kv_limited_tokens: int
    ttft_ms: float = 0.0
    tpot_ms: float = 0.0
    decode_reservation_ms: float = 0.0
    inflight_reservation_ms: float = 0.0
    kv_free_tokens: int = 0
    decode_iterations: int = 0
    slot_wait_ms: float = 0.0


def slot_wait_ms(now_ms: float, decodes: Sequence[DecodeState], prefills: Sequence[PendingPrefill],
                 max_seqs: int | None, finish_rate_per_s: float | None = None, min_step_ms: float = 0.0) -> float:
    """ms until a new request gets a sequence slot (module docstring, "Sequence slots"): 0 when
    ``len(decodes) + len(prefills) < max_seqs`` (or no cap); else, with k = ``len(decodes) +
    len(prefills) - max_seqs + 1``, the k-th earliest end of the decodes less now (inf when fewer than
    k decodes have a known, finite one), and no more than ``1000 * k / finish_rate_per_s`` when a
    positive finish rate is given. A decode's end is its last token's deadline, but no sooner than its
    remaining tokens less one times ``min_step_ms`` from now (one token per step, each step at least
    the fixed cost ``a``: a decode already behind its envelope does not end at once)."""
    if max_seqs is None:
        return 0.0
    k = len(decodes) + len(prefills) - max_seqs + 1
    if k <= 0:
        return 0.0
    ends = []
    for d in decodes:
        if d.max_tokens is None:
            continue
        left = max(0, d.max_tokens - d.tokens_out - 1)
        end = max(d.next_deadline_ms + left * d.tpot_ms - now_ms, left * min_step_ms)
        if end == end and end != math.inf:  # NaN or inf: no promise
            ends.append(end)
    wait = math.inf
    if len(ends) >= k:
        ends.sort()
        wait = max(0.0, ends[k - 1])
    if finish_rate_per_s is not None and finish_rate_per_s > 0.0:
        wait = min(wait, 1000.0 * k / finish_rate_per_s)
    return wait


def planning_horizon_ms(slo: SloClass, margin_frac: float, margin_cap_tpots: float = 1.0) -> float:
    """H = ttft - min(margin_frac * ttft, margin_cap_tpots * tpot) (ms; module docstring, "Derivation").

    Example: TTFT 1000 / TPOT 100, margin 0.1: min(100, 100) -> 900; TTFT 5000 / TPOT 100:
    min(500, 100) -> 4900 (4500 with ``margin_cap_tpots = inf``); TTFT 500 / TPOT 50: 450.
    """
    return slo.ttft_ms - min(margin_frac * slo.ttft_ms, margin_cap_tpots * slo.tpot_ms)


def decode_iterations(now_ms: float, horizon_ms: float, decodes: Iterable[DecodeState]) -> int:
    """N = max_d max(0, floor((t + H - ddl_d) / tpot_d) + 1); 0 without decodes (docs/design.md section 4).

    Computed as ``max(0, floor(max_d x_d) + 1)`` with ``x_d = (t + H - ddl_d) / tpot_d``: floor is
    non-decreasing, so the largest floor is the floor of the largest ``x_d`` (one pass, one floor)."""
    end = now_ms + horizon_ms
    x = max(((end - d.next_deadline_ms) / d.tpot_ms for d in decodes), default=None)
    if x is None:
        return 0
    return max(0, math.floor(x + _EPS) + 1)


def growth_reserve_tokens(horizon_ms: float, decodes: Iterable[DecodeState]) -> int:
    """Sum over decodes of min(remaining output, ceil(H / tpot_d) + 1) (tokens); the cap is computed
    once per distinct TPOT (a fleet has a few SLO classes, a replica many decodes)."""
    total = 0
    caps: dict[float, int] = {}
    for d in decodes:
        tpot = d.tpot_ms
        cap = caps.get(tpot)
        if cap is None:
            cap = caps[tpot] = math.ceil(horizon_ms / tpot - _EPS) + 1
        mt = d.max_tokens
        if mt is None:
            total += cap
        else:
            remaining = mt - d.tokens_out
            total += cap if remaining >= cap else max(0, remaining)
    return total


def _check_waited(waited_ms: float) -> None:
    if not waited_ms >= 0.0:  # also NaN
        raise ValueError(f"waited_ms must be >= 0, got {waited_ms}")


def class_budget(state: ReplicaState, slo: SloClass, waited_ms: float = 0.0) -> ClassBudget:
    """PAB of ``slo`` on the replica in ``state`` (formulas: module docstring, architecture.md "PAB").

    Args:
        state: the replica at ``state.now_ms``.
        slo: the request's SLO class.
        waited_ms: ms the request already spent since its arrival at the router (0 = a fresh
            arrival). The budget is planned over ``H_w = max(0, H - waited_ms)`` with
            ``H`` = :func:`planning_horizon_ms` (module docstring, "Aged requests"); the fields of
            the result (``horizon_ms``, ``pab_ms``, ``pab_tokens``, ...) describe that horizon.

    Raises:
        ValueError: if ``waited_ms`` is negative or NaN.
    """
    _check_waited(waited_ms)
    tm = state.time_model
    horizon = planning_horizon_ms(slo, state.margin_frac, state.margin_cap_tpots)
    if waited_ms:
        horizon = max(0.0, horizon - waited_ms)
    n_iter = decode_iterations(state.now_ms, horizon, state.decodes)
    if state.decodes and n_iter > 0:
        ctx = sum(d.context_tokens for d in state.decodes)
        decode_res = n_iter * tm.batch_ms(len(state.decodes), ctx, 0, len(state.decodes))
    else:
        decode_res = 0.0
    inflight_res = sum(_inflight_terms(tm, state.prefills))
    wait = slot_wait_ms(state.now_ms, state.decodes, state.prefills, state.max_seqs, state.finish_rate_per_s,
                        tm.a_ms)
    pab_ms = max(0.0, horizon - wait - decode_res - inflight_res)
    kv_free = max(0, int(state.kv_free_tokens))
    pending_prompt = sum(p.remaining_tokens for p in state.prefills)
    kv_limited = max(0, kv_free - growth_reserve_tokens(horizon, state.decodes) - pending_prompt)
    pab_tokens = min(tm.tokens_within_ms(pab_ms), kv_limited)
    return ClassBudget(
        slo_class=slo.name,
        ttft_ms=slo.ttft_ms,
        tpot_ms=slo.tpot_ms,
        horizon_ms=horizon,
        pab_ms=pab_ms,
        pab_tokens=pab_tokens,
        decode_reservation_ms=decode_res,
        inflight_reservation_ms=inflight_res,
        kv_free_tokens=kv_free,
        kv_limited_tokens=kv_limited,
        decode_iterations=n_iter,
        slot_wait_ms=wait,
    )


def _inflight_terms(tm: TimeModel, prefills: Iterable[PendingPrefill]) -> Iterator[float]:
    """Each in-flight prefill's reservation ``b'*r + c*computed + e*(r*computed + cross(r))`` (ms; module
    docstring, item 2; ``b'`` = ``tm.prompt_ms_per_token``): it rides in batches that already pay ``a``, so
    it is ``tm.prefill_ms(prompt, computed) - a`` (``prompt_body_ms(r)`` plus the terms over what is computed)."""
    c, e = tm.c_ms_per_context_token, tm.e_ms_per_chunk_prefix
    for p in prefills:
        r = p.remaining_tokens
        yield tm.prompt_body_ms(r) + c * p.computed_tokens + e * r * p.computed_tokens


MAX_INFLIGHT_LUMPS = 8
"""Entries of :func:`inflight_lumps` (the rest are summed into the last one)."""


def inflight_lumps(state: ReplicaState, max_lumps: int = MAX_INFLIGHT_LUMPS) -> tuple[float, ...]:
    """The in-flight reservation split per prefill, in the order the engine serves them (ms).

    ``sum(inflight_lumps(state)) == class_budget(state, k).inflight_reservation_ms`` for every class
    k. A prefill holds its whole reservation until its first token, so the budget a replica's
    snapshots show frees in these lumps, not smoothly: the router's wait prediction
    (router/shedding.py ``predict_start``) needs them to know when a deficit frees. The engine runs
    its waiting prompts first come, first served (vLLM's default), which is the order of
    ``state.prefills`` (tracked arrivals, then leases whose requests have not arrived).

    Args:
        state: the replica now.
        max_lumps: at most this many entries (>= 1); the reservations from the ``max_lumps``-th on
            are summed into the last entry, which frees, conservatively, when the last of them does.

    Returns:
        One float per prefill (ms, >= 0), at most ``max_lumps``; ``()`` without in-flight prefills.
    """
    lumps = list(_inflight_terms(state.time_model, state.prefills))
    if len(lumps) > max_lumps:
        lumps[max_lumps - 1 :] = [sum(lumps[max_lumps - 1 :])]
    return tuple(lumps)


def compute_budgets(state: ReplicaState, classes: Iterable[SloClass]) -> dict[str, ClassBudget]:
    """PAB for every class, keyed by class name (insertion order of ``classes``)."""
    return {c.name: class_budget(state, c) for c in classes}


def fits(prompt_tokens: int, class_budget: ClassBudget, time_model: TimeModel, waited_ms: float = 0.0) -> bool:
    """Whether a prompt of ``prompt_tokens`` tokens may start on this budget (architecture.md "PAB").

    Rule (the same for a fresh arrival and for a request that already waited ``waited_ms``; module
    docstring, "Work conservation"): ``a + b' * P <= pab_ms`` and ``P <= pab_tokens`` (``b'`` =
    ``time_model.prompt_ms_per_token``, ``b`` when f = 0). A prompt
    whose prefill alone exceeds the horizon (``a + b' * P > horizon_ms``) cannot meet its TTFT on
    any replica; it fits only where nothing is reserved (``pab_ms == horizon_ms``, within 1e-9)
    and ``P <= kv_limited_tokens``: it takes a whole idle replica. Only the first five fields of
    ``class_budget`` are read, so a router-side view built from a snapshot works too.

    ``waited_ms`` does not change the answer: a request that already waited (so that its TTFT may
    be lost, :func:`on_time` says whether it is) takes the budget a fresh arrival would take, so it
    costs no admitted request its deadline, and it is served as soon as a replica has that budget
    instead of waiting for an idle one. It is still checked (>= 0) for the callers' sake.

    Args:
        prompt_tokens: P (tokens), >= 0.
        class_budget: the replica's budget for the request's class (possibly from a snapshot).
        time_model: the replica's model (ms; its prompt pricing, a and ``prompt_ms_per_token``).
        waited_ms: w, ms since the request's arrival at the router (>= 0).

    Raises:
        ValueError: if ``prompt_tokens`` or ``waited_ms`` is negative (or ``waited_ms`` NaN).
    """
    if prompt_tokens < 0:
        raise ValueError(f"prompt_tokens must be >= 0, got {prompt_tokens}")
    _check_waited(waited_ms)
    prefill_ms = time_model.prefill_ms(prompt_tokens)  # fresh prompt: ctx 0
    if prefill_ms > class_budget.horizon_ms + _EPS:
        idle = class_budget.pab_ms >= class_budget.horizon_ms - _EPS  # PAB_ms = H: nothing reserved
        return idle and prompt_tokens <= class_budget.kv_limited_tokens
    return prefill_ms <= class_budget.pab_ms + _EPS and prompt_tokens <= class_budget.pab_tokens


def on_time(prompt_tokens: int, class_budget: ClassBudget, time_model: TimeModel, waited_ms: float = 0.0) -> bool:
    """Whether a request that waited ``waited_ms`` can still meet its TTFT here: the router's
    CONSERVATIVE aged rule on the budget of a fresh arrival (horizon H; module docstring, "Aged
    requests", for the proof that the exact rule over H - w admits whatever this admits):
    ``a + b'*P <= pab_ms - w`` and ``P <= pab_tokens`` and ``P <= floor((pab_ms - w - a) / b')``.
    With ``w = 0`` it is :func:`fits` without the prefill-alone case. Never True for a prompt whose
    prefill alone exceeds ``horizon_ms - w``.

    Raises:
        ValueError: if ``prompt_tokens`` or ``waited_ms`` is negative (or ``waited_ms`` NaN).
    """
    if prompt_tokens < 0:
        raise ValueError(f"prompt_tokens must be >= 0, got {prompt_tokens}")
    _check_waited(waited_ms)
    prefill_ms = time_model.prefill_ms(prompt_tokens)
    if prefill_ms > (class_budget.horizon_ms - waited_ms) + _EPS:
        return False
    pab_w = class_budget.pab_ms - waited_ms
    return (
        prefill_ms <= pab_w + _EPS
        and prompt_tokens <= class_budget.pab_tokens
        and (not waited_ms or prompt_tokens <= time_model.tokens_within_ms(pab_w))
    )


def admits(prompt_tokens: int, state: ReplicaState, slo: SloClass, waited_ms: float = 0.0,
           on_time_only: bool = False) -> tuple[bool, ClassBudget]:
    """The agent's fit rule for a request of class ``slo`` that waited ``waited_ms`` ms.

    ``on_time_only`` (the router asks for a start that meets the request's TTFT: a sheddable class,
    or the dispatcher's on-time phase; issue 27): the EXACT on-time rule alone, :func:`on_time` on
    the budget over ``H_w`` (``class_budget`` with ``waited_ms``), without the work-conserving
    fresh-arrival fit below, which would admit a request whose TTFT is already lost. Several
    router copies each place on a view that lacks the others' latest placements; without this an
    on-time placement on such a view became a late start (4 routers: TTFT p99 above the target
    for a sheddable class).

    A prompt whose prefill alone exceeds the full horizon H (``a + b'*P > H``) fits only where
    nothing is reserved over H and ``P <= kv_limited_tokens(H)`` (:func:`fits`). Any other prompt
    fits when it fits the budget of a fresh arrival (:func:`fits` on ``class_budget(state, slo)``,
    work conservation) or the EXACT budget over ``H_w = max(0, H - waited_ms)``
    (:func:`class_budget` with ``waited_ms``; module docstring, "Aged requests"). The router's rule
    (:func:`fits` on the fresh snapshot) is the first of the two, so the agent never refuses what
    the router's view admits (up to the view's age). With ``waited_ms = 0``: exactly
    ``fits(P, class_budget(state, slo), tm)``.

    Returns:
        (fits, the budget of a fresh arrival, full horizon H).

    Raises:
        ValueError: if ``prompt_tokens`` or ``waited_ms`` is negative (or ``waited_ms`` NaN).
    """
    if prompt_tokens < 0:
        raise ValueError(f"prompt_tokens must be >= 0, got {prompt_tokens}")
    _check_waited(waited_ms)
    full = class_budget(state, slo)
    tm = state.time_model
    if on_time_only:
        aged = class_budget(state, slo, waited_ms) if waited_ms else full
        return aged.horizon_ms > 0 and on_time(prompt_tokens, aged, tm), full
    if fits(prompt_tokens, full, tm):
        return True, full
    if waited_ms and tm.prefill_ms(prompt_tokens) <= full.horizon_ms + _EPS:
        aged = class_budget(state, slo, waited_ms)
        if aged.horizon_ms > 0 and on_time(prompt_tokens, aged, tm):
            return True, full
    return False, full
