"""replica_agent/policy/drain.py: the drain's phases, worked by hand (grace 30 000 ms, hand-over bound
5 000 ms, poll 50 ms unless said)."""

from __future__ import annotations

import pytest

from replica_agent.policy.drain import DrainStep, drain_step


def test_nothing_in_flight_exits_at_once() -> None:
    assert drain_step(1000.0, 1000.0, 0, 30_000.0) == DrainStep("exit", 0.0)


def test_in_flight_waits_inside_the_grace_period() -> None:
    assert drain_step(1000.0, 1000.0, 3, 30_000.0) == DrainStep("wait", 50.0)
    # 20 ms of grace left: the next check comes then, not a full poll later
    assert drain_step(1000.0, 30_980.0, 3, 30_000.0) == DrainStep("wait", 20.0)


def test_grace_over_hands_over_once_then_waits_for_the_bound() -> None:
    assert drain_step(1000.0, 31_000.0, 2, 30_000.0).action == "hand_over"
    assert drain_step(1000.0, 32_000.0, 1, 30_000.0, handed_over_ms=31_000.0) == DrainStep("wait", 50.0)
    # 31 000 + 5 000 - 35 990 = 10 ms left
    assert drain_step(1000.0, 35_990.0, 1, 30_000.0, handed_over_ms=31_000.0) == DrainStep("wait", 10.0)
    assert drain_step(1000.0, 36_000.0, 1, 30_000.0, handed_over_ms=31_000.0) == DrainStep("exit", 0.0)


def test_zero_grace_hands_over_at_once() -> None:
    assert drain_step(5.0, 5.0, 4, 0.0).action == "hand_over"


@pytest.mark.parametrize("kw", [{"in_flight": -1}, {"grace_ms": -1.0}, {"handover_ms": -1.0}, {"poll_ms": 0.0}])
def test_bad_arguments_raise(kw: dict) -> None:
    args = {"started_ms": 0.0, "now_ms": 0.0, "in_flight": 1, "grace_ms": 10.0, **kw}
    with pytest.raises(ValueError):
        drain_step(**args)
