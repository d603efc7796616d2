"""The replay report: a JSON document and a printed table with the same figures.

All latencies are simulated ms and all rates per simulated second (wall figures divided by the
time scale, which the report states). Invariant:
``completed + sum(rejected.values()) + failed == requests_total``, overall and per tenant.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from loadgen.replay import ReplayResult
from loadgen.stats import Figures, LatencySummary, Slo, figures, per_tenant, summarize


def _latency(s: LatencySummary) -> dict[str, float | None]:
    return {"p50": s.p50, "p95": s.p95, "p99": s.p99, "mean": s.mean}


def figures_json(f: Figures) -> dict[str, Any]:
    """One :class:`~loadgen.stats.Figures` as a JSON object."""
    return {
        "requests_total": f.requests_total,
        "completed": f.completed,
        "rejected": dict(f.rejected),
        "rejected_total": sum(f.rejected.values()),
        "failed": f.failed,
        "failed_reasons": dict(f.failed_reasons),
        "ttft_ms": _latency(f.ttft_ms),
        "tpot_ms": _latency(f.tpot_ms),
        "itl_ms": _latency(f.itl_ms),
        "e2e_ms": _latency(f.e2e_ms),
        "slo_attainment": f.slo_attainment,
        "slo_met": f.slo_met,
        "goodput_rps": f.goodput_rps,
        "goodput_tokens_per_s": f.goodput_tokens_per_s,
        "throughput_rps": f.throughput_rps,
        "output_tokens_per_s": f.output_tokens_per_s,
        "per_replica_requests": dict(f.per_replica_requests),
    }


def check_invariant(doc: Mapping[str, Any]) -> None:
    """Raise AssertionError unless completed + rejected + failed == requests_total (overall and per tenant)."""
    parts = [("overall", doc), *((f"tenant {t}", d) for t, d in doc.get("per_tenant", {}).items())]
    for name, d in parts:
        got = d["completed"] + sum(d["rejected"].values()) + d["failed"]
        if got != d["requests_total"]:
            raise AssertionError(
                f"{name}: completed + rejected + failed = {got} != requests_total {d['requests_total']}"
            )


def build_report(result: ReplayResult, slos: Mapping[str, Slo], meta: Mapping[str, Any]) -> dict[str, Any]:
    """The report JSON of one replay.

    Args:
        result: the replay's records.
        slos: tenant -> SLO targets used for attainment (simulated ms).
        meta: run description merged in at the top level, e.g. ``trace``, ``rate_scale``,
            ``duration_s`` (trace window, s), ``target``.

    Raises:
        AssertionError: if the outcome counts do not add up (a bug).
    """
    overall = figures(result.records, slos, result.duration_s)
    tenants = per_tenant(result.records, slos, result.duration_s)
    lags = [r.send_lag_ms for r in result.records]
    doc: dict[str, Any] = {
        "time_scale": result.time_scale,
        "trace": None,
        "rate_scale": None,
        "duration_s": None,
        **dict(meta),
        "model": result.model,
        "measured_duration_s": result.duration_s,
        "wall_s": result.wall_s,
        "units": "latencies in simulated ms, rates per simulated s (wall / time_scale)",
        **figures_json(overall),
        "max_send_lag_ms": max(lags) if lags else 0.0,
        "send_lag_ms": _latency(summarize(lags)),
        "slo": {t: {"ttft_ms": s.ttft_ms, "tpot_ms": s.tpot_ms} for t, s in sorted(slos.items()) if t in tenants},
        "per_tenant": {t: figures_json(f) for t, f in tenants.items()},
        "error_samples": dict(result.error_samples),
    }
    check_invariant(doc)
    return doc


def write_report(doc: Mapping[str, Any], path: str | Path) -> Path:
    """Write ``doc`` as indented JSON (parent folders created). Returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n")
    return path


def default_console() -> Console:
    """A rich console; 120 columns wide when stdout is not a terminal (so the table is not squeezed)."""
    console = Console()
    return console if console.is_terminal else Console(width=120)


def _fmt(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f} %"


def _workload(doc: Mapping[str, Any]) -> str:
    """One line naming what was replayed: a trace window and its compression, or a scenario."""
    duration, scale = doc.get("duration_s"), doc.get("rate_scale")
    if doc.get("trace") is None:
        name = doc.get("scenario")
        head = f"scenario {name}" if name else "workload"
        return f"{head}: {duration:g} s of arrivals" if isinstance(duration, (int, float)) else head
    head = f"trace {doc['trace']}"
    if isinstance(duration, (int, float)) and isinstance(scale, (int, float)) and scale > 0:
        return f"{head}: {duration:g} s of trace at rate x{scale:g} = {duration / scale:.1f} s of arrivals"
    return f"{head}: window {duration} s, rate x{scale}"


SUMMARY_COLUMNS = (
    # header (wraps at the space), key, priority: the narrowest consoles drop the highest numbers first
    ("set", "set", 0), ("requests", "requests_total", 0), ("ok", "completed", 0), ("rejected", "rejected", 1),
    ("failed", "failed", 1), ("SLO attained", "slo", 0), ("goodput req/s", "goodput_rps", 2),
    ("goodput tok/s", "goodput_tokens_per_s", 3), ("out tok/s", "output_tokens_per_s", 4),
)
"""Columns of the summary table, with their priority when the console is too narrow for all."""


def _cell(d: Mapping[str, Any], key: str, name: str) -> str:
    if key == "set":
        return name
    if key == "slo":
        return _pct(d["slo_attainment"])
    if key == "rejected":
        return str(sum(d["rejected"].values()))
    if key in ("requests_total", "completed", "failed"):
        return str(d[key])
    return _fmt(d[key], 2 if key == "goodput_rps" else 0)


def summary_table(rows: Sequence[tuple[str, Mapping[str, Any]]], width: int) -> Table:
    """The summary table for a console ``width`` columns wide: every column when they fit (headers
    wrapped at their space), else the lowest-priority ones dropped until it fits (:data:`SUMMARY_COLUMNS`;
    ``set``, ``requests``, ``ok`` and ``SLO attained`` always stay)."""
    measure = Console(width=10_000)
    for cut in range(max(p for *_, p in SUMMARY_COLUMNS), -1, -1):
        t = Table()
        cols = [c for c in SUMMARY_COLUMNS if c[2] <= cut]
        for header, key, _ in cols:
            t.add_column(header.replace(" ", "\n") if key != "set" else header,
                         justify="left" if key == "set" else "right", no_wrap=True)  # fmt: skip
        for name, d in rows:
            t.add_row(*(_cell(d, key, name) for _, key, _ in cols))
        if measure.measure(t).maximum <= width or cut == 0:
            return t
    raise AssertionError("unreachable")


def print_report(doc: Mapping[str, Any], console: Console | None = None) -> None:
    """Print the report's figures as rich tables (overall + per tenant, latencies, replicas)."""
    console = console or default_console()
    title = f"{_workload(doc)}; time scale {doc.get('time_scale')} (latencies in simulated ms)"
    rows = [("all", doc), *sorted(doc.get("per_tenant", {}).items())]

    console.print(title, markup=False)
    console.print(summary_table(rows, console.width))

    lat = Table(title="latencies (simulated ms)", title_justify="left")
    lat.add_column("set", no_wrap=True)
    lat.add_column("metric")
    for col in ("p50", "p95", "p99", "mean"):
        lat.add_column(col, justify="right")
    for name, d in rows:
        for metric in ("ttft_ms", "tpot_ms", "itl_ms"):
            s = d[metric]
            lat.add_row(name, metric.removesuffix("_ms").upper(), _fmt(s["p50"]), _fmt(s["p95"]), _fmt(s["p99"]),
                        _fmt(s["mean"]))
    console.print(lat)

    slo = doc.get("slo") or {}
    if slo:
        console.print("SLO: " + ", ".join(f"{t} TTFT <= {s['ttft_ms']:g} ms, TPOT <= {s['tpot_ms']:g} ms"
                                          for t, s in slo.items()))
    for name, d in rows:
        if d["rejected"]:
            console.print(f"rejected ({name}): " + ", ".join(f"{k} {v}" for k, v in d["rejected"].items()))
    reps = doc.get("per_replica_requests") or {}
    if reps:
        console.print("requests per replica: " + ", ".join(f"{k} {v}" for k, v in reps.items()))
    if doc.get("failed_reasons"):
        console.print("failed: " + ", ".join(f"{k} {v}" for k, v in doc["failed_reasons"].items()))
    for label, msg in (doc.get("error_samples") or {}).items():
        console.print(f"  e.g. {label}: {msg}", markup=False)
    max_lag_ms = doc.get("max_send_lag_ms", 0) or 0
    console.print(
        f"measured {doc.get('measured_duration_s', 0):.1f} simulated s (arrivals, then the drain) in "
        f"{doc.get('wall_s', 0):.1f} wall s; "
        f"send lag behind the trace p99 {_fmt((doc.get('send_lag_ms') or {}).get('p99'))} ms, "
        f"max {max_lag_ms:.1f} ms"
        + (" (high: the client or the machine was overloaded; latencies include it)" if max_lag_ms > 50 else "")
    )


def replay_to_report(
    trace: list[Any],
    cfg: Any,
    slos: Mapping[str, Slo],
    meta: Mapping[str, Any],
    out: str | Path | None = None,
    console: Console | None = None,
) -> dict[str, Any]:
    """Run :func:`loadgen.replay.replay` (on uvloop), print the tables, write ``out`` if given.

    Args:
        trace: the selected :class:`~loadgen.traces.TraceRequest` list.
        cfg: a :class:`~loadgen.replay.ReplayConfig`.
        slos: tenant -> SLO targets (simulated ms).
        meta: run description for the report (trace, rate_scale, duration_s, ...).
        out: JSON path, or None.
    """
    from loadgen.replay import replay
    from fairbatch_common.runtime import run

    result = run(replay(trace, cfg))
    doc = build_report(result, slos, meta)
    print_report(doc, console)
    if out is not None:
        path = write_report(doc, out)
        (console or default_console()).print(f"report written to {path}")
    return doc
