"""Steady-state capacity bound that lets the costliest 10 % of requests miss (pure: numpy only, no I/O).

Capacity in the benchmarks is the highest offered rate λ at which at least a fraction q (0.9) of the
requests meets its SLO. An upper bound on it therefore only has to pay for the q-fraction of requests a
scheduler would choose to serve (an admission controller may refuse the rest at no cost), and a bound that
charges every request (``loadgen/fleet/bench.py``, :func:`~loadgen.fleet.bench.analytic_bound`) is too low
for that yardstick. Derivation (docs/engine-time-model.md, "Steady-state bound"):

**Model of the replica.** It runs back-to-back steps of one length T ms (the bound takes the best T).
Step time is the engine's own model (loadgen/sim/engine_time.py)
``a + b*new + c*context + d*seqs + e*sum chunk*prefix + f*sum chunk^2``, times a log-normal noise of
mean ``m = exp(sigma^2 / 2)``. The fixed cost ``a`` is paid once per step, ``1000 / T`` times a second;
everything else is charged to the request whose tokens cause it. A request meets its SLO only if

- TPOT: every running decode gets a token per step, so ``T <= tpot_ms``;
- TTFT: its prompt of P tokens is prefilled in K chunks, one per step, ending within the TTFT:
  ``K * T <= ttft_ms``, and a chunk holds at most ``M = max_num_batched_tokens`` tokens: ``K >= ceil(P / M)``.
  So ``K`` lies in ``[ceil(P / M), min(P, floor(ttft_ms / T))]``; an empty range: it cannot meet its SLO at T.

**Work of one request** (engine accounting, loadgen/sim/engine.py: a decode is a chunk of 1 over its
context; after the prefill the KV holds P tokens and decode j = 1..O-1 reads P + j - 1):

- decodes: ``(O - 1) * (b + d + f) + (c + e) * ((O - 1) * P + (O - 1) * (O - 2) / 2)``;
- prefill in chunks c_1..c_K (sum P) at prefixes x_k = c_1 + ... + c_{k-1}: ``b*P + c*sum x_k + d*K
  + e*sum c_k x_k + f*S`` with ``S = sum c_k^2``; since ``sum c_k x_k = (P^2 - S) / 2`` this is
  ``b*P + c*sum x_k + d*K + e*P^2/2 + (f - e/2)*S``. Over all partitions into K chunks,
  ``sum x_k >= K (K - 1) / 2`` (1-token chunks first) and ``P^2 / K <= S <= (P - K + 1)^2 + K - 1``, so
  ``prefill(K) >= b*P + c*K(K-1)/2 + d*K + e*P^2/2 + (f - e/2) * (P^2/K if f >= e/2 else (P-K+1)^2 + K-1)``.
- ``W_i(T) = m * (decodes + min over the allowed K of that prefill bound)`` (∞ when no K is allowed).

Every term is a lower bound of what any schedule with step length T spends on request i.

**Time.** At λ requests/s per replica, the served requests bring ``λ * (1/n) * sum_{i in S} W_i`` GPU-ms
per second, S the served set, ``|S| >= ceil(q n)``; the steps' fixed cost takes ``m * a * 1000 / T``. So
``λ <= 1000 * (1 - m*a/T) / ((1/n) * sum of the ceil(q n) smallest W_i(T))``: the cheapest q-fraction by
work, the costliest ``1 - q`` allowed to miss (at q = 1 it is the all-requests bound).

**Prefix caching** (the engines keep vLLM's automatic prefix cache): a request whose first h tokens are
already in the KV cache computes only ``U = P - h`` of them. A request can skip only tokens that *another*
request computed (its own earlier attempt, if preempted, is recomputed), and to meet its TTFT request i
must have its prompt computed by ``t_i + ttft``, while request j computes nothing before it arrives at
``t_j``. So with ``h_i`` = the longest prompt prefix request i shares with another request j of the stream
with ``t_j <= t_i + ttft`` (in whole ``block_tokens`` units, at most ``P - 1``: the engine computes the
last prompt token; :func:`shared_prefix_tokens`), every schedule in which i meets its SLO computes at
least U_i of i's prompt tokens. Order within that window does not matter (a later arrival may be computed
first and serve the earlier one), so both members of a close pair are credited: looser than what a real
cache can do, but a lower bound of each served request's own work, which is all the cheapest-q argument
needs. The chunks now start at prefix h:
``x_k = h + c_1 + ... + c_{k-1}``, so ``sum x_k >= K h + K(K-1)/2`` and ``sum c_k x_k = h U + (U^2 - S)/2``:
``prefill(K) >= b*U + c*(K h + K(K-1)/2) + d*K + e*(h U + U^2/2) + (f - e/2) * S(U, K)``, K in
``[ceil(U / M), min(U, floor(ttft_ms / T))]`` (the formula above with P -> U and d -> d + c h, plus
``e h U``). Decodes are unchanged (their context is the whole P + j). KV and tokens per step count the
U_i uncached tokens only (cached blocks may be shared: counting them once per request could overstate
the need). ``h = 0`` everywhere (no prefix ids, or caching off) is the bound without caching.

**The other resources** (as in the analytic bound, each with its own cheapest q-fraction, which can only
relax it): KV by Little's law ``λ * (1/n) * sum_q K_i * T / 1000 <= kv_capacity`` with
``K_i = sum_{j=0}^{O-1} (P + j)``; sequences ``λ * (1/n) * sum_q O_i * T / 1000 <= max_num_seqs``; tokens per
step ``λ * (1/n) * sum_q (P_i + O_i) * T / 1000 <= M``.

Bound = replicas * max over T of the smallest of the four per-replica limits. It ignores burstiness and
queueing (both only lower capacity) and the finite benchmark window; within the constant-step-length
model it is an upper bound on the capacity at attainment q.

**Bursts** (attainment bounds on one arrival stream, the N replicas pooled into one machine doing
``N * (1 - m*a/T)`` GPU-ms of work per ms, each request's least work W_i(T) split into its prefill and its
decodes by :func:`request_work_parts_ms`). A request i that meets its SLO has its prefill done within
``[t_i, t_i + ttft]`` and its decodes within ``[t_i, t_i + ttft + (O_i - 1) * tpot]``. So in any span [s, e],
the requests with ``s <= t_i`` and ``t_i + ttft <= e`` that meet their SLO do there their prefill, and their
decodes where those are due by e, and all of it fits the machine's work in the span; the cheapest of them
fit first, which gives the fewest that must miss. :func:`windowed_attainment_bound` cuts the window into
intervals of one length L by arrival, each with a span reaching ttft + D past its end (the spans overlap, so
capacity is counted more than once); :func:`interval_attainment_bound` takes pairwise disjoint spans, whose
requests are then disjoint (each prefill window lies inside its span), adds their forced misses, and finds
the family with the most by a dynamic programme over span end points on a grid. Both are valid; neither
need be below the other (the windowed one at a long L is close to the steady bound).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from loadgen.sim.engine_time import EngineTimeModel
from replica_agent.policy.time_model import TimeModel


@dataclass(frozen=True, slots=True)
class SteadyBound:
    """Result of :func:`steady_state_bound`.

    Attributes:
        rps: fleet bound (offered requests/s).
        per_replica_rps: the same per replica.
        iteration_ms: the best step length T (ms).
        limit: the binding constraint at T: ``time``, ``kv``, ``seqs`` or ``tokens``.
        served_frac: q, the fraction of requests (or, with ``served_by="tokens"``, of their prompt +
            output tokens) that must meet the SLO.
        mean_work_ms: mean W_i(T) over the served (cheapest) ``ceil(q n)`` requests (ms); with
            ``served_by="tokens"``, the cheapest cover's work over the requests it serves (fractions counted).
        infeasible: requests that cannot meet their TTFT at T (no allowed chunk count).
        served_by: ``requests`` (the per-request floor) or ``tokens`` (the per-token floor).
    """

    rps: float
    per_replica_rps: float
    iteration_ms: float
    limit: str
    served_frac: float
    mean_work_ms: float
    infeasible: int
    served_by: str = "requests"


@dataclass(frozen=True, slots=True)
class WorkModel:
    """Step-time coefficients as the bound uses them (ms; module docstring), from either kind of model.

    A step costs ``a + b*new + c*context + d*seqs + e*sum_prefill chunk*prefix + e_dec*sum_decodes context
    + f*sum chunk^2 + d_dec*decodes``, times noise of mean ``mean_factor``.

    Attributes:
        a, b, c, d, e, f: as in :class:`~loadgen.sim.engine_time.EngineTimeModel` (``e`` over prefill chunks).
        e_dec: the chunk x prefix coefficient over decodes (a decode's product is its context).
        d_dec: cost of a decode beyond ``b`` (ms per decode; the policy TimeModel's ``d_ms_per_decode``).
        mean_factor: mean of the noise factor, ``exp(sigma^2 / 2)``.
    """

    a: float
    b: float
    c: float
    d: float = 0.0
    e: float = 0.0
    f: float = 0.0
    e_dec: float = 0.0
    d_dec: float = 0.0
    mean_factor: float = 1.0

    @classmethod
    def of(cls, model: EngineTimeModel | TimeModel) -> WorkModel:
        """From the engine's model (its ``e`` and ``d`` apply to every sequence) or a policy TimeModel
        (``--engine-time-model policy``: ``e`` over prefill chunks only, ``d_ms_per_decode`` per decode and
        ``f_ms_per_chunk_sq`` where the TimeModel has them; the bound's f also falls on each decode's chunk
        of 1, f ms more per decode; no noise)."""
        if isinstance(model, EngineTimeModel):
            return cls(model.a_ms, model.b_ms, model.c_ms, model.d_ms, model.e_ms, model.f_ms, model.e_ms, 0.0,
                       math.exp(model.noise_sigma**2 / 2.0))  # fmt: skip
        return cls(model.a_ms, model.b_ms_per_new_token, model.c_ms_per_context_token, 0.0,
                   model.e_ms_per_chunk_prefix, float(getattr(model, "f_ms_per_chunk_sq", 0.0)), 0.0,
                   float(getattr(model, "d_ms_per_decode", 0.0)))  # fmt: skip


def shared_prefix_tokens(
    prefix_ids: Sequence[Sequence[int]],
    prompt_tokens: Sequence[int],
    block_tokens: int,
    arrival_ms: Sequence[float] | None = None,
    ttft_ms: float = math.inf,
) -> np.ndarray:
    """``h_i`` of the module docstring: the longest prompt prefix request i can have found in the cache.

    Request i meets its TTFT only if its prompt is computed by ``t_i + ttft_ms``, and a block can be in the
    cache then only if another request j computed it, after j's arrival: so j counts only when
    ``t_j <= t_i + ttft_ms`` (earlier or later arrivals alike: a later one may be computed first).

    Args:
        prefix_ids: per request, the ids of its prompt's leading blocks (equal leading ids = equal prefix;
            loadgen/fleet/sim.py ``FleetRequest.prefix_ids``), shape (n, variable).
        prompt_tokens: shape (n,), each >= 1.
        block_tokens: tokens per id (> 0).
        arrival_ms: shape (n,), arrival times (ms); None = every other request counts.
        ttft_ms: the TTFT target (ms); inf = every other request counts.

    Returns:
        shape (n,) floats: ``min(P_i - 1, block_tokens * j_i)``, j_i the most leading ids request i has in
        common with one other request that counts (0 for a prompt that shares nothing).

    Raises:
        ValueError: on block_tokens <= 0 or lengths that differ.
    """
    n = len(prompt_tokens)
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be > 0, got {block_tokens}")
    if len(prefix_ids) != n or (arrival_ms is not None and len(arrival_ms) != n):
        raise ValueError("prefix_ids, prompt_tokens and arrival_ms differ in length")
    t = [0.0] * n if arrival_ms is None else [float(x) for x in arrival_ms]
    # A leading run of ids is keyed by a chain of hashes (a collision could only overstate sharing: the safe
    # side); per key the two earliest arrivals (time, request), so "the earliest other one" is known for all.
    chains = []
    first: dict[int, list[tuple[float, int]]] = {}
    for i, ids in enumerate(prefix_ids):
        keys, key = [], 0
        for x in ids:
            key = hash((key, x))
            keys.append(key)
            two = first.setdefault(key, [])
            two.append((t[i], i))
            if len(two) > 2:
                two.sort()
                del two[2:]
        chains.append(keys)
    out = np.zeros(n)
    for i, keys in enumerate(chains):
        j = 0
        while j < len(keys):
            others = [tj for tj, k in first[keys[j]] if k != i]
            if not others or min(others) > t[i] + ttft_ms:
                break
            j += 1
        out[i] = min(max(0, int(prompt_tokens[i]) - 1), block_tokens * j)
    return out


def request_work_ms(
    prompt_tokens: np.ndarray, output_tokens: np.ndarray, model: EngineTimeModel | TimeModel, step_ms: float, ttft_ms: float,
    max_num_batched_tokens: int, cached_tokens: np.ndarray | None = None,
) -> np.ndarray:
    """``W_i(T)`` of the module docstring for every request (ms; ``inf`` where no chunk count meets the TTFT).

    Same arguments and errors as :func:`request_work_parts_ms`; the sum of its two parts.
    """
    prefill, decodes = request_work_parts_ms(prompt_tokens, output_tokens, model, step_ms, ttft_ms,
                                             max_num_batched_tokens, cached_tokens)  # fmt: skip
    return prefill + decodes


def request_work_parts_ms(
    prompt_tokens: np.ndarray, output_tokens: np.ndarray, model: EngineTimeModel | TimeModel, step_ms: float, ttft_ms: float,
    max_num_batched_tokens: int, cached_tokens: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """``W_i(T)`` of the module docstring split into (prefill, decodes), each times the noise mean (ms).

    The prefill part is ``inf`` where no chunk count meets the TTFT at step length T.

    Args:
        prompt_tokens, output_tokens: shape (n,), each >= 1.
        model: the engine's step-time model, or the policy's TimeModel (:meth:`WorkModel.of`).
        step_ms: step length T (ms), > 0.
        ttft_ms: TTFT target (ms).
        max_num_batched_tokens: tokens per step at most (M).
        cached_tokens: h_i, prompt tokens another request may have computed (module docstring, "Prefix
            caching"; :func:`shared_prefix_tokens`), shape (n,), each in [0, P_i - 1]; None = 0.

    Raises:
        ValueError: on step_ms <= 0, a token count < 1, or a cached count outside [0, P - 1].
    """
    p = np.asarray(prompt_tokens, dtype=float)
    o = np.asarray(output_tokens, dtype=float)
    if step_ms <= 0:
        raise ValueError(f"step_ms must be > 0, got {step_ms}")
    if p.size and (p.min() < 1 or o.min() < 1):
        raise ValueError("prompt and output tokens must be >= 1")
    h = np.zeros_like(p) if cached_tokens is None else np.asarray(cached_tokens, dtype=float)
    if h.shape != p.shape or (h.size and (h.min() < 0 or (h > p - 1).any())):
        raise ValueError("cached_tokens must have the prompts' shape, each in [0, P - 1]")
    u = p - h
    w = WorkModel.of(model)
    b, c, d, e, f = w.b, w.c, w.d, w.e, w.f
    dec = (o - 1) * (b + d + f + w.d_dec) + (c + w.e_dec) * ((o - 1) * p + (o - 1) * (o - 2) / 2)
    k_lo = np.ceil(u / max_num_batched_tokens)
    k_hi = np.minimum(u, math.floor(ttft_ms / step_ms + 1e-9))
    g = f - e / 2.0
    dh = d + c * h  # per-chunk cost: d, and c over the cached prefix every chunk reads

    def prefill(k: np.ndarray) -> np.ndarray:
        s = u * u / k if g >= 0 else (u - k + 1) ** 2 + k - 1
        return b * u + c * k * (k - 1) / 2 + dh * k + e * (h * u + u * u / 2) + g * s

    # prefill(K) - const = c K(K-1)/2 + d' K + g U^2 / K (d' = d + c h) is convex in K for g >= 0: its integer
    # minimum over [k_lo, k_hi] is at an end or at floor/ceil of the stationary point c (2K - 1)/2 + d' = g U^2 / K^2
    # (Newton from below: the left side is concave and increasing in K, so the iterates rise to the root).
    # For g < 0 every term grows with K (S's upper bound shrinks), so the minimum is at k_lo.
    cands = [k_lo, k_hi]
    if g > 0 and (c > 0 or d > 0):
        k = np.ones_like(p)
        for _ in range(40):
            k = np.maximum(1.0, k - (c * (2 * k - 1) / 2 + dh - g * u * u / (k * k)) / (c + 2 * g * u * u / k**3))
        cands += [np.floor(k), np.ceil(k)]
    best = np.full(p.shape, np.inf)
    for kc in cands:
        kk = np.clip(kc, k_lo, np.maximum(k_lo, k_hi))
        best = np.minimum(best, prefill(np.maximum(kk, 1.0)))
    return np.where(k_hi >= k_lo, w.mean_factor * best, np.inf), w.mean_factor * dec


def windowed_attainment_bound(
    arrival_ms: Sequence[float],
    prompt_tokens: Sequence[int],
    output_tokens: Sequence[int],
    model: EngineTimeModel | TimeModel,
    ttft_ms: float,
    tpot_ms: float,
    replicas: int,
    start_ms: float,
    end_ms: float,
    max_num_batched_tokens: int = 8192,
    cached_tokens: Sequence[float] | None = None,
    windows_ms: Sequence[float] = (1000.0, 2000.0, 5000.0, 10_000.0, 30_000.0, 60_000.0, 120_000.0, 240_000.0),
    steps_ms: Sequence[float] | None = None,
) -> tuple[float, float, float]:
    """Upper bound on the SLO attainment any schedule reaches on this arrival stream (burst-aware).

    The steady-state bound lets load move freely in time; a request cannot wait longer than its TTFT, so a
    burst must be served within it. Relaxations, each only raising the bound: the N replicas pooled into one
    machine that does N GPU-ms of work per ms; per step the fixed cost ``m*a`` at steps of length T (as in
    the module docstring: a running decode needs a step at least every T <= tpot ms); each request's work
    the lower bound of the module docstring at T (prefix caching through ``cached_tokens``).

    Cut [start, end) into intervals I_k of length L (the last one shorter). A request arriving in I_k that
    meets its SLO has its prefill done within ``[start_k, end_k + ttft]`` and, if ``(O - 1) * tpot <= D``,
    its decodes too within ``[start_k, end_k + ttft + D]`` (TPOT is the mean gap, loadgen/stats.py). So
    the requests of I_k that meet their SLO need, in that span, at most ``replicas * (1 - m*a/T) *
    (|I_k| + ttft + D)`` ms of work: their costs ``prefill_i + [(O_i - 1) tpot <= D] decodes_i`` must fit.
    The most requests that fit one such budget are the cheapest ones (smallest-first maximises a count
    under one sum constraint), and dropping every constraint that links the intervals relaxes the problem,
    so ``sum_k (how many of the cheapest of I_k fit) / n`` bounds the attainment over requests arriving in
    [start, end) (n of them), for every L and D: the bound is the smallest over ``windows_ms`` (L) and
    D in {0, L/8, L/4, L/2, L}; within the constant-step model, the largest over T (``steps_ms``; by default 10
    cells covering (m*a, tpot_ms]). It ignores everything that arrived before ``start`` (it only takes GPU time).

    Args:
        arrival_ms, prompt_tokens, output_tokens: the stream, shape (n_all,) each (ms; tokens >= 1).
        model, ttft_ms, tpot_ms, replicas, max_num_batched_tokens: as in :func:`steady_state_bound`.
        start_ms, end_ms: the counted window (ms), start < end.
        cached_tokens: h_i of the module docstring, shape (n_all,); None = no prefix caching.
        windows_ms: interval lengths L to try (ms), each > 0.
        steps_ms: step lengths T to try (ms), each its own cell; None = cells covering (m*a, tpot_ms]
            (:func:`_step_cells`).

    Returns:
        (attainment bound in [0, 1], the L (ms) and the T (ms) that gave it; by default the upper end of its cell).

    Raises:
        ValueError: on no request in [start, end), start >= end, or tpot_ms <= m*a with no ``steps_ms``.
    """
    t, p, o, h = _counted(arrival_ms, prompt_tokens, output_tokens, cached_tokens, start_ms, end_ms)
    n = t.size
    a, cells = _step_cells(model, tpot_ms, steps_ms, 11)
    best = (0.0, 0.0, cells[-1][1] if cells else float(tpot_ms))
    for low, step in cells:
        pre, dec = request_work_parts_ms(p, o, model, low, ttft_ms, max_num_batched_tokens, h)
        rate = replicas * (1.0 - a / step)  # GPU-ms of work per ms
        worst = (1.0, float(windows_ms[0]))  # every L allows 1.0: the first one is reported
        finite = np.isfinite(pre)  # the others cannot meet their TTFT at this T
        if not finite.any():  # nothing can meet its SLO at this T
            continue
        for length in windows_ms:
            k_all = np.floor((t - start_ms) / length).astype(np.int64)
            for d in (0.0, length / 8.0, length / 4.0, length / 2.0, float(length)):
                cost = (pre + np.where((o - 1) * tpot_ms <= d, dec, 0.0))[finite]
                k = k_all[finite]
                order = np.lexsort((cost, k))  # by interval, cheapest first within one
                k, cost = k[order], cost[order]
                cs = np.cumsum(cost)
                first = np.flatnonzero(np.r_[True, k[1:] != k[:-1]])  # where each interval's run starts
                before = np.where(first > 0, cs[np.maximum(first - 1, 0)], 0.0)
                run = np.repeat(np.arange(first.size), np.diff(np.r_[first, k.size]))
                lo = start_ms + k[first] * length
                cap = rate * (np.minimum(length, end_ms - lo) + ttft_ms + d)
                served = int(np.count_nonzero(cs - before[run] <= cap[run]))
                if served / n < worst[0]:
                    worst = (served / n, float(length))
        if worst[0] > best[0]:
            best = (worst[0], worst[1], float(step))
    return best

def interval_attainment_bound(
    arrival_ms: Sequence[float],
    prompt_tokens: Sequence[int],
    output_tokens: Sequence[int],
    model: EngineTimeModel | TimeModel,
    ttft_ms: float,
    tpot_ms: float,
    replicas: int,
    start_ms: float,
    end_ms: float,
    max_num_batched_tokens: int = 8192,
    cached_tokens: Sequence[float] | None = None,
    grid_ms: float = 1000.0,
    max_span_ms: float = 120_000.0,
    steps_ms: Sequence[float] | None = None,
    served_by: str = "requests",
) -> tuple[float, float]:
    """Upper bound on the SLO attainment any schedule reaches on this stream, from disjoint spans (burst-aware).

    Relaxations as in :func:`windowed_attainment_bound`: the N replicas pooled into one machine doing
    ``rate = N * (1 - m*a/T)`` GPU-ms of work per ms at steps of one length T (the largest value over T of
    ``steps_ms``, by default 10 cells covering all of (m*a, tpot_ms], :func:`_step_cells`); request i's least
    work at T split into ``prefill_i`` and ``decodes_i`` (:func:`request_work_parts_ms`, prefix caching through ``cached_tokens``).

    Derivation. A request i arriving at t_i that meets its SLO has its prefill done within
    ``[t_i, t_i + ttft]`` and all its decodes within ``[t_i, t_i + ttft + (O_i - 1) * tpot]`` (TPOT is the mean
    gap, loadgen/stats.py, so the last token is due by then). Take a span [s, e] and the requests R(s, e) with
    ``s <= t_i`` and ``t_i + ttft <= e``: each of them that meets its SLO does, inside the span, at least
    ``c_i(e) = prefill_i + [t_i + ttft + (O_i - 1) tpot <= e] * decodes_i``, and the machine does at most
    ``rate * (e - s)`` in the span. The most of R(s, e) that can meet their SLO are the cheapest ones
    (smallest-first maximises a count under one sum), so at least ``miss(s, e)`` of them miss: the fewest
    costliest that must be dropped for the rest to fit (a request with ``c_i = inf``, one whose prompt
    cannot be prefilled within the TTFT at T, always misses). For spans that are pairwise disjoint (they may
    share an end point) the sets R are disjoint, since each member's prefill window has length ttft > 0 and
    lies inside its span; so the forced misses of a family of disjoint spans add up, and
    ``1 - max over families of sum miss / n`` bounds the attainment over the n requests arriving in
    [start, end) (the only ones counted; the others are left out, which only loosens it), within the
    constant-step model, for the best T.

    The family is found by a dynamic programme over span end points on the grid ``g_j = start + j * grid_ms``,
    j = 0..J with g_J the first point >= end + max_span (no span that holds a counted request ends later),
    spans of ``L`` grid steps with ``ttft <= L * grid_ms <= max_span_ms``:
    ``best[j] = max(best[j-1], max_L best[j-L] + miss(g_{j-L}, g_j))``, best[0] = 0, the bound
    ``1 - best[J] / n``. Every grid and max span gives a valid bound; a finer grid (one that holds the
    coarser one's points) or a longer max span only tightens it. One pass costs about
    ``J * (requests in a max span) * log`` operations per T (one sort per end point); a first pass on every
    4th grid point (a subfamily of the spans, so a bound at least as high) skips each T that cannot beat the
    best T found, without changing the result. At 16 replicas, ~60k counted requests, 1 s grid and 120 s
    spans it takes a few seconds.

    **Per token** (``served_by="tokens"``, the per-token floor: the share of the counted requests' prompt +
    output tokens that belong to requests meeting their SLO). In one span the most tokens its requests that
    meet their SLO can hold is at most the fractional knapsack's optimum (value = tokens, weight = ``c_i(e)``,
    budget ``rate * (e - s)``; greedy by tokens per ms of work, a fraction of the last one), so at least
    ``tokens(R(s, e)) - that`` of the span's tokens miss; disjoint spans add up as above, and
    ``1 - max over families of the missed tokens / tokens of the n requests`` bounds the token attainment.

    Args:
        arrival_ms, prompt_tokens, output_tokens: the stream, shape (n_all,) each (ms; tokens >= 1).
        model, ttft_ms, tpot_ms, replicas, max_num_batched_tokens: as in :func:`steady_state_bound`.
        start_ms, end_ms: the counted window (ms), start < end.
        cached_tokens: h_i of the module docstring, shape (n_all,); None = no prefix caching.
        grid_ms: the grid step of span end points (ms), > 0.
        max_span_ms: the longest span (ms), >= ttft_ms.
        steps_ms: step lengths T to try (ms), each its own cell; None = cells covering (m*a, tpot_ms]
            (:func:`_step_cells`).
        served_by: ``requests`` (attainment over requests, default) or ``tokens`` (over prompt + output
            tokens).

    Returns:
        (attainment bound in [0, 1], a T (ms) that gave it; by default the upper end of its cell).

    Raises:
        ValueError: on no request in [start, end), start >= end, grid_ms <= 0, max_span_ms < ttft_ms, ttft_ms
            <= 0, tpot_ms <= m*a with no ``steps_ms``, or ``served_by`` neither ``requests`` nor ``tokens``.
    """
    sp = _spans(arrival_ms, prompt_tokens, output_tokens, cached_tokens, start_ms, end_ms, ttft_ms, tpot_ms, grid_ms,
                max_span_ms, served_by)  # fmt: skip
    a, cells = _step_cells(model, tpot_ms, steps_ms, 11)
    # Every cell of T first on the grid's every 4th point (a subfamily of the spans: its bound is >= the fine one),
    # then the fine programme in order of that, skipping each cell whose coarse bound cannot beat the best fine one.
    coarse = sp.lengths[sp.lengths % _COARSE == 0] // _COARSE
    tried = []
    for low, step in cells:
        pre, dec = request_work_parts_ms(sp.p, sp.o, model, low, ttft_ms, max_num_batched_tokens, sp.h)
        rate = replicas * (1.0 - a / step)
        missed = _most_forced_misses(sp.t, pre, dec, sp.due, rate, ttft_ms, sp.grid[::_COARSE], coarse, sp.weight)
        tried.append((1.0 - missed / sp.total, step, pre, dec, rate))
    best = (0.0, cells[-1][1] if cells else float(tpot_ms))
    for upper, step, pre, dec, rate in sorted(tried, key=lambda x: -x[0]):
        if upper <= best[0]:
            break
        missed = _most_forced_misses(sp.t, pre, dec, sp.due, rate, ttft_ms, sp.grid, sp.lengths, sp.weight)
        att = 1.0 - missed / sp.total
        if att > best[0]:
            best = (att, step)
    return best


def pooled_interval_attainment_bound(
    arrival_ms: Sequence[float],
    prompt_tokens: Sequence[int],
    output_tokens: Sequence[int],
    kinds: Sequence[tuple[EngineTimeModel | TimeModel, int, int]],
    ttft_ms: float,
    tpot_ms: float,
    start_ms: float,
    end_ms: float,
    cached_tokens: Sequence[float] | None = None,
    grid_ms: float = 1000.0,
    max_span_ms: float = 120_000.0,
    served_by: str = "requests",
    exchange: Sequence[float] | None = None,
) -> tuple[float, tuple[float, ...]]:
    """:func:`interval_attainment_bound` for a fleet of several GPU kinds (burst-aware, per request or per token).

    Kind k has ``n_k`` replicas; request i costs ``pre_ik`` and ``pre_ik + dec_ik`` on it (the least over
    k's step lengths T in ``(m*a_k, tpot_ms]`` of :func:`request_work_parts_ms`, taken just above ``m*a_k``
    since it only falls with T: a lower bound of its work at any T, and each kind may run its own T), and
    the kind does at most ``r_k = n_k * (1 - m*a_k / tpot_ms)`` GPU-ms of work per ms (its largest over
    T <= tpot).

    Derivation. In a span [s, e] let ``x_ik`` be the share of request i's work done on kind k (``sum_k x_ik
    <= 1``; 1 for a request that meets its SLO). Each kind's work fits: ``sum_i x_ik c_ik <= r_k (e - s)``.
    For any exchange rates ``sigma_k > 0``, summing those with weights ``sigma_k`` and using ``sigma_k c_ik >=
    c_i = min_k sigma_k c_ik`` gives ``sum_i (sum_k x_ik) c_i <= (sum_k sigma_k r_k) (e - s)``: the requests
    that meet their SLO fit one machine of rate ``sum_k sigma_k r_k`` at costs ``c_i``, which is the
    one-kind problem of :func:`interval_attainment_bound` (the same disjoint-span programme, per request or
    per token). So the bound holds for every sigma; it is tight when one sigma fits every request's ratio of
    costs across kinds. Default: ``sigma_0 = 1`` and ``sigma_k`` the median over requests of
    ``(pre_i0 + dec_i0) / (pre_ik + dec_ik)`` (kind 0's ms per ms of kind k).

    Args:
        arrival_ms, prompt_tokens, output_tokens, cached_tokens, start_ms, end_ms, grid_ms, max_span_ms,
            served_by: as in :func:`interval_attainment_bound`.
        kinds: (engine model, replicas >= 1, max_num_batched_tokens) per GPU kind, at least one.
        ttft_ms, tpot_ms: the SLO (ms).
        exchange: sigma per kind, each > 0; None = the default above.

    Returns:
        (attainment bound in [0, 1], the sigmas used).

    Raises:
        ValueError: as :func:`interval_attainment_bound`, on no kind, a kind with fewer than 1 replica,
            ``tpot_ms`` at or below a kind's fixed cost, or ``exchange`` of another length, not positive or
            not finite.
    """
    if not kinds or any(n < 1 for _, n, _ in kinds):
        raise ValueError("need at least one kind, each with at least one replica")
    if exchange is not None and (len(exchange) != len(kinds) or any(not 0 < x < math.inf for x in exchange)):
        raise ValueError("exchange needs one positive, finite rate per kind")
    sp = _spans(arrival_ms, prompt_tokens, output_tokens, cached_tokens, start_ms, end_ms, ttft_ms, tpot_ms, grid_ms,
                max_span_ms, served_by)  # fmt: skip
    parts = []
    rates = []
    for model, replicas, tokens in kinds:
        a, _ = _step_grid(model, tpot_ms, None, 2)  # raises when tpot_ms <= a
        # the least work over every T in (a, tpot]: at T just above a (it only falls with T, _step_cells)
        pk, dk = request_work_parts_ms(sp.p, sp.o, model, a * (1.0 + 1e-9), ttft_ms, tokens, sp.h)
        parts.append((pk, pk + dk))
        rates.append(replicas * (1.0 - a / tpot_ms))
    if exchange is None:
        sig = [1.0]
        for _, tot in parts[1:]:
            ok = np.isfinite(parts[0][1]) & np.isfinite(tot) & (tot > 0)
            sig.append(float(np.median(parts[0][1][ok] / tot[ok])) if ok.any() else 1.0)
    else:
        sig = [float(x) for x in exchange]
    pre = np.min([x * pk for x, (pk, _) in zip(sig, parts)], axis=0)
    tot = np.min([x * tk for x, (_, tk) in zip(sig, parts)], axis=0)
    fin = np.isfinite(pre)
    dec = np.zeros_like(pre)
    dec[fin] = tot[fin] - pre[fin]  # tot >= pre: each kind's total holds its prefill
    rate = float(sum(x * r for x, r in zip(sig, rates)))
    missed = _most_forced_misses(sp.t, pre, dec, sp.due, rate, ttft_ms, sp.grid, sp.lengths, sp.weight)
    return 1.0 - missed / sp.total, tuple(sig)


@dataclass(frozen=True, slots=True)
class _SpanInputs:
    """What the disjoint-span programme needs of a stream (:func:`_spans`).

    Attributes:
        t, p, o, h: the counted requests' arrivals (ms), prompt and output tokens, cached prefix tokens (or
            None), sorted by arrival, shape (n,).
        weight: each request's prompt + output tokens for the per-token floor, None for the per-request one.
        total: what attainment divides by: the tokens of the n requests, or n.
        grid: span end points (ms); lengths: span lengths in grid steps; due: each request's last-token
            deadline (ms).
    """

    t: np.ndarray
    p: np.ndarray
    o: np.ndarray
    h: np.ndarray | None
    weight: np.ndarray | None
    total: float
    grid: np.ndarray
    lengths: np.ndarray
    due: np.ndarray


def _spans(
    arrival_ms: Sequence[float], prompt_tokens: Sequence[int], output_tokens: Sequence[int],
    cached_tokens: Sequence[float] | None, start_ms: float, end_ms: float, ttft_ms: float, tpot_ms: float,
    grid_ms: float, max_span_ms: float, served_by: str,
) -> _SpanInputs:
    """The counted requests sorted by arrival, the span grid and lengths of :func:`interval_attainment_bound`.

    Raises:
        ValueError: as :func:`interval_attainment_bound` (the arguments other than the model's).
    """
    if not grid_ms > 0 or not ttft_ms > 0 or not max_span_ms >= ttft_ms:
        raise ValueError(f"need grid_ms > 0 and max_span_ms >= ttft_ms > 0, got {grid_ms}, {max_span_ms}, {ttft_ms}")
    if served_by not in ("requests", "tokens"):
        raise ValueError(f"served_by must be 'requests' or 'tokens', got {served_by!r}")
    t, p, o, h = _counted(arrival_ms, prompt_tokens, output_tokens, cached_tokens, start_ms, end_ms)
    order = np.argsort(t, kind="stable")
    t, p, o = t[order], p[order], o[order]
    h = None if h is None else h[order]
    weight = (p + o) if served_by == "tokens" else None  # the per-token floor counts prompt + output tokens
    grid = start_ms + grid_ms * np.arange(int(math.ceil((end_ms + max_span_ms - start_ms) / grid_ms - 1e-9)) + 1)
    lengths = np.arange(int(math.ceil(ttft_ms / grid_ms - 1e-9)), int(math.floor(max_span_ms / grid_ms + 1e-9)) + 1)
    return _SpanInputs(t, p, o, h, weight, float(weight.sum()) if weight is not None else float(t.size), grid,
                       lengths, t + ttft_ms + (o - 1) * tpot_ms)  # fmt: skip


def _most_forced_misses(
    t: np.ndarray, pre: np.ndarray, dec: np.ndarray, due: np.ndarray, rate: float, ttft_ms: float,
    grid: np.ndarray, lengths: np.ndarray, weight: np.ndarray | None = None,
) -> float:
    """The dynamic programme of :func:`interval_attainment_bound`: ``best[J]``, the most forced misses of a
    family of disjoint spans on ``grid`` with lengths ``lengths`` (grid steps, ascending, each >= 1).

    ``t``, ``pre``, ``dec``, ``due``: arrival, prefill work, decode work, last-token deadline of each counted
    request, shape (n,), sorted by arrival (ms); ``rate``: GPU-ms of work per ms. ``weight``: None counts
    requests (an integer count); else each request's tokens, shape (n,), > 0, and the misses are the tokens
    the fractional knapsack leaves out (:func:`_span_missed_weight`).

    A request's cost in a span is one of two values (``pre`` or ``pre + dec``), so the 2n (request, value)
    pairs are ranked once (by cost, or by tokens per ms of cost for ``weight``), and each end point sorts
    its pairs' integer ranks instead of their keys.
    """
    n = t.size
    value = np.r_[pre, pre + dec]  # pair i: request i without its decodes; pair n + i: with them
    if weight is None:
        key = np.where(np.isfinite(value), value, -1.0)  # costliest first, inf last
    else:
        wts = np.r_[weight, weight]
        # least dense first; inf pairs are never taken
        key = np.where(np.isfinite(value), -wts / np.maximum(value, 1e-300), -np.inf)
    ranked = np.argsort(-key, kind="stable")
    rank = np.empty(2 * n, dtype=np.int64)
    rank[ranked] = np.arange(2 * n)
    best = np.zeros(grid.size, dtype=np.int64 if weight is None else float)
    first_at = np.searchsorted(t, grid, side="left")  # the first request arriving at or after each grid point
    last_before = np.searchsorted(t, grid - ttft_ms, side="right")  # one past the last with t + ttft <= point
    for j in range(1, grid.size):
        best[j] = best[j - 1]
        ls = lengths[lengths <= j]
        hi = int(last_before[j])
        if ls.size == 0 or hi <= first_at[j - ls[-1]]:
            continue
        starts = j - ls
        lo = np.minimum(first_at[starts], hi)  # nonincreasing in L: the span's requests are [lo_L, hi)
        base = int(lo[-1])
        pair = np.arange(base, hi) + n * (due[base:hi] <= grid[j])
        cost = value[pair]
        desc = ranked[np.sort(rank[pair[np.isfinite(cost)]])]  # this end point's finite pairs, in key order
        cap = rate * (grid[j] - grid[starts])
        at = np.where(desc >= n, desc - n, desc) - base  # each pair's position in this end point's requests
        if weight is None:
            miss = _span_misses(cost, at, lo - base, cap)
            best[j] = max(int(best[j]), int((best[starts] + miss).max()))
        else:  # ranked least dense first: the knapsack takes the densest first
            missed = _span_missed_weight(cost, weight[base:hi], at[::-1], lo - base, cap)
            best[j] = max(float(best[j]), float((best[starts] + missed).max()))
    return float(best[-1])


def _span_misses(cost: np.ndarray, desc: np.ndarray, lo: np.ndarray, cap: np.ndarray) -> np.ndarray:
    """``miss`` of :func:`interval_attainment_bound` for nested sets at once: for each k, the fewest of the
    costs ``cost[lo[k]:]`` to drop (the costliest first; every ``inf`` one) for the rest to sum to at most
    ``cap[k]``.

    Args:
        cost: shape (m,), each >= 0 or inf (ms).
        desc: the indices of the finite costs, costliest first, shape (number finite,).
        lo: shape (K,), nonincreasing, each in [0, m], ``lo[-1] = 0`` (the last set is all of ``cost``).
        cap: shape (K,), the work budget of each set (ms), >= 0.

    Returns:
        shape (K,) int64.

    The sum test allows a relative rounding slack of 1e-9 (in the direction of fewer misses: a looser bound).
    """
    nk = lo.size
    # Level of each position: the first k whose set holds it (lo is nonincreasing: every later k holds it too).
    level = np.repeat(np.arange(nk - 1, -1, -1), (np.r_[cost.size, lo[:-1]] - lo)[::-1])
    miss = np.bincount(level[~np.isfinite(cost)], minlength=nk).cumsum()
    c, lev = cost[desc], level[desc]
    # Work of the costliest ranks in blocks of B: block[b, k] = work of ranks B b .. B (b + 1) - 1 in set k.
    nb = (c.size + _B - 1) // _B
    cell = (np.arange(c.size) // _B) * nk + lev
    block = np.bincount(cell, weights=c, minlength=nb * nk).reshape(nb, nk).cumsum(axis=1)
    total = block.sum(axis=0)
    need = total - cap - 1e-9 * (total + cap)  # drop at least this much finite work
    over = np.flatnonzero(need > 0)
    if over.size == 0:
        return miss
    k, nd, col = over, need[over], np.arange(over.size)
    top = block[:, k].cumsum(axis=0)  # top[b, i]: work of ranks < B (b + 1) in set k[i]
    cnt = np.bincount(cell, minlength=nb * nk).reshape(nb, nk).cumsum(axis=1)[:, k].cumsum(axis=0)
    blk = (top >= nd).argmax(axis=0)  # the block in which the dropped work first reaches need (top[-1] = total)
    prev_sum = np.where(blk > 0, top[np.maximum(blk - 1, 0), col], 0.0)
    prev_cnt = np.where(blk > 0, cnt[np.maximum(blk - 1, 0), col], 0)
    ranks = np.minimum(blk[:, None] * _B + np.arange(_B), c.size - 1)
    member = (blk[:, None] * _B + np.arange(_B) < c.size) & (lev[ranks] <= k[:, None])
    run = prev_sum[:, None] + np.cumsum(np.where(member, c[ranks], 0.0), axis=1)
    reach = (run >= nd[:, None]) & member
    last = np.where(reach.any(axis=1), reach.argmax(axis=1), _B - 1)  # rounding: the block's last member
    miss[k] += prev_cnt + (member & (np.arange(_B) <= last[:, None])).sum(axis=1)
    return miss


def _span_missed_weight(cost: np.ndarray, weight: np.ndarray, dense: np.ndarray, lo: np.ndarray,
                        cap: np.ndarray) -> np.ndarray:
    """Per-token ``miss`` of :func:`interval_attainment_bound` for nested sets at once: for each k, the weight
    of the items ``lo[k]:`` that the fractional knapsack with budget ``cap[k]`` leaves out (items taken densest
    first by ``weight / cost``, a fraction of the first that does not fit; every ``inf`` one left out).

    Args:
        cost: shape (m,), each >= 0 or inf (ms).
        weight: shape (m,), > 0 (tokens).
        dense: the indices of the finite costs, densest first, shape (number finite,).
        lo: shape (K,), nonincreasing, each in [0, m], ``lo[-1] = 0``.
        cap: shape (K,), the work budget of each set (ms), >= 0.

    Returns:
        shape (K,) float. The fit test allows a relative rounding slack of 1e-9 (towards less missed weight).
    """
    nk = lo.size
    level = np.repeat(np.arange(nk - 1, -1, -1), (np.r_[cost.size, lo[:-1]] - lo)[::-1])
    total = np.bincount(level, weights=weight, minlength=nk).cumsum()  # set k: every item of level <= k
    if dense.size == 0:
        return total
    c, w, lev = cost[dense], weight[dense], level[dense]
    member = lev[None, :] <= np.arange(nk)[:, None]  # (K, m'): item in set k
    cc = np.cumsum(np.where(member, c, 0.0), axis=1)
    ww = np.cumsum(np.where(member, w, 0.0), axis=1)
    room = cap * (1.0 + 1e-9)
    fit = (cc <= room[:, None]).sum(axis=1)  # cc is nondecreasing: the members taken whole come first
    rows = np.arange(nk)
    taken = np.where(fit > 0, ww[rows, np.maximum(fit - 1, 0)], 0.0)
    part = np.minimum(fit, c.size - 1)  # the first member that does not fit whole (a member: cc rose there)
    left = room - np.where(fit > 0, cc[rows, np.maximum(fit - 1, 0)], 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):  # a member that does not fit whole costs > 0
        frac = np.where(fit < c.size, np.clip(left / c[part], 0.0, 1.0) * member[rows, part], 0.0)
    return total - taken - frac * w[part]


_B = 64  # block of cost ranks in _span_misses
_COARSE = 4  # interval_attainment_bound's first pass: every 4th grid point


def _counted(
    arrival_ms: Sequence[float], prompt_tokens: Sequence[int], output_tokens: Sequence[int],
    cached_tokens: Sequence[float] | None, start_ms: float, end_ms: float,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """The requests arriving in [start, end) of a stream as float arrays (arrival ms, prompt and output
    tokens, each at least 1, cached prefix tokens at most P - 1 or None), in the stream's order.

    Raises:
        ValueError: on start >= end or no request in [start, end).
    """
    t = np.asarray(arrival_ms, dtype=float)
    p = np.maximum(1, np.asarray(prompt_tokens, dtype=float))
    o = np.maximum(1, np.asarray(output_tokens, dtype=float))
    if not start_ms < end_ms:
        raise ValueError("start_ms must be < end_ms")
    sel = (t >= start_ms) & (t < end_ms)
    if not sel.any():
        raise ValueError("no request arrives in [start_ms, end_ms)")
    t, p, o = t[sel], p[sel], o[sel]
    h = None if cached_tokens is None else np.minimum(np.asarray(cached_tokens, dtype=float)[sel], p - 1)
    return t, p, o, h


def _step_grid(model: EngineTimeModel | TimeModel, tpot_ms: float, steps_ms: Sequence[float] | None, points: int) -> tuple[float, np.ndarray]:
    """(mean fixed cost a of a step, the step lengths T tried, ms): ``steps_ms`` when given, else
    ``points - 1`` even steps in (a, tpot_ms].

    Raises:
        ValueError: without ``steps_ms`` when ``tpot_ms <= a``.
    """
    wm = WorkModel.of(model)
    a = wm.mean_factor * wm.a
    if steps_ms is not None:
        return a, np.asarray(steps_ms, dtype=float)
    if tpot_ms <= a:
        raise ValueError(f"tpot_ms {tpot_ms} is not above the step's fixed cost {a:.3f} ms")
    return a, np.linspace(a, tpot_ms, points)[1:]


def _step_cells(model: EngineTimeModel | TimeModel, tpot_ms: float, steps_ms: Sequence[float] | None,
                points: int) -> tuple[float, list[tuple[float, float]]]:  # fmt: skip
    """(mean fixed cost a of a step, cells of step lengths as (T for the costs, T for the rate), ms).

    A request's least work only falls as T falls (a shorter step allows more chunks within the TTFT; the
    decodes do not depend on T) and the work per ms ``1 - a/T`` only rises with T, so for every T in a cell
    ``(T_lo, T_hi]`` the costs at ``T_lo`` and the rate at ``T_hi`` give a bound at least as high as T's own.
    Without ``steps_ms`` the cells cover all of ``(a, tpot_ms]`` (``points - 1`` even cells, the first one's
    costs at ``a * (1 + 1e-9)``), so the largest bound over the cells holds whatever constant step length a
    schedule runs. With ``steps_ms`` each T is its own cell ``(T, T)``: a bound for schedules whose step
    length is one of them (the hand-worked tests' setting).

    Raises:
        ValueError: without ``steps_ms`` when ``tpot_ms <= a``.
    """
    a, steps = _step_grid(model, tpot_ms, steps_ms, points)
    if steps_ms is not None:
        return a, [(float(t), float(t)) for t in steps if t > a]
    lows = np.r_[a * (1.0 + 1e-9), steps[:-1]]
    return a, [(float(lo), float(hi)) for lo, hi in zip(lows, steps)]


def self_consistent_rate(bound_at: Callable[[float], float], start: float, stop: float, factor: float = 1.02,
                         offered_at: Callable[[float], float] | None = None) -> tuple[float, int]:
    """An upper bound on a capacity whose stream depends on the rate: the first rate of a geometric grid
    above every grid rate whose own stream's bound admits its stream.

    Why: a bench-fleet stream at rate label λ is built from the trace windows that λ covers
    (``loadgen/fleet/bench.py`` ``build_arrivals``), so which requests share prefixes, and with them the
    steady-state bound of that stream (:func:`steady_state_bound` with :func:`shared_prefix_tokens` on
    its arrivals), depends on λ. A policy that meets the floor at λ served that stream, whose offered rate
    R(λ) (its counted requests over the counted window) is then at most the stream's bound: λ *passes*
    when ``bound_at(λ) >= offered_at(λ)``. This scans ``λ_k = start * factor**k`` for ``λ_k <= stop``
    (every point, so a bound that is not monotone in λ is not skipped over) and returns the grid rate just
    above the last one that passes (``start`` when none passes): every grid rate from there up to
    ``stop`` fails, so a capacity above it would have to sit between grid points where the grid sees the
    streams fail. The resolution is ``factor`` (2 % by default); a capacity interpolated between two
    measured rates (bench-fleet's) is bounded to the same approximation.

    Args:
        bound_at: rate label (req/s) -> the bound (req/s) of the stream offered at that label.
        start: first grid rate (req/s, > 0).
        stop: last grid rate at most (req/s, >= start); the caller's trace-wide bound is the natural
            choice, but it must lie above the crossing: a pass at the last grid rate raises.
        factor: grid ratio (> 1).
        offered_at: rate label -> the stream's offered rate (req/s); None = the label itself.

    Returns:
        (the upper bound on the rate label, req/s; the number of grid rates evaluated).

    Raises:
        ValueError: on ``start <= 0``, ``stop < start`` or ``factor <= 1``, and when the last grid rate
            passes (the grid stops below the crossing).

    Example: ``bound_at(λ) = 10 + λ / 2`` (fixed point 20), start 16, factor 1.25, stop 40: the grid is
    16, 20, 25, 31.25, 39.0625 and the bound there 18, 20, 22.5, 25.625, 29.53: 16 and 20 pass, 25 does
    not -> (25, 5).
    """
    return grid_crossing(lambda r: bound_at(r) >= (r if offered_at is None else offered_at(r)), start, stop, factor)


def grid_crossing(passes_at: Callable[[float], bool], start: float, stop: float,
                  factor: float = 1.02) -> tuple[float, int]:  # fmt: skip
    """The first rate of the grid ``start * factor**k <= stop`` above every grid rate where ``passes_at`` holds
    (``start`` when none does), and the number of grid rates evaluated (every one: a test that is not monotone
    in the rate is not skipped over). :func:`self_consistent_rate` with its test given directly.

    Raises:
        ValueError: on ``start <= 0``, ``stop < start`` or ``factor <= 1``, and when the last grid rate passes.
    """
    if not start > 0.0 or not stop >= start or not factor > 1.0:
        raise ValueError(f"need 0 < start <= stop and factor > 1, got {start}, {stop}, {factor}")
    grid = []
    rate = start
    while rate <= stop * (1.0 + 1e-12):
        grid.append(rate)
        rate *= factor
    passes = [passes_at(r) for r in grid]
    if passes[-1]:
        raise ValueError(f"the test passes at the last grid rate {grid[-1]:.4g}: raise stop")
    last = max((i for i, ok in enumerate(passes) if ok), default=-1)
    return grid[last + 1], len(grid)


def cheapest_cover(cost: np.ndarray, weight: np.ndarray, q: float) -> tuple[float, float]:
    """Least total cost of a set that holds at least ``q`` of the total weight, relaxed to fractions.

    ``min sum x_i cost_i`` over ``x`` in [0, 1]^n with ``sum x_i weight_i >= q * sum weight``: the linear
    relaxation of the covering problem, solved exactly by taking items in ascending ``cost / weight``
    (the fractional knapsack's greedy rule) and a fraction of the last one. Any integral set with that
    much weight costs at least this, so a capacity computed from it is still an upper bound.

    Args:
        cost: shape (n,), >= 0 (inf = the item cannot be served; the cover is inf if it needs one).
        weight: shape (n,), > 0.
        q: the share of the weight to cover, in (0, 1].

    Returns:
        (least cost, items served): a 2-tuple; the count includes the fraction of the last item.
    """
    total = float(weight.sum())
    need = q * total
    order = np.argsort(cost / weight, kind="stable")
    cum_w = np.cumsum(weight[order])
    j = int(np.searchsorted(cum_w, need * (1.0 - 1e-12)))
    j = min(j, cost.size - 1)
    before_w = float(cum_w[j - 1]) if j > 0 else 0.0
    before_c = float(cost[order[:j]].sum()) if j > 0 else 0.0
    frac = (need - before_w) / float(weight[order[j]])
    frac = min(1.0, max(0.0, frac))
    last = float(cost[order[j]])
    return (before_c + (frac * last if frac > 0.0 else 0.0)), j + frac


def steady_state_bound(
    prompt_tokens: Sequence[int],
    output_tokens: Sequence[int],
    model: EngineTimeModel | TimeModel,
    ttft_ms: float,
    tpot_ms: float,
    replicas: int,
    kv_capacity_tokens: int,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 8192,
    served_frac: float = 0.9,
    steps_ms: Sequence[float] | None = None,
    cached_tokens: Sequence[float] | None = None,
    served_by: str = "requests",
) -> SteadyBound:
    """The steady-state bound of the module docstring (offered requests/s of the fleet).

    With ``served_by="tokens"`` the yardstick is the per-token floor (at least q of the offered prompt +
    output tokens belong to requests that meet their SLO): the served set is then the cheapest cover of
    q of the tokens (:func:`cheapest_cover`, its linear relaxation, so the figure stays an upper
    bound), for each resource on its own as the request floor takes each resource's cheapest q-fraction.

    Args:
        prompt_tokens, output_tokens: the trace's requests, shape (n,), n >= 1 (values < 1 are taken as 1).
        model: the engine's step-time model, or the policy's TimeModel for ``--engine-time-model policy``.
        ttft_ms, tpot_ms: the SLO (ms).
        replicas: fleet size N.
        kv_capacity_tokens, max_num_seqs, max_num_batched_tokens: engine limits per replica.
        served_frac: q in (0, 1], the attainment that defines capacity.
        steps_ms: step lengths T to try (ms), each its own cell; default 400 cells covering (m*a, tpot_ms]
            (:func:`_step_cells`).
        cached_tokens: h_i of the module docstring ("Prefix caching"; :func:`shared_prefix_tokens`), shape
            (n,); None = no prefix caching.
        served_by: ``requests`` (the per-request floor, default) or ``tokens`` (the per-token floor).

    Raises:
        ValueError: on an empty trace, q outside (0, 1], tpot_ms <= m*a with no ``steps_ms``, or
            ``served_by`` neither ``requests`` nor ``tokens``.
    """
    p = np.maximum(1, np.asarray(prompt_tokens, dtype=float))
    o = np.maximum(1, np.asarray(output_tokens, dtype=float))
    n = p.size
    if n == 0:
        raise ValueError("steady_state_bound needs at least one request")
    if not 0.0 < served_frac <= 1.0:
        raise ValueError(f"served_frac must be in (0, 1], got {served_frac}")
    if served_by not in ("requests", "tokens"):
        raise ValueError(f"served_by must be 'requests' or 'tokens', got {served_by!r}")
    a, cells = _step_cells(model, tpot_ms, steps_ms, 401)
    h = np.zeros_like(p) if cached_tokens is None else np.minimum(np.asarray(cached_tokens, dtype=float), p - 1)
    u = p - h
    k = math.ceil(served_frac * n - 1e-9)
    tokens = p + o  # what token goodput counts: prompt + output

    def least(cost: np.ndarray) -> tuple[float, float]:
        """(least total cost of a served set, its size) under the floor ``served_by``."""
        if served_by == "tokens":
            return cheapest_cover(cost, tokens, served_frac)
        return float(np.sort(cost)[:k].sum()), float(k)

    kv_sum = least(o * u + o * (o - 1) / 2)[0] / n
    o_sum = least(o)[0] / n
    po_sum = least(u + o)[0] / n
    best = SteadyBound(0.0, 0.0, cells[-1][1] if cells else float(tpot_ms), "time", served_frac, math.inf, 0,
                       served_by)  # fmt: skip
    # each cell (lo, t] of step lengths (_step_cells): the work at lo, the time per ms at t, and the KV, sequence
    # and token limits (which fall with T) at lo: at least every T in the cell's own figure
    for lo, t in cells:
        w = request_work_ms(p, o, model, lo, ttft_ms, max_num_batched_tokens, h)
        work, served = least(w)
        infeasible = int(np.isinf(w).sum())
        if not math.isfinite(work):
            continue
        limits = {
            "time": 1000.0 * (1.0 - a / t) / (work / n),
            "kv": 1000.0 * kv_capacity_tokens / (kv_sum * lo),
            "seqs": 1000.0 * max_num_seqs / (o_sum * lo),
            "tokens": 1000.0 * max_num_batched_tokens / (po_sum * lo),
        }
        name = min(limits, key=limits.__getitem__)
        if limits[name] > best.per_replica_rps:
            best = SteadyBound(limits[name] * replicas, limits[name], float(t), name, served_frac,
                               work / served, infeasible, served_by)  # fmt: skip
    return best
