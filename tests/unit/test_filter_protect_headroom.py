"""router/placement/filters/protect_headroom.py, worked by hand.

tests/unit/test_placement.py's views: time model a = 10 ms, b = 0.1 ms/token, horizon 450 ms. With
``short_share`` 0.35 a prompt is short when 10 + 0.1 * P <= 157.5 ms, i.e. P <= 1,475 tokens.
"""

from __future__ import annotations

import pytest

from router.placement import PlacementRequest, default_registry
from router.placement.filters.protect_headroom import ProtectHeadroomFilter
from tests.unit.test_placement import pab_chain_then, replica

FLEET = [replica("r0", 400.0), replica("r1", 380.0), replica("r2", 300.0), replica("r3", 200.0), replica("r4", 150.0)]


def ids(views) -> list[str]:
    return [v.replica_id for v in views]


def test_a_short_prompt_leaves_the_two_roomiest_replicas() -> None:
    f = ProtectHeadroomFilter(protect=2, short_share=0.35)
    # 1,000 tokens: 110 ms <= 157.5 -> short; r0 (400) and r1 (380) are held back
    assert ids(f.filter(PlacementRequest("interactive", 1000, frozenset()), FLEET)) == ["r2", "r3", "r4"]
    # 1,475 tokens: 157.5 ms, at the threshold (inclusive) -> still short
    assert ids(f.filter(PlacementRequest("interactive", 1475, frozenset()), FLEET)) == ["r2", "r3", "r4"]


def test_a_long_prompt_keeps_every_candidate() -> None:
    f = ProtectHeadroomFilter(protect=2, short_share=0.35)
    # 1,500 tokens: 160 ms > 157.5 -> long
    assert ids(f.filter(PlacementRequest("interactive", 1500, frozenset()), FLEET)) == ["r0", "r1", "r2", "r3", "r4"]


def test_soft_and_off() -> None:
    short = PlacementRequest("interactive", 500, frozenset())
    two = FLEET[:2]
    assert ids(ProtectHeadroomFilter(protect=2).filter(short, two)) == ["r0", "r1"]  # nothing else: kept
    assert ids(ProtectHeadroomFilter(protect=0).filter(short, FLEET)) == ids(FLEET)
    # ties on PAB time: the higher replica id is held first
    tied = [replica("a", 400.0), replica("b", 400.0), replica("c", 300.0)]
    assert ids(ProtectHeadroomFilter(protect=1).filter(short, tied)) == ["a", "c"]
    with pytest.raises(ValueError):
        ProtectHeadroomFilter(protect=-1)
    with pytest.raises(ValueError):
        ProtectHeadroomFilter(short_share=1.2)


def test_in_the_chain_a_short_prompt_goes_to_the_roomiest_unprotected_replica() -> None:
    policy = pab_chain_then(ProtectHeadroomFilter())
    # worst fit among r2, r3, r4 (all fit 110 ms): r2 (most headroom) first
    assert policy.place(PlacementRequest("interactive", 1000, frozenset()), FLEET).candidates[:3] == ("r2", "r3", "r4")
    # the long prompt takes r0, as the default profile would
    assert policy.place(PlacementRequest("interactive", 3000, frozenset()), FLEET).candidates[0] == "r0"
    # a registered plugin, so the router YAML can name it
    assert default_registry().filters["protect-headroom"] is ProtectHeadroomFilter
