"""Benchmark the batching policies on one replica in virtual time (issue 4, docs/design.md section 8).

For each arrival rate of a sweep and each policy, replay the trace through one
:class:`~loadgen.sim.engine.SimEngine` on a virtual clock (loadgen/sim/virtual.py) and record:
SLO attainment (TTFT <= ttft_ms and TPOT <= tpot_ms, TPOT = (last - first token) / (n - 1),
docs/design.md section 2; loadgen/stats.py), TTFT and TPOT p50/p99, throughput and goodput (SLO-meeting
requests and their output tokens per second of the window).

Engine step time: ``--engine-time-model`` (default: the profile's shipped file, loadgen/data/engine_time/;
``policy`` = the profile's linear model, which the policies always plan with); the JSON names it
(``engine_time_model``, docs/engine-time-model.md).

Prefix caching: the engine keeps vLLM's automatic prefix cache (``--no-prefix-caching``: off); a
trace with ``hash_ids`` (the Mooncake traces: one id per 512-token prompt block, equal ids = equal
content) gives each prompt its block hashes (loadgen/sim/prefix_cache.py ``block_hashes_from_ids``),
as bench-fleet does, so prompts that share a prefix hit the cache; each row reports
``prefix_hit_ratio`` (hit tokens / queried prompt tokens, vLLM's ``prefix_cache_hits /
prefix_cache_queries``).

Rates: the trace's arrival times are divided by ``rate / native_rate`` (native_rate = requests /
trace span), then the first ``--duration-s`` seconds are kept; every kept request runs to
completion. Requests whose prompt + output exceed ``--max-model-len`` are dropped before the
sweep (counted in the JSON) since no single replica could serve them.

``envelope_attainment`` is the other yardstick, the one FairBatching optimises (arXiv 2510.14392, the
token-deadline envelope): the share of requests whose every token j came by arrival + ttft +
j * tpot (a request may bank time by running ahead and spend it later). ``--attainment envelope``
makes it define capacity; the default is the TTFT-and-TPOT attainment of docs/design.md section 2.

capacity_rps (docs/design.md section 2, DistServe's definition) = the highest rate with attainment >=
``--target`` (0.9): the last sweep point before attainment first falls below the target, linearly
interpolated between it and the next point (``capacity_bound`` says "interpolated",
"below-sweep" (the first point already misses: 0) or "at-least" (no point missed)). Each policy is
also run at the vllm-default capacity rate (``at_default_capacity``).

Run: ``python -m loadgen.bench_policies --trace azure-conv --profile llama-3-8b-a100 --ttft-ms 1000
--tpot-ms 100 --out bench.json --plot bench.png``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from loadgen.delivery import shift_token_times
from loadgen.sim.engine import EngineConfig, SimEngine
from loadgen.sim.engine_time import EngineTimeModel, describe_engine, engine_label
from loadgen.sim.prefix_cache import block_hashes_from_ids
from loadgen.bench_args import (
    add_engine_and_trace_args,
    add_engine_time_arg,
    resolve_engine_and_trace_args,
    resolve_engine_time,
)
from loadgen.sim.virtual import LivelockError, VirtualRequest, run_virtual
from loadgen.stats import OK, REJECTED, RequestRecord, Slo, figures
from loadgen.traces import PREFIX_BLOCK_TOKENS, TraceRequest, load_trace, resolve_trace, spread_arrivals
from replica_agent.policy.batching import POLICIES, PolicyConfig, make_policy
from replica_agent.policy.calibration import CalibratorConfig, OnlineTimeModel
from replica_agent.policy.envelope import Envelope
from replica_agent.policy.profiles import load_profile

DEFAULT_POLICIES = ("vllm-default", "fairbatching", "fcfs", "prefill-first")


@dataclass(frozen=True, slots=True)
class BenchSetup:
    """Everything one run needs (picklable, for worker processes).

    Attributes:
        trace: the filtered trace (arrivals in ms at the native rate).
        native_rps: requests per second of the trace as recorded.
        profile, variant: GPU profile name and fit variant.
        ttft_ms, tpot_ms: the SLO of every request (ms).
        duration_s: measured window after rate scaling (simulated s).
        max_num_batched_tokens, max_num_seqs, block_size, max_model_len: engine settings.
        token_budget: vllm-default's token budget (None -> max_num_batched_tokens).
        engine_time: the engine's own step time (None: the profile's time model, which the policy also uses).
        online_time_model: with ``engine_time``, the policy plans with an online time model learned from
            every step (replica_agent/policy/calibration.py, as the vLLM plugin does), starting from the
            profile; False: it keeps the profile's fixed model.
        prefix_caching: the engine's automatic prefix caching (vLLM's default); with it, a request's
            ``hash_ids`` give its prompt's block hashes (module docstring).
        engine_front_ms: time between a request's arrival and the engine core seeing it (ms; the API
            server's tokenization and hand-off, measured on real vLLM by ``make bench-vllm``,
            docs/vllm.md); TTFT still counts from the arrival. 0: none (the default).
        decode_guard_ms: FairBatching's decode guard (``PolicyConfig.decode_guard_ms``, ms; 0: none).
        delivery_ms: measured ``(d_first, d_last)`` pairs, centred (loadgen/delivery.py ``centred_pairs``):
            each request's client token times are its engine times shifted by one pair drawn at random
            (seeded by the engine model's seed); empty: every token delivered at its step's end.
    """

    trace: tuple[TraceRequest, ...]
    native_rps: float
    profile: str
    variant: str
    ttft_ms: float
    tpot_ms: float
    duration_s: float
    max_num_batched_tokens: int
    max_num_seqs: int
    block_size: int
    max_model_len: int
    token_budget: int | None
    engine_time: EngineTimeModel | None = None
    online_time_model: bool = True
    prefix_caching: bool = True
    engine_front_ms: float = 0.0
    decode_guard_ms: float = 0.0
    delivery_ms: tuple[tuple[float, float], ...] = ()


def run_point(setup: BenchSetup, policy: str, rate_rps: float, tpot_from_first_token: bool = True) -> dict[str, Any]:
    """One policy at one rate: the per-rate row of bench.json."""
    scale = rate_rps / setup.native_rps
    window_ms = setup.duration_s * 1000.0
    front = max(0.0, setup.engine_front_ms)  # the engine sees each request this long after its arrival
    reqs = []
    for i, r in enumerate(setup.trace):
        t = r.arrival_ms / scale
        if t >= window_ms:
            break
        prompt = max(1, r.prompt_tokens)
        hashes = (tuple(block_hashes_from_ids(r.hash_ids, PREFIX_BLOCK_TOKENS, setup.block_size, prompt))
                  if setup.prefix_caching and r.hash_ids else ())  # fmt: skip
        reqs.append(VirtualRequest(str(i), t + front, prompt, max(1, r.output_tokens), setup.ttft_ms, setup.tpot_ms,
                                   hashes))  # fmt: skip
    prof = load_profile(setup.profile, setup.variant)
    cfg = EngineConfig(
        time_model=prof.time_model,
        num_gpu_blocks=prof.kv_capacity_tokens // setup.block_size,
        block_size=setup.block_size,
        max_num_batched_tokens=setup.max_num_batched_tokens,
        max_num_seqs=setup.max_num_seqs,
        max_model_len=setup.max_model_len,
        engine_time=setup.engine_time,
        enable_prefix_caching=setup.prefix_caching,
    )
    pcfg = PolicyConfig(setup.ttft_ms, setup.tpot_ms, setup.token_budget, tpot_from_first_token, setup.decode_guard_ms)
    engine = SimEngine(cfg, make_policy(policy, pcfg))
    t0 = time.perf_counter()
    try:
        cal = (OnlineTimeModel(prof.time_model, CalibratorConfig(refit_every=4))
               if setup.engine_time is not None and setup.online_time_model else None)  # fmt: skip
        run = run_virtual(reqs, engine, calibrator=cal, policy_time_model=prof.time_model)
    except LivelockError as e:
        # the replica stopped serving: every SLO counts as missed at this rate
        return {"rate_rps": round(rate_rps, 4), "requests": len(reqs), "slo_attainment": 0.0,
                "envelope_attainment": 0.0, "error": str(e), "wall_s": round(time.perf_counter() - t0, 3)}  # fmt: skip
    wall_s = time.perf_counter() - t0
    pairs = setup.delivery_ms
    draw = (np.random.default_rng((setup.engine_time.seed if setup.engine_time else 0, 7)).integers(0, len(pairs), len(run.records))
            if pairs else None)  # fmt: skip
    client_times = [shift_token_times(rec.token_times_ms, pairs[draw[i]]) if draw is not None else rec.token_times_ms
                    for i, rec in enumerate(run.records)]  # what the client reads (delivery_ms)
    records = [
        RequestRecord("all", rec.request.arrival_ms - front, rec.request.prompt_tokens, len(rec.token_times_ms),
                      client_times[i], OK if rec.rejected is None else REJECTED, rec.rejected,
                      expected_output_tokens=rec.request.output_tokens)  # fmt: skip
        for i, rec in enumerate(run.records)
    ]
    fig = figures(records, {"all": Slo(setup.ttft_ms, setup.tpot_ms)}, setup.duration_s)
    envelope_met = sum(
        1 for i, rec in enumerate(run.records)
        if rec.rejected is None and len(rec.token_times_ms) == rec.request.output_tokens
        and Envelope(rec.request.arrival_ms - front, setup.ttft_ms, setup.tpot_ms).first_violation(client_times[i]) is None
    )
    ttft_miss = sum(1 for r in records if r.ttft_ms is None or r.ttft_ms > setup.ttft_ms)
    tpot_miss = sum(1 for r in records if (t := r.tpot_ms) is not None and t > setup.tpot_ms)
    n = max(1, len(records))
    return {
        "rate_rps": round(rate_rps, 4),
        "requests": len(records),
        "slo_attainment": fig.slo_attainment,
        "envelope_attainment": envelope_met / max(1, len(records)),
        "ttft_miss_frac": ttft_miss / n,
        "tpot_miss_frac": tpot_miss / n,
        "ttft_p50_ms": fig.ttft_ms.p50,
        "ttft_p99_ms": fig.ttft_ms.p99,
        "tpot_p50_ms": fig.tpot_ms.p50,
        "tpot_p99_ms": fig.tpot_ms.p99,
        "goodput_rps": fig.goodput_rps,
        "goodput_tokens_per_s": fig.goodput_tokens_per_s,
        "throughput_rps": fig.throughput_rps,
        "prefix_hit_ratio": engine.prefix_cache_hits / engine.prefix_cache_queries if engine.prefix_cache_queries else 0.0,
        "preemptions": run.preemptions,
        "steps": run.steps,
        "drain_end_s": run.end_ms / 1000.0,
        "wall_s": round(wall_s, 3),
    }


def capacity(rows: Sequence[dict[str, Any]], target: float, key: str = "slo_attainment") -> tuple[float, str]:
    """(capacity_rps, bound) from rows sorted by rate, judged by ``rows[i][key]``; see the module docstring."""
    prev = None
    for row in rows:
        att = row[key] or 0.0
        if att < target:
            if prev is None:
                return 0.0, "below-sweep"
            r0, a0 = prev["rate_rps"], prev[key]
            r1 = row["rate_rps"]
            return r0 + (a0 - target) / (a0 - att) * (r1 - r0), "interpolated"
        prev = row
    return (rows[-1]["rate_rps"] if rows else 0.0), "at-least"


def _job(args: tuple[BenchSetup, str, float, bool]) -> tuple[str, dict[str, Any]]:
    setup, policy, rate, anchored = args
    return policy, run_point(setup, policy, rate, anchored)


def _run_all(jobs: list[tuple[BenchSetup, str, float, bool]], workers: int) -> list[tuple[str, dict[str, Any]]]:
    if workers <= 1:
        return [_job(j) for j in jobs]
    with ProcessPoolExecutor(workers) as ex:
        return list(ex.map(_job, jobs))


def plot(result: dict[str, Any], path: str) -> None:
    """Attainment, TTFT p99 and TPOT p99 against rate, one line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for name, pol in result["policies"].items():
        rates = [r["rate_rps"] for r in pol["rows"]]
        axes[0].plot(rates, [r["slo_attainment"] for r in pol["rows"]], marker="o", label=name)
        nan = float("nan")  # rows of a livelocked run (key "error") have no latencies
        axes[1].plot(rates, [nan if r.get("ttft_p99_ms") is None else r["ttft_p99_ms"] for r in pol["rows"]],
                     marker="o", label=name)  # fmt: skip
        axes[2].plot(rates, [nan if r.get("tpot_p99_ms") is None else r["tpot_p99_ms"] for r in pol["rows"]],
                     marker="o", label=name)  # fmt: skip
    axes[0].axhline(result["target_attainment"], color="grey", ls="--", lw=1)
    axes[0].set_ylabel("SLO attainment")
    axes[1].set_ylabel("TTFT p99 (ms)")
    axes[1].set_yscale("log")
    axes[1].axhline(result["ttft_ms"], color="grey", ls="--", lw=1)
    axes[2].set_ylabel("TPOT p99 (ms)")
    axes[2].axhline(result["tpot_ms"], color="grey", ls="--", lw=1)
    for ax in axes:
        ax.set_xlabel("arrival rate (req/s)")
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(f"{result['trace']} on {result['profile']}: TTFT {result['ttft_ms']:g} ms, TPOT {result['tpot_ms']:g} ms")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    """Flags of ``bench-policies``."""
    p = argparse.ArgumentParser(
        prog="fairbatch-loadgen bench-policies",
        description="Benchmark the batching policies on one simulated replica in virtual time: sweep the "
        "arrival rate, record SLO attainment, TTFT/TPOT percentiles and goodput per policy and rate, and each "
        "policy's capacity (the highest rate with attainment >= --target-attainment).",
    )
    p.add_argument("--trace", required=True, help="embedded trace name (azure-conv, azure-code, mooncake-conv) or path")
    p.add_argument("--profile", default="llama-3-8b-a100",
                   help="GPU step-time profile: time model and KV capacity (default: llama-3-8b-a100)")
    p.add_argument("--variant", default="all_batches",
                   help="which fit of the profile (replica_agent/data/fitted_coefficients.csv; default: all_batches)")
    p.add_argument("--ttft-ms", type=float, required=True, help="TTFT target, simulated ms")
    p.add_argument("--tpot-ms", type=float, required=True, help="TPOT target, simulated ms")
    p.add_argument("--out", required=True, help="result JSON path, e.g. bench.json")
    p.add_argument("--plot", default=None, help="plot path, e.g. bench.png (optional)")
    p.add_argument("--rates", type=float, nargs="+", default=None,
                   help="arrival rates (req/s); default: 0.25..2.0 x the trace's native rate")  # fmt: skip
    p.add_argument("--duration-s", type=float, default=600.0, help="window of the rate-scaled trace (simulated s)")
    p.add_argument("--policies", nargs="+", default=list(DEFAULT_POLICIES), choices=sorted(POLICIES),
                   help=f"policies to compare (default: {' '.join(DEFAULT_POLICIES)})")
    p.add_argument("--target-attainment", "--target", dest="target", type=float, default=0.9,
                   help="SLO attainment that defines capacity (default: 0.9)")
    p.add_argument("--attainment", choices=("tpot", "envelope"), default="tpot",
                   help="what a met SLO means for capacity: TTFT and TPOT targets (docs/design.md section 2, default) or "
                        "every token inside the seed's deadline envelope")  # fmt: skip
    add_engine_and_trace_args(p)
    add_engine_time_arg(p)
    p.add_argument("--seed", type=int, default=0, help="seed of the arrival spread")
    p.add_argument("--trace-start-s", type=float, default=0.0,
                   help="start the window at this trace time (native s): skips a gap in the trace's start "
                        "(azure-code: 63 requests in 0-39 s, then nothing until 183 s)")  # fmt: skip
    p.add_argument("--block-size", type=int, default=16, help="KV cache block size, tokens (default: 16)")
    p.add_argument("--max-model-len", type=int, default=32768,
                   help="longer prompts of the trace are dropped, as vLLM refuses them (default: 32768)")
    p.add_argument("--token-budget", type=int, default=None,
                   help="vllm-default's chunked-prefill token budget (default: --max-num-batched-tokens)")  # fmt: skip
    p.add_argument("--seed-envelope", action="store_true",
                   help="FairBatching with the seed's envelope only (no first-token TPOT bound)")  # fmt: skip
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="engine without automatic prefix caching (default: on, as vLLM; a trace's hash_ids "
                        "give the prompts' shared blocks)")  # fmt: skip
    p.add_argument("--jobs", type=int, default=1, help="worker processes")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the sweep, write bench.json (and the plot), print a table. Returns the exit code."""
    args = build_parser().parse_args(argv)
    serve = resolve_engine_and_trace_args(args, args.variant)
    engine_time = resolve_engine_time(args)
    spread_ms = args.arrival_spread_ms
    full = spread_arrivals(load_trace(resolve_trace(args.trace)), spread_ms, args.seed)
    start_ms = args.trace_start_s * 1000.0
    after_start = [r for r in full if r.arrival_ms >= start_ms]
    kept = tuple(TraceRequest(r.arrival_ms - start_ms, r.prompt_tokens, r.output_tokens, r.hash_ids) for r in after_start
                 if r.prompt_tokens + max(1, r.output_tokens) <= args.max_model_len)
    if not kept:
        raise SystemExit(f"bench-policies: no request of {args.trace} at or after --trace-start-s {args.trace_start_s:g}")
    span_s = max(1e-9, (full[-1].arrival_ms - full[0].arrival_ms) / 1000.0)
    native = len(full) / span_s
    rates = sorted(args.rates) if args.rates else [round(native * f, 3) for f in (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0)]
    setup = BenchSetup(kept, native, args.profile, args.variant, args.ttft_ms, args.tpot_ms, args.duration_s,
                       args.max_num_batched_tokens, args.max_num_seqs, args.block_size, args.max_model_len,
                       args.token_budget, engine_time, prefix_caching=not args.no_prefix_caching)  # fmt: skip
    anchored = not args.seed_envelope
    t0 = time.perf_counter()
    results = _run_all([(setup, p, r, anchored) for p in args.policies for r in rates], args.jobs)
    policies: dict[str, Any] = {p: {"rows": []} for p in args.policies}
    for name, row in results:
        policies[name]["rows"].append(row)
    for pol in policies.values():
        pol["rows"].sort(key=lambda r: r["rate_rps"])
        cap, bound = capacity(pol["rows"], args.target,
                              "envelope_attainment" if args.attainment == "envelope" else "slo_attainment")
        pol["capacity_rps"] = round(cap, 4)
        pol["capacity_bound"] = bound
    base = "vllm-default" if "vllm-default" in policies else args.policies[0]
    base_cap = policies[base]["capacity_rps"]
    if base_cap > 0:
        for name, row in _run_all([(setup, p, base_cap, anchored) for p in args.policies], args.jobs):
            policies[name]["at_default_capacity"] = row
    result = {
        "trace": args.trace,
        "profile": args.profile,
        "variant": args.variant,
        "ttft_ms": args.ttft_ms,
        "tpot_ms": args.tpot_ms,
        "duration_s": args.duration_s,
        "target_attainment": args.target,
        "attainment": args.attainment,
        "native_rps": round(native, 4),
        "requests_in_trace": len(full),
        "requests_dropped_over_max_model_len": len(after_start) - len(kept),
        "engine": {"max_num_batched_tokens": args.max_num_batched_tokens, "max_num_seqs": args.max_num_seqs,
                   "block_size": args.block_size, "max_model_len": args.max_model_len,
                   "vllm_default_token_budget": args.token_budget or args.max_num_batched_tokens,
                   "fairbatching_tpot_from_first_token": anchored,
                   "vllm_serve_defaults": {"max_num_batched_tokens": serve.max_num_batched_tokens,
                                           "max_num_seqs": serve.max_num_seqs}},
        "engine_time_model": describe_engine(engine_time),
        "prefix_caching": not args.no_prefix_caching,
        "arrival_spread_ms": spread_ms,
        "trace_start_s": args.trace_start_s,
        "seed": args.seed,  # fmt: skip
        "baseline": base,
        "policies": policies,
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    if args.plot:
        plot(result, args.plot)
    print(f"{args.trace}: TTFT {args.ttft_ms:g} ms, TPOT {args.tpot_ms:g} ms, window {args.duration_s:g} s; "
          f"engine step time {engine_label(engine_time)}")
    print(f"{'policy':<14} {'capacity':>9} {'x base':>7} {'TTFT p99 @base cap':>19} {'attain @base cap':>17}")
    for name, pol in policies.items():
        at = pol.get("at_default_capacity") or {}
        ratio = pol["capacity_rps"] / base_cap if base_cap > 0 else float("nan")
        ttft = at.get("ttft_p99_ms")
        att = at.get("slo_attainment")
        ttft_s = "-" if ttft is None else str(round(ttft))
        att_s = "-" if att is None else f"{att:.3f}"
        bound = pol.get("capacity_bound")  # "at-least": the sweep's top rate met the target; "below-sweep": none did
        cap_s = {"at-least": f">={pol['capacity_rps']:.3f}", "below-sweep": "<sweep"}.get(bound, f"{pol['capacity_rps']:.3f}")
        print(f"{name:<14} {cap_s:>9} {ratio:>7.2f} {ttft_s:>19} {att_s:>17}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
