"""router/placement/filters/long_prompt_pool.py, worked by hand.

tests/unit/test_placement.py's views: time model a = 10 ms, b = 0.1 ms/token, horizon H = 450 ms, class
TPOT 50 ms; a view with PAB time p has H - p reserved for decodes in one decode iteration, so its decode
step is F = 450 - p. With every candidate at p = 420, F = 30 ms and a prompt of P tokens is prefilled in
steps of 50 ms that leave it 20 ms each: chunked = 10 + 0.1 * P * 50 / 20 = 10 + 0.25 * P, long when that
exceeds 450 ms, i.e. P > 1,760 tokens.
"""

from __future__ import annotations

import math

import pytest

from router.placement import PlacementRequest, default_registry
from router.placement.filters.long_prompt_pool import LongPromptPoolFilter, chunked_prefill_ms, pool_size
from tests.unit.test_placement import TM, pab_chain_then, replica

FLEET = [replica(f"r{i}", 420.0) for i in range(5)]


def ids(views) -> list[str]:
    return [v.replica_id for v in views]


def req(prompt: int, rid: str = "") -> PlacementRequest:
    return PlacementRequest("interactive", prompt, frozenset(), request_id=rid)


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
    # C without an id, 500 tokens (60 ms): long 29.53125, all 65.15625, share 0.45324 -> ceil(1.133) = 2
    assert ids(f.filter(req(500), FLEET)) == ["r2", "r3", "r4"]
    assert f.long_share == pytest.approx(29.53125 / 65.15625)
    # with occupancy 1.5 the same share holds ceil(3.40) = 4 replicas
    f.occupancy = 1.5
    assert f.pool() == ["r0", "r1", "r2", "r3"]


def test_soft_forgetting_and_the_idle_price_without_decodes() -> None:
    f = LongPromptPoolFilter(occupancy=0.5, window=4, forget_calls=2)
    f.filter(req(2000, "A"), FLEET)
    f.filter(req(1000, "B"), FLEET)  # pool r0, r1 (previous test)
    assert ids(f.filter(req(1000, "B"), FLEET[:2])) == ["r0", "r1"]  # only pool replicas fit: both kept
    # r0 absent from two placements in a row: it leaves the ranking, the pool moves up to r1, r2
    rest = FLEET[1:]
    f.filter(req(1000, "B"), rest)
    assert ids(f.filter(req(1000, "B"), rest)) == ["r3", "r4"]
    # no candidate has decodes (PAB time = H): steps pay only a = 10 -> chunked 10 + 0.1 * P * 50 / 40,
    # long when P > 3,520 tokens; 2,000 tokens (210 ms) is short now: long 39.375 * 3/4 = 29.53, all
    # 66.875 + (210 - 66.875) / 4 = 102.66, share 0.2877 -> ceil(0.5 * 0.2877 * 5) = 1 replica, r0 (seen again)
    idle = [replica(f"r{i}", 450.0) for i in range(5)]
    assert ids(f.filter(req(2000, "D"), idle)) == ["r1", "r2", "r3", "r4"]
    assert ids(f.filter(req(3600, "E"), idle)) == ids(idle)  # 460 ms > 450: long


def test_in_the_chain_and_registered() -> None:
    f = LongPromptPoolFilter(occupancy=0.5, window=4)
    policy = pab_chain_then(f)
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
