"""llm-d's "sticky until saturated" scheduling as a placement policy, ``llm-d-sticky``
(:class:`StickyPolicy`), and its saturation bound calibrated from a GPU step-time profile
(:func:`sticky_tau_tokens`). PURE.

Rule, after the filters (llm-d ``prefix-cache-affinity-filter``, then token-load routing):

1. sticky replicas: those whose cached share of the prompt (``cached / P``, the router's prefix map,
   router/prefix_index.py, as llm-d's approximate prefix-cache plugin) is ``>= affinity_threshold``
   (0.80); with probability ``exploration_probability`` (0.01, seeded) the gate is skipped;
2. saturated: a sticky replica whose uncached prompt tokens in flight (router-local
   :class:`~router.placement.load.RouterLoad` ``prefill_tokens``: routed, first token not yet
   seen) exceed ``tau_tokens`` is no longer sticky; tau = peak prefill throughput x maximum TTFT
   penalty, static, calibrated once per model and GPU;
3. pick: fewest router-local outstanding tokens (``outstanding_tokens``: prompt + requested output
   tokens in flight) among the sticky replicas left, or among all when none is; ties by a seeded
   RNG; the others follow by ascending outstanding tokens (the fallbacks).

Defaults: ``affinityThreshold`` 0.80, ``explorationProbability`` 0.01 and ``maxTTFTPenaltyMs`` 5000
are the documented defaults of llm-d-inference-scheduler's ``prefix-cache-affinity-filter``
(pkg/epp/framework/plugins/scheduling/filter/prefixcacheaffinity/README.md, commit 520af478); the
static tau replaces that filter's predicted-TTFT gate in the "sticky until saturated" default of
the llm-d blog of 2026-08-17 (their example: 20,480 tok/s x 14 s). Here tau comes from the replicas'
profile (:func:`sticky_tau_tokens`) and the penalty defaults to the filter's 5 s.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from replica_agent.policy.time_model import TimeModel
from router.placement.core import PlacementPolicy, PlacementRequest, PlacementResult, ReplicaView, apply_filters
from router.placement.load import RouterLoad

LLMD_STICKY_DEFAULTS: dict[str, float | str] = {
    "affinity_threshold": 0.80,
    "exploration_probability": 0.01,
    "max_ttft_penalty_ms": 5000.0,
    "engine_profile": "llama-3-8b-a100",
}
"""The ``llm-d-sticky`` profile's defaults (module docstring); ``tau_tokens`` (None) is then
:func:`sticky_tau_tokens` of ``engine_profile`` and ``max_ttft_penalty_ms``."""


def peak_prefill_tokens_per_s(time_model: TimeModel, max_num_batched_tokens: int) -> float:
    """Tokens/s of one full prefill step of ``max_num_batched_tokens`` new tokens and no context:
    ``N / (a + b*N) * 1000`` (the step time of ``time_model``, ms).

    Raises:
        ValueError: ``max_num_batched_tokens`` <= 0.
    """
    if max_num_batched_tokens <= 0:
        raise ValueError(f"max_num_batched_tokens must be > 0, got {max_num_batched_tokens}")
    n = max_num_batched_tokens
    return n / (time_model.a_ms + time_model.b_ms_per_new_token * n) * 1000.0


def sticky_tau_tokens(profile: str, max_ttft_penalty_ms: float = 5000.0,
                      max_num_batched_tokens: int | None = None) -> int:  # fmt: skip
    """tau (tokens) = peak prefill throughput x maximum TTFT penalty, for GPU profile ``profile``
    (replica_agent/policy/profiles.py): the throughput of one full ``max_num_batched_tokens`` prefill step
    (default ``vllm serve``'s for the profile's GPU), floored to whole tokens.

    Raises:
        KeyError: an unknown profile or GPU.
        ValueError: a negative penalty.
    """
    from replica_agent.policy.profiles import load_profile, vllm_serve_batch_defaults

    if max_ttft_penalty_ms < 0:
        raise ValueError(f"max_ttft_penalty_ms must be >= 0, got {max_ttft_penalty_ms}")
    prof = load_profile(profile)
    n = max_num_batched_tokens or vllm_serve_batch_defaults(prof.gpu).max_num_batched_tokens
    return int(peak_prefill_tokens_per_s(prof.time_model, n) * max_ttft_penalty_ms / 1000.0)


@dataclass(slots=True)
class StickyPolicy(PlacementPolicy):
    """llm-d "sticky until saturated" (module docstring) after the filters.

    Attributes:
        load: the router's load view (``prefill_tokens``, ``outstanding_tokens``).
        affinity_threshold: least ``cached / P`` for stickiness (0..1, inclusive).
        tau_tokens: a sticky replica's bound on uncached tokens in flight (>= 0; over it: saturated).
        exploration_probability: chance of skipping the affinity gate (0..1).
        seed: RNG seed (exploration, tie-breaks); None = unseeded.

    Raises:
        ValueError: a parameter out of range.
    """

    load: RouterLoad = field(default_factory=RouterLoad)
    affinity_threshold: float = 0.80
    tau_tokens: int = 0
    exploration_probability: float = 0.01
    seed: int | None = None
    rng: random.Random = field(init=False, repr=False, default_factory=random.Random)

    def __post_init__(self) -> None:
        if not 0.0 <= self.affinity_threshold <= 1.0 or self.tau_tokens < 0 or \
                not 0.0 <= self.exploration_probability <= 1.0:  # fmt: skip
            raise ValueError(f"affinity_threshold and exploration_probability must be in [0, 1] and tau_tokens >= 0, "
                             f"got {self.affinity_threshold}, {self.exploration_probability}, {self.tau_tokens}")
        self.rng = random.Random(self.seed)

    def sticky(self, request: PlacementRequest, replicas: Sequence[ReplicaView]) -> list[ReplicaView]:
        """The replicas that keep the request by affinity (cached share >= threshold, not saturated;
        no exploration draw)."""
        p, cached = request.prompt_tokens, request.cached_tokens
        if p <= 0 or not cached:
            return []
        prefill = self.load.prefill_tokens
        return [r for r in replicas if cached.get(r.replica_id, 0) / p >= self.affinity_threshold
                and prefill.get(r.replica_id, 0) <= self.tau_tokens]  # fmt: skip

    def place(self, request: PlacementRequest, replicas: Sequence[ReplicaView]) -> PlacementResult:
        remaining, dropped_by = apply_filters(self.filters, request, replicas)
        if not remaining:
            return PlacementResult((), dropped_by)
        explore = self.exploration_probability > 0 and self.rng.random() < self.exploration_probability
        sticky = [] if explore else self.sticky(request, remaining)
        tokens = self.load.outstanding_tokens
        by_load = sorted(remaining, key=lambda r: (tokens.get(r.replica_id, 0), self.rng.random()))
        pool = {r.replica_id for r in sticky}
        first = next((r for r in by_load if r.replica_id in pool), by_load[0])
        return PlacementResult((first.replica_id,) + tuple(r.replica_id for r in by_load if r is not first))
