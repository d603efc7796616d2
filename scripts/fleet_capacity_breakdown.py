"""Where a fleet's GPU time goes at one operating point (issue 12: the bound ratio on azure-code).

Runs one ``bench-fleet`` point (same setup as ``python -m loadgen.fleet.bench``: trace windows, tenants,
SLOs, engines at the shipped realistic step time) with every engine step recorded, and splits the
replica-time of the counted window [warm-up, end of arrivals] into

- ``idle``: no step running;
- ``fixed``: each step's fixed cost ``a`` (times the step's noise factor);
- ``met`` / ``missed`` / ``uncounted``: the rest of each step, charged to its requests in proportion to
  their marginal cost under the engine's model (``b*n + c*prefix + d + e*n*prefix + f*n^2`` for a chunk of
  n tokens over ``prefix`` computed ones), by the request's fate: met its SLO, served but missed it
  (late TTFT, slow TPOT, cut at the drain), or arrived in the warm-up (not counted);

and compares with the steady-state bound (loadgen/fleet/bound.py): the work its served set needs per
second at the bound's step length, and the minimal work ``W_i(T)`` of the requests this policy met. Also
reports what was shed (prompt-length quantiles of rejected vs met requests). Prints a table; writes JSON.

Usage::

    python scripts/fleet_capacity_breakdown.py --trace azure-code --policy pab+fairbatching --rate 110 \\
        --duration-s 600 --warmup-s 120 --drain-s 120 --out docs/evaluation/breakdown-azure-code-110.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from typing import Any

import numpy as np

from loadgen.fleet.bench import add_point_args, build_arrivals, fleet_config, headline_setup, trace_rows
from loadgen.fleet.bound import WorkModel, request_work_ms, steady_state_bound
from loadgen.fleet.sim import FleetSim
from loadgen.sim.engine import SimEngine
from loadgen.sim.engine_time import load_engine_time_model
from loadgen.stats import OK, Slo, meets_slo
from loadgen.traces import arrival_granularity_ms
from replica_agent.policy.profiles import load_profile


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_point_args(ap, trace=None, ttft_ms=1000.0, duration_s=600.0, warmup_s=120.0)
    ap.add_argument("--policy", default="pab+fairbatching")
    ap.add_argument("--drain-s", type=float, default=120.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    prof = load_profile(args.profile)
    et = load_engine_time_model(None, args.profile)
    if et is None:
        raise SystemExit("the profile has no shipped engine file")
    kept, native, _ = trace_rows(args.trace, arrival_granularity_ms(args.trace), 0)
    setup = headline_setup(kept, native, args.replicas, args.profile, args.ttft_ms, args.tpot_ms, args.duration_s,
                           args.drain_s, args.warmup_s, et)  # fmt: skip
    reqs = build_arrivals(kept, setup.native_rps, args.rate, args.duration_s, args.replicas, 0)

    wm = WorkModel.of(et)
    steps: list[tuple[float, float, float, list[tuple[str, float]]]] = []  # start, duration, fixed, charges
    shape: list[tuple[float, float, int, int]] = []  # start, duration, new tokens, prompt tokens left after it
    done: dict[int, dict[str, int]] = defaultdict(dict)  # engine -> request id -> tokens computed so far
    orig_step = SimEngine.step

    def step(self: SimEngine, now_ms: float):  # type: ignore[no-untyped-def]
        res = orig_step(self, now_ms)
        seen = done[id(self)]
        for rid in res.preempted:
            seen.pop(rid, None)
        if res.duration_ms <= 0:
            return res
        costs = []
        for rid, n in res.batch.items:
            x = seen.get(rid)
            if x is None:  # first chunk: a prefix-cache hit starts it past 0
                req = self.requests.get(rid)
                x = (req.computed_tokens - n) if req is not None else 0
            costs.append((rid, wm.b * n + wm.c * x + wm.d + wm.e * n * x + wm.f * n * n))
            seen[rid] = x + n
        model = wm.a + sum(c for _, c in costs)
        k = res.duration_ms / model
        steps.append((res.start_ms, res.duration_ms, wm.a * k, [(rid, c * k) for rid, c in costs]))
        left = sum(max(0, r.prompt_tokens - r.computed_tokens) for r in self.requests.values())
        shape.append((res.start_ms, res.duration_ms, res.batch.num_new_tokens, left))
        return res

    SimEngine.step = step  # type: ignore[method-assign]
    try:
        sim = FleetSim(fleet_config(setup, args.policy), reqs)
        res = sim.run()
    finally:
        SimEngine.step = orig_step  # type: ignore[method-assign]

    slo = Slo(args.ttft_ms, args.tpot_ms)
    t0, t1 = args.warmup_s * 1000.0, args.duration_s * 1000.0
    fate: dict[str, str] = {}
    for idx, rec in enumerate(res.records):
        if rec.arrival_ms < t0:
            fate[str(idx)] = "uncounted"
        elif meets_slo(rec, slo):
            fate[str(idx)] = "met"
        else:
            fate[str(idx)] = "missed"
    gpu = defaultdict(float)  # request id -> GPU ms charged, whole run
    for _, _, _, charges in steps:
        for rid, c in charges:
            gpu[rid] += c
    win = defaultdict(float)
    for start, dur, fixed, charges in steps:
        lo, hi = max(start, t0), min(start + dur, t1)
        if hi <= lo:
            continue
        share = (hi - lo) / dur
        win["fixed"] += fixed * share
        for rid, c in charges:
            win[fate.get(rid, "uncounted")] += c * share
    total = args.replicas * (t1 - t0)
    win["idle"] = total - sum(win.values())

    counted = [(i, r) for i, r in enumerate(res.records) if r.arrival_ms >= t0]
    p = np.array([r.prompt_tokens for _, r in counted], dtype=float)
    o = np.array([max(1, r.expected_output_tokens) for _, r in counted], dtype=float)
    kinds = np.array([("rejected" if r.outcome != OK and not r.token_times_ms else
                       "met" if meets_slo(r, slo) else "served-missed") for _, r in counted])  # fmt: skip
    bound = steady_state_bound(p, o, et, args.ttft_ms, args.tpot_ms, args.replicas, prof.kv_capacity_tokens,
                               setup.max_num_seqs, setup.max_num_batched_tokens, 0.9)  # fmt: skip
    w = request_work_ms(p, o, et, bound.iteration_ms, args.ttft_ms, setup.max_num_batched_tokens)
    window_s = (t1 - t0) / 1000.0
    n = len(counted)
    q = math.ceil(0.9 * n)
    order = np.argsort(w)
    bound_set = np.zeros(n, dtype=bool)
    bound_set[order[:q]] = True
    met = kinds == "met"

    # Steps of the counted window in 1 s bins by whether requests were shed (rejected) in that second: are
    # steps short (fixed cost paid often) while the router sheds?
    rej_s = {int(r.arrival_ms // 1000) for _, r in counted if r.outcome != OK and not r.token_times_ms}
    sh = np.array([x for x in shape if t0 <= x[0] < t1])
    shed_bin = np.array([int(x // 1000) in rej_s for x in sh[:, 0]])
    sat = sh[:, 3] > 0

    def stat(mask: np.ndarray) -> dict[str, float]:
        if not mask.any():
            return {}
        d = sh[mask, 1]
        return {"steps": int(mask.sum()), "time_share": round(float(d.sum() / sh[:, 1].sum()), 4),
                "mean_step_ms": round(float(d.mean()), 2), "mean_new_tokens": round(float(sh[mask, 2].mean()), 1),
                "saturated_frac": round(float(sat[mask].mean()), 4),
                "fixed_frac": round(float(wm.a * wm.mean_factor * mask.sum() / d.sum()), 4)}  # fmt: skip

    def frac(x: float) -> float:
        return round(x / total, 4)

    spent = np.array([gpu.get(str(i), 0.0) for i, _ in counted])
    swap = {
        "met_outside_bound_set": int((met & ~bound_set).sum()),
        "their_gpu_frac": frac(float(spent[met & ~bound_set].sum())),
        "bound_set_not_met": int((~met & bound_set).sum()),
        "their_min_work_frac": frac(float(w[~met & bound_set].sum())),
        "served_missed_gpu_frac": frac(float(spent[kinds == "served-missed"].sum())),
    }

    out: dict[str, Any] = {
        "trace": args.trace, "profile": args.profile, "policy": args.policy, "rate_rps": args.rate,
        "replicas": args.replicas, "duration_s": args.duration_s, "warmup_s": args.warmup_s, "drain_s": args.drain_s,
        "engine_time": "shipped:" + args.profile,
        "counted_requests": n, "attainment": float(met.mean()),
        "token_attainment": float((p + o)[met].sum() / (p + o).sum()),
        "replica_time_split": {k: frac(v) for k, v in sorted(win.items())},
        "bound": {"rps": bound.rps, "iteration_ms": bound.iteration_ms, "limit": bound.limit},
        "bound_fixed_frac": round(wm.mean_factor * wm.a / bound.iteration_ms, 4),
        "bound_work_frac_at_this_rate": round(float(w[bound_set].sum()) / window_s / 1000.0 / args.replicas, 4),
        "met_min_work_frac": round(float(w[met].sum()) / window_s / 1000.0 / args.replicas, 4),
        "met_requests": int(met.sum()), "bound_set_requests": q,
        "met_tokens_per_request": float((p + o)[met].mean()),
        "bound_set_tokens_per_request": float((p + o)[bound_set].mean()),
        "met_and_in_bound_set": int((met & bound_set).sum()),
        "swap": swap,
        "prompt_quantiles": {k: [float(np.quantile(p[kinds == k], x)) for x in (0.1, 0.5, 0.9, 0.99)]
                             for k in ("met", "served-missed", "rejected") if (kinds == k).any()},
        "counts": {k: int((kinds == k).sum()) for k in ("met", "served-missed", "rejected")},
        "steps": len(steps), "wall_s": res.wall_s,
        "seconds_with_shedding": len(rej_s & set(range(int(t0 // 1000), int(t1 // 1000)))),
        "steps_in_seconds_with_shedding": stat(shed_bin), "steps_in_seconds_without": stat(~shed_bin),
        "steps_saturated": stat(sat), "steps_unsaturated": stat(~sat),
    }  # fmt: skip
    print(json.dumps(out, indent=1))
    print()
    print("| trace | policy | rate | attainment req / tok | idle | fixed (a) | met work | missed work | warm-up work |"
          " met: min work W(T) | bound: work of its served set at this rate |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    s = out["replica_time_split"]
    print(f"| {args.trace} | {args.policy} | {args.rate:g} | {out['attainment']:.3f} / {out['token_attainment']:.3f} |"
          f" {s.get('idle', 0):.3f} | {s.get('fixed', 0):.3f} | {s.get('met', 0):.3f} | {s.get('missed', 0):.3f} |"
          f" {s.get('uncounted', 0):.3f} | {out['met_min_work_frac']:.3f} | {out['bound_work_frac_at_this_rate']:.3f}"
          f" (+ fixed {out['bound_fixed_frac']:.3f}) |")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
