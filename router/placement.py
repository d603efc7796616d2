"""Placement: which replica takes a prompt. PURE (plain data in, plain data out, no I/O, no clock).

Filters -> scorers -> picker (STYLE.md, llm-d endpoint picker):

- filters drop replicas that must not get the prompt: already tried, unhealthy, stale budget
  (not received within its TTL), prompt above the engine's max length, prompt does not fit the
  PAB of its SLO class (docs/architecture.md, section "PAB"; the agent's
  ``replica_agent.policy.pab.fits``): ``a + b*P <= PAB_ms(k)`` and ``P <= PAB_tokens(k)``; a
  prompt whose ``a + b*P`` exceeds the horizon H fits only on a replica with nothing reserved
  and enough KV (``P <= kv_limited_tokens``).
- scorers give each remaining replica a number; ``headroom = (pab_ms - (a + b*P)) / horizon_ms``.
- the picker orders the replicas by score (ties: lowest replica id, or a seeded RNG); the caller
  reserves on the first and falls back to the next one when the Reserve is refused.

Plugins are looked up by name in a :class:`PlacementRegistry` (no module-level mutable state).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from replica_agent.policy.time_model import TimeModel

from replica_agent.policy.pab import ClassBudget, fits

# The router's view of one replica's PAB for one SLO class is the agent's own ClassBudget
# (mirrors proto ClassBudget: horizon_ms, pab_ms, pab_tokens, decode/inflight reservations,
# kv_limited_tokens ...), so placement applies exactly the agent's fit rule ``fits``:
# ``a + b*P <= pab_ms and P <= pab_tokens``; a prompt with ``a + b*P > horizon_ms`` fits only
# where nothing is reserved and ``P <= kv_limited_tokens`` (it takes a whole idle replica).
ClassBudgetView = ClassBudget


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """One replica as placement sees it at one instant.

    Attributes:
        replica_id: replica id.
        healthy: the agent says the engine is reachable and its metrics fresh.
        fresh: the latest snapshot arrived within its TTL (router clock).
        time_model: a, b, c (ms) from the snapshot; None before the first snapshot.
        classes: PAB per SLO class name.
        max_prompt_tokens: engine max model length in tokens (0 = unknown).
    """

    replica_id: str
    healthy: bool
    fresh: bool
    time_model: TimeModel | None
    classes: Mapping[str, ClassBudget]
    max_prompt_tokens: int = 0


@dataclass(frozen=True, slots=True)
class PlacementRequest:
    """What placement needs to know about a request.

    Attributes:
        slo_class: SLO class name.
        prompt_tokens: estimated prompt tokens (tokens).
        exclude: replica ids not to use (already tried for this request).
    """

    slo_class: str
    prompt_tokens: int
    exclude: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class PlacementResult:
    """Ordered candidates (best first) or, when empty, the name of the filter that left none.

    Attributes:
        candidates: replica ids to try in order.
        reason: "" when candidates exist, else e.g. ``"fresh"`` or ``"fits"``.
    """

    candidates: tuple[str, ...]
    reason: str = ""


class Filter(Protocol):
    """Replicas in, fewer out (same order)."""

    name: str

    def filter(self, request: PlacementRequest, replicas: Sequence[ReplicaView]) -> list[ReplicaView]: ...


class Scorer(Protocol):
    """Replica -> score (higher is better)."""

    name: str

    def score(self, request: PlacementRequest, replica: ReplicaView) -> float: ...


class Picker(Protocol):
    """Scored replicas -> replica ids in the order to try them."""

    name: str

    def order(self, scored: Sequence[tuple[ReplicaView, float]]) -> list[str]: ...


# ---------------------------------------------------------------- filters


@dataclass(frozen=True, slots=True)
class ExcludeFilter:
    """Drops the replicas already tried for this request."""

    name: str = "exclude"

    def filter(self, request: PlacementRequest, replicas: Sequence[ReplicaView]) -> list[ReplicaView]:
        if not request.exclude:
            return list(replicas)
        return [r for r in replicas if r.replica_id not in request.exclude]


@dataclass(frozen=True, slots=True)
class HealthyFilter:
    """Keeps replicas whose agent reports healthy."""

    name: str = "healthy"

    def filter(self, request: PlacementRequest, replicas: Sequence[ReplicaView]) -> list[ReplicaView]:
        return [r for r in replicas if r.healthy]


@dataclass(frozen=True, slots=True)
class FreshFilter:
    """Keeps replicas whose latest budget arrived within its TTL (else their budget counts as zero)."""

    name: str = "fresh"

    def filter(self, request: PlacementRequest, replicas: Sequence[ReplicaView]) -> list[ReplicaView]:
        return [r for r in replicas if r.fresh and r.time_model is not None]


@dataclass(frozen=True, slots=True)
class MaxPromptFilter:
    """Keeps replicas whose engine accepts a prompt of this length (unknown limit = accepts)."""

    name: str = "max-prompt"

    def filter(self, request: PlacementRequest, replicas: Sequence[ReplicaView]) -> list[ReplicaView]:
        p = request.prompt_tokens
        return [r for r in replicas if r.max_prompt_tokens <= 0 or p <= r.max_prompt_tokens]


@dataclass(frozen=True, slots=True)
class FitsFilter:
    """Keeps replicas where the prompt fits the PAB of its SLO class (see :func:`fits`)."""

    name: str = "fits"

    def filter(self, request: PlacementRequest, replicas: Sequence[ReplicaView]) -> list[ReplicaView]:
        out = []
        for r in replicas:
            budget = r.classes.get(request.slo_class)
            if budget is not None and r.time_model is not None and fits(request.prompt_tokens, budget, r.time_model):
                out.append(r)
        return out


# ---------------------------------------------------------------- scorers


@dataclass(frozen=True, slots=True)
class HeadroomScorer:
    """``(pab_ms - (a + b*P)) / horizon_ms``: share of the class horizon left after this prefill."""

    name: str = "headroom"

    def score(self, request: PlacementRequest, replica: ReplicaView) -> float:
        budget = replica.classes.get(request.slo_class)
        if budget is None or replica.time_model is None or budget.horizon_ms <= 0:
            return float("-inf")
        tm = replica.time_model
        return (budget.pab_ms - tm.a_ms - tm.b_ms_per_new_token * request.prompt_tokens) / budget.horizon_ms


# ---------------------------------------------------------------- pickers


@dataclass(slots=True)
class HighestScorePicker:
    """Highest score first; ties by lowest replica id, or shuffled by a seeded RNG when ``seed`` is set."""

    seed: int | None = None
    name: str = "highest"
    _rng: random.Random | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.seed is not None:
            self._rng = random.Random(self.seed)

    def order(self, scored: Sequence[tuple[ReplicaView, float]]) -> list[str]:
        if self._rng is None:
            ranked = sorted(scored, key=lambda rs: (-rs[1], rs[0].replica_id))
        else:
            keyed = [(-s, self._rng.random(), r.replica_id) for r, s in scored]
            keyed.sort()
            return [rid for _, _, rid in keyed]
        return [r.replica_id for r, _ in ranked]


# ---------------------------------------------------------------- policy + registry


@dataclass(slots=True)
class PlacementPolicy:
    """Filters, then the weighted sum of scorers, then the picker.

    Attributes:
        filters: applied in order; the first that leaves no replica names the refusal.
        scorers: (scorer, weight) pairs summed into one score.
        picker: orders the scored replicas.
    """

    filters: Sequence[Filter]
    scorers: Sequence[tuple[Scorer, float]]
    picker: Picker

    def place(self, request: PlacementRequest, replicas: Sequence[ReplicaView]) -> PlacementResult:
        """Ordered candidate replica ids for ``request`` (empty with a reason when none fits)."""
        remaining: Sequence[ReplicaView] = replicas
        for f in self.filters:
            remaining = f.filter(request, remaining)
            if not remaining:
                return PlacementResult((), f.name)
        if len(self.scorers) == 1:  # the common case, without a generator per replica
            scorer, weight = self.scorers[0]
            scored = [(r, weight * scorer.score(request, r)) for r in remaining]
        else:
            scored = [(r, sum(w * s.score(request, r) for s, w in self.scorers)) for r in remaining]
        return PlacementResult(tuple(self.picker.order(scored)))


def prompt_exceeds_every_replica(prompt_tokens: int, replicas: Sequence[ReplicaView]) -> bool:
    """True when every replica reports a max prompt length (> 0) and the prompt is above all of them.

    A replica with no snapshot yet or an unknown limit (0) could take it, so the answer is False then.
    """
    if not replicas:
        return False
    for r in replicas:
        if r.max_prompt_tokens <= 0 or prompt_tokens <= r.max_prompt_tokens:
            return False
    return True


class PlacementRegistry:
    """Name -> factory for filters, scorers and pickers, and named policies built from them."""

    def __init__(self) -> None:
        self.filters: dict[str, Callable[[], Filter]] = {}
        self.scorers: dict[str, Callable[[], Scorer]] = {}
        self.pickers: dict[str, Callable[..., Picker]] = {}
        self.policies: dict[str, Callable[..., PlacementPolicy]] = {}

    def build(self, name: str, **params: object) -> PlacementPolicy:
        """A fresh policy by name.

        Raises:
            KeyError: unknown policy name (the message lists the known ones).
        """
        try:
            factory = self.policies[name]
        except KeyError:
            raise KeyError(f"unknown placement policy {name!r}; known: {', '.join(sorted(self.policies))}") from None
        return factory(**params)


def default_registry() -> PlacementRegistry:
    """Registry with the built-in plugins and the ``pab`` policy (filters exclude, healthy, fresh,
    max-prompt, fits; scorer headroom; picker highest, optional ``seed`` for RNG tie-breaks)."""
    reg = PlacementRegistry()
    reg.filters.update(
        {
            "exclude": ExcludeFilter,
            "healthy": HealthyFilter,
            "fresh": FreshFilter,
            "max-prompt": MaxPromptFilter,
            "fits": FitsFilter,
        }
    )
    reg.scorers["headroom"] = HeadroomScorer
    reg.pickers["highest"] = HighestScorePicker

    def pab_policy(seed: int | None = None) -> PlacementPolicy:
        return PlacementPolicy(
            filters=[reg.filters[n]() for n in ("exclude", "healthy", "fresh", "max-prompt", "fits")],
            scorers=[(reg.scorers["headroom"](), 1.0)],
            picker=reg.pickers["highest"](seed=seed),
        )

    reg.policies["pab"] = pab_policy
    return reg
