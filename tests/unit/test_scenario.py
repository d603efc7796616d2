"""loadgen.scenario fairness figures on hand-worked records (pure)."""

from __future__ import annotations

import pytest

from loadgen.scenario import fairness, jain, maxmin_fair, mean_completion_ms
from loadgen.stats import OK, REJECTED, RequestRecord, Slo


def rec(tenant: str, arrival: float, first: float, last: float, prompt: int = 100, out: int = 10,
        outcome: str = OK, reason: str | None = None) -> RequestRecord:
    times = [first, last] if outcome == OK else []
    return RequestRecord(tenant, arrival, prompt, out if outcome == OK else 0, times, outcome, reason,
                         expected_output_tokens=out)


def test_jain_hand_worked() -> None:
    assert jain([1.0, 1.0]) == 1.0
    assert jain([3.0, 1.0]) == pytest.approx(16 / (2 * 10))
    assert jain([]) is None


def test_maxmin_fair_water_filling() -> None:
    # three small tenants get their demand; the flooder gets what is left
    assert maxmin_fair(100, {"a": 10, "b": 10, "c": 10, "f": 500}, dict.fromkeys("abcf", 1.0)) == {
        "a": 10, "b": 10, "c": 10, "f": 70}
    assert maxmin_fair(100, {"a": 100, "b": 100}, {"a": 3, "b": 1}) == {"a": 75, "b": 25}
    assert maxmin_fair(100, {"a": 100, "b": 10}, {"a": 3, "b": 1}) == {"a": 90, "b": 10}


def test_shares_count_first_tokens_in_the_window_only() -> None:
    records = [
        rec("a", 0, 500, 900), rec("a", 100, 1500, 1600), rec("a", 200, 1700, 1800),
        rec("b", 0, 1200, 1300),
        rec("b", 300, 2500, 2600),  # first token after the window: not counted in the share
    ]
    figs = fairness(records, {"a": 3.0, "b": 1.0}, {"a": Slo(1000, 100), "b": Slo(1000, 100)},
                    {"a": 2000, "b": 2000}, (1000.0, 2000.0))
    a, b = figs["per_tenant"]["a"], figs["per_tenant"]["b"]
    assert a["window_served_tokens"] == 220 and b["window_served_tokens"] == 110
    assert a["share"] == pytest.approx(2 / 3) and b["share"] == pytest.approx(1 / 3)
    assert a["share_whole_run"] == pytest.approx(0.6)
    # nothing arrived in [1000, 2000), but b's request from 300 ms still waited past its TTFT
    # target (1300 ms) when the window closed: b alone is backlogged
    assert figs["jain_tenants"] == ["b"] and figs["jain_index"] == 1.0
    assert b["starved"] == 1 and b["max_wait_ms"] == 2200  # TTFT 2200 > max_queue_ms 2000
    assert a["mean_completion_ms"] == pytest.approx((900 + 1500 + 1600) / 3)


def test_backlog_jain_and_maxmin_index() -> None:
    # both offer 4 requests in the window; a is served 3, b 1 (weights 3:1): exactly fair
    records = [rec("a", t, t + 10, t + 20) for t in (0, 10, 20)] + [rec("a", 30, 5000, 5010)]
    records += [rec("b", 0, 15, 25)] + [rec("b", t, 5000, 5010) for t in (10, 20, 30)]
    records += [rec("b", 40, 0, 0, outcome=REJECTED, reason="queue-timeout")]
    figs = fairness(records, {"a": 3.0, "b": 1.0}, {"a": Slo(100, 100), "b": Slo(100, 100)},
                    {"a": 60000, "b": 60000}, (0.0, 1000.0))
    assert figs["jain_tenants"] == ["a", "b"]
    assert figs["jain_index"] == pytest.approx(1.0)
    assert figs["jain_maxmin"] == pytest.approx(1.0)
    assert figs["per_tenant"]["a"]["fair_share"] == pytest.approx(0.75)
    assert figs["per_tenant"]["b"]["starved"] == 1
    assert figs["per_tenant"]["b"]["slo_attainment"] == pytest.approx(1 / 5)


def test_mean_completion_ignores_refusals() -> None:
    assert mean_completion_ms([rec("a", 0, 10, 40), rec("a", 0, 0, 0, outcome=REJECTED, reason="x")]) == 40
    assert mean_completion_ms([]) is None


def test_scenario_cli_reports_a_missing_file_and_accepts_no_progress(capsys: pytest.CaptureFixture[str]) -> None:
    from loadgen.scenario import main

    assert main(["demo", "--scenario", "/nonexistent/flooder.yaml", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fairbatch-loadgen demo: ") and "/nonexistent/flooder.yaml" in err
