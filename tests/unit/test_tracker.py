"""Per-request tracker (replica_agent/tracker.py)."""

from __future__ import annotations

import pytest

from replica_agent.policy.pab import DecodeState, PendingPrefill
from replica_agent.tracker import Phase, Tracker, TrackerFull


def test_lifecycle_prefill_decode_done():
    t = Tracker()
    req = t.on_arrival("r1", "interactive", ttft_ms=300.0, tpot_ms=50.0, arrival_ms=0.0, prompt_tokens=100, max_tokens=8)
    assert req.phase is Phase.PREFILL
    assert t.prefills() == (PendingPrefill(100, 0),)
    assert t.decodes() == ()
    assert t.counts() == {"prefill": 1, "decode": 0}
    # slack of a prefill is against the first-token deadline: 300 - 100 = 200
    assert t.min_slack_ms(100.0) == 200.0
    assert t.on_token("r1", 120.0) is True  # first token: prefill -> decode
    assert t.on_token("r1", 170.0) is False
    assert req.phase is Phase.DECODE and req.tokens_out == 2 and req.first_token_ms == 120.0
    # next token is j = 2: deadline 0 + 300 + 2 * 50 = 400
    assert t.decodes() == (DecodeState(400.0, 50.0, 102, 2, 8),)
    assert t.prefills() == ()
    assert t.min_slack_ms(380.0) == 20.0
    done = t.on_finish("r1", 500.0)
    assert done is not None and done.outcome == "ok" and done.request.tokens_out == 2
    assert len(t) == 0
    assert t.min_slack_ms(500.0) is None


def test_usage_corrects_counts():
    t = Tracker()
    t.on_arrival("r", "c", 300.0, 50.0, 0.0, prompt_tokens=10)
    t.on_token("r", 10.0, n=1)
    t.on_usage("r", prompt_tokens=12, completion_tokens=5)
    r = t.get("r")
    assert r.prompt_tokens == 12 and r.tokens_out == 5 and r.computed_tokens == 12
    assert t.decodes()[0].context_tokens == 17
    t.on_usage("unknown", 1, 1)  # ignored


def test_queued_arrival_counts_in_deadlines():
    t = Tracker()
    # arrival passed as now - queued: 1000 - 200 = 800
    t.on_arrival("r", "c", 300.0, 50.0, arrival_ms=800.0, prompt_tokens=0)
    assert t.min_slack_ms(1000.0) == 100.0


def test_abort_and_unknown_ids():
    t = Tracker()
    t.on_arrival("r", "c", 300.0, 50.0, 0.0, 1)
    assert t.on_token("nope", 1.0) is False
    assert t.on_abort("r", 5.0, "client_disconnect").outcome == "client_disconnect"
    assert t.on_abort("r", 5.0) is None


def test_duplicates_bounds_and_validation():
    t = Tracker(max_requests=1)
    t.on_arrival("r", "c", 300.0, 50.0, 0.0, 1)
    with pytest.raises(KeyError):
        t.on_arrival("r", "c", 300.0, 50.0, 0.0, 1)
    with pytest.raises(TrackerFull):
        t.on_arrival("s", "c", 300.0, 50.0, 0.0, 1)
    with pytest.raises(ValueError):
        Tracker().on_arrival("x", "c", 300.0, 50.0, 0.0, -1)
