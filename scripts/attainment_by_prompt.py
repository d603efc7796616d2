"""SLO attainment and refusals by prompt length, work-aware admission off and on (issue 12).

Runs one ``bench-fleet`` point (same setup as ``python -m loadgen.fleet.bench``: trace windows, tenants,
SLOs, the shipped realistic engine, ``reserve`` leases) twice on the same arrivals, without and with
``--work-shed`` (router/work_shed.py, default settings), and splits the counted requests by prompt
length: requests, share that met the SLO, refusals by reason. Shows *which* requests each run gives up.
Prints a table; writes JSON.

Usage::

    python scripts/attainment_by_prompt.py --trace azure-code --rate 130 --duration-s 300 --warmup-s 60 \\
        --out docs/evaluation/by-prompt-azure-code-16-130.json
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json

from loadgen.fleet.bench import add_point_args, build_arrivals, fleet_config, headline_setup, trace_rows
from loadgen.fleet.sim import run_fleet
from loadgen.sim.engine_time import load_engine_time_model
from loadgen.stats import Slo, meets_slo
from loadgen.traces import arrival_granularity_ms
from router.work_shed import WorkShedSettings

EDGES = (0, 500, 1000, 2000, 3000, 4000, 5400, 7000, 10_000, 32_768)
"""Prompt-length bins (tokens); 5,400 is about where azure-code's costliest 10 % by work begin."""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_point_args(ap, trace="azure-code", ttft_ms=1000.0, duration_s=300.0, warmup_s=60.0)
    ap.add_argument("--policy", default="pab+fairbatching")
    ap.add_argument("--drain-s", type=float, default=120.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    kept, native, _ = trace_rows(args.trace, arrival_granularity_ms(args.trace), 0)
    setup = headline_setup(kept, native, args.replicas, args.profile, args.ttft_ms, args.tpot_ms, args.duration_s,
                           args.drain_s, args.warmup_s, load_engine_time_model(None, args.profile))  # fmt: skip
    reqs = build_arrivals(kept, setup.native_rps, args.rate, args.duration_s, args.replicas, 0)
    slo = Slo(args.ttft_ms, args.tpot_ms)
    out: dict[str, object] = {"trace": args.trace, "profile": args.profile, "policy": args.policy, "rate_rps": args.rate,
                              "replicas": args.replicas, "duration_s": args.duration_s, "warmup_s": args.warmup_s,
                              "work_shed_settings": dataclasses.asdict(WorkShedSettings()), "runs": {}}  # fmt: skip
    for name, ws in (("off", None), ("on", WorkShedSettings())):
        res = run_fleet(fleet_config(dataclasses.replace(setup, work_shed=ws), args.policy), reqs)
        recs = [r for r in res.records if r.arrival_ms >= args.warmup_s * 1000.0]
        met = [meets_slo(r, slo) for r in recs]
        tokens = [r.prompt_tokens + (r.expected_output_tokens or r.output_tokens) for r in recs]
        bins = []
        for lo, hi in zip(EDGES, EDGES[1:]):
            sel = [i for i, r in enumerate(recs) if lo <= r.prompt_tokens < hi]
            rej = collections.Counter(recs[i].reason for i in sel if recs[i].outcome == "rejected")
            bins.append({"prompt_from": lo, "prompt_to": hi, "requests": len(sel),
                         "met": sum(met[i] for i in sel) / len(sel) if sel else None,
                         "served_late": sum(1 for i in sel if recs[i].outcome == "ok" and not met[i]),
                         "rejected": dict(rej)})  # fmt: skip
        run = {"slo_attainment": sum(met) / len(recs),
               "token_slo_attainment": sum(t for t, m in zip(tokens, met, strict=True) if m) / sum(tokens),
               "bins": bins}  # fmt: skip
        out["runs"][name] = run  # type: ignore[index]
        print(f"work_shed {name}: attainment {run['slo_attainment']:.4f} (tokens {run['token_slo_attainment']:.4f})")
        print(f"  {'prompt tokens':>14} {'requests':>9} {'met':>6} {'late':>6}  rejected")
        for b in bins:
            met_s = "-" if b["met"] is None else f"{b['met']:.3f}"
            print(f"  {b['prompt_from']:>6}-{b['prompt_to']:<7} {b['requests']:>9} {met_s:>6} {b['served_late']:>6}  "
                  f"{b['rejected']}")  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
