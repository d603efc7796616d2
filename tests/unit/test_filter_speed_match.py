"""router/placement/filters/speed_match.py, worked by hand.

Horizon 450 ms; slow replicas (A100-like) a = 10 ms, b = 0.1 ms/token; fast ones (H100-like) a = 10 ms,
b = 0.05 ms/token. With ``short_share`` 0.35 a prompt is short when its prefill on the slowest candidate,
10 + 0.1 * P, is at most 157.5 ms: P <= 1,475 tokens.
"""

from __future__ import annotations

import dataclasses

import pytest

from router.placement import PlacementRequest, default_registry
from router.placement.filters.speed_match import SpeedMatchFilter
from replica_agent.policy.time_model import TimeModel
from tests.unit.test_placement import pab_chain_then, replica

FAST = TimeModel(10.0, 0.05, 0.0)


def fast(rid: str, pab_ms: float):
    return dataclasses.replace(replica(rid, pab_ms), time_model=FAST)


FLEET = [replica("a0", 300.0), fast("h0", 400.0), replica("a1", 200.0), fast("h1", 350.0)]


def ids(views) -> list[str]:
    return [v.replica_id for v in views]


def req(p: int) -> PlacementRequest:
    return PlacementRequest("interactive", p, frozenset())


def test_short_prompts_to_slow_replicas_long_ones_to_fast() -> None:
    f = SpeedMatchFilter()
    # 1,000 tokens: 110 ms on an A100-like replica <= 157.5 -> short -> the slow group (b 0.1)
    assert ids(f.filter(req(1000), FLEET)) == ["a0", "a1"]
    # 1,475 tokens: 157.5 ms, at the threshold -> still short
    assert ids(f.filter(req(1475), FLEET)) == ["a0", "a1"]
    # 1,500 tokens: 160 ms -> long -> the fast group (b 0.05)
    assert ids(f.filter(req(1500), FLEET)) == ["h0", "h1"]


def test_homogeneous_or_one_group_keeps_everything() -> None:
    f = SpeedMatchFilter()
    same = [replica("a0", 300.0), replica("a1", 200.0)]
    assert ids(f.filter(req(5000), same)) == ["a0", "a1"]
    # prices within the tolerance (0.1 against 0.095, 1.05x) count as one group
    near = [replica("a0", 300.0), dataclasses.replace(replica("a1", 200.0), time_model=TimeModel(10.0, 0.095, 0.0))]
    assert ids(f.filter(req(5000), near)) == ["a0", "a1"]
    # only fast candidates left (the slow ones did not fit): a short prompt keeps them all
    assert ids(f.filter(req(1000), [fast("h0", 400.0), fast("h1", 350.0)])) == ["h0", "h1"]
    with pytest.raises(ValueError):
        SpeedMatchFilter(short_share=-0.1)
    with pytest.raises(ValueError):
        SpeedMatchFilter(tolerance=0.9)


def test_in_the_chain() -> None:
    policy = pab_chain_then(SpeedMatchFilter())
    # short: worst fit among the A100-like a0 (300) and a1 (200), though h0 has the most headroom
    assert policy.place(req(1000), FLEET).candidates[:2] == ("a0", "a1")
    # 2,500 tokens: 260 ms on a slow replica (a0 300 fits, a1 200 does not), 135 ms on a fast one:
    # long -> h0 (400) then h1 (350)
    assert policy.place(req(2500), FLEET).candidates[:2] == ("h0", "h1")
    # 3,000 tokens: no slow replica fits (310 ms), so the slowest candidates are the fast ones: kept
    assert policy.place(req(3000), FLEET).candidates[:2] == ("h0", "h1")
    assert default_registry().filters["speed-match"] is SpeedMatchFilter
