"""Filter ``window``: the start window (``PlacementRequest.window_steps``; router/placement/core.py
``window_admits``). No parameters."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from router.placement.core import PlacementRequest, ReplicaView, effective_prompt_tokens, window_admits

@dataclass(frozen=True, slots=True)
class WindowFilter:
    """Keeps replicas that can start the prompt within the start window (:func:`window_admits`)."""

    name: str = "window"

    def filter(self, request: PlacementRequest, replicas: Sequence[ReplicaView]) -> list[ReplicaView]:
        if request.window_steps <= 0:
            return list(replicas)
        out = []
        for r in replicas:
            budget = r.classes.get(request.slo_class)
            if budget is not None and r.time_model is not None and window_admits(
                request, budget, r.time_model, effective_prompt_tokens(request, r.replica_id)
            ):
                out.append(r)
        return out


PLUGIN = WindowFilter
