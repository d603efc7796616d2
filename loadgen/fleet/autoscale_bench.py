"""Autoscaling benchmark: a rate that ramps up and down, three ways to size the fleet.

``python -m loadgen.fleet.autoscale_bench --trace azure-conv --max-replicas 8 --out autoscale.json``
(``fairbatch-loadgen bench-autoscale``). One fleet simulation (loadgen/fleet/sim.py, PAB routing,
the router's queue and shedding) per row, same arrivals:

- ``fixed-peak``: ``--max-replicas`` replicas all the time (the fleet sized for the peak);
- ``pab``: the fairbatch rule (router/autoscale.py ``pab_desired``: out when the router queue waits
  and no replica has PAB left, in when the spare PAB exceeds one idle replica's horizon);
- ``num-waiting``: the HPA ``AverageValue`` rule on the engines' ``vllm:num_requests_waiting``
  (router/autoscale.py ``waiting_desired``; vLLM production-stack's KEDA example scales on it),
  behind fairbatch's router (which keeps the waiting in its own queue);
- ``num-waiting-direct``: the same rule behind a round-robin router that forwards at once (vLLM
  production-stack's setup: the requests wait in the engines, where the metric sees them).

Both autoscalers start at ``--min-replicas``, are evaluated every ``--eval-s`` (the HPA's 15 s),
stabilize scale-in over ``--stabilization-s`` (the HPA's 300 s) and pay ``--startup-s`` between a
scale-out decision and the new replica serving (GPU time is paid from the decision on).

Arrivals: the trace's stream at the peak rate (loadgen/fleet/bench.py ``build_arrivals``), thinned
with probability ``rate(t) / peak`` (seeded): ``rate(t)`` is ``--low-fraction`` of the peak for the
first and last 15 % of ``--duration-s``, ramps linearly to the peak over the next 25 %, holds it
for 20 %, and ramps back down. The peak defaults to ``--peak-fraction`` of the analytic bound of
``--max-replicas`` replicas (loadgen/fleet/bench.py ``analytic_bound``).

The engines step at their own time model (``--engine-time-model``, default the profile's shipped
file, as ``bench-fleet``), never at the model the policy plans with; engine batch limits default to
``vllm serve``'s for the profile's GPU.

Reported per row: GPU-hours (replica-hours allocated, starting and draining included, until the
last request is served), SLO attainment over all requests (rejected and failed are misses,
loadgen/stats.py), TTFT p99, mean and peak allocated replicas, scale events.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from loadgen.bench_args import (
    add_engine_and_trace_args,
    add_engine_time_arg,
    resolve_engine_and_trace_args,
    resolve_engine_time,
)
from loadgen.fleet.bench import TENANTS, Setup, analytic_bound, build_arrivals, fleet_config
from loadgen.fleet.sim import AutoscaleConfig, FleetRequest, run_fleet
from loadgen.sim.engine_time import describe_engine
from loadgen.stats import Slo, figures
from loadgen.traces import load_trace, resolve_trace, spread_arrivals
from replica_agent.policy.profiles import load_profile

VARIANTS = ("fixed-peak", "pab", "num-waiting", "num-waiting-direct")
"""Rows: fleet sizing (and, for ``num-waiting-direct``, the router: round-robin without a router
queue, as vLLM production-stack's router, so requests wait inside the engines)."""


def ramp_rate(t_s: float, duration_s: float, low: float, peak: float) -> float:
    """The ramp of the module docstring at ``t_s`` (requests/s): low, up, peak, down, low."""
    x = t_s / duration_s
    if x < 0.15 or x >= 0.85:
        return low
    if x < 0.40:
        return low + (peak - low) * (x - 0.15) / 0.25
    if x < 0.60:
        return peak
    return peak - (peak - low) * (x - 0.60) / 0.25


def thin(reqs: Sequence[FleetRequest], duration_s: float, low: float, peak: float, seed: int) -> list[FleetRequest]:
    """Keep each request of a ``peak``-rate stream with probability ``ramp_rate(t) / peak``."""
    rng = random.Random(seed + 7)
    return [r for r in reqs if rng.random() < ramp_rate(r.arrival_ms / 1000.0, duration_s, low, peak) / peak]


def run_variant(setup: Setup, variant: str, reqs: list[FleetRequest], args: argparse.Namespace) -> dict[str, Any]:
    """One row: the fleet of ``variant`` on ``reqs``."""
    cfg = fleet_config(setup, "round-robin" if variant == "num-waiting-direct" else "pab")
    if variant != "fixed-peak":
        cfg = replace(cfg, autoscale=AutoscaleConfig(
            variant.removesuffix("-direct"), args.min_replicas, args.min_replicas, args.startup_s * 1000.0, args.eval_s * 1000.0,
            args.stabilization_s * 1000.0, args.waiting_target))  # fmt: skip
    res = run_fleet(cfg, reqs)
    slo = Slo(setup.ttft_ms, setup.tpot_ms)
    fig = figures(res.records, {t: slo for t, _ in TENANTS}, setup.duration_s)
    st = res.stats
    timeline = st.replica_timeline
    end = max(st.end_ms, 1e-9)
    return {
        "variant": variant,
        "requests": len(res.records),
        "gpu_hours": st.gpu_ms / 3.6e6,
        "slo_attainment": fig.slo_attainment,
        "ttft_p99_ms": fig.ttft_ms.p99,
        "rejected": sum(fig.rejected.values()),
        "mean_replicas": st.gpu_ms / end,
        "peak_replicas": max(n for _, n in timeline),
        "scale_outs": st.scale_outs,
        "scale_ins": st.scale_ins,
        "sim_end_s": end / 1000.0,
        "wall_s": round(res.wall_s, 1),
        "timeline": [(round(t / 1000.0, 1), n) for t, n in timeline],
    }


def table(rows: Sequence[dict[str, Any]]) -> str:
    """The markdown table of the rows (docs/evaluation)."""
    head = "| fleet | GPU-hours | vs fixed | SLO attainment | TTFT p99 ms | rejected | mean / peak replicas | scale out / in |"
    lines = [head, "|" + "---|" * 8]
    base = next((r["gpu_hours"] for r in rows if r["variant"] == "fixed-peak"), None)
    for r in rows:
        rel = f"{r['gpu_hours'] / base:.2f}x" if base else "-"
        p99 = f"{r['ttft_p99_ms']:.0f}" if r["ttft_p99_ms"] is not None else "-"
        lines.append(f"| {r['variant']} | {r['gpu_hours']:.3f} | {rel} | {r['slo_attainment']:.3f} | {p99} | "
                     f"{r['rejected']} | {r['mean_replicas']:.2f} / {r['peak_replicas']} | "
                     f"{r['scale_outs']} / {r['scale_ins']} |")  # fmt: skip
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """Flags of ``bench-autoscale``."""
    p = argparse.ArgumentParser(prog="fairbatch-loadgen bench-autoscale", description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", default="azure-conv")
    p.add_argument("--profile", default="llama-3-8b-a100")
    p.add_argument("--max-replicas", type=int, default=8, help="the fixed fleet and the autoscalers' maximum")
    p.add_argument("--min-replicas", type=int, default=2)
    p.add_argument("--ttft-ms", type=float, default=1000.0)
    p.add_argument("--tpot-ms", type=float, default=100.0)
    p.add_argument("--duration-s", type=float, default=1200.0, help="arrival window (simulated s)")
    p.add_argument("--drain-s", type=float, default=120.0)
    p.add_argument("--peak-rps", type=float, default=None, help="peak rate (default: --peak-fraction of the bound)")
    p.add_argument("--peak-fraction", type=float, default=0.7)
    p.add_argument("--low-fraction", type=float, default=0.2, help="low rate as a fraction of the peak")
    p.add_argument("--startup-s", type=float, default=60.0, help="scale-out decision to serving (model load)")
    p.add_argument("--eval-s", type=float, default=15.0)
    p.add_argument("--stabilization-s", type=float, default=300.0)
    p.add_argument("--waiting-target", type=float, default=5.0, help="num-waiting: waiting requests per replica")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="autoscale.json")
    add_engine_and_trace_args(p)
    add_engine_time_arg(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the rows, print the table, write the JSON. Returns the exit code."""
    args = build_parser().parse_args(argv)
    resolve_engine_and_trace_args(args)
    engine_time = resolve_engine_time(args)
    full = spread_arrivals(load_trace(resolve_trace(args.trace)), args.arrival_spread_ms, args.seed)
    kept = tuple(r for r in full if r.prompt_tokens + r.output_tokens <= 32768)
    native = len(kept) / max(1e-9, (full[-1].arrival_ms - full[0].arrival_ms) / 1000.0)
    prof = load_profile(args.profile)
    bound = analytic_bound(kept, prof.time_model, prof.kv_capacity_tokens, args.tpot_ms, args.max_replicas,
                           args.max_num_seqs, args.max_num_batched_tokens)  # fmt: skip
    peak = args.peak_rps or round(bound.rps * args.peak_fraction, 2)
    low = peak * args.low_fraction
    setup = Setup(kept, native, args.max_replicas, args.profile, args.ttft_ms, args.tpot_ms, args.duration_s,
                  args.drain_s, 1, 100.0, 0.5, "fair", 0, True, 32768, args.seed, args.max_num_batched_tokens,
                  args.max_num_seqs, engine_time=engine_time)  # fmt: skip
    reqs = thin(build_arrivals(kept, native, peak, args.duration_s, args.max_replicas, args.seed), args.duration_s,
                low, peak, args.seed)  # fmt: skip
    t0 = time.perf_counter()
    rows = []
    for v in args.variants:
        rows.append(run_variant(setup, v, reqs, args))
        print(f"bench-autoscale: {v} done ({rows[-1]['wall_s']} s)", file=sys.stderr)
    doc = {
        "command": "fairbatch-loadgen bench-autoscale " + " ".join(argv if argv is not None else sys.argv[1:]),
        "trace": args.trace, "profile": args.profile, "max_replicas": args.max_replicas,
        "min_replicas": args.min_replicas, "ttft_ms": args.ttft_ms, "tpot_ms": args.tpot_ms,
        "duration_s": args.duration_s, "peak_rps": peak, "low_rps": low, "bound_rps": bound.rps,
        "startup_s": args.startup_s, "eval_s": args.eval_s, "stabilization_s": args.stabilization_s,
        "waiting_target": args.waiting_target, "requests": len(reqs),
        "engine_time_model": describe_engine(engine_time), "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_num_seqs": args.max_num_seqs, "rows": rows,
        "wall_s": round(time.perf_counter() - t0, 1),
    }  # fmt: skip
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=2)
    print(f"{args.trace}, {args.max_replicas} x {args.profile} max, peak {peak:g} req/s (bound {bound.rps:.1f}), "
          f"low {low:.2f} req/s, {len(reqs)} requests over {args.duration_s:g} s; startup {args.startup_s:g} s")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
