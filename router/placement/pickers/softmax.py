"""Picker ``softmax``: NVIDIA Dynamo's KV-router worker selection over costs (``cost = -score``).
Parameters ``temperature`` (``--router-temperature``, default 0) and ``seed`` (the RNG of draws and
tie-breaks; None = ties by lowest id and, with T > 0, a fresh unseeded RNG).

T = 0: lowest cost first, ties in a random order. T > 0: the first replica is drawn with
``p_i = exp(-(c_i - c_min) / ((c_max - c_min) * T)) / sum_j(...)`` (costs normalised to [0, 1],
uniform when all are equal), by one ``u = rng.random()``: the first i whose cumulative probability
reaches u (Dynamo ``lib/kv-router/src/scheduling/selector/default.rs`` ``softmax_sample_index``);
the others follow by ascending cost (the fallbacks). Source: router/placement/dynamo_kv.py."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from router.placement.core import ReplicaView


def softmax_probabilities(costs: Sequence[float], temperature: float) -> list[float]:
    """Dynamo's selection probabilities of ``costs`` at ``temperature`` > 0 (module docstring).

    Raises:
        ValueError: ``temperature`` <= 0 or no costs.
    """
    if temperature <= 0 or not costs:
        raise ValueError(f"softmax needs costs and temperature > 0, got {len(costs)} costs, T={temperature}")
    lo, hi = min(costs), max(costs)
    if lo == hi:
        return [1.0 / len(costs)] * len(costs)
    weights = [math.exp(-(c - lo) / ((hi - lo) * temperature)) for c in costs]
    total = sum(weights)
    return [w / total for w in weights]


@dataclass(slots=True)
class SoftmaxPicker:
    """Dynamo's worker selection (module docstring).

    Attributes:
        temperature: ``--router-temperature`` (>= 0; 0 = lowest cost).
        seed: RNG seed (None: ties by lowest replica id at T = 0, an unseeded RNG at T > 0).
        rng: the RNG (None at T = 0 without a seed).

    Raises:
        ValueError: a negative temperature.
    """

    temperature: float = 0.0
    seed: int | None = None
    name: str = "softmax"
    rng: random.Random | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.seed is not None or self.temperature > 0:
            self.rng = random.Random(self.seed)

    def order(self, scored: Sequence[tuple[ReplicaView, float]]) -> list[str]:
        if not scored:
            return []
        rng = self.rng
        tie = [rng.random() for _ in scored] if rng is not None else [0.0] * len(scored)
        ranked = sorted(range(len(scored)), key=lambda i: (-scored[i][1], tie[i], scored[i][0].replica_id))
        if self.temperature == 0 or len(scored) == 1:
            return [scored[i][0].replica_id for i in ranked]
        assert rng is not None
        probs = softmax_probabilities([-s for _, s in scored], self.temperature)
        u = rng.random()
        first, cumulative = len(scored) - 1, 0.0
        for i, p in enumerate(probs):
            cumulative += p
            if u <= cumulative:
                first = i
                break
        return [scored[first][0].replica_id] + [scored[i][0].replica_id for i in ranked if i != first]


PLUGIN = SoftmaxPicker
