"""loadgen.report: JSON keys, the outcome invariant, the printed table."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from loadgen.replay import ReplayResult
from loadgen.report import build_report, check_invariant, print_report, write_report
from loadgen.stats import FAILED, OK, REJECTED, RequestRecord, Slo

LATENCY_KEYS = {"p50", "p95", "p99", "mean"}
FIGURE_KEYS = {
    "requests_total", "completed", "rejected", "failed", "ttft_ms", "tpot_ms", "itl_ms", "slo_attainment",
    "goodput_rps", "goodput_tokens_per_s", "per_replica_requests",
}


def _result() -> ReplayResult:
    records = [
        RequestRecord("acme", 0.0, 10, 3, [100.0, 110.0, 120.0], OK, None, "r0"),
        RequestRecord("acme", 50.0, 10, 2, [400.0, 420.0], OK, None, "r1"),
        RequestRecord("beta", 60.0, 10, 0, [], REJECTED, "queue-full"),
        RequestRecord("beta", 70.0, 10, 0, [], FAILED, "http-500", "r1"),
    ]
    return ReplayResult(records, duration_s=2.0, wall_s=8.0, time_scale=4.0, model="m",
                        error_samples={"http-500": "boom [x]"})


def test_report_keys_and_invariant(tmp_path: Path) -> None:
    slos = {"acme": Slo(200.0, 20.0), "beta": Slo(200.0, 20.0)}
    doc = build_report(_result(), slos, {"trace": "azure-conv", "rate_scale": 2.0, "duration_s": 30.0})
    assert FIGURE_KEYS <= set(doc)
    assert {"time_scale", "trace", "rate_scale", "duration_s", "per_tenant"} <= set(doc)
    for k in ("ttft_ms", "tpot_ms", "itl_ms"):
        assert set(doc[k]) == LATENCY_KEYS
    assert doc["time_scale"] == 4.0 and doc["trace"] == "azure-conv" and doc["rate_scale"] == 2.0
    assert doc["requests_total"] == 4 and doc["completed"] == 2 and doc["failed"] == 1
    assert doc["rejected"] == {"queue-full": 1}
    assert doc["completed"] + sum(doc["rejected"].values()) + doc["failed"] == doc["requests_total"]
    assert doc["slo_attainment"] == pytest.approx(0.25)  # only the first acme request meets its SLO
    assert doc["goodput_rps"] == pytest.approx(0.5)
    assert doc["per_replica_requests"] == {"r0": 1, "r1": 2}
    assert set(doc["per_tenant"]) == {"acme", "beta"}
    for t in doc["per_tenant"].values():
        assert FIGURE_KEYS <= set(t)
        assert t["completed"] + sum(t["rejected"].values()) + t["failed"] == t["requests_total"]
    path = write_report(doc, tmp_path / "sub" / "report.json")
    assert json.loads(path.read_text()) == json.loads(json.dumps(doc))


def test_check_invariant_detects_mismatch() -> None:
    doc = {"requests_total": 3, "completed": 1, "rejected": {"queue-full": 1}, "failed": 0, "per_tenant": {}}
    with pytest.raises(AssertionError, match="requests_total"):
        check_invariant(doc)
    ok = {"requests_total": 2, "completed": 1, "rejected": {"queue-full": 1}, "failed": 0,
          "per_tenant": {"a": {"requests_total": 1, "completed": 0, "rejected": {}, "failed": 0}}}
    with pytest.raises(AssertionError, match="tenant a"):
        check_invariant(ok)


def test_print_report_shows_figures() -> None:
    slos = {"acme": Slo(200.0, 20.0), "beta": Slo(200.0, 20.0)}
    doc = build_report(_result(), slos, {"trace": "azure-conv", "rate_scale": 2.0, "duration_s": 30.0})
    buf = io.StringIO()
    print_report(doc, Console(file=buf, width=200))
    text = buf.getvalue()
    for needle in ("TTFT", "TPOT", "ITL", "queue-full", "25.0 %", "r1 2", "acme", "beta", "time scale 4.0", "boom [x]"):
        assert needle in text


def test_print_report_names_the_window_in_arrival_seconds() -> None:
    # 30 s of trace at rate x2 arrive in 30 / 2 = 15 s; a scenario has no trace and no rate
    slos = {"acme": Slo(200.0, 20.0), "beta": Slo(200.0, 20.0)}
    doc = build_report(_result(), slos, {"trace": "azure-conv", "rate_scale": 2.0, "duration_s": 30.0})
    buf = io.StringIO()
    print_report(doc, Console(file=buf, width=200))
    assert "trace azure-conv: 30 s of trace at rate x2 = 15.0 s of arrivals" in buf.getvalue()
    assert "measured 2.0 simulated s (arrivals, then the drain) in 8.0 wall s" in buf.getvalue()
    doc = build_report(_result(), slos, {"scenario": "flooder", "duration_s": 25.0})
    buf = io.StringIO()
    print_report(doc, Console(file=buf, width=200))
    assert "scenario flooder: 25 s of arrivals" in buf.getvalue() and "None" not in buf.getvalue()


def _doc_for_tables() -> dict:
    d = {"requests_total": 785, "completed": 762, "rejected": {"slo-infeasible": 23}, "failed": 0,
         "slo_attainment": 0.957, "goodput_rps": 19.31, "goodput_tokens_per_s": 5186, "output_tokens_per_s": 5196}
    lat = {"p50": 107.2, "p95": 279.5, "p99": 393.5, "mean": 122.5}
    d.update({k: lat for k in ("ttft_ms", "tpot_ms", "itl_ms")})
    return {**d, "trace": "azure-conv", "duration_s": 180, "rate_scale": 7, "time_scale": 4.0,
            "per_tenant": {"acme": d, "beta": d}}


def _render(width: int) -> str:
    import io

    from rich.console import Console

    from loadgen.report import print_report

    buf = io.StringIO()
    print_report(_doc_for_tables(), Console(width=width, file=buf, force_terminal=False))
    return buf.getvalue()


def test_summary_table_fits_80_columns_and_keeps_set_and_ok() -> None:
    out = _render(80)
    assert max(len(line) for line in out.splitlines()) <= 80
    header = "\n".join(out.splitlines()[2:6])
    for word in ("set", "requests", "ok", "rejected", "failed", "attained", "goodput"):
        assert word in header, word
    assert "out" not in header  # the lowest-priority column went
    assert "│ acme │      785 │ 762 │" in out  # the rows keep their set and ok cells


def test_summary_table_shows_every_column_when_wide() -> None:
    out = _render(120)
    assert "│ all  │      785 │ 762 │       23 │      0 │   95.7 % │   19.31 │   5,186 │ 5,196 │" in out


def test_summary_table_on_a_very_narrow_console_keeps_the_essentials() -> None:
    out = _render(50)
    assert "│ all  │      785 │ 762 │" in out and "95.7 %" in out and "19.31" not in out
