"""How far any policy can get under the per-token floor: the steady-state bound per floor (issue 27).

For each condition of docs/evaluation.md's headline (trace, fleet, engine model, SLO) this prints the
steady-state bound (loadgen/fleet/bound.py ``steady_state_bound``) under the per-request floor (the
cheapest 90 % of the requests by work served) and under the per-token floor (the cheapest cover of
90 % of the prompt + output tokens, ``served_by="tokens"``), both upper bounds on any policy's
capacity under that floor (they ignore bursts and queueing, which only lower it). With the best
baseline's measured per-token capacity (from the bench-fleet JSON named per condition, when it is
there) it gives the largest ratio any policy could reach over that baseline: a target above it
cannot be met on that condition by admission, placement or batching.

Mixed fleets (several GPU kinds): each kind's bound on the whole mix, summed, as bench-fleet reports it.
That is an estimate, not a bound (a router that gives each kind the requests it serves best can do
slightly better: a one-off joint linear programme over the kinds gave about 1 % more on the 8 A100 +
8 H100 fleet), marked ``~`` and ``estimate_not_bound``.

Prefix caching (mooncake-conv). The trace-wide figure credits every prompt with the longest prefix it
shares with any other request of the whole trace, whenever that request came (``shared_prefix_tokens``
without arrival times). The benchmark does not offer the whole trace: at rate λ it replays the trace
windows that λ covers (bench-fleet ``build_arrivals``, one window per replica), and a prompt can only
skip a prefix that a request *of that stream* computed, arriving no later than its TTFT deadline
(``shared_prefix_tokens`` with the stream's arrival times; the bound module's own rule). So for a
trace with prefix ids the bound is taken on the stream: with ``bound(λ)`` the steady-state bound of
the counted requests (after the warm-up) of the stream offered at rate label λ and ``R(λ)`` that
stream's offered rate (counted requests over the counted window), a policy that meets the floor at λ
has ``R(λ) <= bound(λ)``. The bound reported is the first rate of a 2 % grid (from 0.3x to 1.5x the
trace-wide figure) above every grid rate where that holds (loadgen/fleet/bound.py
``self_consistent_rate``): the streams of every grid rate from there up fail, so a measured capacity
above it would lie where the grid sees the streams fail (up to the grid's 2 %, and bench-fleet's
capacities are interpolated between measured rates to the same approximation). The streams are built
as the condition's bench-fleet JSON says (window, warm-up, seed, window offset, interleaved windows,
arrival spread). The
trace-wide figure stays in the JSON (``trace_wide_*``): on mooncake-conv it credits about 3x the
sharing any stream of the benchmark holds.

Usage::

    python scripts/token_floor_bound.py --out docs/evaluation/headline/token-floor-bounds.json
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from loadgen.fleet.bench import (
    STREAM_GRID_FROM,
    STREAM_GRID_TO,
    kinds_steady_bound,
    parse_fleet,
    stream_steady_bound,
    trace_rows,
)
from loadgen.fleet.bound import shared_prefix_tokens
from loadgen.fleet.sim import ReplicaKind
from loadgen.sim.engine_time import shipped_path
from loadgen.traces import PREFIX_BLOCK_TOKENS, arrival_granularity_ms

HEADLINE = Path(__file__).resolve().parent.parent / "docs" / "evaluation" / "headline"


@dataclass(frozen=True, slots=True)
class Condition:
    """One headline condition.

    Attributes:
        trace: embedded trace name.
        fleet: (replica count, profile, engine-time model file stem or None = the profile's shipped one) per kind.
        ttft_ms, tpot_ms: the SLO (ms).
        measured: the bench-fleet JSON (in docs/evaluation/headline/) with the measured capacities, or None.
        label: how the tables name it.
    """

    trace: str
    fleet: tuple[tuple[int, str, str | None], ...]
    ttft_ms: float
    tpot_ms: float
    measured: str | None
    label: str


CONDITIONS: tuple[Condition, ...] = (
    Condition("azure-code", ((16, "llama-3-8b-a100", None),), 1000.0, 100.0, "azure-code-16.json",
              "azure-code, 16 x 8B A100"),
    Condition("azure-code", ((64, "llama-3-8b-a100", None),), 1000.0, 100.0, "azure-code-64.json",
              "azure-code, 64 x 8B A100"),
    Condition("azure-conv", ((16, "llama-3-8b-a100", None),), 1000.0, 100.0, "azure-conv-16.json",
              "azure-conv, 16 x 8B A100"),
    Condition("servegen-m-large", ((16, "llama-3-8b-a100", None),), 1000.0, 100.0, "servegen-m-large-16.json",
              "ServeGen m-large, 16 x 8B A100"),
    Condition("mooncake-conv", ((16, "llama-3-8b-a100", None),), 2500.0, 100.0, "mooncake-conv-16.json",
              "mooncake-conv (TTFT 2.5 s), 16 x 8B A100"),
    Condition("azure-code", ((8, "llama-3-8b-a100", None), (8, "llama-3-8b-h100", None)), 1000.0, 100.0,
              "azure-code-hetero-8a100-8h100.json", "azure-code, 8 x 8B A100 + 8 x 8B H100"),
    Condition("azure-code", ((16, "llama-2-70b-h100-tp4", None),), 1000.0, 100.0, "azure-code-16-70b-shipped.json",
              "azure-code, 16 x 70B H100 (shipped engine)"),
    Condition("azure-code", ((16, "llama-2-70b-h100-tp4", "llama-2-70b-h100-tp4-splitwise"),), 1000.0, 100.0,
              "azure-code-16-70b-splitwise.json", "azure-code, 16 x 70B H100 (Splitwise-fitted engine)"),
    Condition("azure-conv", ((16, "llama-2-70b-h100-tp4", "llama-2-70b-h100-tp4-splitwise"),), 1000.0, 100.0,
              "azure-conv-16-70b-splitwise.json", "azure-conv, 16 x 70B H100 (Splitwise-fitted engine)"),
    Condition("servegen-m-large", ((16, "llama-2-70b-h100-tp4", "llama-2-70b-h100-tp4-splitwise"),), 1000.0, 100.0,
              "servegen-m-large-16-70b-splitwise.json", "ServeGen m-large, 16 x 70B H100 (Splitwise-fitted engine)"),
    Condition("mooncake-conv", ((16, "llama-3-8b-a100", None),), 5000.0, 100.0, "mooncake-conv-16-ttft5s.json",
              "mooncake-conv (TTFT 5 s), 16 x 8B A100"),
    Condition("mooncake-conv", ((16, "llama-2-70b-h100-tp4", "llama-2-70b-h100-tp4-splitwise"),), 5000.0, 100.0,
              "mooncake-conv-16-70b-splitwise-ttft5s.json",
              "mooncake-conv (TTFT 5 s), 16 x 70B H100 (Splitwise-fitted engine)"),
)
"""The headline's conditions (docs/evaluation.md, "Headline (issue 27)")."""


@dataclass(frozen=True, slots=True)
class StreamSettings:
    """How bench-fleet built the streams of a condition's run (its JSON's fields; the defaults are bench-fleet's).

    Attributes:
        duration_s, warmup_s: the arrival window and the warm-up not counted (s).
        seed, window_offset, windows: ``build_arrivals``' seed, window offset and interleaved windows.
        spread_ms: ``trace_rows``' arrival spread (ms; None = the trace's known granularity).
    """

    duration_s: float = 300.0
    warmup_s: float = 60.0
    seed: int = 0
    window_offset: float = 0.0
    windows: int | None = None
    spread_ms: float | None = None


def condition_kinds(cond: Condition) -> tuple[ReplicaKind, ...]:
    """The condition's replica kinds as bench-fleet builds them (``parse_fleet``, each kind's engine model)."""
    return tuple(k for count, profile, engine in cond.fleet
                 for k in parse_fleet(f"{count}:{profile}", None if engine is None else str(shipped_path(engine))))


def bounds(cond: Condition, stream: StreamSettings | None = None) -> dict[str, float]:
    """{"requests": bound, "tokens": bound} (req/s of the fleet) for one condition, each kind serving the mix
    (bench-fleet's ``kinds_steady_bound`` over the kinds ``parse_fleet`` builds). For a trace with prefix
    ids, the bounds of the streams offered (module docstring; ``stream``: how the run built them, bench-fleet's
    defaults when None), with the trace-wide ones as ``trace_wide_requests`` / ``trace_wide_tokens`` and
    ``stream_grid_points``.

    Raises:
        ValueError: when a stream bound's grid ends below its crossing (``self_consistent_rate``).
    """
    st = stream or StreamSettings()
    spread = arrival_granularity_ms(cond.trace) if st.spread_ms is None else st.spread_ms
    kept, native, _ = trace_rows(cond.trace, spread, st.seed)
    prompts = [r.prompt_tokens for r in kept]
    outputs = [r.output_tokens for r in kept]
    kinds = condition_kinds(cond)
    if not any(r.hash_ids for r in kept):
        return {by: kinds_steady_bound(kinds, prompts, outputs, cond.ttft_ms, cond.tpot_ms, None, served_by=by)
                for by in ("requests", "tokens")}  # fmt: skip
    cached = shared_prefix_tokens([r.hash_ids for r in kept], prompts, PREFIX_BLOCK_TOKENS)
    out: dict[str, float] = {}
    windows = st.windows or sum(k.count for k in kinds)
    for by in ("requests", "tokens"):
        wide = kinds_steady_bound(kinds, prompts, outputs, cond.ttft_ms, cond.tpot_ms, cached, served_by=by)
        rate, points = stream_steady_bound(kept, native, kinds, cond.ttft_ms, cond.tpot_ms, st.duration_s,
                                           st.warmup_s, windows, st.seed, st.window_offset, by,
                                           STREAM_GRID_FROM * wide, STREAM_GRID_TO * wide)  # fmt: skip
        out[by] = rate
        out[f"trace_wide_{by}"] = wide
        out["stream_grid_points"] = out.get("stream_grid_points", 0) + points
    return out


def stream_settings(cond: Condition, headline: Path) -> StreamSettings:
    """The stream settings of the condition's bench-fleet JSON (bench-fleet's defaults for what it lacks,
    and without one)."""
    if cond.measured is None or not (headline / cond.measured).exists():
        return StreamSettings()
    d = json.loads((headline / cond.measured).read_text())
    return StreamSettings(float(d.get("duration_s", 300.0)), float(d.get("warmup_s", 60.0)), int(d.get("seed", 0)),
                          float(d.get("window_offset", 0.0)), d.get("windows_interleaved"), d.get("arrival_spread_ms"))


def measured(cond: Condition, headline: Path) -> dict[str, object] | None:
    """The best baseline's and pab's per-token capacities from the condition's bench-fleet JSON, or None.

    ``pab`` is the PAB policy (name starting ``pab``) with the highest bracketed per-token capacity (the
    first one when none is bracketed); with several, ``pab_token_floors`` gives each one's (None when
    not bracketed)."""
    if cond.measured is None or not (headline / cond.measured).exists():
        return None
    d = json.loads((headline / cond.measured).read_text())
    pols = d["policies"]
    best = d.get("best_baseline_token_goodput")
    ours_all = [n for n in pols if n.startswith("pab")]
    if best is None or not ours_all:
        return None
    def floor(p: dict) -> float | None:  # a capacity the search bracketed, else None
        return p.get("capacity_token_floor_rps") if p.get("capacity_token_floor_bound") == "interpolated" else None

    floors = {n: floor(pols[n]) for n in ours_all}
    ours = max(ours_all, key=lambda n: -1.0 if floors[n] is None else floors[n])
    out: dict[str, object] = {"best_baseline": best, "best_baseline_token_floor_rps": floor(pols[best]),
                              "pab": ours, "pab_token_floor_rps": floors[ours]}  # fmt: skip
    if len(ours_all) > 1:
        out["pab_token_floors"] = floors
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="JSON file to write")
    ap.add_argument("--headline", default=str(HEADLINE), help="folder of the headline's bench-fleet JSON files")
    args = ap.parse_args(argv)
    rows = []
    print("| condition | bound, per-request floor (req/s) | bound, per-token floor (req/s) | best baseline's tok floor "
          "| of the token bound | largest ratio any policy can reach | best pab policy's tok floor | of the token bound |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for cond in CONDITIONS:
        b = bounds(cond, stream_settings(cond, Path(args.headline)))
        m = measured(cond, Path(args.headline))
        row: dict[str, object] = {"condition": cond.label, "file": cond.measured, "trace": cond.trace,
                                  "fleet": [list(k) for k in cond.fleet],
                                  "ttft_ms": cond.ttft_ms, "tpot_ms": cond.tpot_ms,
                                  "request_floor_bound_rps": round(b["requests"], 2),
                                  "token_floor_bound_rps": round(b["tokens"], 2), "measured": m}  # fmt: skip
        if "trace_wide_tokens" in b:  # prefix ids: the bounds above are the streams' (module docstring)
            row["bound_on"] = "stream"
            row["trace_wide_request_floor_bound_rps"] = round(b["trace_wide_requests"], 2)
            row["trace_wide_token_floor_bound_rps"] = round(b["trace_wide_tokens"], 2)
        base = None if m is None else m["best_baseline_token_floor_rps"]
        ours = None if m is None else m["pab_token_floor_rps"]
        mixed = len(cond.fleet) > 1  # each kind's bound on the whole mix, summed: an estimate, not a bound
        row["estimate_not_bound"] = mixed
        ratio = b["tokens"] / base if isinstance(base, float) and base > 0 else None
        if ratio is not None:
            row["largest_ratio_over_best_baseline"] = round(ratio, 3)
        rows.append(row)

        def frac(x: object) -> str:
            return f"{x / b['tokens']:.2f}" if isinstance(x, float) and b["tokens"] > 0 else "-"

        base_text = f"{base:.1f} ({m['best_baseline']})" if m is not None and isinstance(base, float) else "-"
        approx = "~" if mixed else ""
        print(f"| {cond.label} | {approx}{b['requests']:.1f} | {approx}{b['tokens']:.1f} | {base_text} | {frac(base)} | "
              f"{'-' if ratio is None else f'{approx}{ratio:.2f}x'} | "
              f"{'-' if not isinstance(ours, float) else f'{ours:.1f}'} | {frac(ours)} |")  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

