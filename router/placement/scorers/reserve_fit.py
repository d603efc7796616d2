"""Scorer ``reserve-fit``: best fit above a reserve of the TTFT horizon, worst fit below it.
Parameter ``reserve_share`` (0..1, default 0.3); weight in the profile.

Why (issue 27 item 4, "best-fit placement"): the default ``pab`` chain sends each prompt where the
most headroom is left (worst fit), which spreads the load so evenly that at high load no replica has
room for a long prompt, and PAB refuses it. Plain best fit (``headroom`` with weight -1) packs each
prompt onto the replica with the least headroom that still fits, but a fit at the edge of the
budget turns every under-prediction and every placement the view does not show yet into a TTFT miss
(measured in docs/evaluation.md). This scorer packs only while the headroom left after the prefill
stays at least ``reserve_share`` of the horizon, and below that falls back to worst fit.
"""

from __future__ import annotations

from dataclasses import dataclass

from router.placement.core import PlacementRequest, ReplicaView
from router.placement.scorers.headroom import HeadroomScorer

_HEADROOM = HeadroomScorer()


@dataclass(frozen=True, slots=True)
class ReserveFitScorer:
    """``h`` = the ``headroom`` scorer's share of the horizon left after this prefill. Score
    ``2 - h`` when ``h >= reserve_share`` (the least headroom above the reserve first), else ``h - 1``
    (below every replica above the reserve, the most headroom first); -inf where ``headroom`` is.
    Scores are in (1, 2] and [-2, 0) for h in [0, 1], so the two ranges never interleave.

    Raises:
        ValueError: ``reserve_share`` outside [0, 1].
    """

    reserve_share: float = 0.3
    name: str = "reserve-fit"

    def __post_init__(self) -> None:
        if not 0.0 <= self.reserve_share <= 1.0:
            raise ValueError(f"reserve_share must be in [0, 1], got {self.reserve_share}")

    def score(self, request: PlacementRequest, replica: ReplicaView) -> float:
        h = _HEADROOM.score(request, replica)
        if h == float("-inf"):
            return h
        return 2.0 - h if h >= self.reserve_share else h - 1.0


PLUGIN = ReserveFitScorer
