"""Filter ``speed-match``: on a fleet of mixed GPUs, short prompts go to the slower replicas and long
prompts to the faster ones, when any of those can take them. No YAML parameters (the defaults below).

Why (issue 27, the heterogeneous fleet): a long prompt meets its TTFT only where its prefill fits the
horizon, which is far more often on a GPU that prefills faster (an H100 next to A100s), while a short
prompt meets it anywhere. Worst fit alone sends short prompts wherever the most headroom is, which is
often the fast replicas (they drain soonest), and the long prompts that arrive next find no room.

Rule, over the candidates left by the filters before it (they all fit the prompt): each candidate's
price per prompt token is ``b' = time_model.prompt_ms_per_token``. When the slowest price is within
``tolerance`` of the fastest (a homogeneous fleet), every candidate is kept. Otherwise the prompt is
short when its prefill on the slowest candidate, ``a + b'_max * P``, is at most ``short_share`` of that
candidate's horizon for the request's class: it keeps the candidates priced within ``tolerance`` of the
slowest; a long prompt keeps those within ``tolerance`` of the fastest. Both groups are non-empty by
construction, so the filter never leaves a request without a candidate.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from router.placement.core import PlacementRequest, ReplicaView, effective_prompt_tokens


@dataclass(frozen=True, slots=True)
class SpeedMatchFilter:
    """Short prompts to the slowest candidates, long ones to the fastest (module docstring).

    Attributes:
        short_share: a prompt is short when ``a + b'_max * P <= short_share * horizon_ms`` on the
            slowest candidate (0..1).
        tolerance: candidates priced within this factor of the slowest (fastest) form the slow (fast)
            group, and a fleet whose prices are all within it is homogeneous (>= 1).

    Raises:
        ValueError: ``short_share`` outside [0, 1] or ``tolerance < 1``.
    """

    short_share: float = 0.35
    tolerance: float = 1.1
    name: str = "speed-match"

    def __post_init__(self) -> None:
        if not 0.0 <= self.short_share <= 1.0:
            raise ValueError(f"short_share must be in [0, 1], got {self.short_share}")
        if self.tolerance < 1.0:
            raise ValueError(f"tolerance must be >= 1, got {self.tolerance}")

    def filter(self, request: PlacementRequest, replicas: Sequence[ReplicaView]) -> list[ReplicaView]:
        priced = [(r.time_model.prompt_ms_per_token, r) for r in replicas if r.time_model is not None]
        if len(priced) < 2:
            return list(replicas)
        fast = min(p for p, _ in priced)
        slow_b, slowest = max(priced, key=lambda x: x[0])
        if slow_b <= self.tolerance * fast:
            return list(replicas)
        budget = slowest.classes.get(request.slo_class)
        if budget is None:
            return list(replicas)
        tm = slowest.time_model
        assert tm is not None
        if tm.prefill_ms(effective_prompt_tokens(request, slowest.replica_id)) <= self.short_share * budget.horizon_ms:
            return [r for p, r in priced if p * self.tolerance >= slow_b]
        return [r for p, r in priced if p <= self.tolerance * fast]


PLUGIN = SpeedMatchFilter
