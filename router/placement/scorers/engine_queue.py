"""Scorer ``engine-queue``: a shorter engine queue is better, ``-(running + waiting)`` requests from the
latest scrape (the load measure of vllm-router's and the SGLang gateway's ``power_of_two``). Reads
the router's :class:`~router.placement.load.RouterLoad` (``load``, injected by the registry). No
parameters."""

from __future__ import annotations

from dataclasses import dataclass

from router.placement.core import PlacementRequest, ReplicaView
from router.placement.load import RouterLoad


@dataclass(slots=True)
class EngineQueueScorer:
    """``-(running + waiting)`` from the latest scrape: a shorter engine queue is better (0 for a
    replica never scraped)."""

    load: RouterLoad
    name: str = "engine-queue"

    def score(self, request: PlacementRequest, replica: ReplicaView) -> float:
        m = self.load.scraped.get(replica.replica_id)
        return 0.0 if m is None else -float(m.num_running + m.num_waiting)


PLUGIN = EngineQueueScorer
