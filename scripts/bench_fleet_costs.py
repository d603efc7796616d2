"""Several routers and the cost of PAB routing (issue 7, item 4). Prints tables, writes JSON.

1. Double-spend: R = 1, 2, 8 router copies, each with its own stale view (pushes every
   ``--push-period-ms``, ``--net-delay-ms`` per hop), with and without leases, on a 16-replica
   fleet (loadgen/fleet/sim.py) past the analytic bound (1.2x, where budgets bind and Reserves
   are refused), engines at `vllm serve` defaults. A double-spend is a prefill admitted to a
   replica beyond its PAB at grant time (Reserve with leases, arrival without).
2. Push period: SLO attainment and goodput of ``pab+fairbatching`` at fixed rates for push periods
   10 ms .. 1 s, and the capacity interpolated between them (loadgen.bench_policies.capacity).
3. Cost: placement decision time (``policy.place`` over ``BudgetBook.views()``, wall us, p50/p99
   of 3000 decisions with seeded random budgets and prompts) and the router's budget-state memory
   (tracemalloc, one BudgetBook + policy) at 16, 64 and 256 replicas; budget messages per second
   per router = N * 1000 / push_period (snapshots) + Reserve answers (about one per request, more
   when refused; measured in part 1).

Run: ``python scripts/bench_fleet_costs.py --out docs/evaluation/costs.json``; one part only, keeping
the others already in the file: ``--skip double-spend push --merge`` (decision cost alone takes ~2 s).
Part 3 records the machine's load average (``os.getloadavg``) next to the times: they are wall times
of one Python thread and move with whatever else the machine runs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import tracemalloc
from typing import Any

import numpy as np

from loadgen.bench_policies import capacity
from loadgen.fleet.bench import Setup, analytic_bound, run_point
from loadgen.fleet.sim import _Snapshot
from loadgen.traces import load_trace, resolve_trace
from replica_agent.policy.pab import ClassBudget
from replica_agent.policy.profiles import load_profile, vllm_serve_batch_defaults
from router.budgets import BudgetBook
from router.placement import PlacementRequest, default_registry


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def now_ms(self) -> float:
        return self.t


def decision_cost(replicas: int, tm: Any, decisions: int = 3000, seed: int = 0) -> dict[str, Any]:
    """Placement time and router memory at ``replicas`` replicas (see the module docstring)."""
    rng = random.Random(seed)
    clock = _Clock()
    ids = [f"r{i}" for i in range(replicas)]
    tracemalloc.start()
    base = tracemalloc.take_snapshot()
    book = BudgetBook(clock, ids)  # type: ignore[arg-type]
    policy = default_registry().build("pab", seed=seed)
    for i, rid in enumerate(ids):
        pab = rng.uniform(0.0, 900.0)
        cb = ClassBudget("interactive", 900.0, pab, tm.tokens_within_ms(pab), 200_000, 1000.0, 100.0)
        book.update(rid, _Snapshot(1, tm, [cb], 1000.0, True, 32768))
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    mem = sum(s.size_diff for s in after.compare_to(base, "filename"))
    times = []
    for _ in range(decisions):
        p = int(rng.lognormvariate(7.0, 1.0))
        t0 = time.perf_counter()
        policy.place(PlacementRequest("interactive", p), book.views(0.0))
        times.append((time.perf_counter() - t0) * 1e6)
    return {"replicas": replicas, "p50_us": float(np.percentile(times, 50)), "p99_us": float(np.percentile(times, 99)),
            "router_state_bytes": int(mem), "bytes_per_replica": int(mem / replicas)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--trace", default="azure-conv")
    p.add_argument("--profile", default="llama-3-8b-a100")
    p.add_argument("--replicas", type=int, default=16)
    p.add_argument("--rate", type=float, default=None, help="req/s of part 1 (default 1.2 x analytic bound: past it, budgets bind and Reserves are refused)")
    p.add_argument("--push-rates", type=float, nargs="+", default=None, help="rates of part 2 (default 1.0/1.15/1.3 x bound)")
    p.add_argument("--push-periods", type=float, nargs="+", default=[10, 50, 100, 250, 500, 1000])
    p.add_argument("--push-period-ms", type=float, default=100.0)
    p.add_argument("--net-delay-ms", type=float, default=1.0)
    p.add_argument("--duration-s", type=float, default=30.0)
    p.add_argument("--skip", nargs="*", default=[], choices=["double-spend", "push", "cost"])
    p.add_argument("--merge", action="store_true", help="keep the parts already in --out that this run skips")
    args = p.parse_args(argv)
    prof = load_profile(args.profile)
    serve = vllm_serve_batch_defaults(prof.gpu)  # engines as `vllm serve` runs them on this GPU
    full = load_trace(resolve_trace(args.trace))
    kept = tuple(r for r in full if max(1, r.prompt_tokens) + max(1, r.output_tokens) <= 32768)
    native = len(kept) / ((full[-1].arrival_ms - full[0].arrival_ms) / 1000.0)
    bound = analytic_bound(kept, prof.time_model, prof.kv_capacity_tokens, 100.0, args.replicas)
    rate = args.rate or round(1.2 * bound.rps, 1)
    out: dict[str, Any] = {}
    if args.merge and os.path.exists(args.out):
        with open(args.out) as f:
            out = json.load(f)
    out |= {"trace": args.trace, "profile": args.profile, "replicas": args.replicas,
            "analytic_bound_rps": round(bound.rps, 2), "duration_s": args.duration_s}  # fmt: skip

    def setup(routers: int, push: float, leases: bool) -> Setup:
        return Setup(kept, native, args.replicas, args.profile, 1000.0, 100.0, args.duration_s, 60.0, routers,
                     push, args.net_delay_ms, "fair", 0, leases, 32768, 0,
                     serve.max_num_batched_tokens, serve.max_num_seqs)  # fmt: skip

    if "double-spend" not in args.skip:
        rows = []
        print(f"double-spend: {args.replicas} replicas, {rate} req/s, push {args.push_period_ms:g} ms, "
              f"net delay {args.net_delay_ms:g} ms")  # fmt: skip
        print(f"{'routers':>7} {'leases':>6} {'double-spends':>13} {'grants':>7} {'refusals':>8} {'attain':>7} {'msgs/s/router':>13}")
        for routers in (1, 2, 8):
            for leases in (True, False):
                row = run_point(setup(routers, args.push_period_ms, leases), "pab+fairbatching", rate)
                msgs = row["snapshots_per_s_per_router"] + (row["grants"] + row["refusals"]) / row["sim_end_s"] / routers
                rows.append({"routers": routers, "leases": leases, "double_spends": row["double_spends"],
                             "grants": row["grants"], "refusals": row["refusals"],
                             "slo_attainment": row["slo_attainment"], "snapshots_per_s_per_router":
                             row["snapshots_per_s_per_router"], "messages_per_s_per_router": msgs})  # fmt: skip
                print(f"{routers:>7} {str(leases):>6} {row['double_spends']:>13} {row['grants']:>7} "
                      f"{row['refusals']:>8} {row['slo_attainment']:>7.3f} {msgs:>13.0f}", flush=True)  # fmt: skip
        out["double_spend"] = {"rate_rps": rate, "push_period_ms": args.push_period_ms,
                               "net_delay_ms": args.net_delay_ms, "rows": rows}  # fmt: skip

    if "push" not in args.skip:
        rates = args.push_rates or [round(f * bound.rps, 1) for f in (1.0, 1.15, 1.3)]
        print(f"push period: pab+fairbatching, 1 router, rates {rates}")
        prow = []
        for period in args.push_periods:
            rows = [run_point(setup(1, period, True), "pab+fairbatching", r) for r in rates]
            cap, how = capacity(rows, 0.9)
            prow.append({"push_period_ms": period, "capacity_rps": round(cap, 2), "capacity_bound": how,
                         "attainment": [r["slo_attainment"] for r in rows],
                         "goodput_rps": [r["goodput_rps"] for r in rows]})  # fmt: skip
            print(f"  {period:>6g} ms: capacity {cap:7.2f} ({how}); attainment "
                  + " ".join(f"{r['slo_attainment']:.3f}" for r in rows), flush=True)
        out["push_period"] = {"rates_rps": rates, "rows": prow}

    if "cost" not in args.skip:
        load_before = os.getloadavg()
        print(f"decision cost (pab placement over BudgetBook views), load average {load_before[0]:.2f}:")
        crow = []
        for n in (16, 64, 256):
            c = decision_cost(n, prof.time_model)
            c["snapshots_per_s_per_router_at_100ms"] = n * 10.0
            crow.append(c)
            print(f"  {n:>4} replicas: p50 {c['p50_us']:.1f} us, p99 {c['p99_us']:.1f} us, "
                  f"router state {c['router_state_bytes'] / 1024:.0f} KiB, {n * 10} snapshots/s at 100 ms", flush=True)
        out["decision_cost"] = crow
        out["decision_cost_load_average"] = {"before": [round(x, 2) for x in load_before],
                                             "after": [round(x, 2) for x in os.getloadavg()],
                                             "cpus": os.cpu_count()}  # fmt: skip
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
