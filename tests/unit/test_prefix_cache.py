"""Automatic prefix caching of the simulated engine (loadgen/sim/prefix_cache.py, kv_cache.py, engine.py).

Every expected value is worked out by hand in the comments: block counts, the free queue's order
(LRU: head = evicted first, a freed request's blocks appended last block first), hit tokens capped
at prompt - 1, and step times with TimeModel(a=10, b=0.1, c=0.001).
"""

from __future__ import annotations

import pytest

from loadgen.sim.engine import EngineConfig, SimEngine
from loadgen.sim.kv_cache import KVCacheManager
from loadgen.sim.prefix_cache import ROOT_HASH, block_hashes_from_ids, block_hashes_from_tokens, chain_hashes
from replica_agent.policy.time_model import TimeModel

TM = TimeModel(10.0, 0.1, 0.001)


def test_hashes_chain_over_the_blocks_before() -> None:
    a = block_hashes_from_tokens(list(range(10)), 4)  # blocks [0..3], [4..7]; [8, 9] is partial: no hash
    assert len(a) == 2
    assert a[0] == hash((ROOT_HASH, (0, 1, 2, 3))) and a[1] == hash((a[0], (4, 5, 6, 7)))
    b = block_hashes_from_tokens([0, 1, 2, 3, 9, 5, 6, 7, 8, 9, 10, 11], 4)  # differs in block 1 only
    assert b[0] == a[0] and b[1] != a[1]
    c = block_hashes_from_tokens([9, 1, 2, 3, 4, 5, 6, 7], 4)  # differs in block 0: block 1 differs too (chained)
    assert c[0] != a[0] and c[1] != a[1]
    with pytest.raises(ValueError):
        block_hashes_from_tokens([1], 0)


def test_hashes_from_coarse_ids() -> None:
    # 32-token ids over 16-token blocks: engine block j is (ids[j // 2], j % 2)
    h = block_hashes_from_ids([7, 8], 32, 16, 64)
    assert h == chain_hashes([(7, 0), (7, 1), (8, 0), (8, 1)])
    assert block_hashes_from_ids([7, 8], 32, 16, 40) == h[:2]  # 40 // 16 = 2 full blocks
    assert block_hashes_from_ids([7], 32, 16, 64) == h[:2]  # no id past 32 tokens: no hash there
    other = block_hashes_from_ids([7, 9], 32, 16, 64)
    assert other[:2] == h[:2] and other[2] != h[2]
    with pytest.raises(ValueError):
        block_hashes_from_ids([1], 24, 16, 64)


def test_second_request_hits_full_blocks_capped_at_prompt_minus_one() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    hashes = block_hashes_from_tokens(list(range(13)), 4)  # 3 full blocks of a 13-token prompt
    assert kv.attach_prefix("a", hashes, 13) == 0  # cold
    assert kv.allocate_slots("a", 13)  # ceil(13/4) = 4 blocks; the 3 full ones are cached
    assert (kv.free_blocks, kv.cached_blocks) == (4, 3)
    kv.free("a")
    assert (kv.free_blocks, kv.cached_blocks) == (8, 3)  # freed, still cached
    assert kv.attach_prefix("b", hashes, 13) == 12  # 3 blocks, 12 <= 13 - 1
    assert (kv.free_blocks, kv.tokens_of("b"), kv.blocks_of("b")) == (5, 12, 3)
    assert kv.allocate_slots("b", 1)  # the 13th token: one more block
    assert kv.free_blocks == 4
    # a 12-token prompt of the same 3 blocks may hit at most 11 tokens: 2 blocks
    assert kv.attach_prefix("c", hashes, 12) == 8
    assert (kv.queries_tokens, kv.hits_tokens) == (13 + 13 + 12, 0 + 12 + 8)


def test_shared_blocks_are_reference_counted() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=4)
    hashes = block_hashes_from_tokens(list(range(9)), 4)  # 2 full blocks
    kv.attach_prefix("a", hashes, 9)
    kv.allocate_slots("a", 9)  # 3 blocks
    assert kv.attach_prefix("b", hashes, 9) == 8  # shares a's 2 blocks while a runs
    kv.allocate_slots("b", 1)  # its own third block
    assert kv.free_blocks == 6 - 3 - 1
    kv.free("a")  # a's third block is free; the 2 shared ones are still b's
    assert kv.free_blocks == 3
    kv.free("b")
    assert kv.free_blocks == 6


def test_lru_eviction_takes_the_least_recently_freed_and_a_prompts_tail_first() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    hashes = block_hashes_from_tokens(list(range(9)), 4)  # 2 full blocks
    kv.attach_prefix("a", hashes, 9)
    kv.allocate_slots("a", 9)  # blocks 0, 1, 2 (0 and 1 cached); free queue [3]
    kv.free("a")  # appended last block first: free queue [3, 2, 1, 0]
    assert kv.allocate_slots("x", 12)  # takes 3, 2, 1: block 1 (a's second cached block) is evicted
    assert kv.cached_blocks == 1
    assert kv.attach_prefix("a2", hashes, 9) == 4  # only the first block is still cached
    assert kv.allocate_slots("z", 1) is False  # no free block left
    # without prefix caching nothing hits
    off = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    off.attach_prefix("a", hashes, 9)
    off.allocate_slots("a", 9)
    off.free("a")
    assert off.attach_prefix("b", hashes, 9) == 0 and off.cached_blocks == 0


def test_engine_skips_the_cached_prefix_in_prefill() -> None:
    eng = SimEngine(EngineConfig(TM, num_gpu_blocks=100, block_size=16))
    prompt = list(range(64))
    hashes = block_hashes_from_tokens(prompt, 16)  # 4 full blocks
    eng.add_request("a", 64, max_tokens=1, arrival_ms=0.0, block_hashes=hashes)
    s1 = eng.step(0.0)  # cold: 64 new tokens, 10 + 6.4 = 16.4 ms, finishes (1 output token)
    assert s1.batch.items == [("a", 64)] and s1.duration_ms == pytest.approx(16.4)
    eng.add_request("b", 64, max_tokens=1, arrival_ms=20.0, block_hashes=hashes)
    assert eng.requests["b"].computed_tokens == 48  # 3 blocks: 4 * 16 = 64 > 63
    s2 = eng.step(20.0)  # 16 new tokens over 48 cached: 10 + 1.6 + 0.001 * 48 = 11.648 ms
    assert s2.batch.items == [("b", 16)] and s2.duration_ms == pytest.approx(11.648)
    assert s2.outputs[0].ttft_ms == pytest.approx(11.648)
    assert (eng.prefix_cache_queries, eng.prefix_cache_hits) == (128, 48)
    assert eng.counters.prompt_tokens == 128  # prompt tokens count whole prompts, as vLLM's counter


def test_aborting_a_waiting_request_frees_its_cached_prefix() -> None:
    eng = SimEngine(EngineConfig(TM, num_gpu_blocks=10, block_size=16, max_num_seqs=1))
    hashes = block_hashes_from_tokens(list(range(33)), 16)  # 2 full blocks
    eng.add_request("a", 33, max_tokens=5, arrival_ms=0.0, block_hashes=hashes)
    eng.step(0.0)  # a prefills 33 tokens: 3 blocks, 2 cached
    eng.add_request("b", 33, max_tokens=5, arrival_ms=1.0, block_hashes=hashes)  # waits (max_num_seqs 1)
    assert eng.kv.blocks_of("b") == 2 and eng.kv.free_blocks == 7  # shares a's 2 blocks
    eng.abort("a")
    assert eng.kv.free_blocks == 8  # a's third block; the shared 2 stay with b
    eng.abort("b")
    assert eng.kv.free_blocks == 10


def test_preempted_request_looks_up_again() -> None:
    # 4 blocks of 16: a (prompt 32, 2 cached blocks) runs; a preemption frees them and a's next
    # step finds them cached again, so its recompute starts at 16 (cap: 31 // 16 = 1 block).
    eng = SimEngine(EngineConfig(TM, num_gpu_blocks=4, block_size=16))
    hashes = block_hashes_from_tokens(list(range(32)), 16)
    eng.add_request("a", 32, max_tokens=20, arrival_ms=0.0, block_hashes=hashes)
    eng.step(0.0)
    req = eng.requests["a"]
    eng._preempt_newest()  # the engine's own preemption path (frees, computed_tokens = 0)
    assert req.computed_tokens == 0 and eng.kv.free_blocks == 4
    s = eng.step(10.0)
    assert s.batch.items == [("a", 17)]  # 32 + 1 output token - 16 cached
    assert eng.prefix_cache_hits == 16


def test_virtual_replay_hits_the_cache_for_a_repeated_prompt() -> None:
    from loadgen.sim.virtual import VirtualRequest, run_virtual

    hashes = tuple(block_hashes_from_tokens(list(range(64)), 16))
    eng = SimEngine(EngineConfig(TM, num_gpu_blocks=100, block_size=16))
    reqs = [VirtualRequest("a", 0.0, 64, 1, block_hashes=hashes), VirtualRequest("b", 100.0, 64, 1, block_hashes=hashes)]
    run = run_virtual(reqs, eng)
    # a: cold prefill 10 + 6.4 = 16.4 ms; b: 16 new tokens over 48 cached, 10 + 1.6 + 0.048 = 11.648 ms
    assert [r.token_times_ms[0] - r.request.arrival_ms for r in run.records] == pytest.approx([16.4, 11.648])
    assert (eng.prefix_cache_queries, eng.prefix_cache_hits) == (128, 48)
