"""The cache-aware policy of the SGLang router and of vllm-router (a fork of it), as a placement policy
(:class:`CacheAwarePolicy`) with each router's defaults. PURE.

Rule, after the filters: the load (router-local in-flight requests, :class:`~router.placement.load.
RouterLoad` ``outstanding``) is *imbalanced* when ``max - min > balance_abs`` and
``max > balance_rel * min``: then the least loaded replica; otherwise the replica with the longest
cached prefix when ``matched / prompt > cache_threshold``, else the least loaded. SGLang
(sgl-model-gateway ``router_args.py``): threshold 0.3, abs 64, rel 1.5; vllm-router
(``CacheAwareConfig::default``): 0.5, 32, 1.1. Their radix trees of prompt text are modelled by the
router's prefix map (router/prefix_index.py: one replica's KV cache of keys per replica, learnt from
the router's own picks), the same map as every cache-aware policy here, so the policies differ in
their rules only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from router.placement.core import PlacementPolicy, PlacementRequest, PlacementResult, ReplicaView, apply_filters
from router.placement.load import RouterLoad

SGLANG_CACHE_AWARE = {"cache_threshold": 0.3, "balance_abs": 64, "balance_rel": 1.5}
"""SGLang router (sgl-model-gateway) cache-aware defaults."""

VLLM_ROUTER_CACHE_AWARE = {"cache_threshold": 0.5, "balance_abs": 32, "balance_rel": 1.1}
"""vllm-router cache-aware defaults."""


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
