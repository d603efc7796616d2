"""Per-request breakdown of one bench-policies point (issue 27 item 5, docs/bench/fairbatching-paper.md).

Replays one trace at one rate through one simulated replica per policy, exactly as
``loadgen.bench_policies.run_point`` does (same engine, online time model, SLO), and reports which
requests miss: TTFT misses and TPOT misses by prompt-length bucket and TTFT p50/p99 per bucket.

Run: ``PYTHONPATH=. python scripts/fb_paper_breakdown.py --trace azure-conv --ttft-ms 500 --tpot-ms 25
--rate 3.78 --out breakdown.json`` (one sim per policy, about 15-30 s each on one core).
"""

from __future__ import annotations

import argparse
import json
import sys

from loadgen.bench_args import add_engine_and_trace_args, add_engine_time_arg, resolve_engine_and_trace_args, resolve_engine_time
from loadgen.sim.engine import EngineConfig, SimEngine
from loadgen.sim.virtual import VirtualRequest, run_virtual
from loadgen.traces import load_trace, resolve_trace, spread_arrivals
from replica_agent.policy.batching import PolicyConfig, make_policy
from replica_agent.policy.calibration import CalibratorConfig, OnlineTimeModel
from replica_agent.profiles import load_profile

BUCKETS = ((0, 512), (512, 1024), (1024, 2048), (2048, 4096), (4096, 8192), (8192, 1 << 30))


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", required=True)
    p.add_argument("--profile", default="llama-3-8b-a100")
    p.add_argument("--ttft-ms", type=float, required=True)
    p.add_argument("--tpot-ms", type=float, required=True)
    p.add_argument("--rate", type=float, required=True)
    p.add_argument("--duration-s", type=float, default=600.0)
    p.add_argument("--token-budget", type=int, default=None)
    p.add_argument("--trace-start-s", type=float, default=0.0)
    p.add_argument("--policies", nargs="+", default=["vllm-default", "fairbatching"])
    p.add_argument("--seed-envelope", action="store_true",
                   help="also run fairbatching on the seed's envelope alone (reported as fairbatching-seed-envelope)")
    p.add_argument("--out", required=True)
    add_engine_and_trace_args(p)
    add_engine_time_arg(p)
    args = p.parse_args(argv)
    resolve_engine_and_trace_args(args)
    engine_time = resolve_engine_time(args)
    full = spread_arrivals(load_trace(resolve_trace(args.trace)), args.arrival_spread_ms, 0)
    span_s = (full[-1].arrival_ms - full[0].arrival_ms) / 1000.0
    scale = args.rate / (len(full) / span_s)
    start = args.trace_start_s * 1000.0
    reqs = []
    for i, r in enumerate(x for x in full if x.arrival_ms >= start):
        t = (r.arrival_ms - start) / scale
        if t >= args.duration_s * 1000.0:
            break
        if r.prompt_tokens + max(1, r.output_tokens) > 32768:
            continue
        reqs.append(VirtualRequest(str(i), t, max(1, r.prompt_tokens), max(1, r.output_tokens), args.ttft_ms, args.tpot_ms))
    prof = load_profile(args.profile)
    out: dict = {"args": vars(args) | {"engine_time_model": str(args.engine_time_model)}, "requests": len(reqs), "policies": {}}
    runs = [(n, True) for n in args.policies]
    if args.seed_envelope:
        runs.append(("fairbatching", False))
    for name, anchored in runs:
        cfg = EngineConfig(time_model=prof.time_model, num_gpu_blocks=prof.kv_capacity_tokens // 16, block_size=16,
                           max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                           max_model_len=32768, engine_time=engine_time)
        eng = SimEngine(cfg, make_policy(name, PolicyConfig(args.ttft_ms, args.tpot_ms, args.token_budget, anchored)))
        cal = OnlineTimeModel(prof.time_model, CalibratorConfig(refit_every=4)) if engine_time is not None else None
        run = run_virtual(reqs, eng, calibrator=cal, policy_time_model=prof.time_model)
        rows = []
        for lo, hi in BUCKETS:
            recs = [r for r in run.records if lo <= r.request.prompt_tokens < hi and r.rejected is None]
            if not recs:
                continue
            ttfts = [r.ttft_ms for r in recs if r.ttft_ms is not None]
            tm = sum(1 for r in recs if r.ttft_ms is None or r.ttft_ms > args.ttft_ms)
            pm = sum(1 for r in recs if r.tpot_ms is not None and r.tpot_ms > args.tpot_ms)
            both_ok = sum(1 for r in recs if r.ttft_ms is not None and r.ttft_ms <= args.ttft_ms
                          and (r.tpot_ms is None or r.tpot_ms <= args.tpot_ms))
            rows.append({"prompt_tokens": f"[{lo}, {hi})", "n": len(recs), "ttft_miss": tm, "tpot_miss": pm,
                         "attained": both_ok, "ttft_p50_ms": _pct(ttfts, 0.5), "ttft_p99_ms": _pct(ttfts, 0.99)})
        n = len(run.records)
        att = sum(r["attained"] for r in rows) / max(1, n)
        all_ttft = [r.ttft_ms for r in run.records if r.ttft_ms is not None]
        if not anchored:
            name += "-seed-envelope"
        out["policies"][name] = {"slo_attainment": att, "ttft_p99_ms": _pct(all_ttft, 0.99), "steps": run.steps,
                                 "by_prompt": rows}
        print(f"{name}: attainment {att:.3f}, TTFT p99 {_pct(all_ttft, 0.99):.0f} ms, steps {run.steps}")
        for r in rows:
            print(f"  {r['prompt_tokens']:>16} n={r['n']:>5} ttft_miss={r['ttft_miss']:>4} tpot_miss={r['tpot_miss']:>4} "
                  f"ttft p50/p99 {r['ttft_p50_ms']:.0f}/{r['ttft_p99_ms']:.0f}")
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
