"""Baseline routers as placement profiles: the routers people run in front of vLLM today, expressed as
plugins of the same kind as the PAB policy (filters -> scorers -> picker, the shape of llm-d's
endpoint picker) and registered by name in :func:`router.placement.default_registry` (the one
registry of the router and the fleet simulation; :func:`register_baselines`).

Every baseline sees the replicas through a :class:`~router.placement.load.RouterLoad` injected at
construction (``registry.build("least-outstanding", load=load, seed=1)``): what that router knows
without PAB budgets.

- ``outstanding``: requests this router sent to each replica and has not seen finish (exact and
  local to the router, as vllm-router / SGLang gateway count in-flight requests).
- ``scraped``: each replica's engine metrics (``vllm:num_requests_running``,
  ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``) as of the latest scrape (in the
  fleet simulation every ``scrape_period_ms``, 50 ms, llm-d's default refresh; in the router the
  agent's scrape carried by its budget snapshot: router/core.py ``RouterCore.refresh_load``).

Policies (all drop already-tried, unhealthy and too-long-prompt replicas first, "unhealthy" being
the agent's report or, in the router, a budget snapshot older than its TTL: filters ``exclude``,
``healthy``, ``fresh``, ``max-prompt``; none queues at the router: the engine's own waiting queue
absorbs bursts, as in front of plain vLLM; :class:`~router.placement.core.DirectAdmission`):

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
  router and of vllm-router (a fork of it), rule :class:`~router.placement.cache_aware.CacheAwarePolicy`,
  each with its own defaults (SGLang: threshold 0.3, abs 64, rel 1.5; vllm-router: 0.5, 32, 1.1).
- ``static-queue-cap``: least-outstanding routing; the replica refuses a prompt when its waiting
  prompt tokens plus the new prompt exceed a static bound (vLLM-style ``max-num-queued-tokens``
  admission cap, parameter ``queue_cap_tokens``, default :data:`DEFAULT_QUEUE_CAP_TOKENS`; applied
  by the fleet simulation's replica, loadgen/fleet/sim.py, and in a real fleet by the agent, sent
  in ``x-fairbatch-queue-cap``); the router then tries the next candidate, at most 3 in all.

- ``llm-d-flow-control``: llm-d v0.8 with its Flow Control layer (feature gate ``flowControl``):
  the ``llm-d-prefix`` scheduling profile behind llm-d's saturation detector and flow-control queues
  (router/placement/saturation.py, router/placement/flow_control.py, rules and sources there). While
  the pool is saturated (mean over replicas of ``max(waiting / 5, kv_usage / 0.8)`` >= 1, a replica
  without metrics fresher than 200 ms counting 1) a request waits at the router: bands strictly by
  priority, global-strict (or round-robin) fairness between tenants, FCFS within one; it is placed
  when the pool has room again (router/core.py ``RouterCore.dispatch_held``). Parameters:
  ``queue_depth_threshold``, ``kv_cache_util_threshold``, ``metrics_staleness_ms``,
  ``saturation_rule``, ``fairness``, ``ttl_ms`` (None: no TTL, llm-d's default; on expiry 503
  ``flow-control-ttl``), ``band_max_bytes``, ``band_max_requests``, ``max_bytes``,
  ``max_requests`` (over a limit: 429 ``flow-control-capacity``), ``reject_sheddable`` (429
  ``flow-control-shed`` for a sheddable class while saturated; off in llm-d v0.8).

- ``dynamo-kv``: NVIDIA Dynamo's KV router (``--router-mode kv``; router/placement/dynamo_kv.py):
  cost = overlap-credited prefill blocks (router-local active prefill tokens plus the prompt's
  uncached tokens, weight ``overlap_score_weight`` 1) + active decode blocks (router-local, plus
  the request's), in blocks of ``block_size`` (16) tokens (scorer ``dynamo-kv-cost``); lowest cost,
  or a softmax draw at ``router_temperature`` > 0 (picker ``softmax``, seeded); workers over
  ``active_decode_blocks_threshold`` (KV usage) or ``active_prefill_tokens_threshold`` (both off by
  default) are busy (filter ``dynamo-busy``): all busy = refused ``overloaded``, HTTP 529; while
  every worker's active prefill tokens exceed ``router_queue_threshold`` (16) x
  ``max_num_batched_tokens`` (2048) new requests wait at the router, first come first served
  (:class:`~router.placement.dynamo_kv.DynamoQueueGate`, router/core.py ``RouterCore._hold``).
- ``llm-d-sticky``: llm-d's "sticky until saturated" (router/placement/sticky.py): a replica whose
  cached share of the prompt is >= ``affinity_threshold`` (0.8) keeps it while its uncached tokens in
  flight are <= ``tau_tokens`` (peak prefill throughput x maximum TTFT penalty, from
  ``engine_profile`` and ``max_ttft_penalty_ms`` 5000 when not given); otherwise fewest outstanding
  tokens.

- ``llm-d-predicted-latency``: llm-d's predicted-latency scheduling (an online XGBoost model of TTFT
  and TPOT per pod, an SLO headroom tier filter between two prefix-affinity filters, the latency
  scorer, a weighted-random picker and the latency-SLO admitter that refuses sheddable requests no
  pod is predicted to serve in time), :class:`~router.placement.predicted_latency.PredictedLatencyPolicy`;
  parameters: those of :class:`~router.placement.predicted_latency.PredictedLatencySettings` and of
  :class:`~router.placement.latency_predictor.PredictorSettings` (e.g. ``refit_interval_ms``). Its
  drivers feed it each request's end (router/core.py ``RouterCore.latency_observed``) and train it
  (``RouterCore.latency_predictor``).


The seven cache-aware profiles set ``prefix_map``: the router keeps its prefix map for them even
with ``placement.prefix_cache`` off (its chunk and capacity settings apply).
"""

from __future__ import annotations

import random
from dataclasses import fields
from typing import Any

from router.placement.cache_aware import SGLANG_CACHE_AWARE, VLLM_ROUTER_CACHE_AWARE, CacheAwarePolicy
from router.placement.core import DirectAdmission, PlacementPolicy
from router.placement.dynamo_kv import DYNAMO_BLOCK_SIZE, DynamoQueueGate
from router.placement.flow_control import DEFAULT_BAND_MAX_BYTES, FlowControlSettings
from router.placement.latency_predictor import LatencyPredictor, PredictorSettings
from router.placement.load import RouterLoad
from router.placement.predicted_latency import PredictedLatencyPolicy, PredictedLatencySettings
from router.placement.saturation import (
    DEFAULT_KV_CACHE_UTIL_THRESHOLD,
    DEFAULT_METRICS_STALENESS_MS,
    DEFAULT_QUEUE_DEPTH_THRESHOLD,
    UtilizationDetector,
)
from router.placement.sticky import LLMD_STICKY_DEFAULTS, StickyPolicy, sticky_tau_tokens

BASELINE_POLICIES = ("round-robin", "least-outstanding", "least-outstanding-tokens", "power-of-two", "llm-d-scorer",
                     "static-queue-cap", "llm-d-prefix", "sglang-cache-aware", "vllm-router-cache-aware",
                     "llm-d-flow-control", "dynamo-kv", "llm-d-sticky", "llm-d-predicted-latency")  # fmt: skip
"""Names of the baseline placement profiles (the fleet benchmark's policy names)."""

BASELINE_FILTERS = ("exclude", "healthy", "fresh", "max-prompt")
"""The filters every baseline profile runs first (module docstring)."""

DEFAULT_QUEUE_CAP_TOKENS = 8192
"""``static-queue-cap``'s bound on a replica's queued prompt tokens when the profile sets none (the
fleet benchmark sets the prompt tokens a replica prefills within the TTFT, ``(TTFT - a) / b``)."""


def register_baselines(reg: Any) -> None:
    """Add the baseline profiles of the module docstring to ``reg`` (a
    :class:`~router.placement.registry.PlacementRegistry`, which calls this; its plugins are discovered:
    scorers ``least-outstanding``, ``least-outstanding-tokens``, ``engine-queue``, ``llm-d-queue``,
    ``kv-usage``, ``prefix-cache``; pickers ``round-robin``, ``power-of-two``).

    Every profile takes ``load`` (:class:`RouterLoad`; a fresh empty one when None) and ``seed``
    (tie-break RNG); ``static-queue-cap`` also ``queue_cap_tokens``; ``llm-d-flow-control`` the
    parameters of the module docstring; ``dynamo-kv`` and ``llm-d-sticky``
    the parameters of router/placement/dynamo_kv.py ``DYNAMO_KV_DEFAULTS`` and of
    router/placement/sticky.py (``affinity_threshold``, ``tau_tokens``, ``engine_profile``,
    ``max_ttft_penalty_ms``, ``max_num_batched_tokens``, ``exploration_probability``).
    """
    sc, pk = reg.scorers, reg.pickers

    def filters() -> list[Any]:
        return [reg.filters[n]() for n in BASELINE_FILTERS]

    def chain(scorers: list[tuple[str, float]], picker: Any, load: RouterLoad, prefix_map: bool = False,
              cap: int | None = None) -> PlacementPolicy:  # fmt: skip
        built = [(sc[n](load) if n != "prefix-cache" else sc[n](), w) for n, w in scorers]
        return PlacementPolicy(filters(), built, picker, direct=DirectAdmission(cap), prefix_map=prefix_map)

    def round_robin(load: RouterLoad | None = None, seed: int | None = None) -> PlacementPolicy:
        return chain([], pk["round-robin"](), load or RouterLoad())

    def least_outstanding(load: RouterLoad | None = None, seed: int | None = None) -> PlacementPolicy:
        return chain([("least-outstanding", 1.0)], pk["highest"](seed=seed), load or RouterLoad())

    def least_outstanding_tokens(load: RouterLoad | None = None, seed: int | None = None) -> PlacementPolicy:
        return chain([("least-outstanding-tokens", 1.0)], pk["highest"](seed=seed), load or RouterLoad())

    def power_of_two(load: RouterLoad | None = None, seed: int | None = None) -> PlacementPolicy:
        return chain([("engine-queue", 1.0)], pk["power-of-two"](seed=seed), load or RouterLoad())

    def llmd(load: RouterLoad | None = None, seed: int | None = None) -> PlacementPolicy:
        return chain([("llm-d-queue", 1.0), ("kv-usage", 1.0)], pk["highest"](seed=seed), load or RouterLoad())

    def llmd_prefix(load: RouterLoad | None = None, seed: int | None = None) -> PlacementPolicy:
        return chain([("prefix-cache", 3.0), ("llm-d-queue", 2.0), ("kv-usage", 2.0)], pk["highest"](seed=seed),
                     load or RouterLoad(), prefix_map=True)  # fmt: skip

    def cache_aware(defaults: dict[str, Any]) -> Any:
        def build(load: RouterLoad | None = None, seed: int | None = None) -> PlacementPolicy:
            return CacheAwarePolicy(filters(), [], pk["highest"](), load or RouterLoad(), **defaults,
                                    direct=DirectAdmission(), prefix_map=True)  # fmt: skip
        return build

    def static_queue_cap(load: RouterLoad | None = None, seed: int | None = None,
                         queue_cap_tokens: int = DEFAULT_QUEUE_CAP_TOKENS) -> PlacementPolicy:  # fmt: skip
        return chain([("least-outstanding", 1.0)], pk["highest"](seed=seed), load or RouterLoad(),
                     cap=int(queue_cap_tokens))  # fmt: skip

    def llmd_flow_control(load: RouterLoad | None = None, seed: int | None = None,
                          queue_depth_threshold: int = DEFAULT_QUEUE_DEPTH_THRESHOLD,
                          kv_cache_util_threshold: float = DEFAULT_KV_CACHE_UTIL_THRESHOLD,
                          metrics_staleness_ms: float = DEFAULT_METRICS_STALENESS_MS,
                          saturation_rule: str = "gradient", fairness: str = "global-strict",
                          ttl_ms: float | None = None, band_max_bytes: int = DEFAULT_BAND_MAX_BYTES,
                          band_max_requests: int = 0, max_bytes: int = 0, max_requests: int = 0,
                          reject_sheddable: bool = False) -> PlacementPolicy:  # fmt: skip
        policy = llmd_prefix(load, seed)
        detector = UtilizationDetector(int(queue_depth_threshold), float(kv_cache_util_threshold),
                                       float(metrics_staleness_ms), saturation_rule)  # fmt: skip
        policy.direct = DirectAdmission(flow_control=FlowControlSettings(
            detector, fairness, None if ttl_ms is None else float(ttl_ms), int(band_max_bytes),
            int(band_max_requests), int(max_bytes), int(max_requests), bool(reject_sheddable)))  # fmt: skip
        return policy

    def dynamo_kv(load: RouterLoad | None = None, seed: int | None = None, block_size: int = DYNAMO_BLOCK_SIZE,
                  overlap_score_weight: float = 1.0, router_temperature: float = 0.0,
                  active_decode_blocks_threshold: float | None = None,
                  active_prefill_tokens_threshold: int | None = None, router_queue_threshold: float | None = 16.0,
                  max_num_batched_tokens: int = 2048) -> PlacementPolicy:  # fmt: skip
        load = load or RouterLoad()
        busy = reg.filters["dynamo-busy"](load, active_decode_blocks_threshold, active_prefill_tokens_threshold)
        gate = None if router_queue_threshold is None else \
            DynamoQueueGate(load, float(router_queue_threshold), int(max_num_batched_tokens))  # fmt: skip
        return PlacementPolicy(filters() + [busy], [(sc["dynamo-kv-cost"](load, int(block_size),
                                                                           float(overlap_score_weight)), 1.0)],
                               pk["softmax"](float(router_temperature), seed), direct=DirectAdmission(hold=gate),
                               prefix_map=True)  # fmt: skip

    def llmd_sticky(load: RouterLoad | None = None, seed: int | None = None,
                    affinity_threshold: float = float(LLMD_STICKY_DEFAULTS["affinity_threshold"]),
                    tau_tokens: int | None = None,
                    engine_profile: str = str(LLMD_STICKY_DEFAULTS["engine_profile"]),
                    max_ttft_penalty_ms: float = float(LLMD_STICKY_DEFAULTS["max_ttft_penalty_ms"]),
                    max_num_batched_tokens: int | None = None,
                    exploration_probability: float = float(LLMD_STICKY_DEFAULTS["exploration_probability"]),
                    ) -> PlacementPolicy:  # fmt: skip
        tau = sticky_tau_tokens(engine_profile, max_ttft_penalty_ms, max_num_batched_tokens) \
            if tau_tokens is None else int(tau_tokens)  # fmt: skip
        return StickyPolicy(filters(), [], pk["highest"](), load or RouterLoad(), float(affinity_threshold), tau,
                            float(exploration_probability), seed, direct=DirectAdmission(), prefix_map=True)  # fmt: skip
    def predicted_latency(load: RouterLoad | None = None, seed: int | None = None,
                          **params: Any) -> PlacementPolicy:  # fmt: skip
        own = {f.name for f in fields(PredictedLatencySettings)}
        pred = {f.name for f in fields(PredictorSettings)}
        unknown = set(params) - own - pred
        if unknown:
            raise ValueError(f"llm-d-predicted-latency: unknown parameters {sorted(unknown)}")
        return PredictedLatencyPolicy(
            filters(), [], pk["highest"](), load or RouterLoad(),
            LatencyPredictor(PredictorSettings(**{k: v for k, v in params.items() if k in pred})),
            PredictedLatencySettings(**{k: v for k, v in params.items() if k in own}), random.Random(seed),
            direct=DirectAdmission(), prefix_map=True,
        )  # fmt: skip

    reg.policies.update({
        "dynamo-kv": dynamo_kv, "llm-d-sticky": llmd_sticky,
        "round-robin": round_robin, "least-outstanding": least_outstanding,
        "least-outstanding-tokens": least_outstanding_tokens, "power-of-two": power_of_two, "llm-d-scorer": llmd,
        "llm-d-prefix": llmd_prefix, "sglang-cache-aware": cache_aware(SGLANG_CACHE_AWARE),
        "vllm-router-cache-aware": cache_aware(VLLM_ROUTER_CACHE_AWARE), "static-queue-cap": static_queue_cap,
        "llm-d-predicted-latency": predicted_latency,
    })  # fmt: skip
    reg.policies["llm-d-flow-control"] = llmd_flow_control  # fmt: skip
