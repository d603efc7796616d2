"""Scorer ``least-outstanding``: fewer router-local in-flight requests is better (vllm-router and the
SGLang gateway count the requests they sent and have not seen finish). Reads the router's
:class:`~router.placement.load.RouterLoad` (``load``, injected by the registry). No parameters."""

from __future__ import annotations

from dataclasses import dataclass

from router.placement.core import PlacementRequest, ReplicaView
from router.placement.load import RouterLoad


@dataclass(slots=True)
class LeastOutstandingScorer:
    """``-outstanding``: fewer router-local in-flight requests is better."""

    load: RouterLoad
    name: str = "least-outstanding"

    def score(self, request: PlacementRequest, replica: ReplicaView) -> float:
        return -float(self.load.outstanding.get(replica.replica_id, 0))


PLUGIN = LeastOutstandingScorer
