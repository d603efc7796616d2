"""Filter ``exclude``: drops the replicas already tried for this request. No parameters."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from router.placement.core import PlacementRequest, ReplicaView

@dataclass(frozen=True, slots=True)
class ExcludeFilter:
    """Drops the replicas already tried for this request."""

    name: str = "exclude"

    def filter(self, request: PlacementRequest, replicas: Sequence[ReplicaView]) -> list[ReplicaView]:
        if not request.exclude:
            return list(replicas)
        return [r for r in replicas if r.replica_id not in request.exclude]


PLUGIN = ExcludeFilter
