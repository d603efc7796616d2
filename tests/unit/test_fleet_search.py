"""The fleet benchmark's capacity search and summary (loadgen/fleet/search.py, loadgen/fleet/bench.py
``summarize``; issue 27 items 2 and 6). Attainment curves are made up so that every measured rate
and every capacity can be worked by hand:

- per request: 1 - max(0, r - 100) / 50 (the floor 0.9 is met up to r = 105);
- per token:   1 - max(0, r - 80) / 40 (met up to r = 84).
"""

from __future__ import annotations

import math

import pytest

from loadgen.fleet.bench import summarize
from loadgen.fleet.search import SearchSettings, bracket_search, interpolate


def curve(rate: float) -> dict:
    return {"rate_rps": rate, "slo_attainment": 1 - max(0.0, rate - 100) / 50,
            "token_slo_attainment": 1 - max(0.0, rate - 80) / 40}  # fmt: skip


def recorder():
    seen: list[float] = []

    def measure(rate: float) -> dict:
        seen.append(rate)
        return curve(rate)

    return seen, measure


def test_search_from_below_walks_up_until_both_floors_miss_then_bisects_each() -> None:
    seen, measure = recorder()
    rows = bracket_search(measure, SearchSettings(50.0, factor=1.25, refine=1, max_points=9))
    # up by 1.25 from 50: 62.5, 78.125, 97.656 (per request still met, per token not), 122.07 (both miss);
    # then the per-request gap (97.656, 122.07) -> sqrt = 109.183, the per-token gap (78.125, 97.656) -> 87.346
    assert seen == [50.0, 62.5, 78.125, 97.656, 122.07, 109.183, 87.346]
    assert [r["rate_rps"] for r in rows] == sorted(seen)
    s = summarize(rows, bound_rps=200.0)
    # per request: 97.656 meets (1.0), 109.183 misses (1 - 9.183/50 = 0.81634):
    # 97.656 + (1.0 - 0.9) / (1.0 - 0.81634) * (109.183 - 97.656) = 103.932
    assert s["capacity_bound"] == "interpolated"
    assert s["capacity_rps"] == pytest.approx(97.656 + 0.1 / (9.183 / 50) * 11.527, abs=1e-3)
    # per token: 78.125 meets (1.0), 87.346 misses (1 - 7.346/40 = 0.81635): 78.125 + 0.1/0.18365 * 9.221 = 83.146
    assert s["capacity_token_floor_bound"] == "interpolated"
    assert s["capacity_token_floor_rps"] == pytest.approx(78.125 + 0.1 / (7.346 / 40) * 9.221, abs=1e-3)


def test_search_from_above_walks_down_until_both_floors_are_met() -> None:
    seen, measure = recorder()
    bracket_search(measure, SearchSettings(200.0, factor=1.25, refine=1, max_points=9))
    # down: 160, 128, 102.4 (per request met, per token 0.44: keep going), 81.92 (both met); 200 misses both;
    # per request gap (102.4, 128) -> 114.487; per token gap (81.92, 102.4) -> 91.589
    assert seen == [200.0, 160.0, 128.0, 102.4, 81.92, round(math.sqrt(102.4 * 128), 3),
                    round(math.sqrt(81.92 * 102.4), 3)]  # fmt: skip
    assert seen[-2:] == [114.487, 91.589]


def test_search_stops_at_max_points_and_reports_at_least() -> None:
    seen = []

    def always_met(rate: float) -> dict:
        seen.append(rate)
        return {"rate_rps": rate, "slo_attainment": 1.0, "token_slo_attainment": 0.95}

    rows = bracket_search(always_met, SearchSettings(10.0, factor=2.0, refine=3, max_points=3))
    assert seen == [10.0, 20.0, 40.0]
    s = summarize(rows, bound_rps=0.0)
    assert (s["capacity_rps"], s["capacity_bound"]) == (40.0, "at-least")
    assert (s["capacity_token_floor_rps"], s["capacity_token_floor_bound"]) == (40.0, "at-least")
    assert s["fraction_of_bound"] is None


def test_summarize_reports_token_goodput_and_refusals_at_capacity() -> None:
    rows = [
        {"rate_rps": 10.0, "slo_attainment": 0.98, "token_slo_attainment": 0.95, "goodput_rps": 9.8,
         "token_goodput_per_s": 9000.0, "refused_share": 0.01, "refused_share_by_reason": {"slo-infeasible": 0.01}},
        {"rate_rps": 20.0, "slo_attainment": 0.94, "token_slo_attainment": 0.85, "goodput_rps": 18.8,
         "token_goodput_per_s": 16000.0, "refused_share": 0.05,
         "refused_share_by_reason": {"slo-infeasible": 0.03, "queue-timeout": 0.02}},
        {"rate_rps": 30.0, "slo_attainment": 0.86, "token_slo_attainment": 0.70, "goodput_rps": 25.8,
         "token_goodput_per_s": 18000.0, "refused_share": 0.12, "refused_share_by_reason": {"slo-infeasible": 0.12}},
    ]  # fmt: skip
    s = summarize(rows, bound_rps=50.0)
    # per request: 20 + (0.94 - 0.9) / (0.94 - 0.86) * 10 = 25; per token: 10 + 0.05 / 0.10 * 10 = 15
    assert s["capacity_rps"] == 25.0 and s["capacity_token_floor_rps"] == 15.0
    # token goodput at 15: halfway 9000 -> 16000 = 12500; goodput at 25: halfway 18.8 -> 25.8 = 22.3
    assert s["token_goodput_at_token_capacity"] == pytest.approx(12500.0)
    assert s["goodput_rps_at_capacity"] == pytest.approx(22.3)
    # refused at 25: halfway 0.05 -> 0.12 = 0.085; by reason: slo-infeasible 0.03 -> 0.12 = 0.075, queue-timeout
    # 0.02 -> 0 (absent at 30) = 0.01
    assert s["refused_share_at_capacity"] == pytest.approx(0.085)
    assert s["refused_share_by_reason_at_capacity"] == pytest.approx({"queue-timeout": 0.01, "slo-infeasible": 0.075})
    assert s["fraction_of_bound"] == 0.5


def test_interpolate_clamps_outside_and_skips_missing() -> None:
    rows = [{"rate_rps": 1.0, "x": 2.0}, {"rate_rps": 2.0}, {"rate_rps": 3.0, "x": 6.0}]
    assert interpolate(rows, 0.5, "x") == 2.0
    assert interpolate(rows, 2.0, "x") == 4.0
    assert interpolate(rows, 9.0, "x") == 6.0
    assert interpolate(rows, 2.0, "y") is None


@pytest.mark.parametrize("kw", [{"start_rps": 0.0}, {"start_rps": 1.0, "factor": 1.0},
                                {"start_rps": 1.0, "refine": -1}, {"start_rps": 1.0, "max_points": 0},
                                {"start_rps": 1.0, "target": 1.5}])  # fmt: skip
def test_settings_out_of_range_raise(kw: dict) -> None:
    with pytest.raises(ValueError):
        SearchSettings(**kw)
