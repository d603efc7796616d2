"""Prefix-aware PAB placement (router/placement.py ``cached_tokens``) and the router's prefix map
(router/prefix_index.py).

Hand-worked with time model a = 10 ms, b = 0.1 ms/token, c = 0; horizon H = 450 ms; KV large
(kv-headroom = (100000 - P') / 100000, P' = uncached tokens).
"""

from __future__ import annotations

import pytest

from replica_agent.policy.pab import ClassBudget
from replica_agent.policy.time_model import TimeModel
from router.placement import HeadroomScorer, PlacementRequest, ReplicaView, default_registry, effective_prompt_tokens
from router.prefix_index import PrefixIndex, text_block_keys

TM = TimeModel(10.0, 0.1, 0.0)
H = 450.0
KV = 100_000


def view(rid: str, pab_ms: float, pab_tokens: int = 100_000, max_prompt: int = 0) -> ReplicaView:
    return ReplicaView(rid, True, True, TM, {"i": ClassBudget("i", H, pab_ms, pab_tokens, KV)}, max_prompt)


def test_uncached_tokens_decide_fit_and_score() -> None:
    # P = 3000: a + b*P = 310 ms. r0 (pab 200 ms, holds 2500 cached) prices 500 tokens: 60 ms, fits;
    # r1 (pab 400 ms, cold) prices 3000: 310 ms, fits. Scores, headroom + kv-headroom:
    #   r0: (200 - 60) / 450 + (100000 - 500) / 100000 = 0.31111 + 0.995 = 1.30611
    #   r1: (400 - 310) / 450 + (100000 - 3000) / 100000 = 0.2 + 0.97 = 1.17
    # so the warm replica wins although it has half the budget: it saves b * 2500 = 250 ms of
    # prefill, more than the 200 ms of queued work it has beyond r1.
    reps = [view("r0", 200.0), view("r1", 400.0)]
    req = PlacementRequest("i", 3000, cached_tokens={"r0": 2500})
    assert effective_prompt_tokens(req, "r0") == 500 and effective_prompt_tokens(req, "r1") == 3000
    assert HeadroomScorer().score(req, reps[0]) == pytest.approx(140.0 / 450.0)
    reg = default_registry()
    for name in ("pab", "pab-chain"):
        assert reg.build(name).place(req, reps).candidates == ("r0", "r1")
    # without the prefix map r0 does not even fit (310 > 200): PAB sends it to the cold replica alone
    assert reg.build("pab").place(PlacementRequest("i", 3000), reps).candidates == ("r1",)
    # less cached (1000 tokens: P' = 2000, 210 ms > 200): r0 does not fit, no herding onto it
    assert reg.build("pab").place(PlacementRequest("i", 3000, cached_tokens={"r0": 1000}), reps).candidates == ("r1",)


def test_affinity_loses_to_load_when_the_saving_is_smaller() -> None:
    # r0 holds 500 of P = 3000 (saves 50 ms) but has 300 ms less budget than r1:
    #   r0: (100 - 260) ... a + b*2500 = 260 > 100: does not fit at all
    #   with pab 280 for r0: (280 - 260) / 450 + 0.975 = 1.01944;  r1: (580 - 310) / 450 + 0.97 = 1.57
    reps = [view("r0", 280.0), view("r1", 580.0)]
    got = default_registry().build("pab").place(PlacementRequest("i", 3000, cached_tokens={"r0": 500}), reps)
    assert got.candidates == ("r1", "r0")


def test_max_prompt_limit_applies_to_the_whole_prompt() -> None:
    # r0 accepts prompts up to 2000 tokens: a 3000-token prompt is refused there even if 2500 are cached
    reps = [view("r0", 400.0, max_prompt=2000)]
    res = default_registry().build("pab").place(PlacementRequest("i", 3000, cached_tokens={"r0": 2500}), reps)
    assert res.candidates == () and res.reason == "max-prompt"


def test_prefix_index_matches_leading_keys_with_lru_capacity() -> None:
    idx = PrefixIndex(capacity_keys=5, tokens_per_key=512)
    idx.insert("r0", [1, 2, 3])
    idx.insert("r1", [1, 9])
    assert idx.match([1, 2, 3, 4]) == {"r0": 3, "r1": 1}
    assert idx.match([7, 2]) == {}  # keys are chained: no leading match, no match
    # cached tokens: min(matched * 512, P - 1)
    assert idx.cached_tokens([1, 2, 3, 4], 2000) == {"r0": 1536, "r1": 512}
    assert idx.cached_tokens([1, 2, 3], 1200) == {"r0": 1199, "r1": 512}
    # [1, 2, 3] was touched 3, 2, 1 (first key last: most recent), so LRU order is 3, 2, 1.
    # Capacity 5: inserting [4, 5, 6] (touched 6, 5, 4) makes 6 keys and drops the oldest, 3:
    # the prompt's tail goes before its shared head.
    idx.insert("r0", [4, 5, 6])
    assert idx.size("r0") == 5
    assert idx.match([1, 2, 3]) == {"r0": 2, "r1": 1}
    assert idx.match([4, 5, 6]) == {"r0": 3}
    idx.forget("r0")
    assert idx.match([4]) == {}
    with pytest.raises(ValueError):
        PrefixIndex(0, 16)


def test_text_keys_chain_whole_chunks() -> None:
    a = text_block_keys("x" * 130, 64)  # two whole chunks; the last 2 characters get no key
    b = text_block_keys("x" * 64 + "y" * 64, 64)
    c = text_block_keys("y" * 64 + "x" * 64, 64)
    assert len(a) == 2 and a[0] == b[0] and a[1] != b[1]
    assert c[0] != a[0] and c[1] != a[1]  # same second chunk as a, different first: chained, different
    assert text_block_keys("x" * 130, 64) == a  # stable (not Python's salted str hash)
    with pytest.raises(ValueError):
        text_block_keys("abc", 0)
