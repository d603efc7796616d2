"""Filter ``fresh``: keeps replicas whose budget snapshot arrived within its TTL. No parameters."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from router.placement.core import PlacementRequest, ReplicaView

@dataclass(frozen=True, slots=True)
class FreshFilter:
    """Keeps replicas whose latest budget arrived within its TTL (else their budget counts as zero)."""

    name: str = "fresh"

    def filter(self, request: PlacementRequest, replicas: Sequence[ReplicaView]) -> list[ReplicaView]:
        return [r for r in replicas if r.fresh and r.time_model is not None]


PLUGIN = FreshFilter
