"""Scorer ``least-outstanding-tokens``: fewer router-local in-flight tokens is better (prompt + requested
output tokens of the requests in flight there, what a router knows before the engine answers: long
prompts weigh what they cost, which request counts miss). Reads the router's
:class:`~router.placement.load.RouterLoad` (``load``, injected by the registry). No parameters."""

from __future__ import annotations

from dataclasses import dataclass

from router.placement.core import PlacementRequest, ReplicaView
from router.placement.load import RouterLoad


@dataclass(slots=True)
class LeastOutstandingTokensScorer:
    """``-outstanding tokens``: fewer router-local in-flight tokens is better."""

    load: RouterLoad
    name: str = "least-outstanding-tokens"

    def score(self, request: PlacementRequest, replica: ReplicaView) -> float:
        return -float(self.load.outstanding_tokens.get(replica.replica_id, 0))


PLUGIN = LeastOutstandingTokensScorer
