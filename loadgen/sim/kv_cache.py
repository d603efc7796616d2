"""Paged KV cache of the simulated engine: a fixed pool of blocks of ``block_size`` token slots.

Modelled on vLLM v1's ``KVCacheManager`` (``vllm/v1/core/kv_cache_manager.py``): a request holds
``ceil(tokens_in_kv / block_size)`` blocks; :meth:`KVCacheManager.allocate_slots` reserves the
slots for the tokens a step is about to compute and answers ``False`` (vLLM: ``None``) when the
pool cannot hold them, leaving the decision (preempt, stop scheduling) to the caller. No prefix
caching, no watermark: every block belongs to exactly one request.

Pure: no I/O, no time. Units: ``*_tokens`` are token slots, ``*_blocks`` are blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` token slots: ceil(num_tokens / block_size)."""
    return -(-num_tokens // block_size)


@dataclass(slots=True)
class _Held:
    """Slots and blocks one request holds."""

    tokens: int = 0
    blocks: int = 0


@dataclass(slots=True)
class KVCacheManager:
    """Block accounting for the KV cache of one engine.

    Attributes:
        num_blocks: blocks in the pool (vLLM's ``num_gpu_blocks``), > 0.
        block_size: token slots per block, > 0.

    Raises:
        ValueError: if ``num_blocks`` or ``block_size`` is not positive.
    """

    num_blocks: int
    block_size: int
    _free_blocks: int = field(init=False)
    _held: dict[str, _Held] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        if self.num_blocks <= 0 or self.block_size <= 0:
            raise ValueError(
                f"KV cache needs num_blocks > 0 and block_size > 0; got {self.num_blocks}, {self.block_size}"
            )
        self._free_blocks = self.num_blocks

    @property
    def capacity_tokens(self) -> int:
        """Token slots in the whole pool: num_blocks * block_size."""
        return self.num_blocks * self.block_size

    @property
    def free_blocks(self) -> int:
        """Blocks not held by any request."""
        return self._free_blocks

    @property
    def used_blocks(self) -> int:
        """Blocks held by requests."""
        return self.num_blocks - self._free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1 (vLLM's ``kv_cache_usage_perc``)."""
        return (self.num_blocks - self._free_blocks) / self.num_blocks

    def tokens_of(self, request_id: str) -> int:
        """Token slots allocated to ``request_id`` (0 when it holds none)."""
        held = self._held.get(request_id)
        return held.tokens if held is not None else 0

    def blocks_of(self, request_id: str) -> int:
        """Blocks held by ``request_id`` (0 when it holds none)."""
        held = self._held.get(request_id)
        return held.blocks if held is not None else 0

    def allocate_slots(self, request_id: str, num_new_tokens: int) -> bool:
        """Reserve slots for ``num_new_tokens`` more tokens of ``request_id``.

        The request then holds ceil((slots held + num_new_tokens) / block_size) blocks; only the
        missing blocks are taken from the pool (the partly filled last block is used first).

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
        total = held.tokens + num_new_tokens
        need = -(-total // self.block_size) - held.blocks
        if need > self._free_blocks:
            return False
        self._free_blocks -= need
        held.tokens = total
        held.blocks += need
        self._held[request_id] = held
        return True

    def free(self, request_id: str) -> int:
        """Release every block of ``request_id`` (finish, abort or preemption).

        Returns:
            Blocks returned to the pool (0 when the request held none).
        """
        held = self._held.pop(request_id, None)
        if held is None:
            return 0
        self._free_blocks += held.blocks
        return held.blocks
