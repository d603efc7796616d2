"""How much of a trace's prompt is shareable by a prefix cache that keeps blocks only so long (issue 12).

The prefix-cache-corrected steady-state bound (loadgen/fleet/bound.py ``shared_prefix_tokens``) lets a
request skip the prefix it shares with *any* other request arriving no later than its TTFT deadline,
however long before: it assumes the cache kept that prefix since. A replica's KV cache holds
``kv_capacity_tokens``; while prompts arrive at R tokens per second per replica, an unpinned block is
overwritten after at most ``kv_capacity_tokens / R`` seconds (its turnover time; less while running
requests hold part of the cache). This script measures, on the stream ``bench-fleet`` offers at one rate,
the share of the counted prompt tokens that repeat a prefix first seen at most Δ seconds earlier (the
longest run of leading ``block_tokens`` ids the request shares with an earlier one seen within Δ, capped
at P - 1, as the bound counts), for several Δ, and prints the fleet's turnover time beside it. With Δ
unbounded it is the bound's own share, less the credit the bound gives to pairs that arrive within one
TTFT of each other in the other order.

For each Δ it also prints the steady-state bound's formula evaluated with only those shared prefixes
(``retention estimate``): not an upper bound (a cache that kept the shared blocks and evicted the rest
first could hold some prefixes longer than the turnover time), but what the bound gives if the cache
kept prefixes Δ seconds and no longer.

Usage::

    python scripts/prefix_retention.py --trace mooncake-conv --rate 16 --ttft-ms 2500 \\
        --out docs/evaluation/prefix-retention-mooncake-conv-16.json
"""

from __future__ import annotations

import argparse
import json
import math

from loadgen.fleet.bench import add_point_args, build_arrivals, trace_rows
from loadgen.fleet.bound import steady_state_bound
from loadgen.fleet.sim import FleetRequest
from loadgen.sim.engine_time import load_engine_time_model
from loadgen.sim.prefix_cache import chain_hashes
from loadgen.traces import arrival_granularity_ms
from replica_agent.policy.profiles import load_profile, vllm_serve_batch_defaults

DELTAS_S = (5.0, 15.0, 30.0, 60.0, 120.0, 300.0, math.inf)


def shared_within(reqs: list[FleetRequest], block_tokens: int, delta_ms: float) -> list[int]:
    """Per request (in the order of ``reqs``, which must be by arrival), the prompt tokens that repeat a
    prefix seen in an earlier request at most ``delta_ms`` before (module docstring), capped at P - 1."""
    last: dict[int, float] = {}
    out = []
    for r in reqs:
        keys = chain_hashes(r.prefix_ids)
        k = 0
        for j, key in enumerate(keys):
            seen = last.get(key)
            if seen is None or seen < r.arrival_ms - delta_ms:
                break
            k = j + 1
        out.append(min(r.prompt_tokens - 1, block_tokens * k))
        for key in keys:
            last[key] = r.arrival_ms
    return out


def shareable_within(reqs: list[FleetRequest], block_tokens: int, delta_ms: float, counted_from_ms: float) -> float:
    """Share of the prompt tokens of requests arriving at or after ``counted_from_ms`` that repeat a
    prefix seen in an earlier request (in arrival order) at most ``delta_ms`` before (module docstring)."""
    ordered = sorted(reqs, key=lambda x: x.arrival_ms)
    counted = [(r.prompt_tokens, h) for r, h in zip(ordered, shared_within(ordered, block_tokens, delta_ms), strict=True)
               if r.arrival_ms >= counted_from_ms]  # fmt: skip
    total = sum(p for p, _ in counted)
    return sum(h for _, h in counted) / total if total else 0.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_point_args(ap, trace="mooncake-conv", ttft_ms=2500.0, duration_s=600.0, warmup_s=120.0)
    ap.add_argument("--block-tokens", type=int, default=512, help="tokens per prefix id (512 for Mooncake)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    kept, native, _ = trace_rows(args.trace, arrival_granularity_ms(args.trace), 0)
    reqs = build_arrivals(kept, native, args.rate, args.duration_s, args.replicas, 0)
    t0 = args.warmup_s * 1000.0
    counted = [r for r in reqs if r.arrival_ms >= t0]
    window_s = args.duration_s - args.warmup_s
    rate_tokens = sum(r.prompt_tokens for r in counted) / window_s / args.replicas
    kv = load_profile(args.profile).kv_capacity_tokens
    turnover_s = kv / rate_tokens if rate_tokens > 0 else math.inf
    prof = load_profile(args.profile)
    model = load_engine_time_model(None, args.profile) or prof.time_model
    batch = vllm_serve_batch_defaults(prof.gpu).resolve(None, None)
    ordered = sorted(reqs, key=lambda x: x.arrival_ms)
    idx = [i for i, r in enumerate(ordered) if r.arrival_ms >= t0]
    rows = []
    for d in DELTAS_S:
        h = shared_within(ordered, args.block_tokens, d * 1000.0)
        est = steady_state_bound([ordered[i].prompt_tokens for i in idx], [ordered[i].output_tokens for i in idx],
                                 model, args.ttft_ms, args.tpot_ms, args.replicas, prof.kv_capacity_tokens,
                                 batch.max_num_seqs, batch.max_num_batched_tokens, 0.9,
                                 cached_tokens=[float(h[i]) for i in idx])  # fmt: skip
        rows.append({"delta_s": None if math.isinf(d) else d,
                     "shareable": round(shareable_within(reqs, args.block_tokens, d * 1000.0, t0), 4),
                     "retention_estimate_rps": round(est.rps, 2)})  # fmt: skip
    print(f"{args.trace} at {args.rate:g} req/s, {args.replicas} x {args.profile}: {len(counted)} counted requests, "
          f"{rate_tokens:,.0f} prompt tokens/s per replica; KV {kv:,} tokens per replica -> turnover "
          f"{turnover_s:.0f} s")  # fmt: skip
    print(f"{'prefix first seen within':>26} {'shareable share':>16} {'retention estimate (req/s)':>27}")
    for row in rows:
        d = "any time" if row["delta_s"] is None else f"{row['delta_s']:g} s"
        print(f"{d:>26} {row['shareable']:>16.3f} {row['retention_estimate_rps']:>27.1f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"trace": args.trace, "profile": args.profile, "rate_rps": args.rate, "replicas": args.replicas,
                       "ttft_ms": args.ttft_ms, "tpot_ms": args.tpot_ms,
                       "duration_s": args.duration_s, "warmup_s": args.warmup_s, "block_tokens": args.block_tokens,
                       "counted_requests": len(counted), "prompt_tokens_per_s_per_replica": round(rate_tokens, 1),
                       "kv_capacity_tokens": kv, "kv_turnover_s": round(turnover_s, 1), "rows": rows}, f, indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
