"""PAB on hand-computed replica states (docs/architecture.md "PAB").

Common numbers: a = 10 ms, b = 0.1 ms/token, c = 0.001 ms/token; class "interactive" TTFT 500 ms,
TPOT 50 ms; margin 0.1 -> horizon H = 500 * 0.9 = 450 ms.
"""

from __future__ import annotations

import pytest

from replica_agent.policy.leases import LeaseTable
from replica_agent.policy.pab import (
    DecodeState,
    PendingPrefill,
    ReplicaState,
    SloClass,
    class_budget,
    compute_budgets,
    fits,
)
from replica_agent.policy.time_model import TimeModel

TM = TimeModel(10.0, 0.1, 0.001)
INTERACTIVE = SloClass("interactive", 500.0, 50.0)


def state(now_ms=0.0, decodes=(), prefills=(), kv_free_tokens=10_000) -> ReplicaState:
    return ReplicaState(now_ms, tuple(decodes), tuple(prefills), kv_free_tokens, TM, 0.1)


def test_idle_replica():
    b = class_budget(state(), INTERACTIVE)
    # nothing reserved: PAB_ms = H = 450
    assert b.horizon_ms == pytest.approx(450.0)
    assert b.decode_iterations == 0
    assert b.decode_reservation_ms == 0.0
    assert b.inflight_reservation_ms == 0.0
    assert b.pab_ms == pytest.approx(450.0)
    # time part: floor((450 - 10) / 0.1) = 4400; KV: 10000 free, no growth, no pending -> 10000
    assert b.kv_free_tokens == 10_000
    assert b.kv_limited_tokens == 10_000
    assert b.pab_tokens == 4400
    assert fits(4400, b, TM)  # 10 + 440 = 450 <= 450
    # 4401 tokens: 10 + 440.1 > H, so the idle-replica rule applies: idle and 4401 <= 10000 KV
    assert fits(4401, b, TM)


def test_decodes_with_little_slack_and_a_prefill():
    now = 1000.0
    d1 = DecodeState(next_deadline_ms=1010.0, tpot_ms=50.0, context_tokens=1000, tokens_out=10, max_tokens=100)
    d2 = DecodeState(next_deadline_ms=1200.0, tpot_ms=100.0, context_tokens=3000, tokens_out=5, max_tokens=None)
    p = PendingPrefill(prompt_tokens=1000, computed_tokens=0)
    b = class_budget(state(now, [d1, d2], [p], kv_free_tokens=8000), INTERACTIVE)
    # t + H = 1450
    # n1 = floor((1450 - 1010) / 50) + 1 = floor(8.8) + 1 = 9
    # n2 = floor((1450 - 1200) / 100) + 1 = floor(2.5) + 1 = 3
    # N = 9; one iteration = 10 + 0.1 * 2 + 0.001 * (1000 + 3000) = 14.2 ms -> 9 * 14.2 = 127.8 ms
    assert b.decode_iterations == 9
    assert b.decode_reservation_ms == pytest.approx(127.8)
    # in-flight: 0.1 * 1000 + 0.001 * 0 = 100 ms
    assert b.inflight_reservation_ms == pytest.approx(100.0)
    # PAB_ms = 450 - 127.8 - 100 = 222.2
    assert b.pab_ms == pytest.approx(222.2)
    # growth: d1 min(100 - 10, ceil(450/50) + 1 = 10) = 10; d2 unknown max -> ceil(450/100) + 1 = 6
    # kv_limited = 8000 - 16 - 1000 (pending prompt) = 6984
    assert b.kv_limited_tokens == 6984
    # time part floor((222.2 - 10) / 0.1) = 2122 < 6984
    assert b.pab_tokens == 2122
    assert fits(2000, b, TM)  # 10 + 200 = 210 <= 222.2
    assert not fits(2200, b, TM)  # 230 > 222.2
    # a prompt longer than the horizon (10 + 0.1 * 5000 = 510 > 450) never fits a busy replica
    assert not fits(5000, b, TM)


def test_kv_nearly_full():
    d = DecodeState(next_deadline_ms=100.0, tpot_ms=50.0, context_tokens=500, tokens_out=3, max_tokens=5)
    b = class_budget(state(0.0, [d], [], kv_free_tokens=300), INTERACTIVE)
    # n = floor((450 - 100) / 50) + 1 = 8; iteration = 10 + 0.1 + 0.5 = 10.6 -> 84.8 ms
    assert b.decode_iterations == 8
    assert b.decode_reservation_ms == pytest.approx(84.8)
    assert b.pab_ms == pytest.approx(365.2)
    # growth = min(5 - 3, 10) = 2 -> kv_limited = 300 - 2 = 298; time part floor(355.2 / 0.1) = 3552
    assert b.kv_limited_tokens == 298
    assert b.pab_tokens == 298
    assert fits(298, b, TM)
    assert not fits(299, b, TM)


def test_kv_full_gives_zero_tokens_and_negative_pab_clamps():
    d = DecodeState(next_deadline_ms=-500.0, tpot_ms=10.0, context_tokens=100_000, tokens_out=50, max_tokens=None)
    b = class_budget(state(0.0, [d], [], kv_free_tokens=0), INTERACTIVE)
    # behind its envelope: n = floor((450 + 500) / 10) + 1 = 96; iteration = 10 + 0.1 + 100 = 110.1
    assert b.decode_iterations == 96
    assert b.decode_reservation_ms == pytest.approx(96 * 110.1)
    assert b.pab_ms == 0.0
    assert b.pab_tokens == 0
    assert b.kv_limited_tokens == 0
    assert not fits(0, b, TM)  # a + 0 = 10 > 0


def test_decode_far_from_its_deadline_reserves_nothing():
    d = DecodeState(next_deadline_ms=1000.0, tpot_ms=50.0, context_tokens=10, tokens_out=1, max_tokens=2)
    b = class_budget(state(0.0, [d]), INTERACTIVE)
    # n = max(0, floor((450 - 1000) / 50) + 1) = max(0, -11 + 1) = 0
    assert b.decode_iterations == 0
    assert b.decode_reservation_ms == 0.0
    assert b.pab_ms == pytest.approx(450.0)
    # growth min(2 - 1, 10) = 1
    assert b.kv_limited_tokens == 9_999


def test_exact_multiple_counts_the_token_on_the_boundary():
    # (t + H - ddl) / tpot = (450 - 300) / 50 = 3 exactly -> n = 4
    d = DecodeState(next_deadline_ms=300.0, tpot_ms=50.0, context_tokens=0, tokens_out=1)
    assert class_budget(state(0.0, [d]), INTERACTIVE).decode_iterations == 4


def test_chunked_prefill_counts_remaining_and_context():
    p = PendingPrefill(prompt_tokens=1000, computed_tokens=400)
    b = class_budget(state(prefills=[p]), INTERACTIVE)
    # 0.1 * 600 + 0.001 * 400 = 60.4 ms; pending KV 600
    assert b.inflight_reservation_ms == pytest.approx(60.4)
    assert b.kv_limited_tokens == 9_400


def test_prompt_longer_than_horizon_takes_a_whole_idle_replica():
    idle = class_budget(state(), INTERACTIVE)
    assert fits(5000, idle, TM)  # 510 > 450, nothing reserved, 5000 <= 10000 KV
    small_kv = class_budget(state(kv_free_tokens=4000), INTERACTIVE)
    assert not fits(5000, small_kv, TM)
    busy = class_budget(state(prefills=[PendingPrefill(10)]), INTERACTIVE)
    assert not fits(5000, busy, TM)
    with pytest.raises(ValueError):
        fits(-1, idle, TM)


def test_lease_lowers_pab_and_release_restores_it():
    leases = LeaseTable(id_prefix="t")

    def budget():
        return class_budget(state(prefills=[PendingPrefill(x.prompt_tokens) for x in leases.active()]), INTERACTIVE)

    before = budget()
    lease_id = leases.grant(500, "interactive", None, now_ms=0.0, ttl_ms=1000.0)
    during = budget()
    # in-flight 0.1 * 500 = 50 ms -> 400 ms; tokens floor(390 / 0.1) = 3900; KV 10000 - 500
    assert during.pab_ms == pytest.approx(400.0)
    assert during.pab_tokens == 3900
    assert during.kv_limited_tokens == 9500
    assert before.pab_ms - during.pab_ms == pytest.approx(TM.b_ms_per_new_token * 500)
    assert leases.release(lease_id)
    assert budget() == before


def test_compute_budgets_per_class_and_validation():
    batch = SloClass("batch", 20_000.0, 200.0)
    out = compute_budgets(state(), [INTERACTIVE, batch])
    assert list(out) == ["interactive", "batch"]
    assert out["batch"].horizon_ms == pytest.approx(18_000.0)
    with pytest.raises(ValueError):
        SloClass("x", 0.0, 1.0)
    with pytest.raises(ValueError):
        ReplicaState(0.0, (), (), 0, TM, 1.0)
