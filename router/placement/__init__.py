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

Plugins are looked up by name in a :class:`PlacementRegistry` (no module-level mutable state).
The built-in ``pab`` policy is :class:`FusedPabPolicy`: the same chain (exclude, healthy, fresh,
max-prompt, fits; headroom; highest) computed in one pass over the views, keeping only the best
``max_candidates`` (default 3, the Reserve calls a router makes per placement) instead of sorting
every replica; ``pab-chain`` builds the plugin chain itself (reference, same answers, slower).

Layout: router/placement/core.py (data, interfaces, the chain), filters/, scorers/, pickers/ and
hooks/ (one plugin per module), fused.py (the ``pab`` fast path), registry.py (discovery, the
profiles and the YAML ``placement`` section). This package re-exports all of it.
"""

from __future__ import annotations

from router.placement.core import (
    DEFAULT_MAX_CANDIDATES,
    ClassBudgetView,
    Filter,
    PabFitEntry,
    Picker,
    PlacementPolicy,
    PlacementRequest,
    PlacementResult,
    PostDecisionHook,
    ReplicaView,
    Scorer,
    apply_filters,
    effective_prompt_tokens,
    largest_max_prompt,
    prompt_exceeds_every_replica,
    window_admits,
)
from router.placement.filters.exclude import ExcludeFilter
from router.placement.filters.fits import FitsFilter
from router.placement.filters.fresh import FreshFilter
from router.placement.filters.healthy import HealthyFilter
from router.placement.filters.max_prompt import MaxPromptFilter
from router.placement.filters.on_time import OnTimeFilter
from router.placement.filters.window import WindowFilter
from router.placement.fused import FusedPabPolicy
from router.placement.pickers.highest import HighestScorePicker
from router.placement.registry import PlacementRegistry, build_policy, default_registry, discover
from router.placement.scorers.headroom import HeadroomScorer
from router.placement.scorers.kv_headroom import KvHeadroomScorer
from replica_agent.policy.pab import fits, on_time  # re-exported: callers import them from here too

__all__ = [
    "DEFAULT_MAX_CANDIDATES", "ClassBudgetView", "ExcludeFilter", "Filter", "FitsFilter", "FreshFilter",
    "FusedPabPolicy", "HeadroomScorer", "HealthyFilter", "HighestScorePicker", "KvHeadroomScorer",
    "MaxPromptFilter", "OnTimeFilter", "PabFitEntry", "Picker", "PlacementPolicy", "PlacementRegistry",
    "PlacementRequest", "PlacementResult", "PostDecisionHook", "ReplicaView", "Scorer", "WindowFilter",
    "apply_filters", "build_policy", "default_registry", "discover", "effective_prompt_tokens", "fits", "largest_max_prompt",
    "on_time", "prompt_exceeds_every_replica", "window_admits",
]
