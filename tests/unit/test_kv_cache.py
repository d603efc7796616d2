"""Paged KV block accounting (loadgen/sim/kv_cache.py), hand-worked block counts."""

from __future__ import annotations

import pytest

from loadgen.sim.kv_cache import KVCacheManager, blocks_for_tokens


def test_blocks_for_tokens_is_ceiling() -> None:
    # ceil(0/16) = 0, ceil(1/16) = 1, ceil(16/16) = 1, ceil(17/16) = 2
    assert [blocks_for_tokens(n, 16) for n in (0, 1, 16, 17)] == [0, 1, 1, 2]


def test_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError):
        KVCacheManager(0, 16)
    with pytest.raises(ValueError):
        KVCacheManager(10, 0)


def test_prefill_then_decode_fills_partial_block_first() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=16)
    # 20-token prompt: ceil(20/16) = 2 blocks.
    assert kv.allocate_slots("r", 20) is True
    assert (kv.blocks_of("r"), kv.tokens_of("r"), kv.free_blocks) == (2, 20, 8)
    # Decodes 21..32 fit in the second block (32 = 2 * 16): no new block.
    for _ in range(12):
        assert kv.allocate_slots("r", 1) is True
    assert (kv.blocks_of("r"), kv.tokens_of("r"), kv.free_blocks) == (2, 32, 8)
    # Token 33 needs a third block.
    assert kv.allocate_slots("r", 1) is True
    assert (kv.blocks_of("r"), kv.free_blocks) == (3, 7)
    # usage = 3 used / 10 = 0.3
    assert kv.usage == pytest.approx(0.3)


def test_allocation_fails_without_change_when_full() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=16)
    assert kv.allocate_slots("a", 48)  # 3 blocks, 1 free
    # 40 tokens need ceil(40/16) = 3 blocks > 1 free.
    assert kv.allocate_slots("b", 40) is False
    assert (kv.blocks_of("b"), kv.tokens_of("b"), kv.free_blocks) == (0, 0, 1)
    # "a" grows by 17 tokens: ceil(65/16) = 5 blocks, 2 more > 1 free -> refused, a unchanged.
    assert kv.allocate_slots("a", 17) is False
    assert (kv.blocks_of("a"), kv.tokens_of("a")) == (3, 48)
    # 16 more tokens: ceil(64/16) = 4 blocks, 1 more == 1 free -> granted; pool now full.
    assert kv.allocate_slots("a", 16)
    assert kv.free_blocks == 0 and kv.usage == 1.0


def test_free_returns_blocks_and_is_idempotent() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    kv.allocate_slots("a", 9)  # ceil(9/4) = 3
    kv.allocate_slots("b", 4)  # 1
    assert kv.used_blocks == 4
    assert kv.free("a") == 3
    assert kv.free("a") == 0
    assert kv.free("never") == 0
    assert (kv.free_blocks, kv.used_blocks, kv.tokens_of("a")) == (7, 1, 0)
    assert kv.capacity_tokens == 32  # 8 blocks * 4


def test_zero_tokens_and_negative() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=16)
    assert kv.allocate_slots("a", 0) is True and kv.free_blocks == 2
    with pytest.raises(ValueError):
        kv.allocate_slots("a", -1)
