"""Picker ``round-robin``: replicas in turn, one router-local counter (the ``round_robin`` policy of
vllm-router and the SGLang gateway). No parameters."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from router.placement.core import ReplicaView


@dataclass(slots=True)
class RoundRobinPicker:
    """Replicas in turn: the i-th call starts at candidate ``i mod len`` (router-local counter)."""

    name: str = "round-robin"
    _next: int = 0

    def order(self, scored: Sequence[tuple[ReplicaView, float]]) -> list[str]:
        ids = [r.replica_id for r, _ in scored]
        if not ids:
            return []
        start = self._next % len(ids)
        self._next += 1
        return ids[start:] + ids[:start]


PLUGIN = RoundRobinPicker
