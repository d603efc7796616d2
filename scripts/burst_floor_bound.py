"""How far any policy can get once bursts count: a capacity bound from the disjoint-span attainment bound.

The steady-state bound (scripts/token_floor_bound.py) lets load move freely in time. A request cannot
wait longer than its TTFT, so the work of a burst must be done within about one TTFT of it, and a fleet
that is idle between bursts cannot bank that time. loadgen/fleet/bound.py
``pooled_interval_attainment_bound`` bounds the attainment (per request, or per prompt + output token)
that any schedule reaches on one arrival stream: the replicas pooled into one machine, each request at
its least work under the engine's own model, over families of disjoint spans of time (module docstring
there, "Bursts"; one GPU kind at the best step length, ``interval_attainment_bound``; several kinds
through an exchange rate, valid for any rate, with each kind's step length free).

For each condition this scans the streams bench-fleet offers (``build_arrivals`` with the condition's
run settings, read from its JSON: window, warm-up, seed, window offset, interleaved windows, arrival
spread; prefix credit from the stream itself where the trace has prefix ids) on a 2 % grid of rate
labels, and a rate *passes* a floor when the bound on its stream's attainment is at least 0.9. The
figure given is the first grid rate above every pass (``grid_crossing``): every grid rate from there
up to the end of the grid fails, so no policy meets the floor there. The grid ends at 1.02x the
steady-state bound of token_floor_bound.py (its JSON), above which that bound already fails (for
traces with prefix ids it is the stream's own; for the others the stream's is within 0.5 % of the
trace-wide one, docs/evaluation.md); on a mixed fleet, whose steady figure is an estimate, at 1.5x it
(there nothing above the grid is checked: read the top grid rates' bounds in ``*_floor_grid``). Where
every grid rate passes the steady figure stands (``*_burst_bound_rps`` null); where none passes there is
no figure either (null, ``*_fails_at_start`` true, a warning: the measured capacity would then lie above
the first grid rate, against the bound). The grid starts at ``--start-frac`` x the best pab policy's
measured capacity under the floor (at most one grid step below its end).

Usage::

    python scripts/burst_floor_bound.py --out docs/evaluation/headline/burst-floor-bounds.json [--jobs 2]
    python scripts/burst_floor_bound.py --conditions "<label>" ... --merge --out <the same file>

About 5-10 minutes per condition on one core (per-token bound: 10-20 s a stream at 16 replicas).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from token_floor_bound import (  # noqa: E402
    CONDITIONS,
    HEADLINE,
    Condition,
    StreamSettings,
    condition_kinds,
    stream_settings,
)

from loadgen.fleet.bench import build_arrivals, trace_rows  # noqa: E402
from loadgen.fleet.bound import (  # noqa: E402
    grid_crossing,
    interval_attainment_bound,
    pooled_interval_attainment_bound,
    shared_prefix_tokens,
)
from loadgen.traces import PREFIX_BLOCK_TOKENS, TraceRequest, arrival_granularity_ms  # noqa: E402

FLOOR = 0.9
"""The attainment that defines capacity under either floor."""

GRID_FACTOR = 1.02
"""Ratio between grid rates."""


def stream_attainment_bound(cond: Condition, st: StreamSettings, rate: float, served_by: str,
                            kept: Sequence[TraceRequest], native_rps: float) -> float:  # fmt: skip
    """The disjoint-span attainment bound (1 s grid, spans up to 120 s; ``interval_attainment_bound`` for one
    GPU kind, ``pooled_interval_attainment_bound`` for several) on the stream bench-fleet offers for ``cond``
    at rate label ``rate`` (req/s), counted from the warm-up; ``kept``, ``native_rps``: the condition's trace
    as ``trace_rows`` gives it."""
    kinds = condition_kinds(cond)
    windows = st.windows or sum(k.count for k in kinds)
    reqs = build_arrivals(kept, native_rps, rate, st.duration_s, windows, st.seed, st.window_offset)
    cached = None
    if any(r.prefix_ids for r in reqs):
        cached = shared_prefix_tokens([r.prefix_ids for r in reqs], [r.prompt_tokens for r in reqs],
                                      PREFIX_BLOCK_TOKENS, [r.arrival_ms for r in reqs], cond.ttft_ms)  # fmt: skip
    stream = ([r.arrival_ms for r in reqs], [r.prompt_tokens for r in reqs], [r.output_tokens for r in reqs])
    models = [(k.engine_time if k.engine_time is not None else k.time_model, k.count, k.max_num_batched_tokens)
              for k in kinds]  # fmt: skip
    window = (st.warmup_s * 1000.0, st.duration_s * 1000.0)
    if len(models) == 1:  # one kind: the best step length searched exactly (tighter than the pooled relaxation)
        model, count, tokens = models[0]
        att, _ = interval_attainment_bound(*stream, model, cond.ttft_ms, cond.tpot_ms, count, *window, tokens, cached,
                                           served_by=served_by)  # fmt: skip
    else:
        att, _ = pooled_interval_attainment_bound(*stream, models, cond.ttft_ms, cond.tpot_ms, *window, cached,
                                                  served_by=served_by)  # fmt: skip
    return att


def condition_bound(cond: Condition, st: StreamSettings, steady: dict[str, float], measured: dict[str, float],
                    start_frac: float) -> dict[str, object]:  # fmt: skip
    """The burst-aware capacity bound of one condition under both floors (module docstring)."""
    out: dict[str, object] = {"condition": cond.label, "file": cond.measured}
    spread = arrival_granularity_ms(cond.trace) if st.spread_ms is None else st.spread_ms
    kept, native, _ = trace_rows(cond.trace, spread, st.seed)  # once: every grid rate replays this trace
    for by, key in (("requests", "request"), ("tokens", "token")):
        t0 = time.time()
        seen: dict[float, float] = {}

        def passes(rate: float, by: str = by) -> bool:
            seen[rate] = stream_attainment_bound(cond, st, rate, by, kept, native)
            return seen[rate] >= FLOOR

        # above the steady-state bound every rate fails already; a mixed fleet's steady figure is an estimate
        # (each kind's bound on the whole mix, summed), so its grid goes on to 1.5x it
        stop = (1.5 if len(cond.fleet) > 1 else GRID_FACTOR) * steady[by]
        start = min(start_frac * measured[by] if measured.get(by) else 0.5 * steady[by], stop / GRID_FACTOR)
        try:
            rate, points = grid_crossing(passes, start, stop, GRID_FACTOR)
            out[f"{key}_floor_burst_bound_rps"] = round(rate, 2)
        except ValueError:  # passes up to the grid's end: the steady bound stands
            rate, points = steady[by], len(seen)
            out[f"{key}_floor_burst_bound_rps"] = None
        fails_at_start = seen[min(seen)] < FLOOR
        if fails_at_start:  # no grid rate passes: the figure would be the grid's start, below what was measured
            out[f"{key}_floor_burst_bound_rps"] = None
            print(f"WARNING {cond.label}: {by}: the first grid rate {start:.2f} fails; no figure", flush=True)
        out[f"{key}_floor_steady_bound_rps"] = round(steady[by], 2)
        out[f"{key}_floor_fails_at_start"] = fails_at_start
        out[f"{key}_floor_grid"] = {f"{r:.6f}": round(a, 6) for r, a in sorted(seen.items())}
        out[f"{key}_floor_seconds"] = round(time.time() - t0, 1)
        print(f"{cond.label}: {by} burst bound {rate:.2f} req/s (steady {steady[by]:.2f}; {points} rates, "
              f"{time.time() - t0:.0f} s)", flush=True)  # fmt: skip
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="JSON file to write")
    ap.add_argument("--headline", default=str(HEADLINE), help="folder of the headline's bench-fleet JSON files")
    ap.add_argument("--steady", default=None, help="token_floor_bound.py's JSON (default: in --headline)")
    ap.add_argument("--conditions", nargs="*", default=None, help="labels (default: every condition whose best "
                    "baseline reaches under 0.75 of the steady per-token bound: the others are capped by it)")
    ap.add_argument("--start-frac", type=float, default=0.85, help="the grid's first rate over the measured capacity")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--merge", action="store_true", help="keep the rows of other conditions already in --out")
    args = ap.parse_args(argv)
    headline = Path(args.headline)
    steady_rows = {r["condition"]: r for r in json.loads(Path(args.steady or headline / "token-floor-bounds.json")
                                                          .read_text())}  # fmt: skip
    todo = []
    for cond in CONDITIONS:
        row = steady_rows.get(cond.label)
        if row is None or row.get("measured") is None:
            continue
        m = row["measured"]
        base = m.get("best_baseline_token_floor_rps")
        if args.conditions is not None and cond.label not in args.conditions:
            continue
        if args.conditions is None and (base is None or base / row["token_floor_bound_rps"] >= 0.75):
            continue
        pols = json.loads((headline / cond.measured).read_text())["policies"]
        req = max((p.get("capacity_rps") or 0.0 for n, p in pols.items() if n.startswith("pab")), default=0.0)
        todo.append((cond, stream_settings(cond, headline),
                     {"requests": row["request_floor_bound_rps"], "tokens": row["token_floor_bound_rps"]},
                     {"requests": req, "tokens": m.get("pab_token_floor_rps") or 0.0}, args.start_frac))  # fmt: skip
    if args.jobs > 1:
        with ProcessPoolExecutor(max_workers=args.jobs) as pool:
            rows = list(pool.map(condition_bound, *zip(*todo)))
    else:
        rows = [condition_bound(*t) for t in todo]
    print("| condition | per-request floor: burst bound (steady) | per-token floor: burst bound (steady) |")
    print("| --- | --- | --- |")
    for r in rows:
        def cell(key: str, r: dict = r) -> str:
            b = r[f"{key}_floor_burst_bound_rps"]
            return f"{'-' if b is None else f'{b:.1f}'} ({r[f'{key}_floor_steady_bound_rps']:.1f})"

        print(f"| {r['condition']} | {cell('request')} | {cell('token')} |")
    if args.out:
        done = {r["condition"] for r in rows}
        kept = []
        if args.merge and Path(args.out).exists():
            kept = [r for r in json.loads(Path(args.out).read_text()) if r["condition"] not in done]
        order = {c.label: i for i, c in enumerate(CONDITIONS)}
        merged = sorted(kept + rows, key=lambda r: order.get(r["condition"], len(order)))
        Path(args.out).write_text(json.dumps(merged, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
