"""Scorer ``prefix-cache``: llm-d's prefix-cache scorer, ``cached / prompt`` (0..1): the share of the
prompt the replica is estimated to hold (``PlacementRequest.cached_tokens``, from the router's
prefix map, router/prefix_index.py, as llm-d's approximate prefix-cache plugin learns from its own
picks). No parameters; weight in the profile."""

from __future__ import annotations

from dataclasses import dataclass

from router.placement.core import PlacementRequest, ReplicaView


@dataclass(slots=True)
class PrefixCacheScorer:
    """llm-d prefix-cache scorer: ``cached / prompt`` (0..1), the share of the prompt the replica
    is estimated to hold (``PlacementRequest.cached_tokens``, from the router's prefix map)."""

    name: str = "prefix-cache"

    def score(self, request: PlacementRequest, replica: ReplicaView) -> float:
        if request.prompt_tokens <= 0 or not request.cached_tokens:
            return 0.0
        return request.cached_tokens.get(replica.replica_id, 0) / request.prompt_tokens


PLUGIN = PrefixCacheScorer
