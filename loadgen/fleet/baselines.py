"""The fleet benchmark's baseline routers: they live in router/placement/ now (issue 26 item 4), as
placement profiles of the one registry :func:`router.placement.default_registry`, which the router
runs from YAML (``placement: {profile: least-outstanding}``) and the fleet simulation builds its
routers from. The policies, their rules and sources: router/placement/baselines.py; the load view
they read: router/placement/load.py; the SGLang / vllm-router cache-aware rule:
router/placement/cache_aware.py.

This module only re-exports those names for the simulator's callers; :func:`fleet_registry` is
:func:`router.placement.default_registry` (one registry for both).
"""

from __future__ import annotations

from router.placement import (
    BASELINE_POLICIES,
    SGLANG_CACHE_AWARE,
    VLLM_ROUTER_CACHE_AWARE,
    CacheAwarePolicy,
    EngineQueueScorer,
    KvUsageScorer,
    LeastOutstandingScorer,
    LeastOutstandingTokensScorer,
    LlmdQueueScorer,
    MetricsSample,
    PowerOfTwoPicker,
    PrefixCacheScorer,
    RoundRobinPicker,
    RouterLoad,
    default_registry,
)

fleet_registry = default_registry
"""The one placement registry (``pab``, ``pab-chain`` and every baseline profile)."""

__all__ = ["BASELINE_POLICIES", "SGLANG_CACHE_AWARE", "VLLM_ROUTER_CACHE_AWARE", "CacheAwarePolicy",
           "EngineQueueScorer", "KvUsageScorer", "LeastOutstandingScorer", "LeastOutstandingTokensScorer",
           "LlmdQueueScorer", "MetricsSample", "PowerOfTwoPicker", "PrefixCacheScorer", "RoundRobinPicker",
           "RouterLoad", "fleet_registry"]  # fmt: skip
