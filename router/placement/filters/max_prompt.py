"""Filter ``max-prompt``: keeps replicas whose engine accepts the whole prompt. No parameters."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from router.placement.core import PlacementRequest, ReplicaView

@dataclass(frozen=True, slots=True)
class MaxPromptFilter:
    """Keeps replicas whose engine accepts a prompt of this length (unknown limit = accepts)."""

    name: str = "max-prompt"

    def filter(self, request: PlacementRequest, replicas: Sequence[ReplicaView]) -> list[ReplicaView]:
        p = request.prompt_tokens
        return [r for r in replicas if r.max_prompt_tokens <= 0 or p <= r.max_prompt_tokens]


PLUGIN = MaxPromptFilter
