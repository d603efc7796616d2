"""Filter ``healthy``: keeps replicas whose agent reports the engine healthy. No parameters."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from router.placement.core import PlacementRequest, ReplicaView

@dataclass(frozen=True, slots=True)
class HealthyFilter:
    """Keeps replicas whose agent reports healthy."""

    name: str = "healthy"

    def filter(self, request: PlacementRequest, replicas: Sequence[ReplicaView]) -> list[ReplicaView]:
        return [r for r in replicas if r.healthy]


PLUGIN = HealthyFilter
