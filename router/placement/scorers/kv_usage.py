"""Scorer ``kv-usage``: llm-d's KV-cache-utilisation scorer, ``1 - kv_usage`` from the latest scrape
(``vllm:kv_cache_usage_perc``). Reads the router's :class:`~router.placement.load.RouterLoad`
(``load``, injected by the registry). No parameters."""

from __future__ import annotations

from dataclasses import dataclass

from router.placement.core import PlacementRequest, ReplicaView
from router.placement.load import RouterLoad


@dataclass(slots=True)
class KvUsageScorer:
    """llm-d KV-cache-utilisation scorer: ``1 - kv_usage`` from the latest scrape (1 for a replica
    never scraped)."""

    load: RouterLoad
    name: str = "kv-usage"

    def score(self, request: PlacementRequest, replica: ReplicaView) -> float:
        m = self.load.scraped.get(replica.replica_id)
        return 1.0 if m is None else 1.0 - m.kv_usage


PLUGIN = KvUsageScorer
