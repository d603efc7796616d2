"""Picker ``highest``: highest score first; parameter ``seed`` (tie-break RNG; None = lowest id)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from router.placement.core import ReplicaView

@dataclass(slots=True)
class HighestScorePicker:
    """Highest score first; ties by lowest replica id, or shuffled by a seeded RNG when ``seed`` is set.

    With ``seed`` the order is ascending ``(-score, u, replica_id)`` where ``u`` is one
    ``rng.random()`` drawn per scored replica, in input order (:class:`FusedPabPolicy` draws the same).

    Attributes:
        seed: RNG seed for tie-breaks; None = ties by lowest replica id.
        rng: the tie-break RNG (None without ``seed``); its state advances with every call.
    """

    seed: int | None = None
    name: str = "highest"
    rng: random.Random | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.seed is not None:
            self.rng = random.Random(self.seed)

    def order(self, scored: Sequence[tuple[ReplicaView, float]]) -> list[str]:
        if self.rng is None:
            ranked = sorted(scored, key=lambda rs: (-rs[1], rs[0].replica_id))
        else:
            keyed = [(-s, self.rng.random(), r.replica_id) for r, s in scored]
            keyed.sort()
            return [rid for _, _, rid in keyed]
        return [r.replica_id for r, _ in ranked]


PLUGIN = HighestScorePicker
