"""router/placement/filters/long_prompt_pool.py, worked by hand.

tests/unit/test_placement.py's views: time model a = 10 ms, b = 0.1 ms/token, horizon H = 450 ms, class
TPOT 50 ms; a view with PAB time p has H - p reserved for decodes in one decode iteration, so its decode
step is F = 450 - p. With every candidate at p = 420, F = 30 ms and a prompt of P tokens is prefilled in
steps of 50 ms that leave it 20 ms each: chunked = 10 + 0.1 * P * 50 / 20 = 10 + 0.25 * P, long when that
exceeds 450 ms, i.e. P > 1,760 tokens.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from router.placement import PlacementPolicy, PlacementRequest, default_registry
from router.placement.filters.long_prompt_pool import LongPromptPoolFilter, chunked_prefill_ms, pool_size
from tests.unit.test_placement import TM, replica

FLEET = [replica(f"r{i}", 420.0) for i in range(5)]


def ids(views) -> list[str]:
    return [v.replica_id for v in views]


def req(prompt: int, rid: str = "", waited_ms: float = 0.0) -> PlacementRequest:
    return PlacementRequest("interactive", prompt, frozenset(), waited_ms, request_id=rid)


def primed(occupancy: float = 0.5, **kw) -> LongPromptPoolFilter:
    """A filter that saw A (2,000 tokens: long) then B (1,000: short) on FLEET: share 0.58879, pool r0, r1
    (test_short_prompts_leave_the_pool_once_long_prompts_come)."""
    f = LongPromptPoolFilter(occupancy=occupancy, window=4, **kw)
    f.filter(req(2000, "A"), FLEET)
    f.filter(req(1000, "B"), FLEET)
    return f


def test_chunked_price_and_pool_size() -> None:
    # 1,000 tokens: prefill 110 ms, 100 ms of it token work; steps of 50 ms leave 20 -> 100 * 50 / 20 = 250, + a
    assert chunked_prefill_ms(TM, 1000, 30.0, 50.0) == pytest.approx(260.0)
    assert chunked_prefill_ms(TM, 1000, 0.0, 50.0) == pytest.approx(110.0)  # no fixed cost: the idle price
    assert chunked_prefill_ms(TM, 1000, 50.0, 50.0) == math.inf  # a step is all fixed cost
    assert pool_size(0.25, 8, 1.5) == 3  # ceil(3.0)
    assert pool_size(0.2, 16, 1.5) == 5  # ceil(4.8)
    assert pool_size(0.9, 8, 1.5) == 7  # one replica always stays open
    assert pool_size(0.0, 8, 1.5) == 0 and pool_size(0.5, 1, 1.5) == 0


def test_no_long_prompt_seen_no_pool() -> None:
    f = LongPromptPoolFilter(occupancy=0.5, window=4)
    assert ids(f.filter(req(1000, "a"), FLEET)) == ids(FLEET)  # chunked 260 ms: short, share 0
    assert f.long_share == 0.0 and f.pool() == []


def test_short_prompts_leave_the_pool_once_long_prompts_come() -> None:
    f = LongPromptPoolFilter(occupancy=0.5, window=4)
    # A: 2,000 tokens, chunked 510 ms > 450: long; it keeps every candidate. Averages (weight 1/4):
    # long 52.5, all 52.5 (its idle price 210 ms) -> share 1.
    assert ids(f.filter(req(2000, "A"), FLEET)) == ids(FLEET)
    assert f.long_share == pytest.approx(1.0)
    # B: 1,000 tokens (110 ms), short. long 52.5 * 3/4 = 39.375, all 52.5 + (110 - 52.5) / 4 = 66.875,
    # share 0.58879; pool ceil(0.5 * 0.58879 * 5) = ceil(1.47) = 2: r0 and r1 (lowest ids)
    assert ids(f.filter(req(1000, "B"), FLEET)) == ["r2", "r3", "r4"]
    assert f.long_share == pytest.approx(39.375 / 66.875)
    # B placed again (a later dispatch pass): not counted twice
    assert ids(f.filter(req(1000, "B"), FLEET)) == ["r2", "r3", "r4"]
    assert f.long_share == pytest.approx(39.375 / 66.875)
    # C without an id, 500 tokens (60 ms): long 29.53125, all 65.15625, share 0.45324 -> ceil(1.133) = 2;
    # placed again it is counted again: long 22.1484, all 63.8672, share 0.34679 -> ceil(0.867) = 1
    assert ids(f.filter(req(500), FLEET)) == ["r2", "r3", "r4"]
    assert f.long_share == pytest.approx(29.53125 / 65.15625)
    assert ids(f.filter(req(500), FLEET)) == ["r1", "r2", "r3", "r4"]
    assert f.long_share == pytest.approx(22.1484375 / 63.8671875)
    # with occupancy 1.5 the same share holds ceil(2.60) = 3 replicas
    f.occupancy = 1.5
    assert f.pool() == ["r0", "r1", "r2"]
    # a long prompt after the pool formed still gets every candidate, the pool's first
    assert ids(f.filter(req(2000, "D"), FLEET)) == ids(FLEET)


def test_the_pool_is_the_lowest_ids_in_string_order_whatever_the_candidate_order() -> None:
    f = LongPromptPoolFilter(occupancy=0.5, window=4)
    fleet = [replica(rid, 420.0) for rid in ("r2", "r10", "r9", "r1")]
    f.filter(req(2000, "A"), fleet)
    # B: share 0.58879 -> ceil(0.5 * 0.58879 * 4) = ceil(1.18) = 2: sorted ids r1, r10, r2, r9 -> r1, r10
    assert ids(f.filter(req(1000, "B"), fleet)) == ["r2", "r9"]


def test_decode_step_is_the_mean_over_candidates_with_decodes() -> None:
    # r0..r3 at 420 ms (F = 30 each), r4 idle at 450 (no decode iteration): F = 30, not (4*30 + 0) / 5 = 24.
    # 1,800 tokens: chunked 10 + 180 * 50 / 20 = 460 > 450 -> long (with F = 24: 10 + 180 * 50 / 26 = 356 -> short)
    f = LongPromptPoolFilter(occupancy=0.5, window=4)
    mixed = [*FLEET[:4], replica("r4", 450.0)]
    f.filter(req(1800, "A"), mixed)
    assert f.long_share == pytest.approx(1.0)
    # no candidate has decodes (PAB time = H): steps pay only a = 10 -> chunked 10 + 0.1 * P * 50 / 40:
    # long when P > 3,520 tokens; 2,000 tokens is short, 3,600 (460 ms) long
    idle = [replica(f"r{i}", 450.0) for i in range(5)]
    g = LongPromptPoolFilter(occupancy=0.5, window=4)
    g.filter(req(2000, "a"), idle)
    assert g.long_share == 0.0
    g.filter(req(3600, "b"), idle)
    assert g.long_share > 0.0


def busy(rid: str, pab_ms: float) -> object:
    """A view with ``pab_ms`` of PAB time whose decode step is still 30 ms (the rest of the horizon is
    in-flight prefill), so F stays 30 ms."""
    v = replica(rid, pab_ms)
    return dataclasses.replace(v, classes={c: dataclasses.replace(b, decode_reservation_ms=30.0,
                                                                   inflight_reservation_ms=450.0 - pab_ms - 30.0)
                                           for c, b in v.classes.items()})  # fmt: skip


def test_soft_by_the_fit_rule_and_the_on_time_pass() -> None:
    f = primed()
    assert ids(f.filter(req(1000, "B"), FLEET[:2])) == ["r0", "r1"]  # only pool replicas: both kept
    # outside the pool only replicas where 1,000 tokens (110 ms) do not fit (PAB 100): every candidate is kept
    tight = [*FLEET[:2], busy("r2", 100.0), busy("r3", 100.0)]
    assert ids(f.filter(req(1000, "B"), tight)) == ["r0", "r1", "r2", "r3"]
    # PAB 200 outside the pool: 1,000 tokens fit there (110 <= 200); after 100 ms of waiting they are no
    # longer on time there (110 > 200 - 100), so the dispatcher's on-time pass keeps every candidate
    # (chunked 260 <= 450 - 100: still short)
    late = [*FLEET[:2], busy("r2", 200.0), busy("r3", 200.0)]
    assert ids(f.filter(req(1000, "B", waited_ms=100.0), late)) == ["r2", "r3"]
    on_time_pass = dataclasses.replace(req(1000, "B", waited_ms=100.0), on_time_only=True)
    assert ids(f.filter(on_time_pass, late)) == ["r0", "r1", "r2", "r3"]


def test_a_replica_gone_from_the_candidates_leaves_the_ranking() -> None:
    f = primed(forget_calls=2)  # calls 1 (A) and 2 (B) saw r0..r4; pool r0, r1
    rest = FLEET[1:]
    assert ids(f.filter(req(1000, "B"), rest)) == ["r2", "r3", "r4"]  # call 3: r0 seen 1 call ago, still ranked
    assert ids(f.filter(req(1000, "B"), rest)) == ["r3", "r4"]  # call 4: r0 gone 2 calls, the pool is r1, r2


def test_an_aged_short_prompt_may_take_the_pool_and_a_budget_without_tpot_is_left_alone() -> None:
    f = primed()
    # 1,000 tokens: chunked 260 ms; after waiting 200 ms its horizon is 250 < 260: judged long, every candidate
    assert ids(f.filter(req(1000, "B", waited_ms=200.0), FLEET)) == ids(FLEET)
    assert ids(f.filter(req(1000, "B", waited_ms=150.0), FLEET)) == ["r2", "r3", "r4"]  # 260 <= 300: short
    # an agent that sends no TPOT: candidates unchanged and nothing counted
    share = f.long_share
    no_tpot = [dataclasses.replace(v, classes={c: dataclasses.replace(b, tpot_ms=0.0) for c, b in v.classes.items()})
               for v in FLEET]
    assert ids(f.filter(req(1000, "Z"), no_tpot)) == ids(FLEET)
    assert f.long_share == share


def test_in_the_chain_and_registered() -> None:
    f = LongPromptPoolFilter(occupancy=0.5, window=4)
    chain = default_registry().build("pab-chain")
    policy = PlacementPolicy([*chain.filters[:4], f, *chain.filters[4:]], chain.scorers, chain.picker)
    assert [x.name for x in policy.filters][:6] == ["exclude", "healthy", "fresh", "max-prompt", "long-prompt-pool",
                                                     "fits"]
    # r0 has the most PAB time; F = mean(10, 30, 30, 30, 30) = 26: 2,200 tokens take 10 + 220 * 50 / 24 = 468 ms
    # chunked > 450: long, worst fit sends it to the roomiest
    roomy = [replica("r0", 440.0), *FLEET[1:]]
    assert policy.place(req(2200, "A"), roomy).candidates[0] == "r0"
    # a short prompt: share 43.125 / 70.625 = 0.61 -> pool ceil(1.53) = 2 (r0, r1) left out
    assert set(policy.place(req(1000, "B"), roomy).candidates) == {"r2", "r3", "r4"}
    assert default_registry().filters["long-prompt-pool"] is LongPromptPoolFilter
    with pytest.raises(ValueError):
        LongPromptPoolFilter(occupancy=0.0)
    with pytest.raises(ValueError):
        LongPromptPoolFilter(window=0)
