"""PAB on hand-computed replica states (docs/architecture.md "PAB").

Common numbers: a = 10 ms, b = 0.1 ms/token, c = 0.001 ms/token; class "interactive" TTFT 500 ms,
TPOT 50 ms; margin 0.1 -> horizon H = 500 * 0.9 = 450 ms.
"""

from __future__ import annotations

import math
import random

import pytest

from replica_agent.policy.leases import LeaseTable
from replica_agent.policy.pab import (
    DecodeState,
    PendingPrefill,
    ReplicaState,
    SloClass,
    admits,
    class_budget,
    compute_budgets,
    decode_iterations,
    fits,
    growth_reserve_tokens,
    inflight_lumps,
    on_time,
    planning_horizon_ms,
)
from replica_agent.policy.reserve import reserve_decision
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


def test_inflight_lumps_split_the_reservation_in_engine_order():
    # TM b = 0.1, c = 0.001: 1000 tokens with 400 computed -> 60.4 ms; 500 fresh -> 50; 20 -> 2
    prefills = [PendingPrefill(1000, 400), PendingPrefill(500), PendingPrefill(20)]
    s = state(prefills=prefills)
    assert inflight_lumps(s) == pytest.approx((60.4, 50.0, 2.0))
    assert sum(inflight_lumps(s)) == pytest.approx(class_budget(s, INTERACTIVE).inflight_reservation_ms)
    # at most 2 entries: the second holds the rest (52 ms), freeing when the last of them does
    assert inflight_lumps(s, max_lumps=2) == pytest.approx((60.4, 52.0))
    assert inflight_lumps(state()) == ()


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
    assert out["batch"].horizon_ms == pytest.approx(19_800.0)  # margin min(0.1 x 20 s, one TPOT = 200 ms)
    with pytest.raises(ValueError):
        SloClass("x", 0.0, 1.0)
    with pytest.raises(ValueError):
        ReplicaState(0.0, (), (), 0, TM, 1.0)


# ---------------------------------------------------------------- aged requests (waited_ms)

AGED_CLASS = SloClass("aged", 1000.0, 100.0)  # margin 0 below -> H = 1000 ms


def aged_state(decodes=(), prefills=()) -> ReplicaState:
    return ReplicaState(0.0, tuple(decodes), tuple(prefills), 100_000, TM, 0.0)


ONE_DECODE = DecodeState(next_deadline_ms=50.0, tpot_ms=100.0, context_tokens=1000, tokens_out=10, max_tokens=None)


def test_waited_shortens_the_horizon_hand_worked():
    st = aged_state([ONE_DECODE])
    fresh = class_budget(st, AGED_CLASS)
    aged = class_budget(st, AGED_CLASS, waited_ms=300.0)
    # One iteration of the decode: a + b*|D| + c*ctx = 10 + 0.1 * 1 + 0.001 * 1000 = 11.1 ms.
    # w = 0:   H = 1000 * (1 - 0) = 1000; N = floor((0 + 1000 - 50) / 100) + 1 = floor(9.5) + 1 = 10
    #          decode reservation 10 * 11.1 = 111 ms; PAB_ms = 1000 - 111 = 889 ms
    #          tokens: floor((889 - 10) / 0.1) = 8790; KV growth ceil(1000 / 100) + 1 = 11 -> 99 989
    assert fresh.horizon_ms == 1000.0
    assert fresh.decode_iterations == 10
    assert fresh.decode_reservation_ms == pytest.approx(111.0)
    assert fresh.pab_ms == pytest.approx(889.0)
    assert fresh.pab_tokens == 8790
    assert fresh.kv_limited_tokens == 99_989
    # w = 300: H_w = 1000 - 300 = 700; N = floor((700 - 50) / 100) + 1 = floor(6.5) + 1 = 7
    #          decode reservation 7 * 11.1 = 77.7 ms; PAB_ms = 700 - 77.7 = 622.3 ms
    #          tokens: floor((622.3 - 10) / 0.1) = 6123; KV growth ceil(700 / 100) + 1 = 8 -> 99 992
    assert aged.horizon_ms == 700.0
    assert aged.decode_iterations == 7
    assert aged.decode_reservation_ms == pytest.approx(77.7)
    assert aged.pab_ms == pytest.approx(622.3)
    assert aged.pab_tokens == 6123
    assert aged.kv_limited_tokens == 99_992
    # the router's conservative bound: PAB_ms(H) - w = 889 - 300 = 589 <= 622.3 = PAB_ms(H - w)
    assert fresh.pab_ms - 300.0 == pytest.approx(589.0)
    assert fresh.pab_ms - 300.0 <= aged.pab_ms
    # waited_ms = 0 is the fresh budget itself
    assert class_budget(st, AGED_CLASS, waited_ms=0.0) == fresh


def test_aged_prompt_on_time_or_late_hand_worked():
    st = aged_state([ONE_DECODE])
    fresh = class_budget(st, AGED_CLASS)
    # P = 6500: a + b*P = 10 + 650 = 660 ms.
    #   w = 0:   660 <= 889 and 6500 <= 8790                        -> fits, on time
    #   w = 300: on time? 660 > PAB_ms(H) - w = 889 - 300 = 589     -> no (its TTFT is lost here)
    #            fits?    660 <= 889 and 6500 <= 8790 (work conservation: a fresh arrival's fit)
    assert fits(6500, fresh, TM) and on_time(6500, fresh, TM) and admits(6500, st, AGED_CLASS)[0]
    assert not on_time(6500, fresh, TM, waited_ms=300.0)
    assert fits(6500, fresh, TM, waited_ms=300.0)
    ok, budget = admits(6500, st, AGED_CLASS, 300.0)
    assert ok and budget == fresh  # the answer's budget is the full-horizon one
    # P = 5000: 510 ms <= 589 -> on time; the router's token count floor((589 - 10) / 0.1) = 5790
    assert on_time(5000, fresh, TM, waited_ms=300.0)
    assert on_time(5790, fresh, TM, waited_ms=300.0) and not on_time(5791, fresh, TM, waited_ms=300.0)
    # P = 8791: 889.1 ms > 889 -> fits nowhere busy, whatever it waited; the exact aged budget
    # (PAB_ms(700) = 622.3) does not hold it either
    assert not fits(8791, fresh, TM, waited_ms=300.0) and not admits(8791, st, AGED_CLASS, 300.0)[0]


def test_request_past_its_ttft_is_served_by_the_normal_fit():
    # w = 1200 > H = 1000: its TTFT is lost everywhere (on_time is False), yet a 100-token prompt
    # (20 ms <= PAB_ms 889) starts on the busy replica at once: no waiting for an idle one.
    busy = aged_state([ONE_DECODE])
    fresh = class_budget(busy, AGED_CLASS)
    assert not on_time(100, fresh, TM, waited_ms=1200.0)
    assert fits(100, fresh, TM, waited_ms=1200.0)
    assert admits(100, busy, AGED_CLASS, 1200.0)[0]
    # a prompt too long on its own (a + b*P = 10 + 0.1 * 10 000 = 1010 ms > H = 1000) keeps the
    # idle rule: refused on the busy replica, admitted on an idle one (KV 100 000 holds it)
    assert not fits(10_000, fresh, TM, waited_ms=1200.0) and not admits(10_000, busy, AGED_CLASS, 1200.0)[0]
    idle = aged_state()
    assert admits(10_000, idle, AGED_CLASS, 1200.0)[0] and admits(10_000, idle, AGED_CLASS)[0]
    assert fits(10_000, class_budget(idle, AGED_CLASS), TM, waited_ms=1200.0)
    # with w = 950: H_w = 50; a 100-token prompt (20 ms) is still on time by the exact rule (N over
    # 50 ms is floor((50 - 50) / 100) + 1 = 1 -> 11.1 ms -> PAB_ms 38.9 >= 20), while the router's
    # conservative bound 889 - 950 < 0 calls it late; both admit it
    assert on_time(100, class_budget(busy, AGED_CLASS, 950.0), TM)
    assert not on_time(100, fresh, TM, waited_ms=950.0)


def test_waited_ms_validation():
    st = aged_state([ONE_DECODE])
    b = class_budget(st, AGED_CLASS)
    for bad in (-1.0, -1e-12, math.nan):
        with pytest.raises(ValueError, match="waited_ms"):
            class_budget(st, AGED_CLASS, bad)
        with pytest.raises(ValueError, match="waited_ms"):
            fits(100, b, TM, bad)
        with pytest.raises(ValueError, match="waited_ms"):
            admits(100, st, AGED_CLASS, bad)


def _random_state(rng: random.Random, chunk_sq: bool = False) -> tuple[ReplicaState, SloClass]:
    tm = TimeModel(rng.choice([0.0, 5.0, 10.0, 9.8626]), rng.choice([0.05, 0.1, 0.0726711]),
                   rng.choice([0.0, 0.001, 0.0001]))  # fmt: skip
    if chunk_sq:  # the online model's terms: chunk x prefix, decode, chunk^2 and its chunk length K
        tm = TimeModel(tm.a_ms, tm.b_ms_per_new_token, tm.c_ms_per_context_token, rng.choice([0.0, 3e-6]),
                       rng.choice([0.0, -0.02]), rng.choice([0.0, 1e-6, 5.8e-6]), rng.choice([0.0, 256.0, 1500.0]))  # fmt: skip
    slo = SloClass("k", rng.choice([300.0, 500.0, 1000.0, 2500.0]), rng.choice([20.0, 50.0, 100.0]))
    now = rng.uniform(0.0, 10_000.0)
    decodes = [
        DecodeState(now + rng.uniform(-300.0, 2000.0), rng.choice([20.0, 50.0, 100.0, 33.3]), rng.randint(1, 20_000),
                    rng.randint(1, 500), rng.choice([None, rng.randint(1, 1000)]))
        for _ in range(rng.choice([0, 0, 1, 2, 5, 20]))
    ]  # fmt: skip
    prefills = [PendingPrefill(rng.randint(1, 4000), rng.choice([0, 0, rng.randint(0, 1000)]))
                for _ in range(rng.choice([0, 0, 1, 3]))]  # fmt: skip
    kv = rng.choice([1_000_000, rng.randint(0, 20_000)])
    return ReplicaState(now, decodes, prefills, kv, tm, rng.choice([0.0, 0.1, 0.25])), slo


@pytest.mark.parametrize("online_terms", [False, True])
def test_router_rule_never_admits_what_the_agent_refuses(online_terms: bool):
    """Property: on_time(P, budget(H), tm, w) implies fits(...), which implies admits(P, state, slo, w)
    (pab.py "Aged requests", "Work conservation"); also with the online model's terms, whose prompt price
    is convex in P (the cross-chunk term)."""
    rng = random.Random(20251129)
    router_yes = agent_only = late = 0
    for _ in range(4000):
        st, slo = _random_state(rng, chunk_sq=online_terms)
        tm = st.time_model
        fresh = class_budget(st, slo)
        h = fresh.horizon_ms
        w = rng.choice([0.0, rng.uniform(0.0, h), rng.uniform(0.0, 1.5 * h), h, h * 2.0, rng.uniform(0.0, 50.0)])
        exact = class_budget(st, slo, w)
        by_time = tm.tokens_within_ms(fresh.pab_ms - w)
        p = rng.choice([0, 1, rng.randint(0, 30_000), by_time, by_time + 1, fresh.pab_tokens, exact.pab_tokens,
                        exact.pab_tokens + 1, tm.tokens_within_ms(exact.horizon_ms) + 1, exact.kv_limited_tokens])
        p = max(0, p)
        router = fits(p, fresh, tm, w)
        agent, _ = admits(p, st, slo, w)
        assert not router or agent, (st, slo, w, p)
        assert not on_time(p, fresh, tm, w) or router, (st, slo, w, p)  # on time implies fits
        assert exact.pab_ms >= fresh.pab_ms - w - 1e-9  # PAB_ms(H - w) >= PAB_ms(H) - w
        if w == 0.0:
            assert router == agent == fits(p, fresh, tm)
        router_yes += router
        agent_only += agent and not router
        late += router and not on_time(p, fresh, tm, w)
    assert router_yes > 400 and agent_only > 10 and late > 100  # every side of the rule is exercised


def test_decode_iterations_and_growth_reserve_by_hand():
    # t = 0, H = 900 ms. N: (900 - 100) / 100 = 8 -> 9 iterations; (900 - 850) / 50 = 1 -> 2;
    # (900 - 1000) / 100 = -0.1 -> floor -1, + 1 = 0; the largest is 9
    ds = [DecodeState(100.0, 100.0, 500, 3), DecodeState(850.0, 50.0, 500, 3), DecodeState(1000.0, 100.0, 500, 3)]
    assert decode_iterations(0.0, 900.0, ds) == 9
    assert decode_iterations(0.0, 900.0, []) == 0
    assert decode_iterations(0.0, 900.0, [DecodeState(2000.0, 100.0, 500, 3)]) == 0  # first deadline past t + H
    # growth caps: ceil(900 / 100) + 1 = 10 at TPOT 100, ceil(900 / 50) + 1 = 19 at TPOT 50
    gs = [
        DecodeState(0.0, 100.0, 500, 3, None),  # unknown length: the cap, 10
        DecodeState(0.0, 100.0, 500, 25, 30),  # 5 left
        DecodeState(0.0, 50.0, 500, 10, 100),  # 90 left, capped at 19
        DecodeState(0.0, 50.0, 500, 9, 5),  # past its max_tokens: 0
    ]
    assert growth_reserve_tokens(900.0, gs) == 10 + 5 + 19 + 0
    assert growth_reserve_tokens(900.0, []) == 0


def test_on_time_only_admits_no_late_start():
    # issue 27 (router copies): the router asks for an on-time start; the agent's work-conserving
    # fit must not turn it into a late one. Same replica as test_aged_prompt_on_time_or_late_hand_worked:
    # P = 6500 (660 ms) waited 300 ms fits a fresh arrival's budget (889) but not on time (589):
    st = aged_state([ONE_DECODE])
    assert admits(6500, st, AGED_CLASS, 300.0)[0]  # the work-conserving rule takes it late
    assert not admits(6500, st, AGED_CLASS, 300.0, on_time_only=True)[0]
    assert reserve_decision(6500, st, AGED_CLASS, 300.0, on_time_only=True)[0] == "not-on-time"
    # P = 5000 (510 ms) is on time after 300 ms: admitted either way
    assert admits(5000, st, AGED_CLASS, 300.0, on_time_only=True)[0]
    assert reserve_decision(5000, st, AGED_CLASS, 300.0, on_time_only=True)[0] == ""
    # a fresh arrival (w = 0): on time = the fit without the prefill-alone case
    assert admits(6500, st, AGED_CLASS, 0.0, on_time_only=True)[0]
    # past its TTFT (w = 1200 > H = 1000) nothing is on time, however short
    assert not admits(100, st, AGED_CLASS, 1200.0, on_time_only=True)[0]
    # a prompt the budget cannot hold at all keeps its own reason
    assert reserve_decision(8791, st, AGED_CLASS, 300.0, on_time_only=True)[0] == "no-budget"


def test_chunk_sq_pricing_by_hand():
    # f = 1e-5 ms/token^2 at the learned chunk length K = 500: a prompt token costs b' = 0.1 + 0.005 = 0.105
    tm = TimeModel(10.0, 0.1, 0.001, f_ms_per_chunk_sq=1e-5, chunk_tokens=500.0)
    st = ReplicaState(0.0, (), (PendingPrefill(1000, 400),), 1_000_000, tm, 0.1)
    b = class_budget(st, SloClass("k", 1000.0, 100.0))
    # in flight: 0.105 * 600 + 0.001 * 400 = 63.4 ms; H = 900; PAB = 836.6; tokens floor(826.6 / 0.105) = 7872
    assert b.inflight_reservation_ms == pytest.approx(63.4)
    assert inflight_lumps(st) == pytest.approx((63.4,))
    assert b.pab_ms == pytest.approx(836.6) and b.pab_tokens == 7872
    assert fits(7872, b, tm) and not fits(7873, b, tm)  # 10 + 0.105 * 7872 = 836.56 <= 836.6 < 836.665
    assert on_time(7000, b, tm, waited_ms=50.0) and not on_time(7500, b, tm, waited_ms=50.0)  # 745.0 / 797.5 vs 786.6
    # without f (the profile's model) the same state leaves 900 - 60.4 = 839.6 ms and floor(829.6 / 0.1) tokens
    plain = class_budget(ReplicaState(0.0, (), (PendingPrefill(1000, 400),), 1_000_000, TimeModel(10.0, 0.1, 0.001), 0.1),
                         SloClass("k", 1000.0, 100.0))  # fmt: skip
    assert plain.pab_ms == pytest.approx(839.6) and plain.pab_tokens == 8296


def test_router_on_the_linearized_snapshot_decides_as_the_agent():
    """With f and K, the router holds only (a, b', c, e, K) (admission_server.snapshot_pb: tm.linearized(); the
    book builds its model with router/budgets.py ``snapshot_time_model``): its fit and on-time answers equal
    the agent's on the same budget, and whatever it admits the agent admits (pab.py "Aged requests", "Work
    conservation")."""
    from proto import admission_pb2
    from router.budgets import snapshot_time_model

    rng = random.Random(20260301)
    router_yes = 0
    for _ in range(3000):
        st, slo = _random_state(rng, chunk_sq=True)
        tm = st.time_model
        lin = tm.linearized()
        router_tm = snapshot_time_model(admission_pb2.TimeModelCoefficients(
            a_ms=lin.a_ms, b_ms_per_new_token=lin.b_ms_per_new_token, c_ms_per_context_token=lin.c_ms_per_context_token,
            e_ms_per_chunk_prefix=lin.e_ms_per_chunk_prefix, chunk_tokens=lin.chunk_tokens))  # fmt: skip
        fresh = class_budget(st, slo)
        h = fresh.horizon_ms
        w = rng.choice([0.0, rng.uniform(0.0, h), h, rng.uniform(0.0, 50.0)])
        by_time = tm.tokens_within_ms(fresh.pab_ms - w)
        assert router_tm.tokens_within_ms(fresh.pab_ms - w) == by_time
        p = max(0, rng.choice([0, 1, rng.randint(0, 30_000), by_time, by_time + 1, fresh.pab_tokens,
                               fresh.pab_tokens + 1, tm.tokens_within_ms(h) + 1, fresh.kv_limited_tokens]))  # fmt: skip
        router = fits(p, fresh, router_tm, w)
        assert router == fits(p, fresh, tm, w), (tm, p)
        assert on_time(p, fresh, router_tm, w) == on_time(p, fresh, tm, w), (tm, p, w)
        assert not router or admits(p, st, slo, w)[0], (st, slo, w, p)
        # the budget the router reads is the agent's, and the same on the linearized model
        lin_budget = class_budget(ReplicaState(st.now_ms, st.decodes, st.prefills, st.kv_free_tokens, lin,
                                               st.margin_frac), slo)  # fmt: skip
        assert lin_budget.pab_ms == pytest.approx(fresh.pab_ms) and lin_budget.pab_tokens == fresh.pab_tokens
        router_yes += router
    assert router_yes > 300


def test_sequence_slots_full_push_the_start_back() -> None:
    """docs "Sequence slots": the engine at max_num_seqs starts a new prompt only after a decode ends."""
    now = 1000.0
    # d3 has 2 tokens left: its last token's deadline is 1010 + (100 - 98 - 1) * 50 = 1060 -> 60 ms away
    d3 = DecodeState(next_deadline_ms=1010.0, tpot_ms=50.0, context_tokens=1000, tokens_out=98, max_tokens=100)
    d2 = DecodeState(next_deadline_ms=1200.0, tpot_ms=100.0, context_tokens=3000, tokens_out=5, max_tokens=None)
    p = PendingPrefill(prompt_tokens=1000, computed_tokens=0)

    def with_cap(cap):
        return ReplicaState(now, (d3, d2), (p,), 8000, TM, 0.1, cap)

    # reservations as in test_decodes_with_little_slack_and_a_prefill: N = 9 x 14.2 = 127.8, in flight 100
    free = class_budget(with_cap(4), INTERACTIVE)  # 3 requests, 4 slots: one free
    assert free.slot_wait_ms == 0.0 and free.pab_ms == pytest.approx(222.2)
    full = class_budget(with_cap(3), INTERACTIVE)  # 3 requests, 3 slots: d3 must end first (k = 1)
    assert full.slot_wait_ms == pytest.approx(60.0)
    assert full.pab_ms == pytest.approx(450.0 - 60.0 - 127.8 - 100.0)  # 162.2
    assert full.pab_tokens == TM.tokens_within_ms(162.2)
    # two slots short (k = 2): d2 has no max_tokens, so no second finish can be promised
    over = class_budget(with_cap(2), INTERACTIVE)
    assert math.isinf(over.slot_wait_ms) and over.pab_ms == 0.0 and over.pab_tokens == 0
    # no cap: the rule is off (the default, ReplicaState(..., max_seqs=None))
    assert class_budget(with_cap(None), INTERACTIVE).pab_ms == pytest.approx(222.2)
    # an aged request (w = 50): H = 400, N = 8 (t + H = 1400: floor(390 / 50) + 1) -> 113.6;
    # 400 - 60 - 113.6 - 100 = 126.4 >= the router's conservative PAB(H) - w = 112.2
    aged = class_budget(with_cap(3), INTERACTIVE, waited_ms=50.0)
    assert aged.pab_ms == pytest.approx(126.4) and aged.pab_ms >= full.pab_ms - 50.0
    with pytest.raises(ValueError):
        with_cap(0)


def test_slot_wait_takes_the_kth_finish_and_the_finish_rate() -> None:
    from replica_agent.policy.pab import slot_wait_ms

    now = 1000.0

    def dec(ddl, out, mt, tpot=50.0):
        return DecodeState(next_deadline_ms=ddl, tpot_ms=tpot, context_tokens=100, tokens_out=out, max_tokens=mt)

    # last-token deadlines less now: a 1010 + 9 * 50 = 1460 -> 460; b 1100 + 1 * 50 -> 150;
    # c 1020 + 0 -> 20 (its last token is the next); d 900 + 2 * 50 = 1000 -> 0 (behind its envelope: due now)
    a, b, c, d = dec(1010.0, 0, 10), dec(1100.0, 8, 10), dec(1020.0, 9, 10), dec(900.0, 7, 10)
    decodes = (a, b, c, d)
    two_prefills = (PendingPrefill(100), PendingPrefill(200))
    # 6 requests, cap 4: k = 3 -> sorted ends 0, 20, 150, 460 -> the third, 150
    assert slot_wait_ms(now, decodes, two_prefills, 4) == pytest.approx(150.0)
    assert slot_wait_ms(now, decodes, two_prefills, 3) == pytest.approx(460.0)  # k = 4
    assert slot_wait_ms(now, decodes, two_prefills, 6) == pytest.approx(0.0)  # k = 1: d is due now
    assert slot_wait_ms(now, decodes, two_prefills, 7) == 0.0  # a slot is free
    assert math.isinf(slot_wait_ms(now, decodes, two_prefills, 2))  # k = 5 > 4 known finishes
    # a decode past its max_tokens counts as ending with its next token; NaN deadlines promise nothing
    assert slot_wait_ms(now, (dec(1030.0, 12, 10),), (), 1) == pytest.approx(30.0)
    assert math.isinf(slot_wait_ms(now, (dec(math.nan, 0, 10),), (), 1))
    # with 20 requests ending per second the expected wait for k = 3 is 150 ms; 40 /s: 75 ms < 150
    assert slot_wait_ms(now, decodes, two_prefills, 4, finish_rate_per_s=20.0) == pytest.approx(150.0)
    assert slot_wait_ms(now, decodes, two_prefills, 4, finish_rate_per_s=40.0) == pytest.approx(75.0)
    # with a 10 ms floor per step: d (2 tokens left after the next, behind its envelope) ends no
    # sooner than 2 * 10 = 20 ms from now, c (due at 20, 0 left) stays at 20, b at 150, a at 460
    assert slot_wait_ms(now, decodes, two_prefills, 6, min_step_ms=10.0) == pytest.approx(20.0)  # k = 1
    assert slot_wait_ms(now, decodes, two_prefills, 5, min_step_ms=10.0) == pytest.approx(20.0)  # k = 2
    assert slot_wait_ms(now, decodes, two_prefills, 4, min_step_ms=10.0) == pytest.approx(150.0)  # k = 3
    # a decode far behind (its last token was due at -5000 + 100 * 50 = 0, 1000 ms ago) with 100 tokens
    # left after the next ends no sooner than 100 * 10 ms from now
    assert slot_wait_ms(now, (dec(-5000.0, 0, 101),), (), 1, min_step_ms=10.0) == pytest.approx(1000.0)
    assert slot_wait_ms(now, (dec(-5000.0, 0, 101),), (), 1) == 0.0  # without the floor: due already
    # caps only (max_tokens unknown: inf) but a measured rate: the rate's figure, 1000 * 2 / 8 = 250
    unknown = (dec(1010.0, 0, None), dec(1010.0, 0, None))
    assert slot_wait_ms(now, unknown, (), 1, finish_rate_per_s=8.0) == pytest.approx(250.0)
    assert math.isinf(slot_wait_ms(now, unknown, (), 1, finish_rate_per_s=0.0))


def test_planning_horizon_caps_the_margin_at_one_tpot() -> None:
    # H = ttft - min(margin * ttft, cap * tpot)
    assert planning_horizon_ms(SloClass("a", 1000.0, 100.0), 0.1) == 900.0  # min(100, 100)
    assert planning_horizon_ms(SloClass("b", 5000.0, 100.0), 0.1) == 4900.0  # min(500, 100)
    assert planning_horizon_ms(SloClass("b", 5000.0, 100.0), 0.1, math.inf) == 4500.0  # the share alone
    assert planning_horizon_ms(SloClass("b", 5000.0, 100.0), 0.1, 2.5) == 4750.0  # min(500, 250)
    assert planning_horizon_ms(INTERACTIVE, 0.1) == 450.0  # min(50, 50)
    assert planning_horizon_ms(INTERACTIVE, 0.0) == 500.0


def test_long_ttft_budget_plans_over_the_capped_horizon() -> None:
    # TTFT 5 s / TPOT 100 ms: H = 4900 ms (4500 with the share alone); a 1,000-token prefill in flight
    # reserves 0.1 * 1000 = 100 ms, so PAB is 4800 (4400). A 46,000-token prompt costs 10 + 4600 = 4610 ms:
    # it fits 4800; against 4500 it is longer than the horizon and takes only an idle replica: no
    long = SloClass("long", 5000.0, 100.0)
    busy = (PendingPrefill(1000),)
    capped = ReplicaState(0.0, (), busy, 100_000, TM, 0.1)
    uncapped = ReplicaState(0.0, (), busy, 100_000, TM, 0.1, margin_cap_tpots=math.inf)
    b, u = class_budget(capped, long), class_budget(uncapped, long)
    assert (b.horizon_ms, b.pab_ms) == (4900.0, 4800.0) and (u.horizon_ms, u.pab_ms) == (4500.0, 4400.0)
    assert fits(46_000, b, TM) and not fits(46_000, u, TM)
    # a decode due every 100 ms from 50 ms: n = floor((4900 - 50) / 100) + 1 = 49 iterations of
    # a + b + c * 1000 = 10 + 0.1 + 1 = 11.1 ms -> 543.9 ms reserved, PAB 4356.1 ms
    d = DecodeState(50.0, 100.0, 1000, 1)
    b = class_budget(ReplicaState(0.0, (d,), (), 100_000, TM, 0.1), long)
    assert b.decode_iterations == 49 and b.decode_reservation_ms == pytest.approx(543.9)
    assert b.pab_ms == pytest.approx(4356.1)
    with pytest.raises(ValueError, match="margin_cap_tpots"):
        ReplicaState(0.0, (), (), 1, TM, 0.1, margin_cap_tpots=0.0)
