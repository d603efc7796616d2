"""scripts/prefix_retention.py: the shareable share when a prefix must have been seen within Δ (hand-worked)."""

from __future__ import annotations

import math

import pytest

from loadgen.fleet.sim import FleetRequest
from tests.scripts import load_script

mod = load_script("prefix_retention")


def test_shareable_within_by_hand() -> None:
    # blocks of 10 tokens. A (t 0, ids 1 2 3, 30 tokens), B (t 5 s, ids 1 2 9, 30 tokens: shares 2 blocks
    # with A), C (t 100 s, ids 1 2 3 4, 40 tokens: shares 2 blocks with B at 95 s, 3 with A at 100 s).
    reqs = [FleetRequest(0.0, 30, 1, prefix_ids=(1, 2, 3)), FleetRequest(5_000.0, 30, 1, prefix_ids=(1, 2, 9)),
            FleetRequest(100_000.0, 40, 1, prefix_ids=(1, 2, 3, 4))]  # fmt: skip
    # all counted (100 tokens): within 10 s only B's 20 -> 0.2; within 100 s B 20 + C 30 (key "1 2 3"
    # last seen at 0 s, 100 s before) -> 0.5; within 96 s C only 20 (A's third block too old) -> 0.4
    assert mod.shareable_within(reqs, 10, 10_000.0, 0.0) == pytest.approx(0.2)
    assert mod.shareable_within(reqs, 10, 96_000.0, 0.0) == pytest.approx(0.4)
    assert mod.shareable_within(reqs, 10, 100_000.0, 0.0) == pytest.approx(0.5)
    assert mod.shareable_within(reqs, 10, math.inf, 0.0) == pytest.approx(0.5)
    # counted from 1 s: B and C only (70 tokens): 50 / 70; a hit is capped at P - 1 (a 20-token copy of A: 19)
    assert mod.shareable_within(reqs, 10, math.inf, 1_000.0) == pytest.approx(50 / 70)
    assert mod.shareable_within([reqs[0], FleetRequest(1.0, 20, 1, prefix_ids=(1, 2))], 10, math.inf, 1.0) \
        == pytest.approx(19 / 20)


def test_shared_within_per_request() -> None:
    reqs = [FleetRequest(0.0, 30, 1, prefix_ids=(1, 2, 3)), FleetRequest(5_000.0, 30, 1, prefix_ids=(1, 2, 9)),
            FleetRequest(100_000.0, 40, 1, prefix_ids=(1, 2, 3, 4))]  # fmt: skip
    assert mod.shared_within(reqs, 10, 96_000.0) == [0, 20, 20]
    assert mod.shared_within(reqs, 10, math.inf) == [0, 20, 30]
