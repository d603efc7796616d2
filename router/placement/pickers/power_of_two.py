"""Picker ``power-of-two``: two candidates drawn at random (seeded), the higher score first (Mitzenmacher,
"The Power of Two Choices in Randomized Load Balancing", 2001; vllm-router / SGLang gateway
``power_of_two``). Parameter ``seed`` (``placement.seed``)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from router.placement.core import ReplicaView


@dataclass(slots=True)
class PowerOfTwoPicker:
    """Two candidates drawn at random (seeded); the higher score first, the other second."""

    seed: int | None = None
    name: str = "power-of-two"
    _rng: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def order(self, scored: Sequence[tuple[ReplicaView, float]]) -> list[str]:
        if len(scored) <= 2:
            pair = list(scored)
        else:
            i, j = self._rng.sample(range(len(scored)), 2)
            pair = [scored[i], scored[j]]
        pair.sort(key=lambda rs: -rs[1])  # stable: the first drawn wins a tie
        return [r.replica_id for r, _ in pair]


PLUGIN = PowerOfTwoPicker
