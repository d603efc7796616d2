"""Capacity search for the fleet benchmark (issue 27, items 2 and 6). PURE (no I/O, no clock).

A policy's capacity under a floor is the highest arrival rate whose attainment is still at or
above the floor (0.9), linearly interpolated between the last rate at or above it and the first
rate below it (``loadgen.bench_policies.capacity``). A fixed sweep derived from one model
(bench-fleet's old default: fractions of the analytic bound of the *policy's* time model) may
start above a policy's capacity on a slower engine ("below the sweep", a lower limit of every
ratio) or end below it ("at least"). :func:`bracket_search` instead walks the rate until both
floors are bracketed:

1. start at ``start_rps`` (bench-fleet: half the engine model's steady-state bound,
   loadgen/fleet/bound.py ``steady_state_bound`` on the engine's own step-time model, which no
   policy sees);
2. while the lowest measured rate misses either floor, measure ``lowest / factor``;
3. while the highest measured rate meets either floor, measure ``highest * factor``;
4. refine: for each floor, ``refine`` times, measure the geometric mean of the highest rate
   that meets it and the next measured rate above (which misses it).

Two floors (issue 27 item 2): per request (``slo_attainment``: the share of requests that met
both TTFT and TPOT, refused ones count as misses) and per token (``token_slo_attainment``: the
share of prompt + output tokens that belong to such requests). A policy that refuses its costly
prompts keeps the first and loses the second.

The search stops after ``max_points`` measurements; a floor not bracketed by then is reported
``at-least`` (never missed) or ``below-sweep`` (never met), as the fixed sweep reports it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

FLOOR_KEYS = ("slo_attainment", "token_slo_attainment")
"""Row keys of the two floors: per request, per token."""


@dataclass(frozen=True, slots=True)
class SearchSettings:
    """How :func:`bracket_search` walks the rate.

    Attributes:
        start_rps: first rate measured (req/s, > 0).
        factor: step between rates while bracketing (> 1; 1.25 = 25 % apart).
        refine: bisections per floor once bracketed (>= 0).
        max_points: measurements in all (>= 1).
        target: the floor (attainment ratio in (0, 1]).

    Raises:
        ValueError: a setting out of range.
    """

    start_rps: float
    factor: float = 1.25
    refine: int = 1
    max_points: int = 9
    target: float = 0.9

    def __post_init__(self) -> None:
        if not (self.start_rps > 0 and math.isfinite(self.start_rps)):
            raise ValueError(f"start_rps must be > 0, got {self.start_rps}")
        if not self.factor > 1:
            raise ValueError(f"factor must be > 1, got {self.factor}")
        if self.refine < 0 or self.max_points < 1:
            raise ValueError("refine must be >= 0 and max_points >= 1")
        if not 0 < self.target <= 1:
            raise ValueError(f"target must be in (0, 1], got {self.target}")


def _meets(row: dict[str, Any], key: str, target: float) -> bool:
    return (row.get(key) or 0.0) >= target


def bracket_search(measure: Callable[[float], dict[str, Any]], s: SearchSettings,
                   keys: Sequence[str] = FLOOR_KEYS) -> list[dict[str, Any]]:  # fmt: skip
    """Rows (sorted by ``rate_rps``) measured by ``measure(rate)`` until every floor in ``keys`` is
    bracketed and refined (module docstring). ``measure`` returns a row with ``rate_rps`` and the
    ``keys`` (attainment ratios); it is called at most ``s.max_points`` times, never twice at one
    rate (rates are rounded to 3 decimals)."""
    rows: dict[float, dict[str, Any]] = {}

    def at(rate: float) -> bool:
        rate = round(rate, 3)
        if rate in rows or len(rows) >= s.max_points or rate <= 0:
            return False
        row = measure(rate)
        rows[rate] = {**row, "rate_rps": row.get("rate_rps", rate)}
        return True

    def ordered() -> list[dict[str, Any]]:
        return [rows[k] for k in sorted(rows)]

    at(s.start_rps)
    while len(rows) < s.max_points:  # down until the lowest rate meets every floor
        low = ordered()[0]
        if all(_meets(low, k, s.target) for k in keys) or not at(low["rate_rps"] / s.factor):
            break
    while len(rows) < s.max_points:  # up until the highest rate misses every floor
        high = ordered()[-1]
        if not any(_meets(high, k, s.target) for k in keys) or not at(high["rate_rps"] * s.factor):
            break
    for _ in range(s.refine):
        for k in keys:
            rs = ordered()
            gap = _crossing(rs, k, s.target)
            if gap is not None:
                at(math.sqrt(gap[0] * gap[1]))
    return ordered()


def _crossing(rows: Sequence[dict[str, Any]], key: str, target: float) -> tuple[float, float] | None:
    """(r0, r1): the first rate meeting ``key``'s floor followed by a rate missing it, walking up
    from the lowest (the rule of ``loadgen.bench_policies.capacity``), or None."""
    prev = None
    for row in rows:
        if not _meets(row, key, target):
            return None if prev is None else (prev["rate_rps"], row["rate_rps"])
        prev = row
    return None


def interpolate(rows: Sequence[dict[str, Any]], rate: float, key: str) -> float | None:
    """``key`` at ``rate``, linear between the measured rows around it (rows sorted by rate); the
    nearest row's value outside them; None when no row has ``key``."""
    pts = [(r["rate_rps"], r[key]) for r in rows if r.get(key) is not None]
    if not pts:
        return None
    if rate <= pts[0][0]:
        return float(pts[0][1])
    for (r0, v0), (r1, v1) in zip(pts, pts[1:], strict=False):
        if r0 <= rate <= r1:
            return float(v0 + (v1 - v0) * (rate - r0) / (r1 - r0)) if r1 > r0 else float(v1)
    return float(pts[-1][1])
