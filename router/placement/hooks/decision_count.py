"""Hook ``decision-count``: counts granted placements per replica (a minimal learning plugin; the
router's prefix map, router/prefix_index.py, learns from the same event). No parameters."""

from __future__ import annotations

from dataclasses import dataclass, field

from router.placement.core import PlacementRequest


@dataclass(slots=True)
class DecisionCountHook:
    """``counts[replica_id]`` = placements granted there, ``tokens[replica_id]`` = their prompt tokens."""

    name: str = "decision-count"
    counts: dict[str, int] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)

    def after_decision(self, request: PlacementRequest, replica_id: str) -> None:
        self.counts[replica_id] = self.counts.get(replica_id, 0) + 1
        self.tokens[replica_id] = self.tokens.get(replica_id, 0) + request.prompt_tokens


PLUGIN = DecisionCountHook
