"""Paged KV cache of the simulated engine, with vLLM's automatic prefix caching.

Modelled on vLLM v1's ``KVCacheManager`` and ``BlockPool`` (``vllm/v1/core/kv_cache_manager.py``,
``block_pool.py``): a fixed pool of ``num_blocks`` blocks of ``block_size`` token slots. A request
holds ``ceil(tokens_in_kv / block_size)`` blocks; :meth:`KVCacheManager.allocate_slots` reserves the
slots for the tokens a step is about to compute and answers ``False`` (vLLM: ``None``) when the pool
cannot hold them, leaving the decision (preempt, stop scheduling) to the caller.

Prefix caching (vLLM's default, ``enable_prefix_caching``):

- Every *full* block of a prompt has a hash chained over the blocks before it (vLLM's
  ``hash_block_tokens(parent_hash, block_token_ids)``; :mod:`loadgen.sim.prefix_cache` computes
  them). The caller passes a request's prompt block hashes with :meth:`allocate_slots`; a block
  that becomes full of prompt tokens gets its hash and enters the hash -> block map (the first
  block with a given hash stays the cached one, as in vLLM).
- :meth:`attach_prefix` (vLLM's ``get_computed_blocks``) gives a request with no blocks the
  longest run of cached blocks of its prompt, at most ``prompt_tokens - 1`` tokens (the last
  prompt token is always computed, to get its logits); each block's reference count goes up, and
  a block nobody else used leaves the free queue.
- Blocks are reference counted; :meth:`free` drops a request's references, and a block that
  reaches 0 goes to the tail of the free queue, the request's blocks in reverse order (so its last
  blocks are evicted first), still holding its hash: a later request can hit it.
- Allocation takes blocks from the head of the free queue (least recently freed first); taking a
  block that holds a hash evicts it from the map (LRU eviction).

Free blocks count the cached-but-unused ones (vLLM's ``get_num_free_blocks``), and ``usage`` is
``1 - free / num_blocks`` (``vllm:kv_cache_usage_perc``). Counters :attr:`queries_tokens` and
:attr:`hits_tokens` add up every lookup (vLLM's ``vllm:prefix_cache_queries`` and
``vllm:prefix_cache_hits``, in tokens). With no hashes passed, the cache never hits and the block
counts are those of a cache without prefix caching.

Pure: no I/O, no time. Units: ``*_tokens`` are token slots, ``*_blocks`` are blocks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` token slots: ceil(num_tokens / block_size)."""
    return -(-num_tokens // block_size)


@dataclass(slots=True)
class _Held:
    """Slots and blocks one request holds; ``hashes`` are its prompt's full-block hashes."""

    tokens: int = 0
    blocks: list[int] = field(default_factory=list)
    hashes: Sequence[int] = ()
    hashed: int = 0  # leading blocks of ``blocks`` already given their hash (or found cached)


@dataclass(slots=True)
class KVCacheManager:
    """Block accounting and prefix cache of one engine (module docstring).

    Attributes:
        num_blocks: blocks in the pool (vLLM's ``num_gpu_blocks``), > 0.
        block_size: token slots per block, > 0.
        enable_prefix_caching: keep full prompt blocks for reuse (vLLM's default); False: never hit.
        queries_tokens: prompt tokens looked up by :meth:`attach_prefix` (``vllm:prefix_cache_queries``).
        hits_tokens: of those, tokens found cached (``vllm:prefix_cache_hits``).

    Raises:
        ValueError: if ``num_blocks`` or ``block_size`` is not positive.
    """

    num_blocks: int
    block_size: int
    enable_prefix_caching: bool = True
    queries_tokens: int = field(init=False, default=0)
    hits_tokens: int = field(init=False, default=0)
    _free: OrderedDict[int, None] = field(init=False, repr=False)
    _ref: list[int] = field(init=False, repr=False)
    _hash_of: list[int | None] = field(init=False, repr=False)
    _cached: dict[int, int] = field(init=False, repr=False, default_factory=dict)
    _held: dict[str, _Held] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        if self.num_blocks <= 0 or self.block_size <= 0:
            raise ValueError(
                f"KV cache needs num_blocks > 0 and block_size > 0; got {self.num_blocks}, {self.block_size}"
            )
        self._free = OrderedDict.fromkeys(range(self.num_blocks))
        self._ref = [0] * self.num_blocks
        self._hash_of = [None] * self.num_blocks

    @property
    def capacity_tokens(self) -> int:
        """Token slots in the whole pool: num_blocks * block_size."""
        return self.num_blocks * self.block_size

    @property
    def free_blocks(self) -> int:
        """Blocks no request references (cached ones included: they are evicted on demand)."""
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        """Blocks referenced by at least one request."""
        return self.num_blocks - len(self._free)

    @property
    def cached_blocks(self) -> int:
        """Blocks that hold a prompt-block hash (in use or free)."""
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1 (vLLM's ``kv_cache_usage_perc``)."""
        return (self.num_blocks - len(self._free)) / self.num_blocks

    def tokens_of(self, request_id: str) -> int:
        """Token slots allocated to ``request_id`` (0 when it holds none)."""
        held = self._held.get(request_id)
        return held.tokens if held is not None else 0

    def blocks_of(self, request_id: str) -> int:
        """Blocks held by ``request_id`` (0 when it holds none)."""
        held = self._held.get(request_id)
        return len(held.blocks) if held is not None else 0

    def cached_prefix_blocks(self, block_hashes: Sequence[int], prompt_tokens: int) -> int:
        """Leading blocks of a prompt found in the cache now, capped so that at most
        ``prompt_tokens - 1`` tokens hit (no side effect: a peek, for an agent's estimate)."""
        if not self.enable_prefix_caching:
            return 0
        cap = min(len(block_hashes), max(0, prompt_tokens - 1) // self.block_size)
        cached = self._cached
        n = 0
        while n < cap and block_hashes[n] in cached:
            n += 1
        return n

    def attach_prefix(self, request_id: str, block_hashes: Sequence[int], prompt_tokens: int) -> int:
        """Give a request without blocks its cached prompt prefix (vLLM ``get_computed_blocks``).

        Args:
            request_id: a request that holds no blocks now (new, or preempted and freed).
            block_hashes: chained hashes of its prompt's full blocks, in order.
            prompt_tokens: its prompt length (tokens); at most ``prompt_tokens - 1`` tokens hit.

        Returns:
            Tokens found cached (a multiple of ``block_size``); the request now holds those blocks
            and that many slots. Counts ``prompt_tokens`` queried and the hit tokens.

        Raises:
            ValueError: if the request already holds blocks.
        """
        held = self._held.get(request_id)
        if held is not None and held.blocks:
            raise ValueError(f"request {request_id!r} already holds KV blocks")
        n = self.cached_prefix_blocks(block_hashes, prompt_tokens)
        self.queries_tokens += prompt_tokens
        hit = n * self.block_size
        self.hits_tokens += hit
        blocks = [self._cached[h] for h in block_hashes[:n]]
        for b in blocks:
            if self._ref[b] == 0:
                del self._free[b]
            self._ref[b] += 1
        self._held[request_id] = _Held(hit, blocks, block_hashes, n)
        return hit

    def allocate_slots(self, request_id: str, num_new_tokens: int, block_hashes: Sequence[int] | None = None) -> bool:
        """Reserve slots for ``num_new_tokens`` more tokens of ``request_id``.

        The request then holds ceil((slots held + num_new_tokens) / block_size) blocks; only the
        missing blocks are taken from the head of the free queue (evicting any hash they held).
        Blocks that are then full of prompt tokens get their hash from ``block_hashes`` (or the
        hashes given before) and enter the cache.

        Returns:
            True when the slots were allocated; False, with nothing changed, when the free
            blocks do not suffice (the caller preempts or stops scheduling).

        Raises:
            ValueError: if ``num_new_tokens`` is negative.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        held = self._held.get(request_id)
        if held is None:
            held = _Held()
        if block_hashes is not None and not held.hashes:
            held.hashes = block_hashes
        total = held.tokens + num_new_tokens
        need = -(-total // self.block_size) - len(held.blocks)
        free = self._free
        if need > len(free):
            return False
        hash_of = self._hash_of
        cached = self._cached
        ref = self._ref
        for _ in range(need):
            b, _none = free.popitem(last=False)
            h = hash_of[b]
            if h is not None:  # evict: the LRU cached block is reused
                if cached.get(h) == b:
                    del cached[h]
                hash_of[b] = None
            ref[b] = 1
            held.blocks.append(b)
        held.tokens = total
        self._held[request_id] = held
        if self.enable_prefix_caching and held.hashes:
            full = min(total // self.block_size, len(held.hashes))
            for i in range(held.hashed, full):
                h = held.hashes[i]
                b = held.blocks[i]
                if h not in cached:
                    cached[h] = b
                    hash_of[b] = h
            held.hashed = max(held.hashed, full)
        return True

    def free(self, request_id: str) -> int:
        """Drop every block reference of ``request_id`` (finish, abort or preemption).

        Blocks no one references any more go to the tail of the free queue, the request's last
        block first, keeping their hash (module docstring).

        Returns:
            Blocks the request held (0 when it held none).
        """
        held = self._held.pop(request_id, None)
        if held is None:
            return 0
        ref = self._ref
        free = self._free
        for b in reversed(held.blocks):
            ref[b] -= 1
            if ref[b] == 0:
                free[b] = None
        return len(held.blocks)
