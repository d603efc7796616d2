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

**The other resources** (as in the analytic bound, each with its own cheapest q-fraction, which can only
relax it): KV by Little's law ``λ * (1/n) * sum_q K_i * T / 1000 <= kv_capacity`` with
``K_i = sum_{j=0}^{O-1} (P + j)``; sequences ``λ * (1/n) * sum_q O_i * T / 1000 <= max_num_seqs``; tokens per
step ``λ * (1/n) * sum_q (P_i + O_i) * T / 1000 <= M``.

Bound = replicas * max over T of the smallest of the four per-replica limits. It ignores burstiness and
queueing (both only lower capacity) and the finite benchmark window; within the constant-step-length
model it is an upper bound on the capacity at attainment q.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
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
        served_frac: q, the fraction of requests that must meet the SLO.
        mean_work_ms: mean W_i(T) over the served (cheapest) ``ceil(q n)`` requests (ms).
        infeasible: requests that cannot meet their TTFT at T (no allowed chunk count).
    """

    rps: float
    per_replica_rps: float
    iteration_ms: float
    limit: str
    served_frac: float
    mean_work_ms: float
    infeasible: int


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
        (``--engine-time-model policy``: ``e`` over prefill chunks only, ``d_ms_per_decode`` per decode where
        the TimeModel has one; no noise)."""
        if isinstance(model, EngineTimeModel):
            return cls(model.a_ms, model.b_ms, model.c_ms, model.d_ms, model.e_ms, model.f_ms, model.e_ms, 0.0,
                       math.exp(model.noise_sigma**2 / 2.0))  # fmt: skip
        return cls(model.a_ms, model.b_ms_per_new_token, model.c_ms_per_context_token, 0.0,
                   model.e_ms_per_chunk_prefix, 0.0, 0.0, float(getattr(model, "d_ms_per_decode", 0.0)))  # fmt: skip


def request_work_ms(
    prompt_tokens: np.ndarray, output_tokens: np.ndarray, model: EngineTimeModel | TimeModel, step_ms: float, ttft_ms: float,
    max_num_batched_tokens: int,
) -> np.ndarray:
    """``W_i(T)`` of the module docstring for every request (ms; ``inf`` where no chunk count meets the TTFT).

    Args:
        prompt_tokens, output_tokens: shape (n,), each >= 1.
        model: the engine's step-time model, or the policy's TimeModel (:meth:`WorkModel.of`).
        step_ms: step length T (ms), > 0.
        ttft_ms: TTFT target (ms).
        max_num_batched_tokens: tokens per step at most (M).

    Raises:
        ValueError: on step_ms <= 0 or a token count < 1.
    """
    p = np.asarray(prompt_tokens, dtype=float)
    o = np.asarray(output_tokens, dtype=float)
    if step_ms <= 0:
        raise ValueError(f"step_ms must be > 0, got {step_ms}")
    if p.size and (p.min() < 1 or o.min() < 1):
        raise ValueError("prompt and output tokens must be >= 1")
    w = WorkModel.of(model)
    b, c, d, e, f = w.b, w.c, w.d, w.e, w.f
    dec = (o - 1) * (b + d + f + w.d_dec) + (c + w.e_dec) * ((o - 1) * p + (o - 1) * (o - 2) / 2)
    k_lo = np.ceil(p / max_num_batched_tokens)
    k_hi = np.minimum(p, math.floor(ttft_ms / step_ms + 1e-9))
    g = f - e / 2.0

    def prefill(k: np.ndarray) -> np.ndarray:
        s = p * p / k if g >= 0 else (p - k + 1) ** 2 + k - 1
        return b * p + c * k * (k - 1) / 2 + d * k + e * p * p / 2 + g * s

    # prefill(K) - const = c K(K-1)/2 + d K + g P^2 / K is convex in K for g >= 0: its integer minimum over
    # [k_lo, k_hi] is at an end or at floor/ceil of the stationary point c (2K - 1)/2 + d = g P^2 / K^2
    # (Newton from below: the left side is concave and increasing in K, so the iterates rise to the root).
    # For g < 0 every term grows with K (S's upper bound shrinks), so the minimum is at k_lo.
    cands = [k_lo, k_hi]
    if g > 0 and (c > 0 or d > 0):
        k = np.ones_like(p)
        for _ in range(40):
            k = np.maximum(1.0, k - (c * (2 * k - 1) / 2 + d - g * p * p / (k * k)) / (c + 2 * g * p * p / k**3))
        cands += [np.floor(k), np.ceil(k)]
    best = np.full(p.shape, np.inf)
    for kc in cands:
        kk = np.clip(kc, k_lo, np.maximum(k_lo, k_hi))
        best = np.minimum(best, prefill(np.maximum(kk, 1.0)))
    work = w.mean_factor * (dec + best)
    return np.where(k_hi >= k_lo, work, np.inf)


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
) -> SteadyBound:
    """The steady-state bound of the module docstring (offered requests/s of the fleet).

    Args:
        prompt_tokens, output_tokens: the trace's requests, shape (n,), n >= 1 (values < 1 are taken as 1).
        model: the engine's step-time model, or the policy's TimeModel for ``--engine-time-model policy``.
        ttft_ms, tpot_ms: the SLO (ms).
        replicas: fleet size N.
        kv_capacity_tokens, max_num_seqs, max_num_batched_tokens: engine limits per replica.
        served_frac: q in (0, 1], the attainment that defines capacity.
        steps_ms: step lengths T to try (ms); default 400 points over (m*a, tpot_ms].

    Raises:
        ValueError: on an empty trace, q outside (0, 1], or tpot_ms <= m*a with no ``steps_ms``.
    """
    p = np.maximum(1, np.asarray(prompt_tokens, dtype=float))
    o = np.maximum(1, np.asarray(output_tokens, dtype=float))
    n = p.size
    if n == 0:
        raise ValueError("steady_state_bound needs at least one request")
    if not 0.0 < served_frac <= 1.0:
        raise ValueError(f"served_frac must be in (0, 1], got {served_frac}")
    wm = WorkModel.of(model)
    a = wm.mean_factor * wm.a
    if steps_ms is None:
        if tpot_ms <= a:
            raise ValueError(f"tpot_ms {tpot_ms} is not above the step's fixed cost {a:.3f} ms")
        steps = np.linspace(a, tpot_ms, 401)[1:]
    else:
        steps = np.asarray(steps_ms, dtype=float)
    k = math.ceil(served_frac * n - 1e-9)
    kv_sum = float(np.sort(o * p + o * (o - 1) / 2)[:k].sum()) / n
    o_sum = float(np.sort(o)[:k].sum()) / n
    po_sum = float(np.sort(p + o)[:k].sum()) / n
    best = SteadyBound(0.0, 0.0, float(steps[-1]), "time", served_frac, math.inf, 0)
    for t in steps:
        w = request_work_ms(p, o, model, float(t), ttft_ms, max_num_batched_tokens)
        cheapest = np.sort(w)[:k]
        infeasible = int(np.isinf(w).sum())
        if not np.isfinite(cheapest[-1]) or t <= a:
            continue
        limits = {
            "time": 1000.0 * (1.0 - a / t) / (float(cheapest.sum()) / n),
            "kv": 1000.0 * kv_capacity_tokens / (kv_sum * t),
            "seqs": 1000.0 * max_num_seqs / (o_sum * t),
            "tokens": 1000.0 * max_num_batched_tokens / (po_sum * t),
        }
        name = min(limits, key=limits.__getitem__)
        if limits[name] > best.per_replica_rps:
            best = SteadyBound(limits[name] * replicas, limits[name], float(t), name, served_frac,
                               float(cheapest.mean()), infeasible)  # fmt: skip
    return best
