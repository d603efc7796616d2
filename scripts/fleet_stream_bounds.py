"""The bounds of loadgen/fleet/bound.py on the stream each row of a fleet.json offered (no simulation).

bench-fleet writes ``stream_steady_bound_rps``, ``attainment_bound`` and ``interval_attainment_bound`` into
every row it runs (loadgen/fleet/bench.py ``stream_bounds``); this recomputes them for the rates of a JSON
written before those fields existed, from the same setup (trace, fleet, SLOs, window, engine), and prints a
table (the last column: the smaller of the two attainment bounds, both valid, and which one it is). The rows'
fields go to stderr as JSON.

Usage::

    python scripts/fleet_stream_bounds.py docs/evaluation/steady-mooncake-conv-16.json [--rates 12 16 20] \
        [--grid-s 1] [--max-span-s 120]
"""

from __future__ import annotations

import argparse
import json
import sys

from loadgen.fleet.bench import Setup, build_arrivals, stream_bounds, trace_rows
from loadgen.fleet.sim import FleetConfig
from loadgen.sim.engine_time import load_engine_time_model


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("fleet_json")
    ap.add_argument("--rates", type=float, nargs="+", default=None, help="default: every rate of the file")
    ap.add_argument("--grid-s", type=float, default=1.0, help="interval bound: grid of span end points (s)")
    ap.add_argument("--max-span-s", type=float, default=120.0, help="interval bound: longest span (s)")
    args = ap.parse_args(argv)
    with open(args.fleet_json, encoding="utf-8") as fh:
        d = json.load(fh)
    engine = d.get("engine_time_model") or {}
    spec = engine.get("name") if isinstance(engine, dict) else engine
    et = load_engine_time_model(None if spec in (None, f"shipped:{d['profile'].lower()}") else spec, d["profile"])
    kept, native, _ = trace_rows(d["trace"], d["arrival_spread_ms"], d["seed"])
    e = d["engine"]
    setup = Setup(kept, native, d["replicas"], d["profile"], d["ttft_ms"], d["tpot_ms"], d["duration_s"],
                  d["drain_s"], d["routers"], d["push_period_ms"], d["net_delay_ms"], d["queue"],
                  d["static_queue_cap_tokens"], d["leases"], 32768, d["seed"], e["max_num_batched_tokens"],
                  e["max_num_seqs"], d.get("window_offset", 0.0), et, d.get("warmup_s", 0.0), 0.0, "reserve", None,
                  d.get("windows_interleaved") or d["replicas"], d.get("prefix_caching", True))  # fmt: skip
    block = FleetConfig.__dataclass_fields__["prefix_block_tokens"].default
    print(f"{d['trace']}, {d['replicas']} x {d['profile']}, TTFT {d['ttft_ms']:g} / TPOT {d['tpot_ms']:g} ms, "
          f"window {d['duration_s']:g} s (warm-up {d.get('warmup_s', 0):g}); trace-wide steady bound "
          f"{d['steady_state_bound']['rps']:.1f} req/s")  # fmt: skip
    print(f"interval bound: grid {args.grid_s:g} s, spans up to {args.max_span_s:g} s")
    print("| rate (req/s) | steady bound on the stream (req/s) | prefix tokens shareable "
          "| windowed attainment bound (interval L) | interval attainment bound (disjoint spans) | smaller |")
    print("| --- | --- | --- | --- | --- | --- |")
    out = []
    for rate in args.rates or d["rates"]:
        reqs = build_arrivals(kept, setup.native_rps, rate, setup.duration_s, setup.windows, setup.seed,
                              setup.window_offset)  # fmt: skip
        b = stream_bounds(setup, reqs, block, args.grid_s * 1000.0, args.max_span_s * 1000.0)
        share = "-" if b["prefix_shareable_frac"] is None else f"{b['prefix_shareable_frac']:.3f}"
        win, spans = b["attainment_bound"], b["interval_attainment_bound"]
        smaller = f"{spans:.4f} (interval)" if spans <= win else f"{win:.4f} (windowed)"
        print(f"| {rate:g} | {b['stream_steady_bound_rps']:.1f} | {share} | {win:.4f} "
              f"({b['attainment_bound_interval_s']:g} s) | {spans:.4f} | {smaller} |", flush=True)
        out.append({"rate_rps": rate, **b})
    json.dump(out, sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
