"""Placement: which replica takes a prompt. PURE (plain data in, plain data out, no I/O, no clock).

Filters -> scorers -> picker (the shape of llm-d's endpoint picker; docs/design.md section 5):

- filters drop replicas that must not get the prompt: already tried, unhealthy, stale budget
  (not received within its TTL), prompt above the engine's max length, prompt does not fit the
  PAB of its SLO class (docs/architecture.md, section "PAB"; the agent's
  ``replica_agent.policy.pab.fits``): ``a + b*P <= PAB_ms(k)`` and ``P <= PAB_tokens(k)``; a
  prompt whose ``a + b*P`` exceeds the horizon H fits only on a replica with nothing reserved
  and enough KV (``P <= kv_limited_tokens``). The fit is the same for a request that already
  waited ``w`` ms (``PlacementRequest.waited_ms``; pab.py "Work conservation": a late request takes
  the budget a fresh arrival would take, at once); ``on_time_only`` keeps only replicas where it
  can still meet its TTFT (``on_time(..., waited_ms=w)``: ``a + b*P <= PAB_ms(k) - w`` ...), and
  the start window (``window_steps``) keeps only replicas whose un-started prefill work plus this
  prompt fits the work of the next few engine steps (issue 18: the rest waits in the fair queue,
  where tenant weights decide).
- scorers give each remaining replica a number; ``headroom = (pab_ms - w - (a + b*P)) / horizon_ms``
  plus ``kv-headroom = (kv_limited_tokens - P) / max(kv_free_tokens, kv_limited_tokens, 1)``.
- the picker orders the replicas by score (ties: lowest replica id, or a seeded RNG; the router
  always seeds it, from the YAML's ``placement.seed`` or at random per process); the caller
  reserves on the first and falls back to the next one when the Reserve is refused.

Baseline profiles (router/placement/baselines.py: ``round-robin``, ``least-outstanding``,
``least-outstanding-tokens``, ``power-of-two``, ``llm-d-scorer``, ``llm-d-prefix``,
``sglang-cache-aware``, ``vllm-router-cache-aware``, ``static-queue-cap``, ``dynamo-kv``,
``llm-d-sticky``) are the routers the
fleet benchmark compares against; they read a :class:`RouterLoad` (router-local outstanding
requests and tokens, scraped engine metrics) instead of budgets and are admitted directly
(:class:`DirectAdmission`: no fit, no queue, no lease; router/core.py).

Plugins are looked up by name in a :class:`PlacementRegistry` (no module-level mutable state).
The built-in ``pab`` policy is :class:`FusedPabPolicy`: the same chain (exclude, healthy, fresh,
max-prompt, fits; headroom; highest) computed in one pass over the views, keeping only the best
``max_candidates`` (default 3, the Reserve calls a router makes per placement) instead of sorting
every replica; ``pab-chain`` builds the plugin chain itself (reference, same answers, slower).

Layout: router/placement/core.py (data, interfaces, the chain), filters/, scorers/, pickers/ and
hooks/ (one plugin per module), fused.py (the ``pab`` fast path), load.py (the baselines' load
view), cache_aware.py (the SGLang / vllm-router cache-aware policy), baselines.py (the baseline
profiles), registry.py (discovery, the profiles and the YAML ``placement`` section). This package
re-exports all of it.
"""

from __future__ import annotations

from router.placement.core import (
    DEFAULT_MAX_CANDIDATES,
    ClassBudgetView,
    OVERLOAD_FILTERS,
    DirectAdmission,
    Filter,
    PabFitEntry,
    Picker,
    PlacementPolicy,
    PlacementRequest,
    PlacementResult,
    PostDecisionHook,
    ReplicaView,
    SaturationGate,
    Scorer,
    apply_filters,
    effective_prompt_tokens,
    largest_max_prompt,
    prompt_exceeds_every_replica,
    window_admits,
)
from router.placement.baselines import BASELINE_POLICIES, DEFAULT_QUEUE_CAP_TOKENS
from router.placement.cache_aware import SGLANG_CACHE_AWARE, VLLM_ROUTER_CACHE_AWARE, CacheAwarePolicy
from router.placement.dynamo_kv import DYNAMO_KV_DEFAULTS, DynamoQueueGate
from router.placement.sticky import LLMD_STICKY_DEFAULTS, StickyPolicy, sticky_tau_tokens
from router.placement.filters.exclude import ExcludeFilter
from router.placement.filters.fits import FitsFilter
from router.placement.filters.fresh import FreshFilter
from router.placement.filters.healthy import HealthyFilter
from router.placement.filters.max_prompt import MaxPromptFilter
from router.placement.filters.on_time import OnTimeFilter
from router.placement.filters.window import WindowFilter
from router.placement.fused import FusedPabPolicy
from router.placement.load import MetricsSample, RouterLoad
from router.placement.pickers.highest import HighestScorePicker
from router.placement.pickers.power_of_two import PowerOfTwoPicker
from router.placement.pickers.round_robin import RoundRobinPicker
from router.placement.registry import PlacementRegistry, build_policy, default_registry, discover
from router.placement.scorers.engine_queue import EngineQueueScorer
from router.placement.scorers.headroom import HeadroomScorer
from router.placement.scorers.kv_headroom import KvHeadroomScorer
from router.placement.scorers.kv_usage import KvUsageScorer
from router.placement.scorers.least_outstanding import LeastOutstandingScorer
from router.placement.scorers.least_outstanding_tokens import LeastOutstandingTokensScorer
from router.placement.scorers.llmd_queue import LlmdQueueScorer
from router.placement.scorers.prefix_cache import PrefixCacheScorer
from replica_agent.policy.pab import fits, on_time  # re-exported: callers import them from here too

__all__ = [
    "BASELINE_POLICIES", "DEFAULT_MAX_CANDIDATES", "DYNAMO_KV_DEFAULTS", "DynamoQueueGate", "LLMD_STICKY_DEFAULTS",
    "OVERLOAD_FILTERS", "SaturationGate", "StickyPolicy", "sticky_tau_tokens", "DEFAULT_QUEUE_CAP_TOKENS", "SGLANG_CACHE_AWARE",
    "VLLM_ROUTER_CACHE_AWARE", "CacheAwarePolicy", "ClassBudgetView", "DirectAdmission", "EngineQueueScorer",
    "ExcludeFilter", "Filter", "FitsFilter", "FreshFilter", "FusedPabPolicy", "HeadroomScorer", "HealthyFilter",
    "HighestScorePicker", "KvHeadroomScorer", "KvUsageScorer", "LeastOutstandingScorer",
    "LeastOutstandingTokensScorer", "LlmdQueueScorer", "MaxPromptFilter", "MetricsSample", "OnTimeFilter",
    "PabFitEntry", "Picker", "PlacementPolicy", "PlacementRegistry", "PlacementRequest", "PlacementResult",
    "PostDecisionHook", "PowerOfTwoPicker", "PrefixCacheScorer", "ReplicaView", "RoundRobinPicker", "RouterLoad",
    "Scorer", "WindowFilter",
    "apply_filters", "build_policy", "default_registry", "discover", "effective_prompt_tokens", "fits", "largest_max_prompt",
    "on_time", "prompt_exceeds_every_replica", "window_admits",
]
