"""Fleet benchmark (issue 7): PAB routing against today's routers on N simulated replicas.

``python -m loadgen.fleet.bench --replicas 16 --trace azure-conv --profile llama-3-8b-a100
--ttft-ms 1000 --tpot-ms 100 --out fleet.json --plot fleet.png`` (the lead wires it as
``fairbatch-loadgen bench-fleet``).

For every policy of loadgen/fleet/sim.py (:data:`~loadgen.fleet.sim.POLICIES`) and every arrival
rate of the sweep, one fleet simulation (loadgen/fleet/sim.py) of a ``--duration-s`` window;
every request then drains (at most ``--drain-s``; still unfinished = failed). Reported per rate:
SLO attainment (TTFT <= ttft_ms and TPOT <= tpot_ms, loadgen/stats.py; rejected and failed
requests are misses), goodput, TTFT/TPOT p50/p99, rejections by reason, per-tenant attainment,
double-spends, placement decision time, token goodput (``token_goodput_per_s``: prompt + output
tokens/s of the requests that met both TTFT and TPOT), refused share by reason and per-tenant
attainment per request and per token. ``capacity_rps`` (docs/design.md section 2) = highest rate
with per-request attainment >= 0.9, ``capacity_token_floor_rps`` the same with per-token attainment,
each linearly interpolated (``loadgen.bench_policies.capacity``; :func:`summarize`).

Rates: by default each policy's own search (loadgen/fleet/search.py ``bracket_search``, issue 27
item 6) starts at 0.35 x the steady-state bound of the *engine's* step-time model (the model the
simulated engines step at, which no policy sees) and walks until both floors are bracketed, then
bisects each once, so every capacity is measured between two rates rather than "below the sweep".
``--rates`` gives fixed rates instead (a policy's sweep then stops after two rates below the
target); ``--fractions`` the old fixed sweep (fractions of the policy model's analytic bound).

Arrivals: one replica's worth of trace cannot load a fleet, so the stream interleaves K = N
windows of the trace: window w starts at trace time ``w * span / K`` (wrapping past the end) and
is compressed by ``s = rate / (K * native_rps)``; the merged stream has ``rate`` requests/s on
average and keeps the trace's burstiness and length mix. Each request goes to one of 4 tenants
(shares 0.4 / 0.3 / 0.2 / 0.1, seeded), all in one SLO class of weight 1.

Prefix caching: the engines keep vLLM's automatic prefix cache; traces with ``hash_ids``
(mooncake-conv, mooncake-syn) give the prompts' shared prefixes. ``--windows 1`` replays one
stretch of the trace so its conversations stay whole (the prefix-cache study,
docs/bench/prefix-cache.md); rows report ``prefix_cache_hit_rate`` (hit / queried prompt tokens,
all engines) and ``max_load_ratio`` (max / mean replica busy time). Cache-aware policies:
``pab-prefix`` (+fairbatching), ``llm-d-prefix``, ``sglang-cache-aware``, ``vllm-router-cache-aware``
(docs/design.md section 9).

Analytic upper bound (:func:`analytic_bound`): the most requests/s N replicas could serve if
batches were perfectly packed. Request i (prompt P_i, output O_i tokens) needs, beyond per-iteration
fixed costs, ``W_i = b * (P_i + O_i - 1) + c * ((O_i - 1) * P_i + (O_i - 1) * O_i / 2)`` ms: its
prompt once (context 0) and O_i - 1 decode tokens, the j-th reading P_i + j context tokens
(time model of FairBatching, arXiv 2510.14392; docs/design.md section 3: a + b * new + c * context). Let the replica run back-to-back iterations of
length T ms. Every decode must emit a token per TPOT on average, so T <= tpot_ms, and the fixed
cost ``a`` is paid 1000 / T times per second. At λ requests/s per replica:

- time:  λ * mean(W) + a * 1000 / T <= 1000          ->  λ <= 1000 * (1 - a / T) / mean(W)
- KV:    a request holds ~P_i + j tokens during its j-th decode iteration, so by Little's law
         λ * mean(K) * T / 1000 <= kv_capacity, K_i = sum_{j=0}^{O_i-1} (P_i + j)
- seqs:  λ * mean(O) * T / 1000 <= max_num_seqs
- tokens per iteration: λ * mean(P + O) * T / 1000 <= max_num_batched_tokens

The time limit grows with T, the other three shrink with T; bound = N * max over T in
(a, tpot_ms] of the smallest of the four (grid of 2000 points). It ignores arrival burstiness,
TTFT (every prompt is taken to fit one iteration) and the finite window, so it is an upper bound
for work-conserving service of the whole trace; a policy may exceed it slightly when a window's
tail is served during the drain.

Steady-state bound (:func:`loadgen.fleet.bound.steady_state_bound`, reported beside it as
``steady_state_bound``): the capacity yardstick is 90 % attainment, so only the cheapest 90 % of the
requests by work have to be served; that bound charges their work under the engine's own time model
(``--engine-time-model``; the policy's model for ``policy``) with the cheapest prefill chunking the TTFT
allows. With q = 1 it equals the analytic bound's time limit. ``token_steady_state_bound`` is the same
bound for the per-token floor (the cheapest cover of 90 % of the prompt + output tokens, relaxed to
fractions so it stays an upper bound; prefix credit as the trace allows, at any age); each policy's
``token_floor_of_token_bound`` is its measured per-token capacity over it (None below the sweep). On a
mixed fleet both are each GPU kind's bound on the whole mix, summed: an estimate, not a bound (a
router that gives each kind the requests it serves best can do slightly better).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from loadgen.bench_args import (
    add_engine_and_trace_args,
    add_engine_time_arg,
    resolve_engine_and_trace_args,
    resolve_engine_time,
)
from loadgen.bench_policies import capacity
from loadgen.fleet.bound import (
    SteadyBound,
    interval_attainment_bound,
    self_consistent_rate,
    shared_prefix_tokens,
    steady_state_bound,
    windowed_attainment_bound,
)
from loadgen.fleet.search import SearchSettings, bracket_search, interpolate
from loadgen.fleet.sim import POLICIES, FleetConfig, FleetRequest, ReplicaKind, run_fleet
from loadgen.sim.engine_time import EngineTimeModel, describe_engine, engine_label, load_engine_time_model
from loadgen.stats import Slo, figures, meets_slo, per_tenant
from loadgen.traces import PREFIX_BLOCK_TOKENS, TraceRequest, load_trace, resolve_trace, spread_arrivals
from replica_agent.policy.time_model import TimeModel
from replica_agent.policy.profiles import load_profile, vllm_serve_batch_defaults
from router.work_shed import WorkShedSettings

DEFAULT_FRACTIONS = (0.4, 0.55, 0.7, 0.8, 0.9, 1.0, 1.1)
"""Default sweep: these fractions of the analytic bound (req/s)."""

SEARCH_START_OF_STEADY_BOUND = 0.35
"""The capacity search starts at this fraction of the engine model's steady-state bound: the
headline baselines measured 0.27-0.39 of it and pab+fairbatching 0.64 (docs/evaluation.md,
azure-code on 16 replicas), so the walk starts near the baselines and goes up."""

TENANTS = (("t0", 0.4), ("t1", 0.3), ("t2", 0.2), ("t3", 0.1))
"""Tenant names and their shares of the requests."""

BASELINES = ("round-robin", "least-outstanding", "least-outstanding-tokens", "power-of-two", "llm-d-scorer",
             "static-queue-cap", "least-outstanding+fairbatching", "static-queue-cap+fairbatching",
             "llm-d-prefix", "sglang-cache-aware", "vllm-router-cache-aware", "llm-d-flow-control",
             "llm-d-flow-control+fairbatching", "dynamo-kv", "dynamo-kv+fairbatching", "llm-d-sticky",
             "llm-d-sticky+fairbatching", "llm-d-predicted-latency", "llm-d-predicted-latency+fairbatching")  # fmt: skip


@dataclass(frozen=True, slots=True)
class Bound:
    """Result of :func:`analytic_bound`.

    Attributes:
        rps: fleet bound (requests/s).
        per_replica_rps: the same per replica.
        iteration_ms: the best iteration length T (ms).
        limit: which constraint binds at T: ``time``, ``kv``, ``seqs`` or ``tokens``.
        mean_work_ms: mean W_i (ms).
    """

    rps: float
    per_replica_rps: float
    iteration_ms: float
    limit: str
    mean_work_ms: float


def analytic_bound(
    trace: Sequence[TraceRequest],
    tm: TimeModel,
    kv_capacity_tokens: int,
    tpot_ms: float,
    replicas: int,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 8192,
) -> Bound:
    """Upper bound of fleet capacity from the time model and KV capacity (module docstring)."""
    p = np.array([max(1, r.prompt_tokens) for r in trace], dtype=float)
    o = np.array([max(1, r.output_tokens) for r in trace], dtype=float)
    work = tm.b_ms_per_new_token * (p + o - 1) + tm.c_ms_per_context_token * ((o - 1) * p + (o - 1) * o / 2)
    kv = o * p + o * (o - 1) / 2
    w_mean, kv_mean, o_mean, po_mean = float(work.mean()), float(kv.mean()), float(o.mean()), float((p + o).mean())
    best = (0.0, tpot_ms, "time")
    for t in np.linspace(tm.a_ms, tpot_ms, 2001)[1:]:
        limits = {
            "time": 1000.0 * (1.0 - tm.a_ms / t) / w_mean,
            "kv": 1000.0 * kv_capacity_tokens / (kv_mean * t),
            "seqs": 1000.0 * max_num_seqs / (o_mean * t),
            "tokens": 1000.0 * max_num_batched_tokens / (po_mean * t),
        }
        name = min(limits, key=limits.__getitem__)
        if limits[name] > best[0]:
            best = (limits[name], float(t), name)
    return Bound(best[0] * replicas, best[0], best[1], best[2], w_mean)


def steady_bound_json(b: SteadyBound, engine_time: EngineTimeModel | None) -> dict[str, Any]:
    """The ``steady_state_bound`` entry of fleet.json (loadgen/fleet/bound.py)."""
    return {"rps": round(b.rps, 3), "per_replica_rps": round(b.per_replica_rps, 4),
            "iteration_ms": round(b.iteration_ms, 2), "limit": b.limit, "served_frac": b.served_frac,
            "mean_work_ms_served": round(b.mean_work_ms, 3), "infeasible_requests": b.infeasible,
            "served_by": b.served_by, "time_model": engine_label(engine_time)}  # fmt: skip


def trace_rows(trace: str, spread_ms: float, seed: int,
               max_model_len: int = 32768) -> tuple[tuple[TraceRequest, ...], float, int]:  # fmt: skip
    """The requests of ``trace`` (a name or path, loadgen/traces.py ``resolve_trace``) with their
    arrivals spread over ``spread_ms`` (``spread_arrivals``, seeded), less those whose prompt plus
    output (each at least 1 token) exceeds ``max_model_len``; the trace's native rate, kept
    requests over the whole trace's span (req/s); and how many requests the trace has in all.
    The first two are the input of :func:`build_arrivals`."""
    full = spread_arrivals(load_trace(resolve_trace(trace)), spread_ms, seed)
    kept = tuple(r for r in full if max(1, r.prompt_tokens) + max(1, r.output_tokens) <= max_model_len)
    span_s = max(1e-9, (full[-1].arrival_ms - full[0].arrival_ms) / 1000.0)
    return kept, len(kept) / span_s, len(full)


def build_arrivals(
    trace: Sequence[TraceRequest],
    native_rps: float,
    rate_rps: float,
    duration_s: float,
    windows: int,
    seed: int,
    window_offset: float = 0.0,
) -> list[FleetRequest]:
    """The interleaved, rate-scaled stream of the module docstring (sorted by arrival).

    ``window_offset`` in [0, 1) shifts every window start by that fraction of ``span / windows``
    (window w starts at ``(w + window_offset) * span / windows``): other trace segments, same mix.

    Prefix ids (``TraceRequest.hash_ids``) are kept; with several windows each window's ids are
    its own (id ``i`` of window w becomes ``i * windows + w``): two windows are two populations of
    users, and a request replayed in two windows shares nothing with itself. ``windows = 1`` keeps
    the trace's conversations whole (every follow-up turn after its predecessor, gaps divided by
    the scale), which is what a prefix-cache study needs.

    Raises:
        ValueError: if ``window_offset`` is outside [0, 1).
    """
    if not 0.0 <= window_offset < 1.0:
        raise ValueError(f"window_offset must be in [0, 1), got {window_offset}")
    span = max(1e-9, trace[-1].arrival_ms - trace[0].arrival_ms)
    scale = rate_rps / (windows * native_rps)
    horizon_ms = duration_s * 1000.0
    rng = random.Random(seed)
    names = [t for t, _ in TENANTS]
    shares = [s for _, s in TENANTS]
    out: list[tuple[float, int, int, tuple[int, ...]]] = []
    for w in range(windows):
        start = trace[0].arrival_ms + (w + window_offset) * span / windows
        for r in trace:
            t = ((r.arrival_ms - start) % span) / scale
            if t < horizon_ms:
                ids = r.hash_ids if windows == 1 else tuple(i * windows + w for i in r.hash_ids)
                out.append((t, max(1, r.prompt_tokens), max(1, r.output_tokens), ids))
    out.sort()
    return [FleetRequest(t, p, o, rng.choices(names, shares)[0], ids) for t, p, o, ids in out]


@dataclass(frozen=True, slots=True)
class Setup:
    """What every point needs (picklable for worker processes)."""

    trace: tuple[TraceRequest, ...]
    native_rps: float
    replicas: int
    profile: str
    ttft_ms: float
    tpot_ms: float
    duration_s: float
    drain_s: float
    routers: int
    push_period_ms: float
    net_delay_ms: float
    queue_kind: str
    queue_cap_tokens: int
    leases: bool
    max_model_len: int
    seed: int
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    window_offset: float = 0.0
    engine_time: EngineTimeModel | None = None
    warmup_s: float = 0.0
    start_window_steps: float = 0.0
    lease_mode: str = "reserve"
    min_push_interval_ms: float | None = None
    windows: int = 0
    prefix_caching: bool = True
    work_shed: WorkShedSettings | None = None
    contention_max_inflight: int = 32
    max_bypass: int = 8
    replica_kinds: tuple[ReplicaKind, ...] = ()
    contention_keep_running: bool = True
    faults: tuple[tuple[float, int], ...] = ()  # (ms, replica) killed (FleetConfig.faults)
    max_migrations: int = 3  # FleetConfig.max_migrations
    engine_front_ms: float = 0.0  # FleetConfig.engine_front_ms
    decode_guard_ms: float = 0.0  # FleetConfig.decode_guard_ms
    margin_frac: float = 0.1  # FleetConfig.margin_frac: the agents' PAB horizon margin (agent --margin-frac)
    margin_cap_tpots: float = 1.0  # FleetConfig.margin_cap_tpots (agent --margin-cap-tpots)


def parse_fleet(spec: str, engine_time_spec: str | None = None) -> tuple[ReplicaKind, ...]:
    """``--fleet 8:llama-3-8b-a100,8:llama-3-8b-h100``: replica kinds of a heterogeneous fleet, each
    with its profile's time model (the agents' prior) and KV cache, its shipped engine model
    (loadgen/data/engine_time/<profile>.json; ``engine_time_spec`` ``policy`` = oracle engines) and
    ``vllm serve``'s batch defaults for its GPU (replica_agent/policy/profiles.py).

    Raises:
        ValueError: a malformed item; KeyError: an unknown profile.
    """
    kinds = []
    for item in spec.split(","):
        count, sep, name = item.strip().partition(":")
        if not sep or not count.strip().isdigit():
            raise ValueError(f"--fleet: {item!r} is not COUNT:PROFILE")
        prof = load_profile(name.strip())
        batch = vllm_serve_batch_defaults(prof.gpu).resolve(None, None)
        kinds.append(ReplicaKind(prof.name, int(count), prof.time_model, prof.kv_capacity_tokens,
                                 load_engine_time_model(engine_time_spec, prof.name),
                                 batch.max_num_batched_tokens, batch.max_num_seqs))  # fmt: skip
    return tuple(kinds)


def kinds_steady_bound(kinds: Sequence[ReplicaKind], prompts: Sequence[int], outputs: Sequence[int], ttft_ms: float,
                       tpot_ms: float, cached_tokens: Any = None, served_by: str = "requests") -> float:  # fmt: skip
    """A heterogeneous fleet's steady-state bound (req/s): the sum of each kind's
    (loadgen/fleet/bound.py ``steady_state_bound`` on its engine model, its count of replicas and
    its batch settings, under the floor ``served_by``): requests split in the best proportion, each
    kind serving the trace's mix."""
    return sum(steady_state_bound(prompts, outputs, k.engine_time if k.engine_time is not None else k.time_model,
                                  ttft_ms, tpot_ms, k.count, k.kv_capacity_tokens, k.max_num_seqs,
                                  k.max_num_batched_tokens, 0.9, cached_tokens=cached_tokens,
                                  served_by=served_by).rps for k in kinds)  # fmt: skip


STREAM_GRID_FROM, STREAM_GRID_TO, STREAM_GRID_FACTOR = 0.3, 1.5, 1.02
"""The stream bound's grid (:func:`stream_steady_bound`) spans these multiples of the trace-wide bound, in
steps of this ratio."""


def stream_steady_bound(kept: Sequence[TraceRequest], native_rps: float, kinds: Sequence[ReplicaKind], ttft_ms: float,
                        tpot_ms: float, duration_s: float, warmup_s: float, windows: int, seed: int,
                        window_offset: float, served_by: str, start: float, stop: float,
                        factor: float = STREAM_GRID_FACTOR) -> tuple[float, int]:  # fmt: skip
    """The steady-state bound on the streams a run offers, for a trace with prefix ids (req/s, grid rates
    evaluated): loadgen/fleet/bound.py ``self_consistent_rate`` over the streams :func:`build_arrivals`
    makes at each grid rate (``duration_s``, ``windows``, ``seed``, ``window_offset`` as the run), each
    stream's counted requests (arriving from ``warmup_s``) credited with the prefixes of that stream
    (``shared_prefix_tokens`` with arrival times and ``ttft_ms``) and bounded by :func:`kinds_steady_bound`
    under ``served_by``; a grid rate passes when that bound covers the stream's offered rate (its
    counted requests over ``duration_s - warmup_s``).

    Why: a prompt can only skip a prefix that a request of the stream offered computed, and which windows
    of the trace a stream holds depends on the rate; crediting sharing with the whole trace overstates
    it (mooncake-conv: about 3x; docs/evaluation.md, "How far any policy can get").

    Raises:
        ValueError: as ``self_consistent_rate`` (a grid that ends below the crossing, bad arguments).
    """
    streams: dict[float, tuple[list[int], list[int], list[float]]] = {}
    counted_s = duration_s - warmup_s

    def stream_at(rate: float) -> tuple[list[int], list[int], list[float]]:
        if rate not in streams:
            reqs = build_arrivals(kept, native_rps, rate, duration_s, windows, seed, window_offset)
            credit = shared_prefix_tokens([r.prefix_ids for r in reqs], [r.prompt_tokens for r in reqs],
                                          PREFIX_BLOCK_TOKENS, [r.arrival_ms for r in reqs], ttft_ms)  # fmt: skip
            idx = [i for i, r in enumerate(reqs) if r.arrival_ms >= warmup_s * 1000.0]
            streams[rate] = ([reqs[i].prompt_tokens for i in idx], [reqs[i].output_tokens for i in idx],
                             [float(credit[i]) for i in idx])  # fmt: skip
        return streams[rate]

    def bound_at(rate: float) -> float:
        p, o, c = stream_at(rate)
        return kinds_steady_bound(kinds, p, o, ttft_ms, tpot_ms, c, served_by=served_by)

    return self_consistent_rate(bound_at, start, stop, factor, offered_at=lambda r: len(stream_at(r)[0]) / counted_s)


def add_point_args(ap: argparse.ArgumentParser, *, trace: str | None, ttft_ms: float, duration_s: float,
                   warmup_s: float) -> None:
    """The flags of one steady-state fleet point that the analysis scripts share: ``--trace`` (required when
    ``trace`` is None), ``--profile``, ``--rate`` (required), ``--replicas``, ``--ttft-ms``, ``--tpot-ms``,
    ``--duration-s`` and ``--warmup-s`` (simulated ms and s), with the script's own defaults."""
    if trace is None:
        ap.add_argument("--trace", required=True)
    else:
        ap.add_argument("--trace", default=trace)
    ap.add_argument("--profile", default="llama-3-8b-a100")
    ap.add_argument("--rate", type=float, required=True)
    ap.add_argument("--replicas", type=int, default=16)
    ap.add_argument("--ttft-ms", type=float, default=ttft_ms)
    ap.add_argument("--tpot-ms", type=float, default=100.0)
    ap.add_argument("--duration-s", type=float, default=duration_s)
    ap.add_argument("--warmup-s", type=float, default=warmup_s)


def headline_setup(kept: tuple[TraceRequest, ...], native_rps: float, replicas: int, profile: str, ttft_ms: float,
                   tpot_ms: float, duration_s: float, drain_s: float, warmup_s: float,
                   engine_time: EngineTimeModel | None) -> Setup:  # fmt: skip
    """The :class:`Setup` of docs/evaluation.md's headline runs with bench-fleet's defaults otherwise:
    one router, pushes every 100 ms, 0.5 ms network delay, the fair queue, leases in ``reserve``
    mode, no start window, engines at ``vllm serve``'s defaults for the profile's GPU, seed 0, one
    window per replica."""
    prof = load_profile(profile)
    batch = vllm_serve_batch_defaults(prof.gpu).resolve(None, None)
    return Setup(kept, native_rps, replicas, profile, ttft_ms, tpot_ms, duration_s, drain_s, 1, 100.0, 0.5, "fair",
                 prof.time_model.tokens_within_ms(ttft_ms), True, 32768, 0, batch.max_num_batched_tokens,
                 batch.max_num_seqs, 0.0, engine_time, warmup_s, 0.0, "reserve", None, replicas, True)  # fmt: skip


def fleet_config(setup: Setup, policy: str) -> FleetConfig:
    """The FleetConfig of ``policy`` under ``setup``."""
    prof = load_profile(setup.profile)
    return FleetConfig(
        policy=policy, replicas=setup.replicas, time_model=prof.time_model,
        kv_capacity_tokens=prof.kv_capacity_tokens, ttft_ms=setup.ttft_ms, tpot_ms=setup.tpot_ms,
        routers=setup.routers, push_period_ms=setup.push_period_ms, net_delay_ms=setup.net_delay_ms,
        leases=setup.leases, queue_kind=setup.queue_kind, queue_cap_tokens=setup.queue_cap_tokens,
        max_queue_ms=2.0 * setup.ttft_ms, tenant_weights=tuple((t, 1.0) for t, _ in TENANTS),
        max_model_len=setup.max_model_len, drain_ms=setup.drain_s * 1000.0, seed=setup.seed,
        max_num_batched_tokens=setup.max_num_batched_tokens, max_num_seqs=setup.max_num_seqs,
        engine_time=setup.engine_time, start_window_steps=setup.start_window_steps,
        lease_mode=setup.lease_mode, min_push_interval_ms=setup.min_push_interval_ms,
        prefix_caching=setup.prefix_caching, work_shed=setup.work_shed,
        contention_max_inflight=setup.contention_max_inflight, max_bypass=setup.max_bypass,
        replica_kinds=setup.replica_kinds, contention_keep_running=setup.contention_keep_running,
        faults=setup.faults, max_migrations=setup.max_migrations, engine_front_ms=setup.engine_front_ms,
        decode_guard_ms=setup.decode_guard_ms, margin_frac=setup.margin_frac, margin_cap_tpots=setup.margin_cap_tpots,
    )  # fmt: skip


def _max_ratio(xs: Sequence[float]) -> float | None:
    """max / mean of per-replica loads (1 = perfectly even), None when all are 0."""
    mean = sum(xs) / len(xs) if xs else 0.0
    return max(xs) / mean if mean > 0 else None


def _pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


def run_point(setup: Setup, policy: str, rate_rps: float) -> dict[str, Any]:
    """One policy at one rate: a row of fleet.json."""
    reqs = build_arrivals(setup.trace, setup.native_rps, rate_rps, setup.duration_s, setup.windows or setup.replicas,
                          setup.seed, setup.window_offset)  # fmt: skip
    cfg = fleet_config(setup, policy)
    res = run_fleet(cfg, reqs)
    bounds = stream_bounds(setup, reqs, cfg.prefix_block_tokens)
    slo = Slo(setup.ttft_ms, setup.tpot_ms)
    slos = {t: slo for t, _ in TENANTS}
    # steady state: requests that arrived during the warm-up run (they load the fleet) but are not counted
    records = [r for r in res.records if r.arrival_ms >= setup.warmup_s * 1000.0]
    window_s = setup.duration_s - setup.warmup_s
    fig = figures(records, slos, window_s)
    tenants = {t: f.slo_attainment for t, f in per_tenant(records, slos, window_s).items()}
    st = res.stats
    n = max(1, len(records))
    ok = [r for r in records if r.outcome == "ok"]
    tokens = [r.prompt_tokens + (r.expected_output_tokens or r.output_tokens) for r in records]
    met = [meets_slo(r, slo) for r in records]
    met_tokens = sum(t for m, t in zip(met, tokens, strict=True) if m)
    tenant_tokens: dict[str, list[int]] = {}
    for r, m, t in zip(records, met, tokens, strict=True):
        acc = tenant_tokens.setdefault(r.tenant, [0, 0])
        acc[0] += t if m else 0
        acc[1] += t
    refused = sum(fig.rejected.values())
    return {
        "rate_rps": round(rate_rps, 3),
        "requests": len(records),
        "offered_rps": round(len(records) / window_s, 3),
        "warmup_s": setup.warmup_s,
        "slo_attainment": fig.slo_attainment,
        "token_slo_attainment": met_tokens / max(1, sum(tokens)),
        "late_step_frac": st.late_steps / max(1, st.steps),
        "time_model_mean_abs_error": st.time_model_mean_abs_error,
        "ttft_miss_frac": sum(1 for r in ok if (r.ttft_ms or 0) > setup.ttft_ms) / n,
        "tpot_miss_frac": sum(1 for r in ok if (t := r.tpot_ms) is not None and t > setup.tpot_ms) / n,
        "goodput_rps": fig.goodput_rps,
        "goodput_tokens_per_s": fig.goodput_tokens_per_s,
        "token_goodput_per_s": met_tokens / window_s,
        "throughput_rps": fig.throughput_rps,
        "refused_share": refused / n,
        "refused_share_by_reason": {k: v / n for k, v in sorted(fig.rejected.items())},
        "ttft_p50_ms": fig.ttft_ms.p50, "ttft_p99_ms": fig.ttft_ms.p99,
        "tpot_p50_ms": fig.tpot_ms.p50, "tpot_p99_ms": fig.tpot_ms.p99,
        "rejected": fig.rejected, "failed": fig.failed_reasons,
        "tenant_attainment": tenants,
        "tenant_token_attainment": {t: a / max(1, b) for t, (a, b) in sorted(tenant_tokens.items())},
        "double_spends": st.double_spends, "grants": st.grants, "refusals": st.refusals,
        "placement_p50_us": _pct(st.placement_us, 50), "placement_p99_us": _pct(st.placement_us, 99),
        "snapshots_per_s_per_router": st.snapshots_delivered / max(1e-9, st.end_ms / 1000.0) / setup.routers,
        "pushes_per_s_per_replica": st.pushes / max(1e-9, st.end_ms / 1000.0) / setup.replicas,
        "reserve_answers": st.reserve_answers,
        "prefix_cache_hit_rate": st.prefix_cache_hits / st.prefix_cache_queries if st.prefix_cache_queries else None,
        "prefix_cache_queries": st.prefix_cache_queries, "prefix_cache_hits": st.prefix_cache_hits,
        "max_load_ratio": _max_ratio(st.replica_busy_ms), "max_requests_ratio": _max_ratio(st.replica_requests),
        "preemptions": st.preemptions, "steps": st.steps, "dispatch_passes": st.dispatch_passes,
        "dispatch_stalled_ms": st.dispatch_stalled_ms,
        "migrations": dict(sorted(st.migrations.items())),
        "migration_added_ms_p50": _pct(st.migration_added_ms, 50),
        "migration_added_ms_p99": _pct(st.migration_added_ms, 99),
        "sim_end_s": st.end_ms / 1000.0, "wall_s": round(res.wall_s, 2),
        **bounds,
    }  # fmt: skip


def stream_bounds(
    setup: Setup, reqs: Sequence[FleetRequest], block_tokens: int, grid_ms: float = 1000.0,
    max_span_ms: float = 120_000.0,
) -> dict[str, Any]:
    """The bounds of loadgen/fleet/bound.py on the stream actually offered at one rate (row fields).

    ``stream_steady_bound_rps``: the steady-state bound of the counted requests, with the prefix cache's
    best case (:func:`~loadgen.fleet.bound.shared_prefix_tokens`) where the engines cache prefixes and the
    trace has prefix ids (the trace-wide ``steady_state_bound`` charges every prompt token);
    ``attainment_bound``: the burst-aware upper bound on attainment at this rate
    (:func:`~loadgen.fleet.bound.windowed_attainment_bound`), with the interval length that gave it;
    ``interval_attainment_bound``: the disjoint-span one (:func:`~loadgen.fleet.bound.interval_attainment_bound`)
    on a grid of ``grid_ms`` with spans up to ``max_span_ms`` (both recorded in the row, in s). The defaults take
    a few seconds a row at 16 replicas (~60k counted requests): on azure-code a 0.5 s grid is tighter by 0.002,
    on azure-conv and mooncake-conv spans of 30 s are much looser (docs/evaluation.md, "Bursts"). Both
    attainment bounds are valid; neither need be below the other.
    ``block_tokens``: tokens per prefix id (FleetConfig.prefix_block_tokens).
    """
    prof = load_profile(setup.profile)
    model = setup.engine_time if setup.engine_time is not None else prof.time_model
    h = None
    if setup.prefix_caching and any(r.prefix_ids for r in reqs):
        h = shared_prefix_tokens([r.prefix_ids for r in reqs], [r.prompt_tokens for r in reqs], block_tokens,
                                 [r.arrival_ms for r in reqs], setup.ttft_ms)  # fmt: skip
    t0 = setup.warmup_s * 1000.0
    counted = [i for i, r in enumerate(reqs) if r.arrival_ms >= t0]
    if not counted:
        return {}
    if setup.replica_kinds:  # heterogeneous: the steady bound summed over kinds; the stream bounds assume one kind
        rps = kinds_steady_bound(setup.replica_kinds, [reqs[i].prompt_tokens for i in counted],
                                 [reqs[i].output_tokens for i in counted], setup.ttft_ms, setup.tpot_ms,
                                 None if h is None else h[counted])  # fmt: skip
        return {"stream_steady_bound_rps": round(rps, 3)}
    steady = steady_state_bound(
        [reqs[i].prompt_tokens for i in counted], [reqs[i].output_tokens for i in counted], model, setup.ttft_ms,
        setup.tpot_ms, setup.replicas, prof.kv_capacity_tokens, setup.max_num_seqs, setup.max_num_batched_tokens,
        0.9, cached_tokens=None if h is None else h[counted],
    )  # fmt: skip
    stream = ([r.arrival_ms for r in reqs], [r.prompt_tokens for r in reqs], [r.output_tokens for r in reqs], model,
              setup.ttft_ms, setup.tpot_ms, setup.replicas, t0, setup.duration_s * 1000.0,
              setup.max_num_batched_tokens, h)  # fmt: skip
    att, length, _ = windowed_attainment_bound(*stream)
    spans, _ = interval_attainment_bound(*stream, grid_ms=grid_ms, max_span_ms=max_span_ms)
    return {
        "stream_steady_bound_rps": round(steady.rps, 3),
        "prefix_shareable_frac": None if h is None else round(float(h[counted].sum()) /
                                                              max(1, sum(reqs[i].prompt_tokens for i in counted)), 4),
        "attainment_bound": round(att, 4), "attainment_bound_interval_s": length / 1000.0,
        "interval_attainment_bound": round(spans, 4), "interval_bound_grid_s": grid_ms / 1000.0,
        "interval_bound_max_span_s": max_span_ms / 1000.0,
    }  # fmt: skip


def offered_rows(rows: Sequence[dict[str, Any]], duration_s: float) -> list[dict[str, Any]]:
    """``rows`` with ``rate_rps`` replaced by the offered rate (requests in the window / ``duration_s``,
    req/s), the label kept as ``label_rps``, sorted by the offered rate.

    A row's label is the trace's long-run rate times the scale (gaps included); the requests its
    window of interleaved trace segments holds can differ, by 2x and more on small fleets (few
    windows) and bursty traces (docs/evaluation.md, "Rate labels vs offered rates").
    """
    out = [{**r, "label_rps": r["rate_rps"], "rate_rps": r["requests"] / duration_s} for r in rows]
    return sorted(out, key=lambda r: r["rate_rps"])


def capacity_text(cap: float, how: str, rows: Sequence[dict[str, Any]]) -> str:
    """Capacity for a table: ``<lowest`` below the sweep, ``>=cap`` when the sweep never fell below
    the target, else the interpolated value (req/s, 2 decimals)."""
    if how == "below-sweep":
        return f"<{min(r['rate_rps'] for r in rows):.2f}" if rows else "-"
    return f">={cap:.2f}" if how == "at-least" else f"{cap:.2f}"


def sweep(setup: Setup, policy: str, rates: Sequence[float], target: float = 0.9) -> list[dict[str, Any]]:
    """Rows of ``policy`` at ascending ``rates``, stopping after two rates below ``target``."""
    rows = []
    below = 0
    for rate in sorted(rates):
        row = run_point(setup, policy, rate)
        rows.append(row)
        print(f"  {policy:<18} {rate:8.2f} req/s (offered {row['offered_rps']:.2f})  "
              f"attainment {row['slo_attainment']:.3f} (tokens {row['token_slo_attainment']:.3f})  "
              f"TPOT p99 {row['tpot_p99_ms'] or 0:.1f} ms  late steps {100 * row['late_step_frac']:.1f} %  "
              f"model err {100 * row['time_model_mean_abs_error']:.1f} %  "
              f"prefix hits {100 * (row['prefix_cache_hit_rate'] or 0):.1f} %  max/mean load {row['max_load_ratio'] or 0:.2f}  "
              f"wall {row['wall_s']:.1f}s", file=sys.stderr, flush=True)  # fmt: skip
        if (row["slo_attainment"] or 0.0) < target:
            below += 1
            if below >= 2:
                break
    return rows


def search_rows(setup: Setup, policy: str, settings: SearchSettings) -> list[dict[str, Any]]:
    """Rows of ``policy`` at the rates :func:`~loadgen.fleet.search.bracket_search` picks: both
    floors (per request, per token) bracketed and refined."""

    def measure(rate: float) -> dict[str, Any]:
        row = run_point(setup, policy, rate)
        print(f"  {policy:<18} {rate:8.2f} req/s  attainment {row['slo_attainment']:.3f} "
              f"(tokens {row['token_slo_attainment']:.3f})  refused {100 * row['refused_share']:.1f} %  "
              f"TTFT p99 {row['ttft_p99_ms'] or 0:.0f} ms  wall {row['wall_s']:.1f}s", file=sys.stderr, flush=True)  # fmt: skip
        return row

    return bracket_search(measure, settings)


def _sweep_job(args: tuple[Setup, str, tuple[float, ...], SearchSettings | None]) -> tuple[str, list[dict[str, Any]]]:
    setup, policy, rates, search = args
    return policy, (search_rows(setup, policy, search) if search is not None else sweep(setup, policy, rates))


def summarize(rows: Sequence[dict[str, Any]], bound_rps: float) -> dict[str, Any]:
    """A policy's entry of fleet.json from its rows (sorted by rate): capacity under the per-request
    floor (``capacity_rps``) and under the per-token floor (``capacity_token_floor_rps``), each with
    how it is bounded (``interpolated``, ``at-least``, ``below-sweep``), token goodput (prompt +
    output tokens/s of requests that met both TTFT and TPOT) at the per-token capacity, goodput
    (req/s) and refused share by reason at the per-request capacity (issue 27 item 2)."""
    cap, how = capacity(rows, 0.9)
    tcap, thow = capacity(rows, 0.9, key="token_slo_attainment")
    at_cap = {k: interpolate(rows, cap, k) for k in ("goodput_rps", "refused_share", "token_slo_attainment")}
    reasons = sorted({k for r in rows for k in r.get("refused_share_by_reason", {})})
    by_reason = {k: interpolate([{"rate_rps": r["rate_rps"], k: r.get("refused_share_by_reason", {}).get(k, 0.0)}
                                 for r in rows], cap, k) for k in reasons}  # fmt: skip
    return {
        "capacity_rps": round(cap, 3), "capacity_bound": how,
        "capacity_token_floor_rps": round(tcap, 3), "capacity_token_floor_bound": thow,
        "token_goodput_at_token_capacity": interpolate(rows, tcap, "token_goodput_per_s") if thow != "below-sweep" else 0.0,
        "goodput_rps_at_capacity": at_cap["goodput_rps"] if how != "below-sweep" else 0.0,
        "refused_share_at_capacity": at_cap["refused_share"] if how != "below-sweep" else None,
        "refused_share_by_reason_at_capacity": by_reason if how != "below-sweep" else {},
        "token_attainment_at_capacity": at_cap["token_slo_attainment"] if how != "below-sweep" else None,
        "fraction_of_bound": round(cap / bound_rps, 3) if bound_rps > 0 else None,
        "rows": list(rows),
    }  # fmt: skip


def plot(result: dict[str, Any], path: str) -> None:
    """Attainment, goodput and TTFT p99 against rate, one line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.4))
    for name, pol in result["policies"].items():
        rates = [r["rate_rps"] for r in pol["rows"]]
        style = "-" if name.startswith("pab") else "--"
        axes[0].plot(rates, [r["slo_attainment"] for r in pol["rows"]], style, marker="o", label=name)
        axes[1].plot(rates, [r["goodput_rps"] for r in pol["rows"]], style, marker="o", label=name)
        axes[2].plot(rates, [r["ttft_p99_ms"] for r in pol["rows"]], style, marker="o", label=name)
    bound = result["analytic_bound"]["rps"]
    for ax in axes:
        ax.axvline(bound, color="grey", ls=":", lw=1)
        ax.set_xlabel("arrival rate (req/s)")
        ax.grid(alpha=0.3)
    axes[0].axhline(0.9, color="grey", ls="--", lw=1)
    axes[0].set_ylabel("SLO attainment")
    axes[1].set_ylabel("goodput (req/s)")
    axes[2].set_ylabel("TTFT p99 (ms)")
    axes[2].set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{result['trace']}, {result['replicas']} x {result['profile']}: TTFT {result['ttft_ms']:g} ms, "
                 f"TPOT {result['tpot_ms']:g} ms (dotted: analytic bound)")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    """Flags of ``bench-fleet``."""
    p = argparse.ArgumentParser(prog="fairbatch-loadgen bench-fleet", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--replicas", type=int, default=16, help="simulated replicas (engine + agent each)")
    p.add_argument("--trace", required=True, help="embedded trace name (azure-conv, azure-code, mooncake-conv) or path")
    p.add_argument("--profile", default="llama-3-8b-a100", help="GPU step-time profile of every replica")
    p.add_argument("--out", required=True, help="fleet.json")
    p.add_argument("--plot", default=None, help="fleet.png")
    p.add_argument("--routers", type=int, default=1, help="router copies")
    p.add_argument("--fleet", default=None, metavar="N:PROFILE,...",
                   help="a heterogeneous fleet, e.g. 8:llama-3-8b-a100,8:llama-3-8b-h100: each kind with its profile "
                        "(the agents' prior), its shipped engine model and vllm serve's batch defaults for its GPU; "
                        "replaces --replicas and --profile")  # fmt: skip
    p.add_argument("--push-period-ms", type=float, default=100.0, help="agents' periodic budget push (simulated ms)")
    p.add_argument("--net-delay-ms", type=float, default=0.5, help="one-way router-agent network delay (simulated ms)")
    p.add_argument("--ttft-ms", type=float, default=1000.0, help="TTFT target of the one SLO class (ms)")
    p.add_argument("--tpot-ms", type=float, default=100.0, help="TPOT target of the one SLO class (ms)")
    p.add_argument("--rates", type=float, nargs="+", default=None,
                   help="arrival rates (req/s); default: a search per policy that brackets its capacity under "
                        "both floors (--search-*)")  # fmt: skip
    p.add_argument("--fractions", action="store_true",
                   help="the old fixed sweep: 0.4..1.1 x the analytic bound of the policy's time model")
    p.add_argument("--search-start-rps", type=float, default=None,
                   help="first rate of the search; default: 0.35 x the steady-state bound of the engine's model")
    p.add_argument("--search-factor", type=float, default=1.25, help="rate step while bracketing (x)")
    p.add_argument("--search-refine", type=int, default=1, help="bisections per floor once bracketed")
    p.add_argument("--search-max-points", type=int, default=9, help="rates measured per policy at most")
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    p.add_argument("--duration-s", type=float, default=60.0, help="arrival window (simulated s)")
    p.add_argument("--drain-s", type=float, default=60.0, help="time after the window before unfinished = failed")
    p.add_argument("--start-window-steps", type=float, default=0.0,
                   help="pab routers: the router's start window (admission.start_window_steps; router default 4), "
                        "in steps of --max-num-batched-tokens; 0 = none")
    p.add_argument("--warmup-s", type=float, default=0.0,
                   help="requests arriving in the first this many seconds load the fleet but are not counted "
                        "(steady state: the window measured is [warmup, duration])")
    p.add_argument("--pab-margin", type=float, default=0.1,
                   help="pab agents: horizon margin as a share of the TTFT (the agent's --margin-frac)")
    p.add_argument("--pab-margin-cap-tpots", type=float, default=1.0,
                   help="pab agents: the margin is at most this many TPOTs, H = ttft - min(margin * ttft, cap * tpot) "
                        "(the agent's --margin-cap-tpots; inf = the share alone)")
    p.add_argument("--contention-max-inflight", type=int, default=32,
                   help="pab routers: admission.contention_max_inflight (router default 32; 0 = off)")
    p.add_argument("--contention-fixed-cap", action="store_true",
                   help="pab routers: admission.contention_keep_running false (the fixed cap of earlier releases: "
                        "under contention every replica's batch shrinks to the cap)")
    p.add_argument("--max-bypass", type=int, default=8,
                   help="pab routers: queue.max_bypass, entries admitted behind a blocked head before it gets a "
                        "held replica (router default 8)")
    p.add_argument("--queue", choices=("fair",), default="fair",
                   help="admission queue of the pab routers (the router's weighted fair queue)")
    p.add_argument("--queue-cap-tokens", type=int, default=None,
                   help="static-queue-cap bound (tokens); default: the prompt tokens one replica prefills "
                        "within the TTFT target, floor((ttft - a) / b)")  # fmt: skip
    p.add_argument("--no-leases", action="store_true", help="pab routers forward without Reserve (double-spend demo)")
    p.add_argument("--lease-mode", choices=("reserve", "inline"), default="reserve",
                   help="pab routers: Reserve round trip before forwarding, or the agent decides on arrival "
                        "(router admission.lease_mode)")
    p.add_argument("--min-push-interval-ms", type=float, default=None,
                   help="agents also push on change, at most one snapshot per this many ms (default: periodic only)")
    p.add_argument("--max-model-len", type=int, default=32768, help="requests longer than this are left out (tokens)")
    p.add_argument("--windows", type=int, default=None,
                   help="interleaved trace windows (default: --replicas); 1 = one stretch of the trace, its "
                        "conversations whole (the prefix-cache study)")
    p.add_argument("--no-prefix-caching", action="store_true", help="engines without automatic prefix caching")
    p.add_argument("--work-shed", action="store_true",
                   help="pab routers: work-aware admission under contention (router/work_shed.py; the router's "
                        "admission.work_shed, off by default there too)")
    ws = WorkShedSettings()
    p.add_argument("--work-shed-gain", type=float, default=ws.gain, help="work shed: refused share per refused-for-budget share")
    p.add_argument("--work-shed-max-share", type=float, default=ws.max_share, help="work shed: largest refused share")
    p.add_argument("--work-shed-window", type=int, default=ws.window, help="work shed: arrivals whose work sets the threshold")
    p.add_argument("--work-shed-horizon", type=int, default=ws.horizon, help="work shed: arrivals over which contention is measured")
    add_engine_and_trace_args(p)
    add_engine_time_arg(p)
    p.add_argument("--seed", type=int, default=0, help="tenant draw, push phases, power-of-two choices, arrival spread")
    p.add_argument("--window-offset", type=float, default=0.0,
                   help="shift every interleaved trace window by this fraction of span/N, in [0, 1): other trace "
                        "segments for a second sample")  # fmt: skip
    p.add_argument("--jobs", type=int, default=1, help="worker processes (one policy sweep each)")
    p.add_argument("--merge", action="store_true",
                   help="keep what --out already holds for the same trace/fleet/profile: other policies as they are, "
                        "rows of a rerun policy joined by rate (this run's row wins)")  # fmt: skip
    p.add_argument("--bounds-only", action="store_true",
                   help="with --merge: run no policy; take the rows of --out as they are and recompute its bounds "
                        "(steady-state, per request and per token) and each policy's share of them with this run's "
                        "settings, which must be the file's")  # fmt: skip
    return p


_MERGE_DEFAULTS: dict[str, Any] = {"seed": 0, "window_offset": 0.0, "prefix_caching": True, "fleet": [],
                                   "engine_time_model": {"name": "policy"}}
"""What a fleet.json made before a setting was recorded ran with (a setting missing with no default here is not
checked: ``max_model_len``, recorded since 2026-12-08, is checked through ``requests_dropped_over_max_model_len``)."""


def _file_to_merge(args: argparse.Namespace, mine: dict[str, Any], engine_limits: tuple[int, int]) -> dict[str, Any]:
    """The fleet.json that ``--merge`` joins this run to (``{}`` without ``--merge`` or when ``--out`` does not
    exist yet), after checking that it was run with this run's settings ``mine`` (fleet.json keys: trace,
    fleet, SLOs, window, warm-up, drain, routers, seed, arrival spread, engine model, ...) and engine limits
    ``(max_num_batched_tokens, max_num_seqs)``, and that its PAB rows used this run's margin.

    Raises:
        SystemExit: on any setting that differs (rows of another setting must not be joined, nor bounds of
            this run put beside them), and for ``--bounds-only`` without a file to merge into.
    """
    if not (args.merge and os.path.exists(args.out)):
        if args.bounds_only:
            raise SystemExit("bench-fleet: --bounds-only needs --merge and an existing --out")
        return {}
    with open(args.out) as f:
        old = json.load(f)
    missing = object()
    defaults = {**_MERGE_DEFAULTS, "windows_interleaved": old.get("replicas")}  # one window per replica before
    other = []
    for key, value in mine.items():
        was = old.get(key, defaults.get(key, missing))
        if was is not missing and was != value:
            other.append(f"{key} ({was} against {value})")
    engine = old.get("engine", {})
    was_limits = (engine.get("max_num_batched_tokens", engine_limits[0]), engine.get("max_num_seqs", engine_limits[1]))
    if was_limits != engine_limits:
        other.append(f"max_num_batched_tokens / max_num_seqs ({was_limits} against {engine_limits})")
    if other:
        raise SystemExit(f"--merge: {args.out} was run with another " + ", ".join(other))
    # the agents' margin: only PAB rows depend on it (files made before the cap record none: their agents
    # planned with the share alone, inf); a file whose PAB rows were taken out may take rows of another
    old_cap = old.get("pab_margin_cap_tpots")
    old_margin = (old.get("pab_margin_frac", 0.1), math.inf if old_cap is None else float(old_cap))
    if old_margin != (args.pab_margin, args.pab_margin_cap_tpots) and any(n.startswith("pab") for n in old["policies"]):
        raise SystemExit(f"--merge: {args.out} holds PAB rows run with another --pab-margin / --pab-margin-cap-tpots "
                         f"({old_margin[0]} / {old_margin[1]})")
    return old


def main(argv: Sequence[str] | None = None) -> int:
    """Run the sweep, write fleet.json (and the plot), print the table. Returns the exit code."""
    args = build_parser().parse_args(argv)
    serve = resolve_engine_and_trace_args(args)
    engine_time = resolve_engine_time(args)
    spread_ms = args.arrival_spread_ms
    kept, native, n_trace = trace_rows(args.trace, spread_ms, args.seed, args.max_model_len)
    kinds = parse_fleet(args.fleet, args.engine_time_model) if args.fleet else ()
    if kinds:  # heterogeneous: --profile is the first kind (the router's defaults and the tables' label)
        args.replicas, args.profile = sum(k.count for k in kinds), kinds[0].name
        engine_time = kinds[0].engine_time
    prof = load_profile(args.profile)
    max_tokens = args.max_num_batched_tokens
    max_seqs = args.max_num_seqs
    fleet_desc = [{"profile": k.name, "count": k.count, "max_num_batched_tokens": k.max_num_batched_tokens,
                   "max_num_seqs": k.max_num_seqs, "engine_time_model": describe_engine(k.engine_time)} for k in kinds]
    # before any bound or sweep: a file this run may not merge into stops it at once
    old = _file_to_merge(args, {"trace": args.trace, "replicas": args.replicas, "profile": args.profile,
                                "seed": args.seed, "window_offset": args.window_offset,
                                "windows_interleaved": args.windows or args.replicas,
                                "prefix_caching": not args.no_prefix_caching, "ttft_ms": args.ttft_ms,
                                "tpot_ms": args.tpot_ms, "duration_s": args.duration_s, "warmup_s": args.warmup_s,
                                "drain_s": args.drain_s, "routers": args.routers, "arrival_spread_ms": spread_ms,
                                "fleet": fleet_desc, "engine_time_model": describe_engine(engine_time),
                                "max_model_len": args.max_model_len,
                                "requests_dropped_over_max_model_len": n_trace - len(kept)},
                         (max_tokens, max_seqs))  # fmt: skip
    bound = analytic_bound(kept, prof.time_model, prof.kv_capacity_tokens, args.tpot_ms, args.replicas,
                           max_seqs, max_tokens)  # fmt: skip
    prompts, outputs = [r.prompt_tokens for r in kept], [r.output_tokens for r in kept]

    def fleet_bound(served_by: str, cached_tokens: Any = None) -> SteadyBound:
        """The trace-wide steady-state bound under the floor ``served_by`` (mixed fleets: the kinds summed)."""
        b = steady_state_bound(prompts, outputs, engine_time if engine_time is not None else prof.time_model,
                               args.ttft_ms, args.tpot_ms, args.replicas, prof.kv_capacity_tokens, max_seqs,
                               max_tokens, 0.9, cached_tokens=cached_tokens, served_by=served_by)  # fmt: skip
        if kinds:
            b = dataclasses.replace(b, rps=kinds_steady_bound(kinds, prompts, outputs, args.ttft_ms, args.tpot_ms,
                                                              cached_tokens, served_by=served_by))  # fmt: skip
        return b

    # the search starts from the bound without prefix credit (as it always has: the searches stay the same)
    steady = search_steady = fleet_bound("requests")
    # the per-token bound credits every prefix a prompt shares with any other request of the trace, at any
    # age (more than a cache keeps: still a bound) where the engines cache prefixes
    cached = (shared_prefix_tokens([r.hash_ids for r in kept], prompts, PREFIX_BLOCK_TOKENS)
              if not args.no_prefix_caching and any(r.hash_ids for r in kept) else None)  # fmt: skip
    steady_tokens = fleet_bound("tokens", cached)
    stream_requests: dict[str, Any] | None = None
    stream_tokens: dict[str, Any] | None = None
    if cached is not None:  # prefix ids: both floors' bounds on the streams this run offers (stream_steady_bound)
        stream_kinds = kinds or (ReplicaKind(args.profile, args.replicas, prof.time_model, prof.kv_capacity_tokens,
                                             engine_time, max_tokens, max_seqs),)  # fmt: skip

        def on_streams(wide_bound: SteadyBound, served_by: str) -> tuple[SteadyBound, dict[str, Any]]:
            """The bound on the streams offered under ``served_by``, from the grid around the trace-wide
            (prefix-credited) ``wide_bound``; the trace-wide figure, saying why, when the grid ends below."""
            wide = wide_bound.rps
            try:
                rate, points = stream_steady_bound(kept, native, stream_kinds, args.ttft_ms, args.tpot_ms,
                                                   args.duration_s, args.warmup_s, args.windows or args.replicas,
                                                   args.seed, args.window_offset, served_by, STREAM_GRID_FROM * wide,
                                                   STREAM_GRID_TO * wide)  # fmt: skip
            except ValueError as e:  # a grid that ends below the crossing: the trace-wide figure, said so (no
                # policy's share is taken against it: the streams' bound lies above the grid, so it bounds nothing)
                return wide_bound, {"trace_wide_rps": round(wide, 3), "error": str(e)}
            # per_replica_rps follows the figure; the other fields (limit, step, work) describe the trace-wide one
            return (dataclasses.replace(wide_bound, rps=rate, per_replica_rps=rate / args.replicas),
                    {"trace_wide_rps": round(wide, 3), "grid_points": points, "grid_factor": STREAM_GRID_FACTOR,
                     "other_fields": "of the trace-wide figure"})  # fmt: skip

        # per request too (before, the per-request figure charged every prompt token: not a bound where
        # the engines skip cached prefixes)
        steady, stream_requests = on_streams(fleet_bound("requests", cached), "requests")
        steady_tokens, stream_tokens = on_streams(steady_tokens, "tokens")
    search = None
    if args.rates:
        rates = sorted(args.rates)
    elif args.fractions:
        rates = [round(bound.rps * f, 2) for f in DEFAULT_FRACTIONS]
    else:  # issue 27 item 6: bracket each policy's capacity, starting from the engine model's bound
        start = args.search_start_rps or SEARCH_START_OF_STEADY_BOUND * search_steady.rps
        search = SearchSettings(start, args.search_factor, args.search_refine, args.search_max_points)
        rates = []
    cap_tokens = args.queue_cap_tokens or prof.time_model.tokens_within_ms(args.ttft_ms)
    work_shed = WorkShedSettings(args.work_shed_gain, args.work_shed_max_share, args.work_shed_window,
                                 args.work_shed_horizon) if args.work_shed else None  # fmt: skip
    setup = Setup(kept, native, args.replicas, args.profile, args.ttft_ms, args.tpot_ms, args.duration_s,
                  args.drain_s, args.routers, args.push_period_ms, args.net_delay_ms, args.queue, cap_tokens,
                  not args.no_leases, args.max_model_len, args.seed, max_tokens, max_seqs,
                  args.window_offset, engine_time, args.warmup_s, args.start_window_steps, args.lease_mode,
                  args.min_push_interval_ms, args.windows or args.replicas, not args.no_prefix_caching,
                  work_shed, args.contention_max_inflight, args.max_bypass, kinds,
                  not args.contention_fixed_cap, margin_frac=args.pab_margin,
                  margin_cap_tpots=args.pab_margin_cap_tpots)  # fmt: skip
    if not 0.0 <= args.warmup_s < args.duration_s:
        raise SystemExit("bench-fleet: --warmup-s must be in [0, --duration-s)")
    if not 0.0 <= args.pab_margin < 1.0:
        raise SystemExit("bench-fleet: --pab-margin must be in [0, 1)")
    if not args.pab_margin_cap_tpots > 0.0:
        raise SystemExit("bench-fleet: --pab-margin-cap-tpots must be > 0")
    t0 = time.perf_counter()
    jobs = [] if args.bounds_only else [(setup, p, tuple(rates), search) for p in args.policies]
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs) as ex:
            done = list(ex.map(_sweep_job, jobs))
    else:
        done = [_sweep_job(j) for j in jobs]
    policies: dict[str, Any] = {}
    for name, rows in done:
        policies[name] = summarize(rows, bound.rps)
    if old:
        for name, pol in old["policies"].items():
            if name not in policies:
                policies[name] = pol
            else:  # same policy: union of the rows, this run's row wins at a rate both have
                rows = {r["rate_rps"]: r for r in pol["rows"]}
                rows.update({r["rate_rps"]: r for r in policies[name]["rows"]})
                policies[name] = summarize([rows[k] for k in sorted(rows)], bound.rps)
        policies = {n: policies[n] for n in POLICIES if n in policies}
        rates = sorted(set(rates) | set(old.get("rates", [])))
    offered_by_policy = {n: offered_rows([r for r in pol["rows"] if "requests" in r], args.duration_s - args.warmup_s)
                         for n, pol in policies.items()}
    for name, pol in policies.items():
        off = offered_by_policy[name]
        cap, how = capacity(off, 0.9) if off else (0.0, "below-sweep")
        pol["offered_capacity_rps"], pol["offered_capacity_bound"] = round(cap, 3), how
    # a streams' grid that ended below its crossing left the trace-wide figure, which bounds nothing: no share of it
    failed = {n for n, d in (("requests", stream_requests), ("tokens", stream_tokens)) if d and "error" in d}
    req_ok = steady.rps > 0 and "requests" not in failed
    tok_ok = steady_tokens.rps > 0 and "tokens" not in failed
    for pol in policies.values():
        pol["fraction_of_steady_bound"] = round(pol["capacity_rps"] / steady.rps, 3) if req_ok else None
        tok_cap = pol.get("capacity_token_floor_rps")
        measured = pol.get("capacity_token_floor_bound") in ("interpolated", "at-least")
        pol["token_floor_of_token_bound"] = (round(tok_cap / steady_tokens.rps, 3)
                                             if measured and tok_cap is not None and tok_ok else None)  # fmt: skip
    rr = policies.get("round-robin", {}).get("capacity_rps")
    base_caps = {n: policies[n]["capacity_rps"] for n in BASELINES if n in policies}
    best_name = max(base_caps, key=base_caps.__getitem__) if base_caps else None
    base_tok = {n: policies[n].get("token_goodput_at_token_capacity") or 0.0 for n in BASELINES if n in policies}
    best_tok = max(base_tok, key=base_tok.__getitem__) if base_tok else None
    for pol in policies.values():
        pol["x_round_robin"] = round(pol["capacity_rps"] / rr, 3) if rr else None
        pol["x_best_baseline"] = round(pol["capacity_rps"] / base_caps[best_name], 3) if best_name and base_caps[best_name] else None
        tg = pol.get("token_goodput_at_token_capacity")
        pol["x_best_baseline_token_goodput"] = (round(tg / base_tok[best_tok], 3)
                                                if tg is not None and best_tok and base_tok[best_tok] else None)  # fmt: skip
    result = {
        "trace": args.trace, "profile": args.profile, "replicas": args.replicas, "routers": args.routers,
        "fleet": fleet_desc, "max_model_len": args.max_model_len,
        "ttft_ms": args.ttft_ms, "tpot_ms": args.tpot_ms, "duration_s": args.duration_s, "warmup_s": args.warmup_s, "drain_s": args.drain_s,
        "push_period_ms": args.push_period_ms, "net_delay_ms": args.net_delay_ms, "queue": args.queue,
        "leases": not args.no_leases, "static_queue_cap_tokens": cap_tokens, "seed": args.seed,
        "window_offset": args.window_offset, "pab_margin_frac": args.pab_margin,
        "pab_margin_cap_tpots": args.pab_margin_cap_tpots if math.isfinite(args.pab_margin_cap_tpots) else "inf",
        "engine": {"max_num_batched_tokens": max_tokens, "max_num_seqs": max_seqs,
                   "vllm_serve_defaults": {"max_num_batched_tokens": serve.max_num_batched_tokens,
                                           "max_num_seqs": serve.max_num_seqs, "gpu": prof.gpu}},
        "arrival_spread_ms": spread_ms,
        "native_rps": round(native, 4), "windows_interleaved": args.windows or args.replicas,
        "prefix_caching": not args.no_prefix_caching,
        "work_shed": None if work_shed is None else dataclasses.asdict(work_shed),
        "requests_in_trace": n_trace, "requests_dropped_over_max_model_len": n_trace - len(kept),
        "time_model": {"a_ms": prof.time_model.a_ms, "b_ms_per_new_token": prof.time_model.b_ms_per_new_token,
                       "c_ms_per_context_token": prof.time_model.c_ms_per_context_token},
        "engine_time_model": describe_engine(engine_time),
        "kv_capacity_tokens": prof.kv_capacity_tokens,
        "analytic_bound": {"rps": round(bound.rps, 3), "per_replica_rps": round(bound.per_replica_rps, 4),
                           "iteration_ms": round(bound.iteration_ms, 2), "limit": bound.limit,
                           "mean_work_ms": round(bound.mean_work_ms, 3)},
        "steady_state_bound": {**steady_bound_json(steady, engine_time),
                               **({} if stream_requests is None else
                                  {"on": "stream", **stream_requests,
                                   "without_prefix_credit_rps": round(search_steady.rps, 3)})},
        "token_steady_state_bound": {**steady_bound_json(steady_tokens, engine_time),
                                     **({} if stream_tokens is None else {"on": "stream", **stream_tokens})},
        "best_baseline": best_name, "best_baseline_token_goodput": best_tok,
        "rates": rates or sorted({r["rate_rps"] for pol in policies.values() for r in pol["rows"]}),
        "search": None if search is None else dataclasses.asdict(search), "policies": policies,
        "wall_s": round(time.perf_counter() - t0, 1),
    }  # fmt: skip
    if args.bounds_only:  # only what was recomputed changes: the file's settings, rates, search and run time stay
        result = {**old, **{k: result[k] for k in ("analytic_bound", "steady_state_bound", "token_steady_state_bound",
                                                   "policies", "best_baseline", "best_baseline_token_goodput")}}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    if args.plot:
        plot(result, args.plot)
    print(f"{args.trace}, {args.replicas} x {args.profile}, TTFT {args.ttft_ms:g} / TPOT {args.tpot_ms:g} ms; "
          f"analytic bound {bound.rps:.1f} req/s ({bound.limit}-limited); steady-state bound (costliest 10 % may miss) "
          f"{steady.rps:.1f} req/s{' on the streams offered' if stream_requests and 'requests' not in failed else ''} "
          f"({steady.limit}-limited, step {steady.iteration_ms:.1f} ms); per-token "
          f"steady-state bound (costliest 10 % of the tokens may miss) {steady_tokens.rps:.1f} req/s"
          f"{' on the streams offered' if stream_tokens and 'tokens' not in failed else ''}; "
          f"engine step time {engine_label(engine_time)}")  # fmt: skip
    print("capacity = highest rate with SLO attainment >= 0.9, on the rate label and on the offered rate "
          "(requests in the window / window)")
    print("hits / load @cap: prefix-cache hit rate (hit / queried prompt tokens) and max / mean replica busy time "
          "at the highest swept rate with attainment >= 0.9")
    print("tok floor = highest rate with per-token attainment >= 0.9; tok goodput = prompt + output tokens/s of "
          "requests that met both TTFT and TPOT, at that rate; refused = refused share at the per-request capacity")
    print(f"{'policy':<24} {'capacity':>9} {'offered':>9} {'of bound':>9} {'of steady':>9} {'x RR':>6} {'x best':>7} "
          f"{'hits @cap':>9} {'load @cap':>9} {'tok floor':>9} {'tok goodput':>11} {'x best tok':>10} {'refused':>8}")
    for name, pol in policies.items():
        xr = pol["x_round_robin"]
        xb = pol["x_best_baseline"]
        below = pol["capacity_bound"] == "below-sweep"
        label = capacity_text(pol["capacity_rps"], pol["capacity_bound"], pol["rows"])
        offered = capacity_text(pol["offered_capacity_rps"], pol["offered_capacity_bound"], offered_by_policy[name])
        frac = "-" if below or pol["fraction_of_bound"] is None else f"{pol['fraction_of_bound']:.3f}"
        sfrac = "-" if below or pol.get("fraction_of_steady_bound") is None else f"{pol['fraction_of_steady_bound']:.3f}"
        at = [r for r in pol["rows"] if (r.get("slo_attainment") or 0.0) >= 0.9]
        top = max(at, key=lambda r: r["rate_rps"]) if at else None
        hits = "-" if top is None or top.get("prefix_cache_hit_rate") is None else f"{top['prefix_cache_hit_rate']:.3f}"
        load = "-" if top is None or top.get("max_load_ratio") is None else f"{top['max_load_ratio']:.2f}"
        tfloor = capacity_text(pol["capacity_token_floor_rps"], pol["capacity_token_floor_bound"], pol["rows"])
        xtg = pol.get("x_best_baseline_token_goodput")
        xt = "-" if xtg is None else f"{xtg:.2f}"
        rs = pol.get("refused_share_at_capacity")
        refused = "-" if rs is None else f"{100 * rs:.1f}%"
        print(f"{name:<24} {label:>9} {offered:>9} {frac:>9} {sfrac:>9} "
              f"{'-' if xr is None or below else f'{xr:.2f}':>6} {'-' if xb is None or below else f'{xb:.2f}':>7} "
              f"{hits:>9} {load:>9} {tfloor:>9} {pol['token_goodput_at_token_capacity'] or 0:>11.0f} {xt:>10} "
              f"{refused:>8}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

