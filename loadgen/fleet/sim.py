"""Discrete-event fleet simulation: N simulated vLLM replicas, R router copies, one virtual clock.

Builds on loadgen/sim/virtual.py (one replica, events = arrivals and step ends) and runs the REAL
pure code of every part; only I/O (sockets, gRPC, HTTP streams, Prometheus scrapes) is replaced
by events on one heap:

- replicas: :class:`~loadgen.sim.engine.SimEngine` with a batching policy from
  ``replica_agent.policy.batching.make_policy`` (``vllm-default`` or ``fairbatching``); step time
  from ``engine_time`` (the engine's own model, loadgen/sim/engine_time.py) or, without it, the
  profile's time model. Each replica's agent runs in *plugin mode*: PAB inputs
  (:class:`~replica_agent.policy.pab.ReplicaState`) are built from the engine's exact request
  state by the rule the plugin export uses (replica_agent/policy/engine_state.py ``pab_inputs``:
  the next-token deadline, which requests are decodes), as of the start of the step in flight as the
  plugin's state record gives it (:class:`StepView`; the engine applies a step's tokens when it
  starts), plus the agent's
  :class:`~replica_agent.policy.leases.LeaseTable`; budgets by ``pab.class_budget``; Reserve by
  the agent's own decision (replica_agent/policy/reserve.py ``reserve_decision``) with the
  request's age ``waited_ms = now - arrival at the router``. With ``online_time_model`` (the
  default) each replica learns its step times as the agent and the plugin do
  (replica_agent/policy/calibration.py: every step's features and duration), and its policy, PAB
  and snapshots plan with the learned conservative model.
- routers (``pab`` kind): each copy has its own :class:`router.budgets.BudgetBook` (fed by
  delayed snapshots), the ``pab`` placement policy of :func:`router.placement.default_registry`,
  a :class:`router.fair_queue.FairQueue` (or FIFO) and the real
  :class:`router.admission_queue.Dispatcher`, whose async methods are driven synchronously (the
  simulated ``admit`` never suspends). Request path as ``router/server.py`` ``_acquire``, by the
  same pure rules (router/arrival.py: placement + Reserve at once when nobody waits, else queue or
  refuse; router/admission.py: the offers and lease tokens of a placement, the rule after an inline
  refusal, tests/unit/test_router_sim_parity.py); ``take_local`` before each Reserve and
  ``apply_reserve`` with the answer; up to 3 Reserve candidates per placement; placement and
  Reserve both get ``waited_ms = now - arrival at the router``.
- routers (baselines: the placement profiles of router/placement/baselines.py): the same core
  (router/core.py), whose baseline path places at once on router-local outstanding counts or
  scraped engine metrics (:class:`~router.placement.RouterLoad`), no router queue, no lease; each
  router's book holds one snapshot per replica that never goes stale (healthy, the fleet's time
  model and max length), and every ``SCRAPE`` delivers the engine's running and waiting requests
  and KV usage to every router's book at once, as the agents' snapshots carry them to the real
  router (router/core.py ``RouterCore.refresh_load``).

Events (simulated ms): ``ARRIVE`` (client request at a router; routers are chosen uniformly at
random with the seeded RNG, as behind an L4 load balancer), ``FORWARD`` (request reaches a
replica), ``STEP_END``, ``PUSH`` (an agent computes its budget every ``push_period_ms``, phases
drawn at random; each router gets it ``net_delay_ms`` later: ``DELIVER``), ``SCRAPE`` (every
``scrape_period_ms``, for the metric-based baselines), ``DISPATCH`` (a router's queue pass).

Network: one hop costs ``net_delay_ms``. A granted Reserve answered at t puts the request on the
replica at ``t + 3 * d`` (Reserve there, answer back, request there) plus ``2 * d`` per refused
Reserve before it; the agent evaluates the Reserve with its state at the decision instant t (its
grants are serialised, as the agent's event loop does). Inline admission (``lease_mode="inline"``):
the request reaches the replica at ``t + d`` and the agent decides then; a refusal reaches the
router ``d`` later. Baselines forward at ``t + d``. Token
times reach the client ``d`` after the engine step that sampled them. Agents push periodically
(``push_period_ms``) and, with ``min_push_interval_ms`` set, also on change, coalesced to one
snapshot per that interval as the real agent does; without it periodically only (the period is
then the staleness under study).

Dispatcher wake-ups: on every snapshot delivery and every new queue entry at that router
(the view changes only then), coalesced to one pass per ``dispatch_gap_ms`` (a pass takes router CPU time too),
and at the queue's next deadline at the latest; a wake-up before a pending deadline pass moves it earlier.

Double-spend: a prefill admitted to a replica beyond that replica's PAB at the moment it was
granted. With leases the moment is the Reserve decision, before forwarding or (inline) on
arrival (the lease then counts in PAB's in-flight reservation); without leases (``leases=False``, routers forward on their own view alone) it is
the request's arrival at the replica, checked with ``pab.admits`` (its age then: ``waited_ms =
arrival at the replica - arrival at the router``) against the exact state then.

Faults and migration (issue 29 item 6): ``FleetConfig.faults`` kills replicas at given times (kill -9 of
engine and agent): the step in progress yields nothing, the replica takes no more work (a request
forwarded to it fails one hop later: connection refused), and one hop later every router's budget
stream from it breaks (``BudgetBook.mark_disconnected``) and each of its requests' connections
does. The router then does what router/server.py does: a request with no token out yet is re-placed
whole (the replica excluded; ``migrations["retries"]``); a stream with tokens out goes through
router/migration.py ``decide_resume`` (the migration limit, the context) and, continued, is placed
through the same core as a request arriving now whose prompt carries the tokens sent
(``continuation_sizes``: the re-prefill of prompt + generated is priced and admitted by PAB like any
prompt), the failed replicas excluded; the engine re-prefills it (its prefix cache helps only with
the original prompt's blocks) and decodes the rest. The client's token times run on across the cut,
so the gap counts in its TPOT and in SLO attainment; ``stats.migration_added_ms`` holds each gap. A
continuation that no replica takes fails (``migration-no-replica``), as does one past the limit
(``migration-limit``).

Requests not finished by ``duration end + drain_ms`` count as failed (``unfinished``).
Deterministic: one seeded ``random.Random``; virtual time only (wall time is measured only for
the placement-decision figures).
"""

from __future__ import annotations

import heapq
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from loadgen.sim.engine import EngineConfig, SimEngine, StepResult
from loadgen.sim.engine_time import EngineTimeModel
from loadgen.sim.prefix_cache import block_hashes_from_ids, chain_hashes
from loadgen.stats import FAILED, OK, REJECTED, RequestRecord
from replica_agent.engine_metrics import PrefixHitWindow
from replica_agent.policy.batching import PolicyConfig, make_policy
from replica_agent.policy.calibration import CalibratorConfig, OnlineTimeModel
from replica_agent.policy.engine_state import pab_inputs
from replica_agent.policy.leases import LeaseTable
from replica_agent.policy.pab import (
    ClassBudget,
    DecodeState,
    PendingPrefill,
    ReplicaState,
    SloClass,
    admits,
    class_budget,
    planning_horizon_ms,
)
from replica_agent.policy.prefill_eta import inflight_schedule
from replica_agent.policy.queue_cap import over_queue_cap
from replica_agent.policy.reserve import reserve_decision
from replica_agent.policy.time_model import TimeModel
from router.admission import RelayAttempts
from router.autoscale import FleetSignal, Stabilizer, pab_desired, waiting_desired
from router.budget_client import ReserveResult
from router.config import RouterConfig
from router.core import CoreRequest, Grant, Placed, Queued, RouterCore
from router.migration import continuation_sizes, decide_resume
from router.placement import BASELINE_POLICIES, LLMD_STICKY_DEFAULTS
from router.placement.sticky import peak_prefill_tokens_per_s
from router.prefix_correction import PrefixCorrection
from router.prefix_index import PrefixIndex
from router.work_shed import BUDGET_REASONS, REASON as WORK_SHED_REASON, WorkShed, WorkShedSettings

POLICIES: dict[str, tuple[str, str]] = {
    "round-robin": ("direct", "vllm-default"),
    "least-outstanding": ("direct", "vllm-default"),
    "power-of-two": ("direct", "vllm-default"),
    "llm-d-scorer": ("direct", "vllm-default"),
    "static-queue-cap": ("queue-cap", "vllm-default"),
    "least-outstanding-tokens": ("direct", "vllm-default"),
    "least-outstanding+fairbatching": ("direct", "fairbatching"),
    "static-queue-cap+fairbatching": ("queue-cap", "fairbatching"),
    "llm-d-prefix": ("direct", "vllm-default"),
    "sglang-cache-aware": ("direct", "vllm-default"),
    "vllm-router-cache-aware": ("direct", "vllm-default"),
    "llm-d-flow-control": ("direct", "vllm-default"),
    "llm-d-flow-control+fairbatching": ("direct", "fairbatching"),
    "dynamo-kv": ("direct", "vllm-default"),
    "llm-d-sticky": ("direct", "vllm-default"),
    "dynamo-kv+fairbatching": ("direct", "fairbatching"),
    "llm-d-sticky+fairbatching": ("direct", "fairbatching"),
    "llm-d-predicted-latency": ("direct", "vllm-default"),
    "llm-d-predicted-latency+fairbatching": ("direct", "fairbatching"),
    "pab": ("pab", "vllm-default"),
    "pab+fairbatching": ("pab", "fairbatching"),
    "pab-prefix": ("pab", "vllm-default"),
    "pab-prefix+fairbatching": ("pab", "fairbatching"),
    "pab-best-fit+fairbatching": ("pab", "fairbatching"),
    "pab-reserve-fit+fairbatching": ("pab", "fairbatching"),
    "pab-protect+fairbatching": ("pab", "fairbatching"),
    "pab-speed-match+fairbatching": ("pab", "fairbatching"),
    "pab-pool+fairbatching": ("pab", "fairbatching"),
}
"""Fleet policy name -> (router kind, replica batching policy). ``X+fairbatching`` for a baseline
router X: the same placement in front of FairBatching replicas (what an operator who installed the
scheduler plugin but kept their router would run)."""


PREFIX_POLICIES = frozenset({"llm-d-prefix", "sglang-cache-aware", "vllm-router-cache-aware", "pab-prefix",
                             "pab-prefix+fairbatching", "llm-d-flow-control", "llm-d-flow-control+fairbatching",
                             "dynamo-kv", "llm-d-sticky", "dynamo-kv+fairbatching", "llm-d-sticky+fairbatching",
                             "llm-d-predicted-latency", "llm-d-predicted-latency+fairbatching"})  # fmt: skip
"""Fleet policies whose routers keep a prefix map (router/prefix_index.py) and place with it."""

BEST_FIT_SCORERS = {"pab-best-fit+fairbatching": [{"name": "headroom", "weight": -1.0}],
                    "pab-reserve-fit+fairbatching": [{"name": "reserve-fit", "weight": 1.0}]}
"""Fleet policies whose ``pab`` routers place with a custom chain (router YAML ``placement.scorers``):
``pab-best-fit``: the default filters (the request fits, on time, inside the start window), then the
replica with the *least* headroom left after this prefill (best fit; the default ``pab`` profile
takes the most headroom plus KV headroom: worst fit), which keeps replicas with room for long prompts;
``pab-reserve-fit``: best fit while 30 % of the horizon stays free, else worst fit
(router/placement/scorers/reserve_fit.py)."""

CUSTOM_FILTERS = {"pab-protect+fairbatching": ["exclude", "healthy", "fresh", "max-prompt", "fits", "on-time", "window",
                                               "protect-headroom"],
                  "pab-speed-match+fairbatching": ["exclude", "healthy", "fresh", "max-prompt", "fits", "on-time",
                                                   "window", "speed-match"],
                  "pab-pool+fairbatching": ["exclude", "healthy", "fresh", "max-prompt", "long-prompt-pool", "fits",
                                            "on-time", "window"]}
"""Fleet policies whose ``pab`` routers filter with a custom chain (router YAML ``placement.filters``):
``pab-protect``: the default filters, then ``protect-headroom`` (short prompts leave the replicas with
the most PAB time to long ones; router/placement/filters/protect_headroom.py); ``pab-speed-match``: the
default filters, then ``speed-match`` (on mixed GPUs short prompts to the slower replicas, long ones to
the faster; router/placement/filters/speed_match.py); ``pab-pool``: the default filters with
``long-prompt-pool`` before ``fits`` (short prompts leave a pool sized by the long prompts' share of the work to the
prompts that need a replica without young decodes; router/placement/filters/long_prompt_pool.py)."""


SCRAPED_POLICIES = frozenset({"power-of-two", "llm-d-scorer", "llm-d-prefix", "llm-d-flow-control", "dynamo-kv",
                              "llm-d-predicted-latency"})
"""Placement profiles that read scraped engine metrics (the fleet scrapes every ``scrape_period_ms`` for them)."""


def placement_name(policy: str) -> str:
    """The placement policy of a fleet policy: ``least-outstanding+fairbatching`` -> ``least-outstanding``."""
    return policy.removesuffix("+fairbatching") if POLICIES[policy][0] != "pab" else "pab"


SLO_CLASS = "interactive"

(_ARRIVE, _FORWARD, _STEP_END, _PUSH, _DELIVER, _SCRAPE, _DISPATCH, _REFUSED, _CHANGE_PUSH, _SCALE, _KILL, _FAILED,
 _WATCH_DOWN) = range(13)

AUTOSCALE_SIGNALS = ("pab", "num-waiting")


@dataclass(frozen=True, slots=True)
class AutoscaleConfig:
    """An autoscaler that adds and removes replicas while the fleet runs (router/autoscale.py).

    ``FleetConfig.replicas`` is then the pool's maximum. Every ``eval_period_ms`` the autoscaler
    reads the signal (``pab``: the first router's budget view and the router queues, as the
    router's /metrics exports them; ``num-waiting``: the engines' waiting requests, as vLLM's
    /metrics does), computes the raw desired count (``pab_desired`` or ``waiting_desired``) and
    stabilizes it as the HPA does (:class:`router.autoscale.Stabilizer`). A replica added starts
    serving ``startup_ms`` later (pod scheduling, model load) and costs GPU time from the decision
    on; a replica removed stops taking work at once (its agent reports unhealthy) and is released
    when its running requests finish (a starting one is cancelled first).

    Attributes:
        signal: ``pab`` or ``num-waiting``.
        min_replicas, initial_replicas: bounds at start (1 <= min <= initial <= FleetConfig.replicas).
        startup_ms: decision to serving (ms).
        eval_period_ms: evaluation period (the HPA's sync period is 15 s).
        stabilization_ms: scale-down stabilization window (the HPA's default 300 s).
        waiting_target: ``num-waiting``: target waiting requests per replica.
    """

    signal: str
    min_replicas: int
    initial_replicas: int
    startup_ms: float = 60_000.0
    eval_period_ms: float = 15_000.0
    stabilization_ms: float = 300_000.0
    waiting_target: float = 5.0


@dataclass(frozen=True, slots=True)
class FleetRequest:
    """One client request.

    Attributes:
        arrival_ms: arrival at the router (simulated ms).
        prompt_tokens, output_tokens: lengths (tokens, >= 1).
        tenant: tenant name.
        prefix_ids: ids of the prompt's prefix blocks, one per ``FleetConfig.prefix_block_tokens``
            tokens (equal leading ids = equal prompt prefix; Mooncake ``hash_ids``); empty = a
            prompt that shares nothing.
    """

    arrival_ms: float
    prompt_tokens: int
    output_tokens: int
    tenant: str = "t0"
    prefix_ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class ReplicaKind:
    """Replicas of one GPU kind in a heterogeneous fleet (:attr:`FleetConfig.replica_kinds`).

    Attributes:
        name: the kind's profile name (``llama-3-8b-h100``), for reports.
        count: replicas of this kind (>= 1).
        time_model: the agent's prior (its GPU profile; the online model learns from it).
        kv_capacity_tokens: KV cache per replica (tokens).
        engine_time: the engine's own step time; None: it steps at ``time_model`` (an oracle).
        max_num_batched_tokens, max_num_seqs: the engine's batch settings (``vllm serve`` defaults
            differ per GPU: replica_agent/policy/profiles.py ``vllm_serve_batch_defaults``).

    Raises:
        ValueError: ``count`` < 1.
    """

    name: str
    count: int
    time_model: TimeModel
    kv_capacity_tokens: int
    engine_time: EngineTimeModel | None
    max_num_batched_tokens: int
    max_num_seqs: int

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ValueError(f"replica kind {self.name!r}: count must be >= 1, got {self.count}")


@dataclass(frozen=True, slots=True)
class FleetConfig:
    """One fleet run.

    Attributes:
        policy: a key of :data:`POLICIES`.
        replicas: number of replicas N.
        time_model: a, b, c (ms) of every replica.
        kv_capacity_tokens: KV cache per replica (tokens).
        ttft_ms, tpot_ms: the SLO class of every request (ms).
        routers: router copies R.
        push_period_ms: agent budget push period (ms).
        net_delay_ms: one network hop (ms).
        scrape_period_ms: metric scrape period of the metric-based baselines (ms).
        leases: PAB routers Reserve a lease before forwarding (False: forward on the view alone).
        lease_mode: ``reserve`` (a Reserve round trip before forwarding: the request reaches the
            replica ``3 d`` after the decision) or ``inline`` (router/config.py ``admission.lease_mode``:
            forwarded at once, ``d``; the agent runs the Reserve decision on arrival and a refusal
            comes back ``d`` later, when the router applies the budget it reports and re-places the
            request, the refusing replica excluded for that placement).
        min_push_interval_ms: None: agents push periodically only. A number: also on every change
            (a request arrives, a lease is granted, a step ends with a first token or a finish), at
            most one snapshot per this many ms (replica_agent/admission_server.py coalescing).
        margin_frac, margin_cap_tpots: the agents' PAB horizon margin (replica_agent/policy/pab.py
            ``planning_horizon_ms``: H = ttft - min(margin_frac * ttft, margin_cap_tpots * tpot)).
        budget_ttl_ms: a snapshot older than this counts as zero budget (router clock, ms).
        lease_ttl_ms: a lease whose request never arrives lapses after this (ms).
        max_queue_ms: longest wait in a router queue (ms).
        sheddable: the class is sheddable: the router's own rule (router/shedding.py) refuses a
            request at arrival when it cannot start in time and sheds it from the queue as soon as
            it no longer can (reason ``slo-infeasible``); False: it waits up to ``max_queue_ms``.
        start_window_steps: the router's start window (router/config.py ``admission``; the router's
            default is 4): a replica takes a prompt only while its un-started prefill work fits this
            many steps of ``max_num_batched_tokens``. 0 = no window.
        queue_kind: ``fair`` (router/fair_queue.py), the only queue the router has (the fleet's
            routers are the shipped router's core, router/core.py).
        queue_max_requests, queue_max_tokens: router queue bounds.
        dispatch_gap_ms: at most one dispatcher pass per this many ms per router.
        queue_cap_tokens: ``static-queue-cap`` bound on a replica's waiting prompt tokens.
        tenant_weights: tenant -> VTC weight (fair queue).
        block_size, max_num_batched_tokens, max_num_seqs, max_model_len: engine settings.
        drain_ms: simulated time after the last arrival before unfinished requests are cut.
        seed: RNG seed.
        engine_time: every replica's own step time (loadgen/sim/engine_time.py; replica i draws noise
            stream i); None: the replicas step at ``time_model``, the model the policies plan with.
        online_time_model: each replica learns its step times from ``time_model`` on (module
            docstring); False: policies and PAB keep ``time_model`` fixed.
        calibration: the online time model's settings.
        autoscale: add and remove replicas while running (:class:`AutoscaleConfig`; signal ``pab``
            needs a ``pab`` policy, ``num-waiting`` runs with any); None: all ``replicas`` serve from the start.
        prefix_caching: the engines' automatic prefix caching (vLLM's default; loadgen/sim/kv_cache.py).
        prefix_block_tokens: tokens per id of ``FleetRequest.prefix_ids`` (512 for Mooncake); also
            the unit of the routers' prefix maps, which hold about one replica's KV cache each.
        contention_max_inflight: the ``pab`` routers' contention cap (router/config.py
            ``admission.contention_max_inflight``; the router's default 32, 0 = off).
        contention_keep_running: ``admission.contention_keep_running`` (the router's default True:
            under contention a replica keeps the batch it had; False: the fixed cap).
        max_bypass: entries admitted behind a blocked queue head before it gets a held replica
            (``queue.max_bypass``; the router's default 8).
        placement_hooks: post-decision hooks of the ``pab`` routers' placement (router/config.py
            ``placement.hooks``; router/placement/hooks/), told of every granted placement.
        work_shed: ``pab`` routers with a sheddable class refuse, under contention, the arrivals of
            costliest predicted work (router/work_shed.py, the router's ``admission.work_shed``;
            reason ``work-shed``); None: off, the router's default. The decode estimate is the
            request's ``output_tokens`` (the simulated client's ``max_tokens``).
        replica_kinds: a heterogeneous fleet (issue 27 item 3): replicas r0.. of the first kind,
            then the next kind's, ...; their counts sum to ``replicas``. Each kind's time model,
            KV cache, engine model and batch settings replace ``time_model``,
            ``kv_capacity_tokens``, ``engine_time``, ``max_num_batched_tokens`` and
            ``max_num_seqs`` for its replicas. Empty: every replica from those fields.
        faults: ``(ms, replica index)`` pairs: that replica (engine and agent) is killed then, as by
            kill -9 (module docstring, "Faults and migration"); it serves no more in this run.
        max_migrations: the routers' ``migration.max_migrations`` (continuations per request; 0: a
            request cut mid-stream fails).
        engine_front_ms: time from a request's arrival at the replica to its engine core (ms; vLLM's API
            server: tokenization and hand-off), added to the forwarding hop; ``make bench-vllm``
            measures it on real vLLM (docs/vllm.md). 0: none (the default).
        decode_guard_ms: FairBatching replicas plan each decode's deadline this many ms early
            (replica_agent/policy/batching.py ``PolicyConfig.decode_guard_ms``; 0: none, the default).
    """

    policy: str
    replicas: int
    time_model: TimeModel
    kv_capacity_tokens: int
    ttft_ms: float
    tpot_ms: float
    routers: int = 1
    push_period_ms: float = 100.0
    net_delay_ms: float = 0.5
    scrape_period_ms: float = 50.0
    leases: bool = True
    lease_mode: str = "reserve"
    min_push_interval_ms: float | None = None
    margin_frac: float = 0.1
    budget_ttl_ms: float = 1000.0
    lease_ttl_ms: float = 5000.0
    max_queue_ms: float = 2000.0
    sheddable: bool = True
    start_window_steps: float = 0.0
    queue_kind: str = "fair"
    queue_max_requests: int = 4096
    queue_max_tokens: int = 16_000_000
    dispatch_gap_ms: float = 5.0
    queue_cap_tokens: int = 0
    tenant_weights: tuple[tuple[str, float], ...] = ()
    block_size: int = 16
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    max_model_len: int = 32768
    drain_ms: float = 60_000.0
    seed: int = 0
    engine_time: EngineTimeModel | None = None
    online_time_model: bool = True
    calibration: CalibratorConfig = field(default_factory=lambda: CalibratorConfig(refit_every=4))
    autoscale: AutoscaleConfig | None = None
    prefix_caching: bool = True
    prefix_block_tokens: int = 512
    work_shed: WorkShedSettings | None = None
    placement_hooks: tuple[str, ...] = ()
    contention_max_inflight: int = 32
    max_bypass: int = 8
    replica_kinds: tuple[ReplicaKind, ...] = ()
    contention_keep_running: bool = True
    faults: tuple[tuple[float, int], ...] = ()
    max_migrations: int = 3
    engine_front_ms: float = 0.0
    decode_guard_ms: float = 0.0
    margin_cap_tpots: float = 1.0

    def __post_init__(self) -> None:
        if self.replica_kinds and sum(k.count for k in self.replica_kinds) != self.replicas:
            raise ValueError(f"replica_kinds count {sum(k.count for k in self.replica_kinds)} replicas, "
                             f"replicas is {self.replicas}")  # fmt: skip
        if self.policy not in POLICIES:
            raise ValueError(f"unknown fleet policy {self.policy!r}; known: {', '.join(POLICIES)}")
        if self.replicas < 1 or self.routers < 1:
            raise ValueError("replicas and routers must be >= 1")
        if self.push_period_ms <= 0 or self.net_delay_ms < 0 or self.scrape_period_ms <= 0:
            raise ValueError("push_period_ms and scrape_period_ms must be > 0, net_delay_ms >= 0")
        if not self.engine_front_ms >= 0:
            raise ValueError(f"engine_front_ms must be >= 0, got {self.engine_front_ms}")
        if self.lease_mode not in ("reserve", "inline"):
            raise ValueError(f"lease_mode must be 'reserve' or 'inline', got {self.lease_mode!r}")
        if self.min_push_interval_ms is not None and self.min_push_interval_ms < 0:
            raise ValueError("min_push_interval_ms must be >= 0")
        if any(not 0 <= ri < self.replicas or t < 0 for t, ri in self.faults):
            raise ValueError("faults need a time >= 0 and a replica index in [0, replicas)")
        if self.queue_kind != "fair":
            raise ValueError(f"queue_kind must be 'fair' (the router's weighted fair queue), got {self.queue_kind!r}")
        a = self.autoscale
        if a is not None:
            if a.signal not in AUTOSCALE_SIGNALS or (a.signal == "pab" and POLICIES[self.policy][0] != "pab"):
                raise ValueError(f"autoscale needs a signal in {AUTOSCALE_SIGNALS}; signal pab needs a pab policy")
            if not 1 <= a.min_replicas <= a.initial_replicas <= self.replicas:
                raise ValueError("autoscale needs 1 <= min_replicas <= initial_replicas <= replicas")


@dataclass(slots=True)
class FleetStats:
    """Counters of one run.

    Attributes:
        grants: leases granted (or, without leases, PAB-routed arrivals).
        refusals: Reserve calls refused (inline mode: admissions refused on arrival).
        double_spends: admitted prefills beyond the replica's PAB at grant time (module docstring).
        double_spent_ms: sum of the excess, predicted prefill ms beyond pab_ms.
        snapshots_delivered: budget snapshots received, all routers together.
        pushes: budget snapshots computed, all agents together (periodic and on change).
        reserve_answers: Reserve answers received, all routers together.
        dispatch_passes: dispatcher wake-ups (chains of passes), all routers together.
        dispatch_stalled_ms: the longest stall the dispatchers' watchdog saw (router/admission_queue.py
            ``Dispatcher.stalled_ms``: queued requests that did not move while the head of a band
            could be placed; issue 25), all routers; 0 for a work-conserving dispatcher.
        placement_us: wall microseconds of each placement decision (views + place), sampled.
        preemptions: preemptions by recompute, all replicas.
        steps: engine steps, all replicas.
        end_ms: simulated time of the last event processed.
        late_steps: steps that ran longer than the time the policy planned for them (the model in
            force when the batch was formed, its margin included).
        time_model_mean_abs_error: mean over replicas of the online model's mean |measured /
            predicted - 1| over its last window at the end (NaN without the online model).
        gpu_ms: replica-ms of GPU time held (every replica allocated, starting or draining
            included), from 0 to the end of the arrivals plus the drain of the requests.
        replica_timeline: ``(ms, allocated replicas)`` at every change (autoscale runs).
        scale_outs, scale_ins: replicas added and removed by the autoscaler.
        prefix_cache_queries, prefix_cache_hits: prompt tokens looked up in the engines' prefix
            caches and found there, all replicas (``vllm:prefix_cache_queries`` / ``_hits``).
        replica_busy_ms: per replica, the sum of its step times (ms): its load.
        replica_requests: per replica, requests it was given.
        migrations: outcome -> count of the streams cut by a fault after their first token
            (router/migration.py ``decide_resume``: ``resume`` continued elsewhere, else the reason
            it was not); ``retries`` counts those cut before their first token (re-placed whole).
        migration_added_ms: per continuation placed, simulated ms from the failure seen at the
            router to the continuation's first token there (the stream's added gap).
    """

    grants: int = 0
    refusals: int = 0
    double_spends: int = 0
    double_spent_ms: float = 0.0
    snapshots_delivered: int = 0
    pushes: int = 0
    reserve_answers: int = 0
    dispatch_passes: int = 0
    dispatch_stalled_ms: float = 0.0
    placement_us: list[float] = field(default_factory=list)
    preemptions: int = 0
    steps: int = 0
    end_ms: float = 0.0
    late_steps: int = 0
    time_model_mean_abs_error: float = float("nan")
    gpu_ms: float = 0.0
    replica_timeline: list[tuple[float, int]] = field(default_factory=list)
    scale_outs: int = 0
    scale_ins: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    replica_busy_ms: list[float] = field(default_factory=list)
    replica_requests: list[int] = field(default_factory=list)
    migrations: dict[str, int] = field(default_factory=dict)
    migration_added_ms: list[float] = field(default_factory=list)


@dataclass(slots=True)
class FleetResult:
    """Result of :func:`run_fleet`: one record per request (input order) and the counters."""

    records: list[RequestRecord]
    stats: FleetStats
    wall_s: float


@dataclass(slots=True)
class _Snapshot:
    """Duck-typed ``BudgetSnapshot`` (proto) for :meth:`BudgetBook.update`."""

    seq: int
    coefficients: TimeModel
    classes: list[ClassBudget]
    ttl_ms: float
    healthy: bool = True
    max_prompt_tokens: int = 0
    status_detail: str = ""
    inflight_prefill_ms: tuple[float, ...] = ()
    inflight_prefill_done_ms: tuple[float, ...] = ()
    prefix_queries_tokens: int = 0
    prefix_hits_tokens: int = 0
    inline_admission: bool = True  # the simulated agents decide inline admissions on arrival
    num_running: int = 0  # the engine's metrics (the baselines' scrapes)
    num_waiting: int = 0
    kv_usage: float = 0.0


@dataclass(slots=True)
class _SimFuture:
    """The part of ``asyncio.Future`` the Dispatcher uses; results go to callbacks."""

    on_result: Callable[[Any], None]
    on_error: Callable[[BaseException], None]
    _done: bool = False

    def done(self) -> bool:
        return self._done

    def set_result(self, value: Any) -> None:
        self._done = True
        self.on_result(value)

    def set_exception(self, exc: BaseException) -> None:
        self._done = True
        self.on_error(exc)


def _unset(value: Any) -> None:
    raise AssertionError("a queue entry's callbacks are set when it is queued")


def _unset_future() -> _SimFuture:
    """The core's ``new_future``: callbacks are attached once the entry is known to be queued."""
    return _SimFuture(_unset, _unset)


def profile_params(cfg: FleetConfig, profile: str) -> dict[str, Any]:
    """The placement profile's parameters in this fleet: ``static-queue-cap`` its cap; ``dynamo-kv``
    the engines' block size and ``max_num_batched_tokens`` (Dynamo reads both from its workers);
    ``llm-d-sticky`` its tau from the fleet's time model, calibrated as llm-d's guide says (peak
    prefill throughput of a full ``max_num_batched_tokens`` step x the maximum TTFT penalty,
    router/placement/sticky.py); none for the others."""
    if profile == "static-queue-cap":
        return {"queue_cap_tokens": cfg.queue_cap_tokens}
    if profile == "dynamo-kv":
        return {"block_size": cfg.block_size, "max_num_batched_tokens": cfg.max_num_batched_tokens}
    if profile == "llm-d-sticky":
        penalty_ms = float(LLMD_STICKY_DEFAULTS["max_ttft_penalty_ms"])
        rate = peak_prefill_tokens_per_s(cfg.time_model, cfg.max_num_batched_tokens)
        return {"tau_tokens": int(rate * penalty_ms / 1000.0)}
    return {}


def sim_router_config(cfg: FleetConfig, seed: int) -> RouterConfig:
    """The router configuration a fleet's ``pab`` routers run (router/config.py), from ``cfg``: one
    class (``SLO_CLASS``: its TTFT, TPOT, sheddability and max queue time), the tenants of
    ``tenant_weights`` (``t0`` when none), the queue bounds, the admission settings (lease mode,
    start window of ``max_num_batched_tokens``-token steps, work shedding), the placement profile
    (``pab``, or the baseline of a direct policy, router/placement/baselines.py, with
    ``queue_cap_tokens`` for ``static-queue-cap``) and, for the prefix-aware policies, the prefix map
    (one key per ``prefix_block_tokens`` tokens, about one KV cache remembered per replica).
    Everything else is the router's default, as a user gets it:
    among them the contention cap (``admission.contention_max_inflight``, 32) and the dispatcher's
    holds (``queue.max_bypass``, 8)."""
    ws = cfg.work_shed
    profile = placement_name(cfg.policy)
    return RouterConfig.model_validate({
        "model": "fleet-sim",
        "slo_classes": {SLO_CLASS: {"ttft_ms": cfg.ttft_ms, "tpot_ms": cfg.tpot_ms, "sheddable": cfg.sheddable,
                                    "max_queue_ms": cfg.max_queue_ms}},
        "tenants": {t: {"weight": w, "slo_class": SLO_CLASS} for t, w in (cfg.tenant_weights or (("t0", 1.0),))},
        "replicas": [{"id": f"r{i}", "http_url": f"http://127.0.0.1:{i + 1}", "grpc_target": f"127.0.0.1:{i + 1}"}
                     for i in range(cfg.replicas)],
        "queue": {"max_requests": cfg.queue_max_requests, "max_tokens": cfg.queue_max_tokens,
                  "max_bypass": cfg.max_bypass},
        "admission": {
            "contention_max_inflight": cfg.contention_max_inflight,
            "contention_keep_running": cfg.contention_keep_running,
            "lease_mode": cfg.lease_mode if cfg.leases else "reserve", "bytes_per_token": 4.0,
            "start_window_steps": cfg.start_window_steps, "step_tokens": cfg.max_num_batched_tokens,
            "work_shed": {"enabled": True, "gain": ws.gain, "max_share": ws.max_share, "window": ws.window,
                          "horizon": ws.horizon, "min_samples": ws.min_samples}
            if ws is not None and cfg.sheddable else {},
        },
        "placement": {"seed": seed, "hooks": list(cfg.placement_hooks), "profile": profile,
                      "params": profile_params(cfg, profile),
                      **({"scorers": BEST_FIT_SCORERS[cfg.policy]} if cfg.policy in BEST_FIT_SCORERS else {}),
                      **({"filters": CUSTOM_FILTERS[cfg.policy]} if cfg.policy in CUSTOM_FILTERS else {}),
                      "prefix_cache": {
            "enabled": cfg.policy in PREFIX_POLICIES, "chunk_chars": 4 * cfg.prefix_block_tokens,
            "capacity_tokens": max(cfg.prefix_block_tokens, cfg.kv_capacity_tokens)}},
    })  # fmt: skip


class _SimReserve:
    """The core's :class:`~router.core.ReservePort` on the simulated agents (:meth:`FleetSim.reserve`).

    Counts each request's refused Reserves until its grant (they delay its arrival at the replica
    by a round trip each); a lease given back returns to its replica's table."""

    def __init__(self, sim: FleetSim, clock: _Clock) -> None:
        self.sim = sim
        self.clock = clock
        self.refusals: dict[str, int] = {}
        self._lease_replica: dict[str, int] = {}
        self._n = 0

    async def reserve(self, replica_id: str, slo_class: str, prompt_tokens: int, request_id: str,
                      max_tokens: int, waited_ms: float, on_time_only: bool = False) -> ReserveResult:
        sim = self.sim
        ri = sim.index_of[replica_id]
        granted, lease_id, after = sim.reserve(ri, prompt_tokens, self.clock.t, waited_ms, on_time_only)
        sim.stats.reserve_answers += 1
        if not granted:
            self.refusals[request_id] = self.refusals.get(request_id, 0) + 1
        elif not lease_id:  # no leases (forward on the view alone): a key of our own for the load count
            self._n += 1
            lease_id = f"nolease-{self._n}"
        else:
            self._lease_replica[lease_id] = ri
        return ReserveResult(granted, lease_id, "", after.pab_ms if after is not None else -1.0,
                             after.pab_tokens if after is not None else -1)  # fmt: skip

    def release(self, lease_id: str, reason: str) -> None:
        ri = self._lease_replica.pop(lease_id, None)
        if ri is not None:
            self.sim.replicas[ri].leases.release(lease_id)


@dataclass(slots=True)
class _Clock:
    """Router clock for BudgetBook / Dispatcher: simulated ms, no wall time."""

    t: float = 0.0

    def now_ms(self) -> float:
        return self.t

    def to_wall_s(self, sim_ms: float) -> float:
        return sim_ms / 1000.0


@dataclass(slots=True)
class _Replica:
    rid: str
    engine: SimEngine
    leases: LeaseTable
    calibrator: OnlineTimeModel | None = None
    stepping: bool = False
    result: StepResult | None = None
    step_view: StepView | None = None  # the engine as the agent sees it while a step runs (replica_state)
    seq: int = 0
    last_push_ms: float = float("-inf")
    change_push_at: float | None = None  # time of the pending change-triggered push, None when none
    allocated: bool = True  # holds a GPU (serving, starting or draining)
    ready_ms: float = 0.0  # serves from then on (autoscale: decision + startup)
    draining: bool = False  # removed: takes no new work, released when idle
    dead: bool = False  # killed (FleetConfig.faults): its events are void, its requests cut
    busy_ms: float = 0.0
    requests: int = 0
    prefix_window: PrefixHitWindow = field(default_factory=PrefixHitWindow)  # the agent's, fed at each push


@dataclass(slots=True)
class _ReqState:
    token_times: list[float] = field(default_factory=list)
    outcome: str = ""
    reason: str | None = None
    replica: int = -1
    router: int = 0
    lease_id: str = ""
    admit_tokens: int = 0  # inline: the prompt tokens the agent is asked to admit (uncached)
    attempts: RelayAttempts | None = None  # inline refusals so far (router/admission.py), from the first one
    grant: Grant | None = None  # pab routers: the core's grant, until the request ends
    resumed: int = 0  # tokens the current attempt's prompt carries back (a continuation's base)
    migrations: int = 0  # continuations placed
    exclude: frozenset[str] = frozenset()  # replicas that failed this request
    attempt_tokens: int = 0  # tokens of the current attempt (its first: the prefill done)
    resume_arrival_ms: float | None = None  # a continuation's arrival at the router (placed as arriving now)
    failed_at_ms: float | None = None  # when the router saw the failure (the added time's start)


def _drive(coro: Any) -> Any:
    """Run a coroutine that never suspends to completion and return its value."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    coro.close()
    raise RuntimeError("simulated coroutine suspended")


@dataclass(frozen=True, slots=True)
class StepView:
    """An engine's PAB inputs as of the start of the step in flight (:func:`replica_state`).

    Attributes:
        decodes, prefills: :func:`~replica_agent.policy.engine_state.pab_inputs` of the engine's
            queues just before the step was formed.
        request_ids: the requests the engine held then (one added later is a pending prefill).
        kv_free_tokens: free KV cache then (tokens): before the step allocated its blocks and freed those
            of the requests it finishes, as the plugin's record gives ``kv_free_blocks``. (The headline
            JSON files of docs/evaluation.md were measured with the free KV read after the step's
            allocation; keeping it here moved token attainment by at most 0.3 point at the points tried.)
    """

    decodes: tuple[DecodeState, ...]
    prefills: tuple[PendingPrefill, ...]
    request_ids: frozenset[str]
    kv_free_tokens: int


def step_view(engine: SimEngine, default_ttft_ms: float = 1000.0, default_tpot_ms: float = 100.0) -> StepView:
    """The engine's PAB inputs now, kept for the step about to start (:class:`StepView`)."""
    decodes, prefills = pab_inputs(engine.running, engine.waiting, default_ttft_ms, default_tpot_ms)
    ids = frozenset(r.request_id for group in (engine.running, engine.waiting) for r in group)
    return StepView(tuple(decodes), tuple(prefills), ids, engine.kv.free_blocks * engine.config.block_size)


def replica_state(engine: SimEngine, leases: LeaseTable, now_ms: float, margin_frac: float,
                  extra_prefill_tokens: int = 0, default_ttft_ms: float = 1000.0,
                  default_tpot_ms: float = 100.0, view: StepView | None = None,
                  margin_cap_tpots: float = 1.0) -> ReplicaState:  # fmt: skip
    """PAB inputs in plugin mode: the engine's exact requests by the plugin export's rule
    (replica_agent/policy/engine_state.py) plus active leases (module docstring).

    While a step runs (``view``, taken when it was formed) the requests are as of its start, as the
    plugin's state record gives them (replica_agent/plugin_mode.py: "the tokens that step computes are
    still counted as to do"); a request added since is a pending prefill of what it has left. The
    simulated engine applies a step's tokens when the step starts, so without the view the agent would
    see a prefill that is still running as done and offer its time again: on the Splitwise-fitted 70B
    engine, whose long prompts run in steps of up to 0.9 s, that made PAB admit prompts behind such a
    step (docs/evaluation.md, "The agents' view of the step in flight").

    ``extra_prefill_tokens`` adds one more pending prompt (a lease being granted) when > 0; the
    defaults are the targets of requests that carry none (the fleet's requests all carry theirs).
    """
    if view is None:
        decodes, prefills = pab_inputs(engine.running, engine.waiting, default_ttft_ms, default_tpot_ms)
        kv_free = engine.kv.free_blocks * engine.config.block_size
    else:  # a request added since the step began is a pending prefill (pab_inputs' rule for a waiting one)
        added = [r for group in (engine.running, engine.waiting) for r in group if r.request_id not in view.request_ids]
        decodes = list(view.decodes)
        prefills = [*view.prefills, *pab_inputs((), added, default_ttft_ms, default_tpot_ms)[1]]
        kv_free = view.kv_free_tokens
    for lease in leases.active():
        prefills.append(PendingPrefill(lease.prompt_tokens))
    if extra_prefill_tokens > 0:
        prefills.append(PendingPrefill(extra_prefill_tokens))
    return ReplicaState(now_ms, decodes, prefills, kv_free, engine.policy_time_model, margin_frac,
                        engine.config.max_num_seqs, margin_cap_tpots=margin_cap_tpots)  # fmt: skip


class _Router:
    """One router copy: the shipped router's core (router/core.py) on simulated ports, for every
    policy (``pab``: budgets, queue, dispatcher; baselines: the direct path and its load view)."""

    def __init__(self, sim: FleetSim, index: int) -> None:
        self.sim = sim
        self.index = index
        cfg = sim.cfg
        self.clock = _Clock()
        self.kind = POLICIES[cfg.policy][0]
        self.ids = [r.rid for r in sim.replicas]
        seed = cfg.seed * 1000 + index
        self.pass_at: float | None = None  # time of the pending dispatcher pass, None when none
        self.pass_token = 0  # a _DISPATCH event with an older token was superseded by an earlier pass
        self.last_pass_ms = float("-inf")
        self.reserve_port = _SimReserve(sim, self.clock)
        self.core = RouterCore(sim_router_config(cfg, seed), self.clock, self.reserve_port,  # type: ignore[arg-type]
                               _unset_future, seed, replica_ids=self.ids, observe_placement=sim.sample_decision)
        self.book = self.core.book
        self.queue: Any = self.core.queue
        self.dispatcher = self.core.dispatcher
        self.policy = self.core.policy
        # the router's prefix map (prefix-aware policies only), about one replica's KV cache per replica;
        # pab routers discount it by the engines' measured hits (router/prefix_correction.py), baselines do not
        self.prefix: PrefixIndex | None = self.core.prefix
        self.prefix_correction: PrefixCorrection | None = self.core.prefix_correction
        self.work_shed: WorkShed | None = self.core.work_shed
        if self.kind != "pab":  # healthy replicas that never go stale: the baselines' views (module docstring)
            for rid in self.ids:
                self.book.update(rid, sim.metrics_snapshot(rid))

    # ------------------------------------------------------------ pab path

    def core_request(self, idx: int) -> CoreRequest:
        """Request ``idx`` as the core sees it (its output length is its ``max_tokens``); a
        continuation as router/server.py ``_migrate`` builds it: prompt + the tokens it carries back,
        the output bound less them (router/migration.py ``continuation_sizes``), arriving now."""
        req = self.sim.requests[idx]
        st = self.sim.states[idx]
        keys = self.sim.router_keys(idx) if self.prefix is not None else ()
        prompt, max_tokens = continuation_sizes(req.prompt_tokens, req.output_tokens, st.resumed)
        arrival = req.arrival_ms if st.resume_arrival_ms is None else st.resume_arrival_ms
        return CoreRequest(str(idx), req.tenant, SLO_CLASS, prompt, max_tokens, arrival, keys)

    def _schedule_pass(self, at: float) -> None:
        """Make sure a dispatcher pass happens at ``at`` or earlier (an earlier one supersedes a later)."""
        if self.pass_at is not None and self.pass_at <= at:
            return
        self.pass_at = at
        self.pass_token += 1
        self.sim.push_event(at, _DISPATCH, self.index, self.pass_token)

    def wake(self) -> None:
        """Ask for a dispatcher pass (coalesced to one per ``dispatch_gap_ms``).

        Also when a pass is already scheduled for a later queue deadline: the view changed, so the
        queue is retried now (as the router's dispatcher loop wakes on every budget change), not
        only when its earliest entry expires.
        """
        if self.core.held_queue is not None:  # a router queue: a pass at the earliest TTL (book changes wake it too)
            nd = self.core.held_next_deadline_ms()
            if nd is not None:
                self._schedule_pass(max(nd, self.clock.t))
            return
        if self.kind != "pab" or len(self.queue) == 0:
            return
        self._schedule_pass(max(self.clock.t, self.last_pass_ms + self.sim.cfg.dispatch_gap_ms))

    def dispatch(self, token: int) -> None:
        if token != self.pass_token:  # superseded by an earlier pass
            return
        self.pass_at = None
        self.last_pass_ms = self.clock.t
        self.sim.stats.dispatch_passes += 1
        if self.core.held_queue is not None:  # a router queue: expire and dispatch (router/core.py)
            self.core.dispatch_held()
            self.wake()
            return
        stats = _drive(self.dispatcher.dispatch_chain())
        self.sim.stats.dispatch_stalled_ms = max(self.sim.stats.dispatch_stalled_ms,
                                                 self.dispatcher.stalled_ms(self.clock.t))
        if len(self.queue):
            gap = self.sim.cfg.dispatch_gap_ms
            nd = self.queue.next_deadline_ms()
            if nd is not None:  # wake at the next expiry at the latest
                self._schedule_pass(max(nd, self.clock.t + gap))
            if stats.shed_kept:  # as the router's dispatcher loop: ask the kept sheddable ones again soon
                self._schedule_pass(self.clock.t + max(gap, self.dispatcher.shed_recheck_ms))

    def arrive(self, idx: int, avoid: frozenset[str] = frozenset()) -> None:
        """A client request reaches this router (or comes back refused: ``avoid`` = the replica that
        refused it, left out of the immediate placement only)."""
        sim = self.sim
        st = sim.states[idx]
        st.router = self.index
        now = self.clock.t
        core = self.core
        creq = self.core_request(idx)
        predictor = core.latency_predictor  # llm-d-predicted-latency: its training loop, at simulated times
        if predictor is not None and predictor.refit_due(now):
            predictor.fit(now)
        # work-aware admission under contention (router/work_shed.py), once per new request (never a baseline's)
        if not avoid and st.attempts is None and not st.exclude and core.refuse_by_work(creq, self.book.views(now)):
            sim.reject(idx, WORK_SHED_REASON)
            return
        core.track_prefix(creq)
        # a baseline router does not pick a replica with no pod, starting or draining (autoscale); pab routers
        # see such a replica's agent report unhealthy
        exclude = sim.not_serving(now) if self.kind != "pab" else frozenset()
        got = _drive(core.acquire(creq, exclude | st.exclude, avoid))  # router/core.py: placed, queued or refused
        if isinstance(got, Placed):
            self._granted(idx, got.grant)
        elif isinstance(got, Queued):
            fut = got.entry.future
            fut.on_result = lambda g, i=idx: self._granted(i, g)
            fut.on_error = lambda e, i=idx: self._rejected(i, getattr(e, "reason", "queue-timeout"))
            self.wake()
        else:  # a direct placement that found no replica is named by the filter that left none
            self._rejected(idx, got.detail if got.reason == "no-replica" and got.detail else got.reason)

    def refused(self, idx: int, ri: int, after: ClassBudget | None) -> None:
        """An inline admission came back refused (router/server.py ``_serve_placed``): the core's
        rule after the attempt (router/core.py ``after_attempt``: the budget the agent reported
        applied, the charge refunded), then the request is re-placed away from the replicas that
        refused it, or given up at ``MAX_ADMIT_REFUSALS``."""
        sim = self.sim
        st = sim.states[idx]
        if st.attempts is None:
            st.attempts = self.core.attempts(1)
        st.attempts.next_try()  # the attempt that just came back (a refusal gives it back)
        grant, st.grant = st.grant, None
        assert grant is not None, "a refused admission had a grant"
        action = self.core.after_attempt(st.attempts, self.core_request(idx), grant, "lease_refused",
                                         after.pab_ms if after is not None else -1.0,
                                         after.pab_tokens if after is not None else -1)  # fmt: skip
        if action.next == "give_up":
            self._rejected(idx, "no-budget")
            return
        self.arrive(idx, st.attempts.refused_on)

    def _granted(self, idx: int, grant: Grant) -> None:
        """The core granted request ``idx`` (at once or from the queue): charge it (a continuation is
        not: the tenant pays once, as router/server.py ``_migrate``), forward it."""
        if self.sim.states[idx].migrations == 0:
            self.core.charge_dispatch(self.core_request(idx))
        self.sim.states[idx].grant = grant
        self.sim.forward_granted(idx, grant, self.clock.t, self.reserve_port.refusals.pop(str(idx), 0))

    def _rejected(self, idx: int, reason: str) -> None:
        self.core.forget_prefix(str(idx))
        self.sim.reject(idx, reason)

    def ended(self, idx: int) -> None:
        """Request ``idx`` finished on its replica: its lease settles (the contention cap's count)."""
        st = self.sim.states[idx]
        if self.core.latency_predictor is not None:  # the training signal: TTFT and TPOT as this router saw them
            times = st.token_times
            ttft = times[0] - self.sim.requests[idx].arrival_ms if times else None
            tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) >= 2 else None
            self.core.latency_observed(str(idx), ttft, tpot)
        if st.grant is not None:
            self.core.lease_done(st.grant)
            st.grant = None
        self.core.forget_prefix(str(idx))

    def failed(self, idx: int, ri: int) -> None:
        """Request ``idx``'s replica ``ri`` died under it (the connection lost, seen now): the core's
        rule after the attempt (its lease settled or released), then as router/server.py: nothing
        reached the client yet -> re-placed whole, the replica excluded (a retry); else
        router/migration.py ``decide_resume`` -> a continuation placed as a request arriving now with
        prompt + the tokens sent (``continuation_sizes``), the failed replicas excluded, or the
        stream ends failed (``migration-<reason>``)."""
        sim = self.sim
        st = sim.states[idx]
        if st.outcome:
            return
        req = sim.requests[idx]
        sent = len(st.token_times)
        grant, st.grant = st.grant, None
        if grant is not None:
            tries = self.core.attempts(1)
            tries.next_try()
            self.core.after_attempt(tries, self.core_request(idx), grant,
                                    "upstream_error" if st.attempt_tokens else "retryable")  # fmt: skip
        rid = sim.replicas[ri].rid
        st.exclude = st.exclude | {rid}
        counts = sim.stats.migrations
        if sent == 0:
            counts["retries"] = counts.get("retries", 0) + 1
            self.arrive(idx, frozenset({rid}))
            return
        decision = decide_resume(sent, max(0, req.output_tokens - sent), False, st.migrations,
                                 sim.cfg.max_migrations, True, req.prompt_tokens, sim.cfg.max_model_len)  # fmt: skip
        counts[decision.reason] = counts.get(decision.reason, 0) + 1
        if not decision.go:
            self.core.forget_prefix(str(idx))
            st.outcome, st.reason = FAILED, f"migration-{decision.reason}"
            return
        st.migrations += 1
        st.resumed = sent
        st.resume_arrival_ms = st.failed_at_ms = self.clock.t
        self.arrive(idx, frozenset({rid}))

    def redirect(self, idx: int) -> Grant | None:
        """Request ``idx``'s replica refused it (static-queue-cap): the core's next candidate (router/core.py
        ``RouterCore.redirect``), or None when none is left."""
        st = self.sim.states[idx]
        assert st.grant is not None, "a refused request had a grant"
        st.grant = self.core.redirect(st.grant, self.core_request(idx))
        return st.grant


class FleetSim:
    """The event loop (see the module docstring). Use :func:`run_fleet`."""

    def __init__(self, cfg: FleetConfig, requests: Sequence[FleetRequest]) -> None:
        self.cfg = cfg
        self.requests = requests
        self.states = [_ReqState() for _ in requests]
        self.rng = random.Random(cfg.seed)
        self.stats = FleetStats()
        self.slo = SloClass(SLO_CLASS, cfg.ttft_ms, cfg.tpot_ms)
        self.pab_agents = POLICIES[cfg.policy][0] == "pab"  # only PAB agents read the step view (replica_state)
        batching = POLICIES[cfg.policy][1]
        kinds = cfg.replica_kinds or (ReplicaKind("", cfg.replicas, cfg.time_model, cfg.kv_capacity_tokens,
                                                  cfg.engine_time, cfg.max_num_batched_tokens, cfg.max_num_seqs),)  # fmt: skip
        pcfg = PolicyConfig(cfg.ttft_ms, cfg.tpot_ms, decode_guard_ms=cfg.decode_guard_ms)
        self.replicas = []
        for kind in kinds:
            ecfg = EngineConfig(kind.time_model, kind.kv_capacity_tokens // cfg.block_size, cfg.block_size,
                                kind.max_num_batched_tokens, kind.max_num_seqs, cfg.max_model_len, kind.engine_time,
                                cfg.prefix_caching)  # fmt: skip
            for _ in range(kind.count):
                i = len(self.replicas)
                self.replicas.append(_Replica(
                    f"r{i}", SimEngine(ecfg, make_policy(batching, pcfg), noise_stream=i), LeaseTable(1 << 20, f"r{i}"),
                    OnlineTimeModel(kind.time_model, cfg.calibration) if cfg.online_time_model else None))  # fmt: skip
        self.index_of = {r.rid: i for i, r in enumerate(self.replicas)}
        self._metrics_seq = 0  # seq of the baselines' metric snapshots
        self.routers = [_Router(self, i) for i in range(cfg.routers)]
        self._heap: list[tuple[float, int, int, int, Any]] = []
        self._seq = 0
        self._decision_every = 1
        self._gpu_t = 0.0
        self._refused = 0  # capacity refusals since the last autoscaler evaluation
        a = cfg.autoscale
        self.stabilizer = None if a is None else Stabilizer(a.stabilization_ms, a.min_replicas, cfg.replicas)
        if a is not None:
            for rep in self.replicas[a.initial_replicas:]:
                rep.allocated = False
        self.stats.replica_timeline.append((0.0, self._allocated()))
        self._router_keys: dict[int, list[int]] = {}

    def router_keys(self, idx: int) -> list[int]:
        """Request ``idx``'s prefix-map keys: its ``prefix_ids`` chained (key i = prompt up to block i)."""
        keys = self._router_keys.get(idx)
        if keys is None:
            keys = self._router_keys[idx] = chain_hashes(self.requests[idx].prefix_ids)
        return keys

    def engine_hashes(self, idx: int) -> list[int]:
        """Request ``idx``'s prompt block hashes as the engine computes them (loadgen/sim/prefix_cache.py)."""
        req = self.requests[idx]
        if not (self.cfg.prefix_caching and req.prefix_ids):
            return []
        return block_hashes_from_ids(req.prefix_ids, self.cfg.prefix_block_tokens, self.cfg.block_size,
                                     req.prompt_tokens)  # fmt: skip

    # ------------------------------------------------------------ events

    def push_event(self, t: float, kind: int, a: int, b: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, a, b))

    def sample_decision(self, seconds: float) -> None:
        """Keep placement decision times (us), at most ~20k samples."""
        s = self.stats.placement_us
        if len(s) < 20_000:
            s.append(seconds * 1e6)

    # ------------------------------------------------------------ agent side

    def reserve(
        self, ri: int, prompt_tokens: int, now_ms: float, waited_ms: float = 0.0, on_time_only: bool = False
    ) -> tuple[bool, str, ClassBudget | None]:
        """The agent's Reserve (plugin mode): grant a lease when the prompt fits PAB now, over the
        class horizon minus ``waited_ms`` (``pab.admits``, as ``Agent.reserve``). The budget
        returned (for the router's view) is the fresh-arrival one, full horizon."""
        rep = self.replicas[ri]
        cfg = self.cfg
        if not self.cfg.leases:  # forward on the router's view alone; checked at arrival
            self.stats.grants += 1
            return True, "", None
        state = replica_state(rep.engine, rep.leases, now_ms, cfg.margin_frac, view=rep.step_view,
                              margin_cap_tpots=cfg.margin_cap_tpots)
        reason, fit_budget = reserve_decision(prompt_tokens, state, self.slo, waited_ms, True, cfg.max_model_len,
                                              on_time_only)  # fmt: skip
        # the answer carries the fresh-arrival budget: the fit's own when the request has not waited
        before = fit_budget if not waited_ms and fit_budget is not None else class_budget(state, self.slo)
        if reason:
            self.stats.refusals += 1
            return False, "", before
        self.stats.grants += 1
        lease_id = rep.leases.grant(prompt_tokens, SLO_CLASS, None, now_ms, cfg.lease_ttl_ms)
        self.changed(ri, now_ms)
        after = class_budget(replace(state, prefills=[*state.prefills, PendingPrefill(prompt_tokens)]), self.slo)
        return True, lease_id, after

    def forward_granted(self, idx: int, grant: Grant, now_ms: float, refusals: int = 0) -> None:
        """Send a granted request to its replica: one hop after a direct grant (a baseline's) or an
        inline admission, else after the Reserve round trips (``refusals`` refused ones first) and
        the hop."""
        d = self.cfg.net_delay_ms + self.cfg.engine_front_ms  # the last hop ends in the engine core
        st = self.states[idx]
        st.lease_id = grant.lease_id
        ri = self.index_of[grant.replica_id]
        if grant.direct:  # a baseline's placement: forwarded at once, no lease
            self.push_event(now_ms + d, _FORWARD, idx, (ri,))
            return
        if grant.inline:
            st.admit_tokens = grant.prompt_tokens
            self.push_event(now_ms + d, _FORWARD, idx, (ri,))
            return
        n = self.cfg.net_delay_ms
        self.push_event(now_ms + 2 * n + 2 * n * refusals + d, _FORWARD, idx, (ri,))

    def changed(self, ri: int, t: float) -> None:
        """Replica ``ri``'s state changed: push a snapshot now, or at the end of the coalescing
        interval when one went out less than ``min_push_interval_ms`` ago (None: periodic only)."""
        gap = self.cfg.min_push_interval_ms
        rep = self.replicas[ri]
        if gap is None or rep.change_push_at is not None:
            return
        rep.change_push_at = max(t, rep.last_push_ms + gap)
        self.push_event(rep.change_push_at, _CHANGE_PUSH, ri, 0)

    def _admission_check(self, rep: _Replica, prompt_tokens: int, now_ms: float, waited_ms: float) -> None:
        """Without leases: count a prefill that arrives beyond the replica's exact PAB (over the
        class horizon minus ``waited_ms``, its age at the replica: ``pab.admits``)."""
        fit, b = admits(prompt_tokens, replica_state(rep.engine, rep.leases, now_ms, self.cfg.margin_frac,
                                                           view=rep.step_view, margin_cap_tpots=self.cfg.margin_cap_tpots),
                        self.slo, waited_ms)  # fmt: skip
        tm = rep.engine.policy_time_model
        if not fit:
            self.stats.double_spends += 1
            self.stats.double_spent_ms += max(0.0, tm.prefill_ms(prompt_tokens) - b.pab_ms)

    def _queued_tokens(self, engine: SimEngine) -> int:
        return sum(r.remaining_tokens for r in engine.waiting) + sum(
            r.remaining_tokens for r in engine.running if r.tokens_out == 0
        )

    def _on_forward(self, t: float, idx: int, cands: tuple[int, ...]) -> None:
        req = self.requests[idx]
        st = self.states[idx]
        ri = cands[0]
        rep = self.replicas[ri]
        if rep.dead:  # connection refused: the router knows one hop later
            self.push_event(t + self.cfg.net_delay_ms, _FAILED, idx, ri)
            return
        kind = POLICIES[self.cfg.policy][0]
        router = self.routers[st.router]
        if kind == "queue-cap" and over_queue_cap(self._queued_tokens(rep.engine), req.prompt_tokens,
                                                  self.cfg.queue_cap_tokens, rep.engine.has_work()):  # the agent's rule
            nxt = router.redirect(idx)  # the placement's next candidate (router/core.py), at most 3 in all
            if nxt is not None:  # 429 back to the router (d), next candidate (d)
                self.push_event(t + 2 * self.cfg.net_delay_ms + self.cfg.engine_front_ms, _FORWARD, idx,
                                (self.index_of[nxt.replica_id],))
            else:
                router._rejected(idx, "queue-cap")
            return
        if kind == "pab":
            if self.cfg.leases and self.cfg.lease_mode == "inline":  # the agent's Reserve decision, on arrival
                waited = max(0.0, t - req.arrival_ms)
                # independent check of what is admitted: the exact fit on the state before the decision
                on_time = st.grant is not None and st.grant.on_time_only  # x-fairbatch-on-time
                fit = admits(st.admit_tokens, replica_state(rep.engine, rep.leases, t, self.cfg.margin_frac,
                                                                 view=rep.step_view,
                                                                 margin_cap_tpots=self.cfg.margin_cap_tpots),
                             self.slo, waited, on_time)[0]  # fmt: skip
                granted, lease_id, after = self.reserve(ri, st.admit_tokens, t, waited, on_time)
                if granted and not fit:
                    self.stats.double_spends += 1
                if not granted:
                    self.push_event(t + self.cfg.net_delay_ms, _REFUSED, idx, (ri, after))
                    return
                rep.leases.consume(lease_id)
            elif self.cfg.leases:
                rep.leases.consume(st.lease_id)
            else:
                self._admission_check(rep, req.prompt_tokens, t, max(0.0, t - req.arrival_ms))
        rep.seq += 1
        rep.requests += 1
        prompt, output = continuation_sizes(req.prompt_tokens, req.output_tokens, st.resumed)
        arrival = req.arrival_ms if st.resume_arrival_ms is None else st.resume_arrival_ms
        st.attempt_tokens = 0
        rep.engine.add_request(str(idx), prompt, output, arrival, self.cfg.ttft_ms, self.cfg.tpot_ms,
                               self.engine_hashes(idx))  # fmt: skip
        st.replica = ri
        self.changed(ri, t)
        self._start_step(ri, t)

    def _start_step(self, ri: int, t: float) -> None:
        rep = self.replicas[ri]
        if rep.stepping:
            return
        eng = rep.engine
        while eng.has_work():
            view = step_view(eng, self.cfg.ttft_ms, self.cfg.tpot_ms) if self.pab_agents else None
            result = eng.step(t)
            if result.duration_ms > 0:
                rep.stepping = True
                rep.step_view = view
                rep.result = result
                rep.busy_ms += result.duration_ms
                self.stats.steps += 1
                self.push_event(result.end_ms, _STEP_END, ri, 0)
                return
            if not result.preempted:
                return

    def _on_step_end(self, t: float, ri: int) -> None:
        rep = self.replicas[ri]
        if rep.dead:  # killed mid-step: nothing of it comes out
            return
        result = rep.result
        assert result is not None
        rep.stepping = False
        rep.result = None
        rep.step_view = None
        if result.features is not None and result.duration_ms > rep.engine.policy_time_model.step_ms(result.features):
            self.stats.late_steps += 1
        cal = rep.calibrator
        if cal is not None and result.features is not None:  # the agent and the plugin learn every step
            cal.observe(result.features, result.duration_ms)
            rep.engine.policy_time_model = cal.conservative()
        d = self.cfg.net_delay_ms
        for out in result.outputs:
            idx = int(out.request_id)
            st = self.states[idx]
            st.token_times.append(t + d)
            st.attempt_tokens += 1
            first = st.attempt_tokens == 1  # this attempt's first token (a continuation's too)
            if out.finished or first:  # a decode joins or leaves: the budget changed
                self.changed(ri, t)
            router = self.routers[st.router]
            if router.core.has_held():  # a request held at the router (dynamo-kv) may start now, at this time
                router.clock.t = t
            if first:  # the attempt's first token reaches its router: its prefill is done
                if st.grant is not None:
                    router.core.prefill_done(st.grant)
                if st.failed_at_ms is not None:
                    self.stats.migration_added_ms.append(t + d - st.failed_at_ms)
                    st.failed_at_ms = None
            if len(st.token_times) == 1:
                router.core.latency_first_token(str(idx))
            if out.finished:
                st.outcome = OK
                self.routers[st.router].ended(idx)
        self._start_step(ri, t)

    def _on_push(self, t: float, ri: int, periodic: bool = True) -> None:
        rep = self.replicas[ri]
        cfg = self.cfg
        if not periodic:
            rep.change_push_at = None
        if rep.dead:  # no agent any more: no pushes
            return
        if not rep.allocated or t < rep.ready_ms:  # no pod, or still loading its model: no agent yet
            if periodic:
                self.push_event(t + cfg.push_period_ms, _PUSH, ri, 0)
            return
        rep.last_push_ms = t
        self.stats.pushes += 1
        rep.leases.expire(t)
        if rep.draining and not rep.engine.has_work() and len(rep.leases) == 0:
            self._set_allocated(rep, False, t)  # drained: the pod goes, its GPU is free
        state = replica_state(rep.engine, rep.leases, t, cfg.margin_frac, view=rep.step_view,
                              margin_cap_tpots=cfg.margin_cap_tpots)
        b = class_budget(state, self.slo)
        rep.seq += 1
        # the engine's prefix-cache counters over the agent's window (its scrape, here at each push)
        rep.prefix_window.add(t, rep.engine.prefix_cache_queries, rep.engine.prefix_cache_hits)
        snap = _Snapshot(rep.seq, rep.engine.policy_time_model.linearized(), [b], cfg.budget_ttl_ms,
                         rep.allocated and not rep.draining, cfg.max_model_len, "",
                         *inflight_schedule(state, rep.engine.config.max_num_batched_tokens), *rep.prefix_window.delta())  # fmt: skip
        for r in self.routers:
            self.push_event(t + cfg.net_delay_ms, _DELIVER, r.index, (ri, snap))
        if periodic:
            self.push_event(t + cfg.push_period_ms, _PUSH, ri, 0)

    def metrics_snapshot(self, rid: str) -> _Snapshot:
        """A baseline router's snapshot of replica ``rid`` (module docstring): healthy, never stale, the
        fleet's time model and max length, and the engine's running and waiting requests and KV
        usage now."""
        self._metrics_seq += 1
        eng = self.replicas[self.index_of[rid]].engine
        return _Snapshot(self._metrics_seq, eng.config.time_model, [], float("inf"), True, self.cfg.max_model_len,
                         num_running=eng.num_running, num_waiting=eng.num_waiting, kv_usage=eng.kv_usage)

    def _on_scrape(self, t: float, ri: int) -> None:
        if self.replicas[ri].dead:
            return
        rid = self.replicas[ri].rid
        snap = self.metrics_snapshot(rid)
        for r in self.routers:  # the scrape reaches every router at once (the baselines' scrape period)
            r.clock.t = t
            r.book.update(rid, snap)
        self.push_event(t + self.cfg.scrape_period_ms, _SCRAPE, ri, 0)

    # ------------------------------------------------------------ autoscaling

    def not_serving(self, t: float) -> frozenset[str]:
        """Replicas a direct router must not pick at ``t`` (killed; autoscale: no pod, starting, draining)."""
        if self.cfg.autoscale is None:
            return frozenset(r.rid for r in self.replicas if r.dead) if self.cfg.faults else frozenset()
        return frozenset(r.rid for r in self.replicas if r.dead or not r.allocated or r.draining or t < r.ready_ms)

    def _allocated(self) -> int:
        return sum(1 for r in self.replicas if r.allocated)

    def _account_gpu(self, t: float) -> None:
        self.stats.gpu_ms += self._allocated() * max(0.0, t - self._gpu_t)
        self._gpu_t = max(self._gpu_t, t)

    def _set_allocated(self, rep: _Replica, allocated: bool, t: float) -> None:
        self._account_gpu(t)
        rep.allocated = allocated
        if not allocated:
            rep.draining = False
        self.stats.replica_timeline.append((t, self._allocated()))

    def fleet_signal(self, t: float) -> FleetSignal:
        """The signals the autoscaler reads at ``t`` (router/autoscale.py ``FleetSignal``): the first
        router's view of usable PAB (as its /metrics exports it), the router queues, the engines'
        waiting requests."""
        router = self.routers[0]
        router.clock.t = t
        spare = 0.0
        for v in router.book.views(t) if router.kind == "pab" else ():
            cb = v.classes.get(SLO_CLASS)
            if v.healthy and v.fresh and cb is not None:
                spare += max(0.0, cb.pab_ms)
        ready = sum(1 for r in self.replicas if r.allocated and not r.draining and t >= r.ready_ms)
        return FleetSignal(ready, spare, sum(len(r.queue) for r in self.routers if r.kind == "pab"),
                           sum(r.engine.num_waiting for r in self.replicas if r.allocated), self._refused)  # fmt: skip

    def _on_scale(self, t: float) -> None:
        a = self.cfg.autoscale
        assert a is not None and self.stabilizer is not None
        for rep in self.replicas:  # drained ones go (pab replicas also check at each push)
            if rep.draining and not rep.engine.has_work() and len(rep.leases) == 0:
                self._set_allocated(rep, False, t)
        sig = self.fleet_signal(t)
        if a.signal == "pab":
            raw = pab_desired(sig, planning_horizon_ms(self.slo, self.cfg.margin_frac, self.cfg.margin_cap_tpots))
        else:
            raw = waiting_desired(sig, a.waiting_target)
        target = self.stabilizer.recommend(t, raw)
        self._refused = 0
        live = [r for r in self.replicas if r.allocated and not r.draining]
        if target > len(live):
            for _ in range(target - len(live)):
                back = next((r for r in self.replicas if r.draining), None)
                if back is not None:  # still loaded: serves again at once
                    back.draining = False
                else:
                    spare = next(r for r in self.replicas if not r.allocated)
                    spare.ready_ms = t + a.startup_ms
                    self._set_allocated(spare, True, t)
                self.stats.scale_outs += 1
        elif target < len(live):
            # cancel starting pods first (newest first), then drain the newest serving ones
            order = sorted(live, key=lambda r: (r.ready_ms <= t, -self.index_of[r.rid]))
            for rep in order[: len(live) - target]:
                if rep.ready_ms > t:
                    self._set_allocated(rep, False, t)
                else:
                    rep.draining = True
                self.stats.scale_ins += 1
        self.push_event(t + a.eval_period_ms, _SCALE, 0, 0)

    def kill(self, t: float, ri: int) -> None:
        """Replica ``ri`` dies now (kill -9 of its engine and agent): whatever it was computing is
        lost; every router sees its budget stream and each of its requests' connections break one
        hop later (:meth:`_Router.failed`)."""
        rep = self.replicas[ri]
        if rep.dead:
            return
        rep.dead = True
        self._set_allocated(rep, False, t)
        d = self.cfg.net_delay_ms
        for r in self.routers:
            self.push_event(t + d, _WATCH_DOWN, r.index, ri)
        for rid in sorted(rep.engine.requests, key=int):
            self.push_event(t + d, _FAILED, int(rid), ri)

    def reject(self, idx: int, reason: str) -> None:
        if reason in ("slo-infeasible", "queue-full", "queue-timeout"):
            self._refused += 1
        st = self.states[idx]
        if st.migrations:  # a continuation no replica took: the stream ends with the error event (router/server.py)
            self.stats.migrations["no_replica"] = self.stats.migrations.get("no_replica", 0) + 1
            st.outcome, st.reason = FAILED, "migration-no-replica"
            return
        st.outcome = REJECTED
        st.reason = reason
        gate = self.routers[st.router].work_shed
        if gate is not None and reason in BUDGET_REASONS:
            gate.budget_refused()

    # ------------------------------------------------------------ loop

    def run(self) -> FleetResult:
        cfg = self.cfg
        t_wall = time.perf_counter()
        kind = POLICIES[cfg.policy][0]
        for idx, req in enumerate(self.requests):
            self.push_event(req.arrival_ms, _ARRIVE, idx, self.rng.randrange(cfg.routers))
        last_arrival = max((r.arrival_ms for r in self.requests), default=0.0)
        stop_ms = last_arrival + cfg.drain_ms
        if cfg.autoscale is not None:
            self.push_event(cfg.autoscale.eval_period_ms, _SCALE, 0, 0)
        for at_ms, ri in cfg.faults:
            self.push_event(at_ms, _KILL, ri, 0)
        for ri in range(cfg.replicas):
            if kind == "pab":
                self.push_event(self.rng.uniform(0.0, cfg.push_period_ms), _PUSH, ri, 0)
            elif placement_name(cfg.policy) in SCRAPED_POLICIES:
                self.push_event(self.rng.uniform(0.0, cfg.scrape_period_ms), _SCRAPE, ri, 0)
        pending = len(self.requests)
        heap = self._heap
        t = 0.0
        while heap:
            t, _, ev, a, b = heapq.heappop(heap)
            if t > stop_ms:
                break
            if ev == _STEP_END:
                self._on_step_end(t, a)
            elif ev == _ARRIVE:
                pending -= 1
                router = self.routers[b]
                router.clock.t = t
                router.arrive(a)
            elif ev == _FORWARD:
                self._on_forward(t, a, b)
            elif ev == _DELIVER:
                router = self.routers[a]
                router.clock.t = t
                ri, snap = b
                router.book.update(self.replicas[ri].rid, snap)
                self.stats.snapshots_delivered += 1
                router.wake()
            elif ev == _DISPATCH:
                router = self.routers[a]
                router.clock.t = t
                router.dispatch(b)
            elif ev == _REFUSED:
                router = self.routers[self.states[a].router]
                router.clock.t = t
                router.refused(a, *b)
            elif ev == _CHANGE_PUSH:
                self._on_push(t, a, periodic=False)
            elif ev == _KILL:
                self.kill(t, a)
            elif ev == _FAILED:
                router = self.routers[self.states[a].router]
                router.clock.t = t
                router.failed(a, b)
            elif ev == _WATCH_DOWN:
                router = self.routers[a]
                router.clock.t = t
                router.book.mark_disconnected(self.replicas[b].rid)
            elif ev in (_PUSH, _SCRAPE, _SCALE):
                if pending == 0 and not any(r.engine.has_work() for r in self.replicas if not r.dead) and not any(
                    (kind == "pab" and len(r.queue)) or r.core.has_held()
                    for r in self.routers
                ):
                    continue  # everything drained: let the periodic events die out
                if ev == _SCALE:
                    self._on_scale(t)
                else:
                    (self._on_push if ev == _PUSH else self._on_scrape)(t, a)
        self.stats.end_ms = t
        self._account_gpu(t)
        self.stats.preemptions = sum(r.engine.counters.num_preemptions for r in self.replicas)
        self.stats.prefix_cache_queries = sum(r.engine.prefix_cache_queries for r in self.replicas)
        self.stats.prefix_cache_hits = sum(r.engine.prefix_cache_hits for r in self.replicas)
        self.stats.replica_busy_ms = [r.busy_ms for r in self.replicas]
        self.stats.replica_requests = [r.requests for r in self.replicas]
        errs = [e for r in self.replicas if r.calibrator is not None
                and (e := r.calibrator.mean_abs_rel_error()) == e]  # fmt: skip
        if errs:
            self.stats.time_model_mean_abs_error = sum(errs) / len(errs)
        records = []
        for req, st in zip(self.requests, self.states):
            outcome, reason = st.outcome, st.reason
            if outcome == "":
                outcome, reason = FAILED, "unfinished"
            records.append(RequestRecord(req.tenant, req.arrival_ms, req.prompt_tokens, len(st.token_times),
                                         st.token_times, outcome, reason,
                                         self.replicas[st.replica].rid if st.replica >= 0 else None,
                                         req.output_tokens))  # fmt: skip
        return FleetResult(records, self.stats, time.perf_counter() - t_wall)


def run_fleet(cfg: FleetConfig, requests: Sequence[FleetRequest]) -> FleetResult:
    """Simulate ``requests`` (any order) on the fleet ``cfg``; see the module docstring."""
    return FleetSim(cfg, requests).run()


__all__ = ["AUTOSCALE_SIGNALS", "AutoscaleConfig", "BASELINE_POLICIES", "FleetConfig", "FleetRequest", "FleetResult",
           "FleetStats", "POLICIES", "PREFIX_POLICIES", "SCRAPED_POLICIES", "StepView", "replica_state", "run_fleet",
           "step_view"]  # fmt: skip
