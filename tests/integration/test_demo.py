"""`fairbatch-loadgen demo` end to end, shortened: the same command `make demo` runs, on 2 replicas."""

from __future__ import annotations

import json
import subprocess

import pytest

from loadgen.procs import script

pytestmark = pytest.mark.timeout(240)


def test_demo_runs_the_fleet_and_reports(tmp_path) -> None:
    out = tmp_path / "report.json"
    proc = subprocess.run(
        script("fairbatch-loadgen") + ["demo", "--replicas", "2", "--duration-s", "40", "--rate-scale", "2",
                                       "--time-scale", "1", "--no-progress", "--out", str(out)],
        capture_output=True, text=True, timeout=220,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    # 40 s of the Azure conversation trace from its start holds this many arrivals (counted in the CSV:
    # rows with TIMESTAMP < 18:15:46.68 + 40 s: 89)
    total = doc["requests_total"]
    assert total == 89
    assert total == doc["completed"] + sum(doc["rejected"].values()) + doc["failed"]
    assert set(doc["per_replica_requests"]) == {"r0", "r1"} and min(doc["per_replica_requests"].values()) > 0
    assert doc["completed"] >= 0.9 * total
    for key in ("ttft_ms", "tpot_ms", "itl_ms"):
        assert 0 < doc[key]["p50"] <= doc[key]["p99"]
    assert 0 <= doc["slo_attainment"] <= 1 and doc["goodput_rps"] > 0
    assert "attained" in proc.stdout  # the header "SLO attained", wrapped over two lines
