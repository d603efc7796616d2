"""Filter ``protect-headroom``: short prompts leave the replicas with the most headroom to long ones.
No YAML parameters (the defaults below).

Why (issue 27 item 4; docs/evaluation.md, "Where we win"): at the rates where the per-token floor
is decided, PAB refuses the long prompts (on azure-code the 7 % of requests over 6,144 tokens hold a
quarter of the tokens) because no replica has the contiguous prefill time they need, while the short
ones still fit somewhere. Worst fit sends every short prompt to the replica with the most headroom,
so the replica that was closest to taking a long prompt is the first to lose that room. This filter
keeps the ``protect`` replicas with the most PAB time (``pab_ms`` of the request's class) out of a
short prompt's candidates: they keep draining their running work and are there when a long prompt
comes. A prompt is short when its prefill on an idle replica (``a + b*P``, the fit rule's price)
is at most ``short_share`` of the class's horizon. Soft: when leaving those replicas out leaves
no candidate, every candidate is kept (a short prompt is never refused by this filter).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from router.placement.core import PlacementRequest, ReplicaView, effective_prompt_tokens


@dataclass(frozen=True, slots=True)
class ProtectHeadroomFilter:
    """Drops, for a short prompt, the ``protect`` candidates with the most PAB time (ties: the
    higher replica id is dropped first, so the order is deterministic).

    Attributes:
        protect: candidates held back from short prompts (>= 0; 0 = the filter keeps everything).
        short_share: a prompt is short when ``a + b*P <= short_share * horizon_ms`` on the candidate
            with the most PAB time (0..1).

    Raises:
        ValueError: ``protect < 0`` or ``short_share`` outside [0, 1].
    """

    protect: int = 2
    short_share: float = 0.35
    name: str = "protect-headroom"

    def __post_init__(self) -> None:
        if self.protect < 0:
            raise ValueError(f"protect must be >= 0, got {self.protect}")
        if not 0.0 <= self.short_share <= 1.0:
            raise ValueError(f"short_share must be in [0, 1], got {self.short_share}")

    def filter(self, request: PlacementRequest, replicas: Sequence[ReplicaView]) -> list[ReplicaView]:
        if self.protect == 0 or len(replicas) <= self.protect:
            return list(replicas)
        cls = request.slo_class
        ranked: list[tuple[float, str, ReplicaView]] = []
        for r in replicas:
            budget = r.classes.get(cls)
            ranked.append((budget.pab_ms if budget is not None else float("-inf"), r.replica_id, r))
        ranked.sort(key=lambda x: (x[0], x[1]), reverse=True)
        top = ranked[0][2]
        tm, budget = top.time_model, top.classes.get(cls)
        if tm is None or budget is None:
            return list(replicas)
        if tm.prefill_ms(effective_prompt_tokens(request, top.replica_id)) > self.short_share * budget.horizon_ms:
            return list(replicas)  # a long prompt: every candidate
        held = {x[1] for x in ranked[: self.protect]}
        return [r for r in replicas if r.replica_id not in held]


PLUGIN = ProtectHeadroomFilter
