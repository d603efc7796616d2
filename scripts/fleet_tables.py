"""Markdown capacity tables of docs/evaluation.md from bench-fleet JSON files.

Usage: ``python scripts/fleet_tables.py docs/evaluation/azure-conv-16.json [...]``. For each file:
a heading line with the analytic bound, then one row per policy: capacity (req/s, attainment >= 0.9,
interpolated; "at least" when the sweep never fell below 0.9), its fraction of the bound, x
round-robin, x best baseline, and at the highest swept rate with attainment >= 0.9: TTFT p99 /
TPOT p99 (ms), rejected / all requests, and min-max per-tenant attainment.
"""

from __future__ import annotations

import json
import sys


def _f(v: float | None, digits: int = 2) -> str:
    """``v`` to ``digits`` decimals, ``-`` when absent (a policy the run did not include)."""
    return "-" if v is None else f"{v:.{digits}f}"


def table(path: str) -> str:
    """The markdown block of one fleet.json."""
    with open(path) as f:
        d = json.load(f)
    b = d["analytic_bound"]
    eng = d.get("engine", {})
    sb = d.get("steady_state_bound") or {}
    steady = f"; steady-state bound {sb['rps']:.1f}" if sb.get("rps") else ""
    window = f"; window {d.get('duration_s', '?'):g} s, warm-up {d.get('warmup_s', 0):g} s" if "duration_s" in d else ""
    lines = [
        f"### {d['trace']}, {d['replicas']} x {d['profile']} (bound {b['rps']:.1f} req/s, {b['limit']}-limited{steady}; "
        f"engine {eng.get('max_num_batched_tokens', '?')} tokens / {eng.get('max_num_seqs', '?')} seqs{window})",
        "",
        "| policy | capacity (req/s) | of bound | of steady bound | x round-robin | x best baseline "
        "| TTFT p99 / TPOT p99 (ms) @ rate | attainment req / tok @ rate | rejected | per-tenant attainment |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    lowest = min((r["rate_rps"] for p in d["policies"].values() for r in p["rows"]), default=0)
    for name, p in d["policies"].items():
        ok = [r for r in p["rows"] if (r["slo_attainment"] or 0.0) >= 0.9]
        if not ok:
            r0 = p["rows"][0]
            lines.append(f"| {name} | < {lowest:g} (below sweep) | - | - | - | - | {r0['ttft_p99_ms']:.0f} / "
                         f"{r0['tpot_p99_ms']:.0f} @ {r0['rate_rps']:g} | {r0['slo_attainment']:.2f} | - | - |")
            continue
        at = max(ok, key=lambda r: r["rate_rps"])
        cap = f"{p['capacity_rps']:.1f}" + (" (at least)" if p["capacity_bound"] != "interpolated" else "")
        rej = sum(at["rejected"].values()) if isinstance(at["rejected"], dict) else at["rejected"]
        ten = at["tenant_attainment"].values()
        steady = p.get("fraction_of_steady_bound")
        tok = at.get("token_slo_attainment")
        lines.append(
            f"| {name} | {cap} | {_f(p['fraction_of_bound'])} | {_f(steady)} | {_f(p['x_round_robin'])} "
            f"| {_f(p['x_best_baseline'])} | {at['ttft_p99_ms']:.0f} / {at['tpot_p99_ms']:.0f} @ {at['rate_rps']:g} "
            f"| {_f(at['slo_attainment'], 3)} / {_f(tok, 3)} | {rej}/{at['requests']} | {min(ten):.3f}-{max(ten):.3f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    print("\n\n".join(table(p) for p in sys.argv[1:]))
