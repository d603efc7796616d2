"""Capacity from a sweep (DistServe's definition, interpolated) under either attainment yardstick."""

from __future__ import annotations

from loadgen.bench_policies import capacity


def test_capacity_interpolates_where_attainment_crosses_the_target() -> None:
    rows = [
        {"rate_rps": 1.0, "slo_attainment": 1.00, "envelope_attainment": 1.00},
        {"rate_rps": 2.0, "slo_attainment": 0.95, "envelope_attainment": 0.99},
        {"rate_rps": 3.0, "slo_attainment": 0.85, "envelope_attainment": 0.93},
        {"rate_rps": 4.0, "slo_attainment": 0.50, "envelope_attainment": 0.80},
    ]
    # TTFT/TPOT: crosses 0.9 between 2 (0.95) and 3 (0.85): 2 + (0.95 - 0.9) / (0.95 - 0.85) * 1 = 2.5
    cap, bound = capacity(rows, 0.9)
    assert bound == "interpolated" and abs(cap - 2.5) < 1e-9
    # envelope: crosses between 3 (0.93) and 4 (0.80): 3 + 0.03 / 0.13 = 3.2308
    cap, bound = capacity(rows, 0.9, "envelope_attainment")
    assert bound == "interpolated" and abs(cap - (3 + 0.03 / 0.13)) < 1e-9


def test_capacity_bounds() -> None:
    assert capacity([{"rate_rps": 1.0, "slo_attainment": 0.5}], 0.9) == (0.0, "below-sweep")
    assert capacity([{"rate_rps": 1.0, "slo_attainment": 0.95}, {"rate_rps": 2.0, "slo_attainment": 0.91}], 0.9) == (
        2.0, "at-least")
