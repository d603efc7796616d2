"""Test doubles shared by the unit tests (one per concept)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class FakeClock:
    """A clock the test moves by hand: ``t`` simulated ms, ``scale`` wall ms per simulated ms
    (:class:`fairbatch_common.clock.Clock`'s interface)."""

    t: float = 0.0
    scale: float = 1.0

    def now_ms(self) -> float:
        return self.t

    def unix_ms(self) -> int:
        return int(self.t)

    def to_wall_s(self, sim_ms: float) -> float:
        return sim_ms / 1000.0
