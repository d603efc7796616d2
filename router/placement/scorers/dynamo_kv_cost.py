"""Scorer ``dynamo-kv-cost``: NVIDIA Dynamo's KV-router cost (router/placement/dynamo_kv.py), as a
score ``-cost`` (higher is better). Reads the router's :class:`~router.placement.load.RouterLoad`
(``load``, injected by the registry) and the prefix map's estimate (``PlacementRequest.cached_tokens``).
Parameters ``block_size`` (tokens, default 16) and ``overlap_score_weight`` (default 1)."""

from __future__ import annotations

from dataclasses import dataclass

from router.placement.core import PlacementRequest, ReplicaView
from router.placement.load import RouterLoad


@dataclass(slots=True)
class DynamoKvCostScorer:
    """``-cost`` with, in KV blocks of ``block_size`` tokens (P = the prompt, c = its tokens the
    replica holds by the prefix map, counted in whole blocks: ``block_size * (c // block_size)``):

    ``cost = overlap_score_weight * max(0, prefill_tokens + P - c) / block_size
    + (prompt_tokens + P) / block_size``

    where ``prefill_tokens`` (uncached prompt tokens routed there whose first token has not come)
    and ``prompt_tokens`` (whole prompts in flight there) are the router's own counts.

    Attributes:
        load: the router's load view.
        block_size: tokens per KV block (> 0).
        overlap_score_weight: weight of the prefill term (>= 0).

    Raises:
        ValueError: ``block_size`` <= 0 or a negative weight.
    """

    load: RouterLoad
    block_size: int = 16
    overlap_score_weight: float = 1.0
    name: str = "dynamo-kv-cost"

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.overlap_score_weight < 0:
            raise ValueError(f"block_size must be > 0 and overlap_score_weight >= 0, got {self.block_size}, "
                             f"{self.overlap_score_weight}")  # fmt: skip

    def cost(self, request: PlacementRequest, replica_id: str) -> float:
        """The cost of ``replica_id`` for ``request`` (KV blocks; class docstring)."""
        bs = self.block_size
        p = max(0, request.prompt_tokens)
        cached = request.cached_tokens.get(replica_id, 0) if request.cached_tokens else 0
        overlap = bs * (max(0, cached) // bs)
        load = self.load
        prefill = max(0, load.prefill_tokens.get(replica_id, 0) + p - overlap)
        return (self.overlap_score_weight * prefill + load.prompt_tokens.get(replica_id, 0) + p) / bs

    def score(self, request: PlacementRequest, replica: ReplicaView) -> float:
        return -self.cost(request, replica.replica_id)


PLUGIN = DynamoKvCostScorer
