"""Baseline routers as placement plugins (filters -> scorers -> picker, router/placement.py).

The routers people run in front of vLLM today, expressed as plugins of the same kind as our PAB
policy (the shape of llm-d's endpoint picker) and registered by name in a
:class:`~router.placement.PlacementRegistry` built from :func:`router.placement.default_registry`
(no module-level state: :func:`fleet_registry` returns a fresh registry).

Every baseline sees the replicas through a :class:`RouterLoad` injected at construction: what that
router knows without PAB budgets.

- ``outstanding``: requests this router sent to each replica and has not seen finish (exact and
  local to the router, as vllm-router / SGLang gateway count in-flight requests).
- ``scraped``: each replica's engine metrics (``vllm:num_requests_running``,
  ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``) as of the latest scrape, every
  ``scrape_period_ms`` (50 ms, llm-d's default refresh), so up to one period stale.

Policies (all drop already-tried, unhealthy and too-long-prompt replicas first; none queues at the
router: the engine's own waiting queue absorbs bursts, as in front of plain vLLM):

- ``round-robin``: replicas in turn, one router-local counter.
- ``least-outstanding``: fewest router-local outstanding requests; ties broken by a seeded RNG.
- ``least-outstanding-tokens``: fewest router-local outstanding tokens (prompt + requested output
  tokens of the requests in flight there, what a router knows before the engine answers); ties
  by a seeded RNG. Long prompts weigh what they cost, which request counts miss.
- ``power-of-two``: two replicas drawn at random (seeded), the one with the shorter engine queue
  (running + waiting requests, scraped) wins (Mitzenmacher, "The Power of Two Choices in
  Randomized Load Balancing", 2001; vllm-router / SGLang gateway ``power_of_two``).
- ``llm-d-scorer``: llm-d / Gateway API Inference Extension default scorers, weight 1 each:
  queue scorer ``(max_q - q) / (max_q - min_q)`` over the waiting queues (1 when all equal) and
  KV-cache-utilisation scorer ``1 - kv_usage``; max-score picker with random tie-break (no
  prefix scorer: ``llm-d-prefix`` adds it).
- ``llm-d-prefix``: llm-d's default scheduling profile with prefix-cache awareness: prefix-cache
  scorer ``matched / prompt`` (weight 3; the router's approximate prefix map, router/prefix_index.py,
  as llm-d's approximate prefix-cache plugin learns from its own picks), queue scorer (weight 2) and
  KV-cache-utilisation scorer (weight 2), max-score picker.
- ``sglang-cache-aware`` and ``vllm-router-cache-aware``: the cache-aware policy of the SGLang
  router and of vllm-router (a fork of it), rule :class:`CacheAwarePolicy`, each with its own
  defaults: the load (router-local in-flight requests) is *imbalanced* when ``max - min >
  balance_abs`` and ``max > balance_rel * min``: then the least loaded replica; otherwise the
  replica with the longest cached prefix when ``matched / prompt > cache_threshold``, else the
  least loaded. SGLang (sgl-model-gateway ``router_args.py``): threshold 0.3, abs 64, rel 1.5;
  vllm-router (``CacheAwareConfig::default``): 0.5, 32, 1.1. Their radix trees of prompt text are
  modelled by the same prefix map as every cache-aware policy here (one replica's KV cache of
  keys per replica), so the policies differ in their rules only.
- ``static-queue-cap``: least-outstanding routing; the replica refuses (429) a prompt when its
  waiting prompt tokens plus the new prompt exceed a static bound (vLLM-style
  ``max-num-queued-tokens`` admission cap; the cap itself is applied by the fleet simulation's
  replica, see loadgen/fleet/sim.py); the router then tries the next candidate, at most 3 in all.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from router.placement import (
    ExcludeFilter,
    HealthyFilter,
    HighestScorePicker,
    MaxPromptFilter,
    PlacementPolicy,
    PlacementRegistry,
    PlacementRequest,
    PlacementResult,
    ReplicaView,
    apply_filters,
    default_registry,
)

BASELINE_POLICIES = ("round-robin", "least-outstanding", "least-outstanding-tokens", "power-of-two", "llm-d-scorer",
                     "static-queue-cap", "llm-d-prefix", "sglang-cache-aware", "vllm-router-cache-aware")  # fmt: skip
"""Names of the baseline placement policies in :func:`fleet_registry`."""


@dataclass(slots=True)
class MetricsSample:
    """One replica's engine metrics as of one scrape.

    Attributes:
        num_running: ``vllm:num_requests_running``.
        num_waiting: ``vllm:num_requests_waiting``.
        kv_usage: ``vllm:kv_cache_usage_perc`` (0..1).
        scraped_ms: scrape time (simulated ms).
    """

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    scraped_ms: float = float("-inf")


@dataclass(slots=True)
class RouterLoad:
    """What one baseline router knows about the replicas (injected into its scorers).

    Attributes:
        outstanding: replica id -> requests this router sent there and has not seen finish.
        scraped: replica id -> latest scraped metrics.
        version: bumped on every scrape delivery (scorers cache per version).
        outstanding_tokens: replica id -> prompt + requested output tokens of those requests.
    """

    outstanding: dict[str, int] = field(default_factory=dict)
    scraped: dict[str, MetricsSample] = field(default_factory=dict)
    version: int = 0
    outstanding_tokens: dict[str, int] = field(default_factory=dict)

    def add(self, replica_id: str, tokens: int) -> None:
        """One request (of ``tokens`` prompt + output tokens) sent to ``replica_id`` (``tokens`` < 0:
        one finished or refused there)."""
        self.outstanding[replica_id] = self.outstanding.get(replica_id, 0) + (1 if tokens >= 0 else -1)
        self.outstanding_tokens[replica_id] = self.outstanding_tokens.get(replica_id, 0) + tokens


# ---------------------------------------------------------------- scorers


@dataclass(slots=True)
class LeastOutstandingScorer:
    """``-outstanding``: fewer router-local in-flight requests is better."""

    load: RouterLoad
    name: str = "least-outstanding"

    def score(self, request: PlacementRequest, replica: ReplicaView) -> float:
        return -float(self.load.outstanding.get(replica.replica_id, 0))


@dataclass(slots=True)
class LeastOutstandingTokensScorer:
    """``-outstanding tokens``: fewer router-local in-flight tokens is better."""

    load: RouterLoad
    name: str = "least-outstanding-tokens"

    def score(self, request: PlacementRequest, replica: ReplicaView) -> float:
        return -float(self.load.outstanding_tokens.get(replica.replica_id, 0))


@dataclass(slots=True)
class EngineQueueScorer:
    """``-(running + waiting)`` from the latest scrape: a shorter engine queue is better."""

    load: RouterLoad
    name: str = "engine-queue"

    def score(self, request: PlacementRequest, replica: ReplicaView) -> float:
        m = self.load.scraped.get(replica.replica_id)
        return 0.0 if m is None else -float(m.num_running + m.num_waiting)


@dataclass(slots=True)
class LlmdQueueScorer:
    """llm-d queue scorer: ``(max_q - q) / (max_q - min_q)`` over the scraped waiting queues, 1 if all equal."""

    load: RouterLoad
    name: str = "llm-d-queue"
    _cached_version: int = -1
    _min_q: int = 0
    _max_q: int = 0

    def score(self, request: PlacementRequest, replica: ReplicaView) -> float:
        load = self.load
        if load.version != self._cached_version:
            qs = [m.num_waiting for m in load.scraped.values()] or [0]
            self._min_q, self._max_q = min(qs), max(qs)
            self._cached_version = load.version
        m = load.scraped.get(replica.replica_id)
        q = 0 if m is None else m.num_waiting
        if self._max_q == self._min_q:
            return 1.0
        return (self._max_q - q) / (self._max_q - self._min_q)


@dataclass(slots=True)
class KvUsageScorer:
    """llm-d KV-cache-utilisation scorer: ``1 - kv_usage`` from the latest scrape."""

    load: RouterLoad
    name: str = "kv-usage"

    def score(self, request: PlacementRequest, replica: ReplicaView) -> float:
        m = self.load.scraped.get(replica.replica_id)
        return 1.0 if m is None else 1.0 - m.kv_usage


@dataclass(slots=True)
class PrefixCacheScorer:
    """llm-d prefix-cache scorer: ``cached / prompt`` (0..1), the share of the prompt the replica
    is estimated to hold (``PlacementRequest.cached_tokens``, from the router's prefix map)."""

    name: str = "prefix-cache"

    def score(self, request: PlacementRequest, replica: ReplicaView) -> float:
        if request.prompt_tokens <= 0 or not request.cached_tokens:
            return 0.0
        return request.cached_tokens.get(replica.replica_id, 0) / request.prompt_tokens


@dataclass(slots=True)
class CacheAwarePolicy(PlacementPolicy):
    """SGLang / vllm-router cache-aware rule (module docstring) after the filters.

    Order returned: the chosen replica, then the others by ascending load (ties by input order).

    Attributes:
        load: the router's in-flight request counts (:class:`RouterLoad` ``outstanding``).
        cache_threshold: least ``matched / prompt`` for cache affinity (strictly above it).
        balance_abs: absolute load gap (requests) of the imbalance test.
        balance_rel: load ratio of the imbalance test.
    """

    load: RouterLoad = field(default_factory=RouterLoad)
    cache_threshold: float = 0.5
    balance_abs: int = 32
    balance_rel: float = 1.1

    def place(self, request: PlacementRequest, replicas: Sequence[ReplicaView]) -> PlacementResult:
        remaining, dropped_by = apply_filters(self.filters, request, replicas)
        if not remaining:
            return PlacementResult((), dropped_by)
        out = self.load.outstanding
        loads = [out.get(r.replica_id, 0) for r in remaining]
        lo, hi = min(loads), max(loads)
        by_load = sorted(range(len(remaining)), key=lambda i: loads[i])  # stable: first minimum first
        chosen = by_load[0]
        if not (hi - lo > self.balance_abs and hi > lo * self.balance_rel) and request.prompt_tokens > 0:
            cached = request.cached_tokens
            best, best_rate = -1, 0.0
            for i, r in enumerate(remaining):
                rate = cached.get(r.replica_id, 0) / request.prompt_tokens if cached else 0.0
                if rate > best_rate:
                    best, best_rate = i, rate
            if best >= 0 and best_rate > self.cache_threshold:
                chosen = best
        order = [chosen] + [i for i in by_load if i != chosen]
        return PlacementResult(tuple(remaining[i].replica_id for i in order))


SGLANG_CACHE_AWARE = {"cache_threshold": 0.3, "balance_abs": 64, "balance_rel": 1.5}
"""SGLang router (sgl-model-gateway) cache-aware defaults."""

VLLM_ROUTER_CACHE_AWARE = {"cache_threshold": 0.5, "balance_abs": 32, "balance_rel": 1.1}
"""vllm-router cache-aware defaults."""


# ---------------------------------------------------------------- pickers


@dataclass(slots=True)
class RoundRobinPicker:
    """Replicas in turn: the i-th call starts at candidate ``i mod len`` (router-local counter)."""

    name: str = "round-robin"
    _next: int = 0

    def order(self, scored: Sequence[tuple[ReplicaView, float]]) -> list[str]:
        ids = [r.replica_id for r, _ in scored]
        if not ids:
            return []
        start = self._next % len(ids)
        self._next += 1
        return ids[start:] + ids[:start]


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


# ---------------------------------------------------------------- registry


def _base_filters() -> list[object]:
    return [ExcludeFilter(), HealthyFilter(), MaxPromptFilter()]


def fleet_registry() -> PlacementRegistry:
    """:func:`router.placement.default_registry` (``pab``) plus the baseline plugins and policies.

    Baseline policies take ``load`` (:class:`RouterLoad`) and an optional ``seed``;
    ``registry.build("least-outstanding", load=load, seed=1)``.
    """
    reg = default_registry()
    reg.scorers.update(
        {
            "least-outstanding": LeastOutstandingScorer,  # type: ignore[dict-item]
            "least-outstanding-tokens": LeastOutstandingTokensScorer,  # type: ignore[dict-item]
            "engine-queue": EngineQueueScorer,  # type: ignore[dict-item]
            "llm-d-queue": LlmdQueueScorer,  # type: ignore[dict-item]
            "kv-usage": KvUsageScorer,  # type: ignore[dict-item]
        }
    )
    reg.scorers["prefix-cache"] = PrefixCacheScorer  # type: ignore[assignment]
    reg.pickers.update({"round-robin": RoundRobinPicker, "power-of-two": PowerOfTwoPicker})

    def round_robin(load: RouterLoad, seed: int | None = None) -> PlacementPolicy:
        return PlacementPolicy(_base_filters(), [], RoundRobinPicker())  # type: ignore[arg-type]

    def least_outstanding(load: RouterLoad, seed: int | None = None) -> PlacementPolicy:
        return PlacementPolicy(
            _base_filters(), [(LeastOutstandingScorer(load), 1.0)], HighestScorePicker(seed=seed)  # type: ignore[arg-type]
        )

    def least_outstanding_tokens(load: RouterLoad, seed: int | None = None) -> PlacementPolicy:
        return PlacementPolicy(
            _base_filters(), [(LeastOutstandingTokensScorer(load), 1.0)], HighestScorePicker(seed=seed)  # type: ignore[arg-type]
        )

    def power_of_two(load: RouterLoad, seed: int | None = None) -> PlacementPolicy:
        return PlacementPolicy(_base_filters(), [(EngineQueueScorer(load), 1.0)], PowerOfTwoPicker(seed=seed))  # type: ignore[arg-type]

    def llmd(load: RouterLoad, seed: int | None = None) -> PlacementPolicy:
        return PlacementPolicy(
            _base_filters(),  # type: ignore[arg-type]
            [(LlmdQueueScorer(load), 1.0), (KvUsageScorer(load), 1.0)],
            HighestScorePicker(seed=seed),
        )

    def llmd_prefix(load: RouterLoad, seed: int | None = None) -> PlacementPolicy:
        return PlacementPolicy(
            _base_filters(),  # type: ignore[arg-type]
            [(PrefixCacheScorer(), 3.0), (LlmdQueueScorer(load), 2.0), (KvUsageScorer(load), 2.0)],
            HighestScorePicker(seed=seed),
        )

    def sglang(load: RouterLoad, seed: int | None = None) -> PlacementPolicy:
        return CacheAwarePolicy(_base_filters(), [], HighestScorePicker(), load, **SGLANG_CACHE_AWARE)  # type: ignore[arg-type]

    def vllm_router(load: RouterLoad, seed: int | None = None) -> PlacementPolicy:
        return CacheAwarePolicy(_base_filters(), [], HighestScorePicker(), load, **VLLM_ROUTER_CACHE_AWARE)  # type: ignore[arg-type]

    reg.policies.update(
        {
            "llm-d-prefix": llmd_prefix,
            "sglang-cache-aware": sglang,
            "vllm-router-cache-aware": vllm_router,
            "round-robin": round_robin,
            "least-outstanding": least_outstanding,
            "least-outstanding-tokens": least_outstanding_tokens,
            "power-of-two": power_of_two,
            "llm-d-scorer": llmd,
            "static-queue-cap": least_outstanding,
        }
    )
    return reg
