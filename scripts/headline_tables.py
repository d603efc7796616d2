"""Markdown tables of the issue-27 headline (docs/evaluation.md "Headline: goodput at SLO against the
admission controllers that ship today") from bench-fleet JSON files.

``python scripts/headline_tables.py docs/evaluation/headline/*.json``: one table per file, a row per
policy, led by token goodput at the per-token floor (issue 27 item 2):

- tok floor: the highest rate with per-token attainment >= 0.9 (interpolated between two measured
  rates; ``>=`` / ``<`` when the search could not bracket it);
- tok goodput: prompt + output tokens/s of requests that met both TTFT and TPOT at that rate;
- x best: that figure over the best baseline's (bench-fleet's ``x_best_baseline_token_goodput``);
- req floor, goodput req/s and refused share (with its main reason) at the per-request capacity;
- TTFT p99 at the highest measured rate that met the per-request floor.

When the file has bench-fleet's ``token_steady_state_bound`` (the per-token floor's steady-state bound,
loadgen/fleet/bound.py), a line after the table gives it, each policy's per-token capacity as a share
of it, and the largest ratio over the best baseline that any policy could reach (on a mixed fleet the
figure is an estimate, not a bound, and no ratio is claimed). For a trace with prefix ids the bound in
the file credits sharing with the whole trace; when ``token-floor-bounds.json`` (scripts/token_floor_bound.py)
lies beside the file and has its row with ``bound_on: stream``, that row's bound on the stream offered
is given instead, the trace-wide one beside it. When ``burst-floor-bounds.json`` (scripts/burst_floor_bound.py)
lies beside the file with a per-token figure for it, a second line gives that burst-aware bound (a bound on
a mixed fleet too), each policy's share of it and the largest ratio it leaves over the best baseline.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def cap_text(value: float, how: str, rows: list[dict[str, Any]]) -> str:
    """A capacity as bench-fleet prints it (``<`` below the search, ``>=`` above it)."""
    if how == "below-sweep":
        return f"<{min(r['rate_rps'] for r in rows):.1f}" if rows else "-"
    return f">={value:.1f}" if how == "at-least" else f"{value:.1f}"


def table(path: Path) -> str:
    """The markdown table of one bench-fleet JSON file."""
    d = json.loads(path.read_text())
    fleet = ", ".join(f"{k['count']} x {k['profile']}" for k in d.get("fleet") or []) or \
        f"{d['replicas']} x {d['profile']}"  # fmt: skip
    eng = " + ".join(k["engine_time_model"]["name"] for k in d["fleet"]) if d.get("fleet") else \
        d.get("engine_time_model", {}).get("name", "policy")  # fmt: skip
    head = (f"#### {d['trace']}, {fleet}, {d.get('routers', 1)} router(s); TTFT {d['ttft_ms']:g} / TPOT "
            f"{d['tpot_ms']:g} ms; engine {eng}; {d['duration_s']:g} s window, {d.get('warmup_s', 0):g} s warm-up "
            f"(`{path.name}`)\n\n")  # fmt: skip
    lines = ["| policy | tok floor (req/s) | tok goodput (tok/s) | x best | req floor (req/s) | goodput (req/s) "
             "| refused @ req floor | TTFT p99 (ms) | rates measured |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, p in d["policies"].items():
        rows = p["rows"]
        tok = cap_text(p.get("capacity_token_floor_rps", 0.0), p.get("capacity_token_floor_bound", "below-sweep"), rows)
        req = cap_text(p["capacity_rps"], p["capacity_bound"], rows)
        tg = p.get("token_goodput_at_token_capacity")
        xb = p.get("x_best_baseline_token_goodput")
        rs = p.get("refused_share_at_capacity")
        reasons = p.get("refused_share_by_reason_at_capacity") or {}
        main = max(reasons, key=reasons.__getitem__) if reasons and max(reasons.values()) > 0 else None
        refused = "-" if rs is None else f"{100 * rs:.1f} %" + (f" ({main})" if main else "")
        ok = [r for r in rows if (r.get("slo_attainment") or 0) >= 0.9]
        top = max(ok, key=lambda r: r["rate_rps"]) if ok else None
        ttft = "-" if top is None else f"{top['ttft_p99_ms']:.0f} @ {top['rate_rps']:.1f}"
        gp = p.get("goodput_rps_at_capacity")
        bold = name.startswith("pab")
        cell = (lambda s: f"**{s}**") if bold else (lambda s: s)
        lines.append(f"| {cell(name)} | {tok} | {cell('-' if tg is None else f'{tg:,.0f}')} | "
                     f"{'-' if xb is None else f'{xb:.2f}'} | {req} | {'-' if gp is None else f'{gp:.1f}'} | "
                     f"{refused} | {ttft} | {len(rows)} |")  # fmt: skip
    best = d.get("best_baseline_token_goodput")
    return (head + "\n".join(lines) + f"\n\nBest baseline by token goodput: `{best}`.\n"
            + bound_line(d, stream_bound(path)) + burst_line(d, burst_bound(path)))


def _beside(path: Path, name: str, field: str, **match: object) -> float | None:
    """``field`` of the row for ``path`` in the JSON file ``name`` beside it (a list of rows with ``file``),
    when that row also has every ``match`` value and a figure there; else None."""
    bounds = path.parent / name
    if not bounds.exists():
        return None
    for row in json.loads(bounds.read_text()):
        if row.get("file") == path.name and all(row.get(k) == v for k, v in match.items()) and row.get(field):
            return float(row[field])
    return None


def burst_bound(path: Path) -> float | None:
    """The burst-aware per-token bound for ``path`` from ``burst-floor-bounds.json`` beside it, or None (no
    file, no row, or a row whose scan never fell below the floor)."""
    return _beside(path, "burst-floor-bounds.json", "token_floor_burst_bound_rps")


def stream_bound(path: Path) -> float | None:
    """The per-token bound on the stream offered for ``path`` from ``token-floor-bounds.json`` beside it
    (module docstring), or None."""
    return _beside(path, "token-floor-bounds.json", "token_floor_bound_rps", bound_on="stream")


def _shares(d: dict[str, Any], bound: float) -> str:
    """Each policy's bracketed per-token capacity as a share of ``bound`` ("" when none has one)."""
    return ", ".join(f"{n} {p['capacity_token_floor_rps'] / bound:.2f}" for n, p in d["policies"].items()
                     if p.get("capacity_token_floor_bound") in ("interpolated", "at-least"))  # fmt: skip


def _best_baseline(d: dict[str, Any]) -> tuple[str | None, float | None]:
    """(the best baseline's name, its per-token capacity when the search bracketed it, else None)."""
    best = d.get("best_baseline_token_goodput")
    bp = d["policies"].get(best, {}) if best else {}
    return best, bp.get("capacity_token_floor_rps") if bp.get("capacity_token_floor_bound") == "interpolated" else None


def burst_line(d: dict[str, Any], bound: float | None) -> str:
    """The burst-aware bound's sentence (module docstring), or "" when ``bound`` is None."""
    if not bound:
        return ""
    text = (f"\nPer-token bound with bursts (scripts/burst_floor_bound.py: no request waits past its TTFT; the "
            f"replicas pooled): {bound:.1f} req/s; per-token capacity as a share of it: {_shares(d, bound) or 'none'}.")
    best, base = _best_baseline(d)
    if base:
        text += (f" With bursts no policy's per-token capacity can exceed {bound / base:.2f}x `{best}`'s here "
                 f"(to the scan's 2 % grid).")
    return text + "\n"


def bound_line(d: dict[str, Any], stream: float | None = None) -> str:
    """The per-token bound's sentence (module docstring), or "" without ``token_steady_state_bound``;
    ``stream``: the bound on the stream offered, which replaces the file's trace-wide one."""
    tsb = d.get("token_steady_state_bound") or {}
    tb, wide = tsb.get("rps"), None  # wide: the trace-wide figure, when tb is the bound on the streams
    if not tb:
        return ""
    if stream is not None:
        tb, wide = stream, tb
    elif tsb.get("on") == "stream":  # bench-fleet took it on the streams itself
        wide = tsb.get("trace_wide_rps")
    shares = _shares(d, tb) or "none (no policy has a per-token capacity in the rates measured)"
    if d.get("fleet"):  # mixed GPUs: each kind's bound on the whole mix, summed (bench-fleet's docstring)
        return (f"\nPer-token steady-state estimate (each GPU kind's bound on the whole mix, summed; not a bound "
                f"for a mixed fleet): {tb:.1f} req/s; per-token capacity as a share of it: {shares}.\n")
    text = f"\nPer-token steady-state bound: {tb:.1f} req/s; per-token capacity as a share of it: {shares}."
    if wide is not None:
        text = (f"\nPer-token steady-state bound on the stream offered (prefix credit only from its own requests, "
                f"loadgen/fleet/bench.py stream_steady_bound; {wide:.1f} req/s with credit from the whole trace): {tb:.1f} req/s; "
                f"per-token capacity as a share of it: {shares}.")
    best, base = _best_baseline(d)
    if base:
        text += f" No policy's per-token capacity can exceed {tb / base:.2f}x `{best}`'s here."
    return text + "\n"


def main(argv: list[str]) -> int:
    """Print one table per JSON file named in ``argv``."""
    for a in argv:
        print(table(Path(a)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
