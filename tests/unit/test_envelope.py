"""The latency envelope of FairBatching (arXiv 2510.14392; docs/design.md section 2) (replica_agent/policy/envelope.py)."""

from __future__ import annotations

import pytest

from replica_agent.policy.envelope import Envelope, tpot_ms, ttft_ms

SEED = Envelope(arrival_ms=0.0, ttft_ms=300.0, tpot_ms=50.0)


def test_deadline_of_token_6_is_600_ms():
    # 0 + 300 + 6 * 50 = 600
    assert SEED.deadline_ms(6) == 600.0
    assert SEED.deadline_ms(0) == 300.0


def test_slack_at_430_ms_with_token_6_next_is_170_ms():
    # 6 tokens out -> next is token 6 (deadline 600): 600 - 430 = 170
    assert SEED.slack_ms(tokens_out=6, now_ms=430.0) == 170.0


def test_negative_slack_when_behind():
    assert SEED.slack_ms(tokens_out=0, now_ms=350.0) == -50.0


def test_banked_time_is_not_a_violation():
    # deadlines 300, 350, 400; one gap is 90 ms > TPOT 50, still within the envelope
    times = [50.0, 60.0, 150.0]
    assert max(b - a for a, b in zip(times, times[1:])) == 90.0
    assert SEED.first_violation(times) is None


def test_first_violation_index():
    assert SEED.first_violation([310.0]) == 0
    assert SEED.first_violation([100.0, 200.0, 401.0]) == 2


def test_negative_token_index_raises():
    with pytest.raises(ValueError):
        SEED.deadline_ms(-1)


def test_ttft_and_tpot():
    assert ttft_ms(0.0, [50.0, 60.0, 150.0]) == 50.0
    assert tpot_ms([50.0, 60.0, 150.0]) == 50.0  # (150 - 50) / 2
    assert ttft_ms(0.0, []) is None
    assert tpot_ms([1.0]) is None
