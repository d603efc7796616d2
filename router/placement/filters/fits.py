"""Filter ``fits``: the PAB fit rule (replica_agent/policy/pab.py ``fits``) on the uncached prompt tokens
(docs/design.md sections 4 and 9). No parameters."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from replica_agent.policy.pab import fits
from router.placement.core import PlacementRequest, ReplicaView, _keep_by_budget

@dataclass(frozen=True, slots=True)
class FitsFilter:
    """Keeps replicas where the prompt fits the PAB of its SLO class (see :func:`fits`)."""

    name: str = "fits"

    def filter(self, request: PlacementRequest, replicas: Sequence[ReplicaView]) -> list[ReplicaView]:
        return _keep_by_budget(request, replicas, fits)


PLUGIN = FitsFilter
