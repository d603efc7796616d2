"""Filter ``on-time``: with ``request.on_time_only``, keeps replicas where the request can still meet its
TTFT (replica_agent/policy/pab.py ``on_time``). No parameters."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from replica_agent.policy.pab import on_time
from router.placement.core import PlacementRequest, ReplicaView, _keep_by_budget

@dataclass(frozen=True, slots=True)
class OnTimeFilter:
    """With ``request.on_time_only``: keeps replicas where the request can still meet its TTFT
    (:func:`~replica_agent.policy.pab.on_time`); otherwise keeps every replica."""

    name: str = "on-time"

    def filter(self, request: PlacementRequest, replicas: Sequence[ReplicaView]) -> list[ReplicaView]:
        if not request.on_time_only:
            return list(replicas)
        return _keep_by_budget(request, replicas, on_time)


PLUGIN = OnTimeFilter
