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
    # next token is j = 2: the later of the envelope, 0 + 300 + 2 * 50 = 400, and the pace from the
    # first token, 120 + 2 * 50 = 220 (proxy mode; Tracker.next_deadline_ms)
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


def test_pab_paces_a_decode_from_its_first_token() -> None:
    from replica_agent.policy.engine_state import next_token_deadline

    # TTFT 300 / TPOT 50, arrival 0. Before the first token: the TTFT deadline, 300
    assert next_token_deadline(0.0, 300.0, 50.0, 0, None) == 300.0
    # an early first token (120): its TTFT slack is not spent on decodes, token 2 by 120 + 100 = 220
    assert next_token_deadline(0.0, 300.0, 50.0, 2, 120.0) == 220.0
    # a late first token (4000, TTFT lost): paced from it, 4000 + 100 = 4100, not the arrival-based
    # 300 + 100 = 400 that would have it catch up on tokens no SLO can win back
    assert next_token_deadline(0.0, 300.0, 50.0, 2, 4000.0) == 4100.0
    # proxy mode (the tracker): the later of the envelope and that pace; a late first token is paced
    # from itself, 4100, an early one keeps the envelope, 400
    t = Tracker()
    t.on_arrival("late", "c", 300.0, 50.0, 0.0, 100, 8)
    t.on_token("late", 4000.0, 2)
    assert t.decodes()[0].next_deadline_ms == 4100.0
    t.on_arrival("early", "c", 300.0, 50.0, 0.0, 100, 8)
    t.on_token("early", 120.0, 2)
    assert t.get("early").next_deadline_ms() == 400.0


def _fresh_decodes(t: Tracker) -> tuple[DecodeState, ...]:
    """The decode list built from scratch (what Tracker.decodes built before it kept its entries)."""
    return tuple(
        DecodeState(r.next_deadline_ms(), r.envelope.tpot_ms, r.context_tokens, r.tokens_out, r.max_tokens)
        for r in t._requests.values() if r.phase is Phase.DECODE
    )


def test_kept_decode_and_prefill_lists_follow_every_event() -> None:
    """decodes() and prefills() are kept between calls; each event that changes them shows at the next
    call (values worked by hand: deadline = max(arrival + ttft + j*tpot, first + j*tpot), ttft 300,
    tpot 50), and a call with nothing changed returns the same tuple."""
    t = Tracker()
    t.on_arrival("a", "c", 300.0, 50.0, 0.0, prompt_tokens=100, max_tokens=8)
    t.on_arrival("b", "c", 300.0, 50.0, 10.0, prompt_tokens=40)
    assert t.prefills() == (PendingPrefill(100, 0), PendingPrefill(40, 0))  # arrival
    assert t.decodes() == ()
    p1, d1 = t.prefills(), t.decodes()
    assert t.prefills() is p1 and t.decodes() is d1  # nothing changed: kept
    t.on_token("b", 320.0)  # b's first token (late: paced from itself, 320 + 50 = 370 > 10 + 300 + 50)
    assert t.prefills() == (PendingPrefill(100, 0),)
    assert t.decodes() == (DecodeState(370.0, 50.0, 41, 1, None),)
    t.on_token("a", 330.0)  # a's first token: both decode, in arrival order
    assert t.decodes() == (DecodeState(380.0, 50.0, 101, 1, 8), DecodeState(370.0, 50.0, 41, 1, None))
    assert t.prefills() == ()
    kept_b = t.decodes()[1]
    t.on_token("a", 380.0, n=2)  # a token of a: a's entry moves (j = 3: 330 + 150), b's is kept as it was
    d = t.decodes()
    assert d == (DecodeState(480.0, 50.0, 103, 3, 8), DecodeState(370.0, 50.0, 41, 1, None))
    assert d[1] is kept_b
    t.on_usage("b", prompt_tokens=45, completion_tokens=2)  # usage corrects b
    assert t.decodes()[1] == DecodeState(420.0, 50.0, 47, 2, None)
    t.on_arrival("c", "c", 300.0, 50.0, 400.0, prompt_tokens=7)
    t.on_usage("c", prompt_tokens=9)  # usage of a prefill corrects the prefill list
    assert t.prefills() == (PendingPrefill(9, 0),)
    t.on_finish("a", 500.0)  # finish of a decode
    assert t.decodes() == (DecodeState(420.0, 50.0, 47, 2, None),)
    t.on_abort("c", 510.0)  # abort of a prefill
    assert t.prefills() == ()
    assert t.decodes() == _fresh_decodes(t)


def test_kept_decode_list_equals_a_fresh_build_over_random_events() -> None:
    """Over a random run of arrivals, tokens, usage corrections and finishes, the kept lists equal
    the lists built afresh after every event."""
    import random

    rng = random.Random(17)
    t = Tracker()
    now, n = 0.0, 0
    for _ in range(3000):
        now += rng.uniform(0.0, 5.0)
        ids = list(t._requests)
        op = rng.random()
        if op < 0.15 or not ids:
            n += 1
            t.on_arrival(f"r{n}", "c", rng.choice((300.0, 800.0)), rng.choice((20.0, 50.0)), now - rng.uniform(0, 50),
                         rng.randint(0, 500), rng.choice((None, 16, 64)))
        elif op < 0.8:
            t.on_token(rng.choice(ids), now, rng.choice((1, 1, 1, 3)))
        elif op < 0.87:
            t.on_usage(rng.choice(ids), rng.randint(0, 600), rng.randint(0, 80))
        else:
            t.on_finish(rng.choice(ids), now)
        if rng.random() < 0.5:
            assert t.decodes() == _fresh_decodes(t)
            assert t.prefills() == tuple(PendingPrefill(r.prompt_tokens, r.computed_tokens)
                                         for r in t._requests.values() if r.phase is Phase.PREFILL)


def test_finish_rate_over_the_last_window():
    t = Tracker(finish_window_ms=1000.0)
    for i in range(5):
        t.on_arrival(f"r{i}", "interactive", ttft_ms=300.0, tpot_ms=50.0, arrival_ms=0.0, prompt_tokens=10, max_tokens=4)
    assert t.finish_rate_per_s(100.0) is None  # nothing ended yet
    t.on_finish("r0", 100.0)
    assert t.finish_rate_per_s(100.0) is None  # one end is no rate
    t.on_finish("r1", 300.0)
    t.on_abort("r2", 700.0)  # an abort frees a slot too
    t.on_finish("unknown", 750.0)  # not tracked: not counted
    # ends at 100, 300, 700 within [0, 1000]: 3 per second
    assert t.finish_rate_per_s(1000.0) == pytest.approx(3.0)
    # at 1200 the window is [200, 1200]: 300 and 700 -> 2 per second
    assert t.finish_rate_per_s(1200.0) == pytest.approx(2.0)
    assert t.finish_rate_per_s(1800.0) is None  # window [800, 1800]: no end left in it
