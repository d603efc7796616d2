"""The router's request sequence as sans-IO code: one core that the HTTP server and the fleet
simulation both drive (issue 26; docs/architecture.md "Who decides what").

:class:`RouterCore` holds the router's decision state (budget book, weighted fair queue and its
dispatcher, placement policy, prefix map and its correction, work-aware shedding, per-replica
load) and strings the pure rules together:

1. arrival (:meth:`RouterCore.refuse_by_work`): a sheddable class under contention may be
   refused by work (router/work_shed.py) before any budget is spent;
2. :meth:`RouterCore.acquire`: placed at once when nobody waits and a replica fits
   (router/arrival.py ``place_now_exclude``), else queued with a deadline or refused
   (``queue_or_refuse``): the answer is a value, :class:`Placed`, :class:`Queued` or
   :class:`Refused`, never an exception;
3. :meth:`RouterCore.place`: placement (filters -> scorers -> picker on the book's views, with the
   request's age, the contention cap, the start window and the prefix map's estimates), then
   Reserve on the candidates in order through the :class:`ReservePort` (inline admission: no
   round trip), then the post-decision bookkeeping (local take, prefix map, prefix correction,
   the placement plugins' hooks, replica load);
4. the queue's :class:`~router.admission_queue.Dispatcher` places waiting requests by the same
   :meth:`RouterCore.place` whenever budget may have appeared; a sheddable request that can no
   longer start in time leaves (router/shedding.py);
5. after a relay attempt (:meth:`RouterCore.after_attempt`): router/admission.py ``RelayAttempts``
   says whether to refund, release and try again; the lease is released or settled.

Baseline profiles (router/placement/baselines.py: ``least-outstanding``, ``round-robin``, ...; a policy
with :attr:`~router.placement.PlacementPolicy.direct` set): like the router each imitates, the core
admits every request and places it at once (:meth:`RouterCore.acquire`): no work shedding, no PAB
fit, no admission queue, no Reserve. The policy reads the core's :class:`~router.placement.RouterLoad`
(:meth:`RouterCore.refresh_load`); the grant is *direct* (:class:`Grant` ``direct``): no lease exists
anywhere, the request goes to its replica's agent with ``x-fairbatch-direct: 1`` and no
``x-fairbatch-lease`` / ``x-fairbatch-admit``, which the agent admits as it is (tracked and relayed,
as every request without a lease). A baseline with a router queue holds a request at the router
while its gate says the pool is saturated (:meth:`RouterCore.acquire` answers :class:`Queued`; its
entry waits in the core's one *held queue*, a :class:`~router.placement.flow_control.FlowControlQueue`,
not in the fair queue): ``llm-d-flow-control`` (gate: llm-d's saturation detector on the scraped
engine metrics; llm-d's band / fairness / FCFS order, TTL, capacity limits) and ``dynamo-kv`` (gate:
Dynamo's all-workers-busy on the router's active prefill tokens; one band, first come first served).
:meth:`RouterCore.dispatch_held` places waiting requests in that order while the gate is open: on
every change of the book (a listener: a new snapshot or scrape), whenever a request's prefill or
the request ends (:meth:`RouterCore.prefill_done`, :meth:`RouterCore.lease_done`: Dynamo's queue
is woken as active prefill tokens fall), and at the earliest TTL (the drivers' timer: the server's
wait on the entry, the simulation's event), when an expired entry fails with ``flow-control-ttl``.
Each entry leaves exactly once: granted, refused, expired, or taken out by
:meth:`RouterCore.leave_queue` (client gone). ``static-queue-cap`` adds ``x-fairbatch-queue-cap: <tokens>``: the
agent refuses the request (409 ``x-fairbatch-refused: queue-cap``) while it has work and its queued
prompt tokens plus this prompt exceed the cap, and the core then takes the placement's next
candidate (:meth:`RouterCore.redirect`, at most ``DEFAULT_MAX_CANDIDATES`` in all; then refused
``queue-cap``). Its load counts (outstanding requests and tokens) end with the request
(:meth:`RouterCore.lease_done`), like a lease's.

I/O goes through ports: :class:`ReservePort` (Reserve and Release; the gRPC budget client and the
simulated agents are two implementations) and the ``new_future`` factory (an asyncio future in
the server, a callback future in the simulation). Coroutines of the core only await the ports;
with ports that never suspend (the simulation's) they run to completion when driven by hand.
Times are simulated ms on the core's clock.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from fairbatch_common.clock import Clock
from router.admission import (
    MAX_ADMIT_REFUSALS,
    RelayAction,
    RelayAttempts,
    ContentionCap,
    hold_replica,
    lease_tokens,
    offer_replicas,
    use_inline,
)
from router.admission_queue import Attempt, Dispatcher, PlacementFailed, QueueFull, QueueTimeout, WaitingRequest
from router.arrival import Refuse, no_replica_left, place_now_exclude, queue_or_refuse
from router.budget_client import ReserveResult
from router.budgets import BudgetBook
from router.charges import decode_estimate
from router.config import RouterConfig
from router.fair_queue import FairQueue, TenantShare
from router.placement import (
    DEFAULT_MAX_CANDIDATES,
    OVERLOAD_FILTERS,
    MetricsSample,
    PlacementPolicy,
    PlacementRequest,
    ReplicaView,
    RouterLoad,
    default_registry,
)
from router.placement.flow_control import FlowControlQueue, FlowControlSettings, FlowItem, band_key
from router.placement.latency_predictor import LatencyPredictor
from router.prefix_correction import PrefixCorrection
from router.prefix_index import PrefixIndex
from router.shedding import MAX_DRAIN_RATE, agent_margin_ms, infeasible, predict_start, priced_tokens
from router.work_shed import WorkShed, WorkShedSettings, refuse_by_work

log = logging.getLogger(__name__)

HOLD_QUEUE = FlowControlSettings(band_max_bytes=0)
"""The held queue of a gate without flow-control settings (``DirectAdmission.hold``: ``dynamo-kv``,
Dynamo's ``SchedulerQueue``): every request in one band (:data:`HOLD_BAND`), first come first served,
no TTL (the caller bounds the wait by arrival + the class's ``max_queue_ms``), no capacity limit."""
HOLD_BAND = (0, 0)

__all__ = ["CoreRequest", "Grant", "Placed", "Queued", "Refused", "ReservePort", "RouterCore", "tenant_shares"]


@dataclass(slots=True)
class Grant:
    """A lease on one replica for one request.

    Attributes:
        replica_id: the replica.
        lease_id: the agent's lease id (``reserve`` mode), or the router's own key of an inline
            admission (``inline`` mode: no lease exists on the agent until the request arrives).
        inline: admitted on the router's view; the agent decides on arrival (``x-fairbatch-admit``).
        prompt_tokens: the prompt tokens placed, less those the replica is estimated to hold in its
            prefix cache (sent in ``x-fairbatch-admit``); a direct grant's whole prompt.
        on_time_only: the agent is to admit it only where it still meets its TTFT
            (``x-fairbatch-on-time: 1`` with an inline admission; see :meth:`RouterCore.place`).
        direct: a baseline profile's placement (module docstring): no lease, no budget check; the
            agent admits the request as it is. ``lease_id`` is then the router's own key.
        fallbacks: a direct grant's next candidates, tried in order when the replica refuses it
            (:meth:`RouterCore.redirect`).
        queue_cap_tokens: a direct grant's queued-token cap for the agent (``static-queue-cap``), None: none.
        refused: the agent refused this grant on arrival (set by :meth:`RouterCore.after_attempt`).
        alternates: an inline or Reserve grant's other placement candidates, best first (no lease on
            them): the ext_proc picker's fallback endpoints (router/ext_proc.py), where each agent
            decides on arrival.
    """

    replica_id: str
    lease_id: str
    inline: bool = False
    prompt_tokens: int = 0
    on_time_only: bool = False
    direct: bool = False
    fallbacks: tuple[str, ...] = ()
    queue_cap_tokens: int | None = None
    refused: bool = False
    alternates: tuple[str, ...] = ()

    def add_headers(self, headers: dict[str, str]) -> None:
        """The agent's admission headers of this grant (docs/architecture.md "Agent"): a direct grant
        ``x-fairbatch-direct: 1`` (and ``x-fairbatch-queue-cap``), an inline one
        ``x-fairbatch-admit: <prompt tokens>`` (and ``x-fairbatch-on-time: 1``), else
        ``x-fairbatch-lease: <lease id>``."""
        if self.direct:
            headers["x-fairbatch-direct"] = "1"
            if self.queue_cap_tokens is not None:
                headers["x-fairbatch-queue-cap"] = str(self.queue_cap_tokens)
        elif self.inline:
            headers["x-fairbatch-admit"] = str(self.prompt_tokens)
            if self.on_time_only:
                headers["x-fairbatch-on-time"] = "1"
        else:
            headers["x-fairbatch-lease"] = self.lease_id


@dataclass(frozen=True, slots=True)
class CoreRequest:
    """What the core needs of one parsed request.

    Attributes:
        request_id: the router-made id (keys the queue entry, the lease and the prefix keys).
        tenant, slo_class: who sent it and its class (names of the config).
        prompt_tokens: prompt size (tokens, the router's estimate or exact count).
        max_tokens: output tokens asked for, all choices together (0 = unknown).
        arrival_ms: router clock at its arrival (simulated ms).
        prefix_keys: the prompt's prefix-block keys (router/prefix_index.py; empty without a map).
        ttft_slo_ms, tpot_slo_ms: the request's own latency SLO (ms; the ``x-slo-ttft-ms`` /
            ``x-slo-tpot-ms`` headers of llm-d), 0 = its class's; read by ``llm-d-predicted-latency``.
    """

    request_id: str
    tenant: str
    slo_class: str
    prompt_tokens: int
    max_tokens: int
    arrival_ms: float
    prefix_keys: Sequence[int] = ()
    ttft_slo_ms: float = 0.0
    tpot_slo_ms: float = 0.0


@dataclass(frozen=True, slots=True)
class Placed:
    """Placed at once: the request holds ``grant``."""

    grant: Grant


@dataclass(frozen=True, slots=True)
class Queued:
    """Waiting in the fair queue: ``entry.future`` resolves with a :class:`Grant` or fails with
    :class:`~router.admission_queue.QueueTimeout` (its deadline, or shed as infeasible).

    Attributes:
        entry: the queue entry.
        lifted_counter: the tenant's VTC counter when the push lifted it (a tenant that was idle:
            router/fair_queue.py), to be shared with the other routers; None when it did not move.
    """

    entry: WaitingRequest
    lifted_counter: float | None = None


@dataclass(frozen=True, slots=True)
class Refused:
    """Not placed, not queued.

    Attributes:
        reason: ``queue-full``, ``slo-infeasible`` (predicted wait ``wait_ms``), ``queue-timeout``
            (the class's max queue time already passed), ``no-replica`` (every replica failed for
            it; a direct placement: none passed the filters, ``detail`` names the filter that left
            none), ``queue-cap`` (a direct placement's candidates all refused it), ``overloaded``
            (a direct placement found every replica busy: a filter of ``OVERLOAD_FILTERS`` left
            none, ``dynamo-kv``; answered 529) or
            ``placement-error`` (placement raised; ``detail`` names the exception class).
        wait_ms: the predicted queue wait of an ``slo-infeasible`` refusal (simulated ms).
        detail: the exception class name of a ``placement-error``; the filter of a direct ``no-replica``.
        queued: refused after waiting in the queue (its deadline, or shed there), not at arrival.
    """

    reason: str
    wait_ms: float = 0.0
    detail: str = ""
    queued: bool = False


Acquired = Placed | Queued | Refused


class ReservePort(Protocol):
    """The core's I/O with the agents (router/budget_client.py over gRPC; loadgen/fleet/sim.py in
    simulation)."""

    async def reserve(self, replica_id: str, slo_class: str, prompt_tokens: int, request_id: str,
                      max_tokens: int, waited_ms: float, on_time_only: bool = False) -> ReserveResult:
        """A lease of ``prompt_tokens`` on ``replica_id`` (never raises for transport errors: a
        refusal with a reason; ``pab_ms`` / ``pab_tokens`` -1 when no answer arrived);
        ``on_time_only``: only a start that meets the request's TTFT."""
        ...

    def release(self, lease_id: str, reason: str) -> None:
        """Give the lease back, in the background (never blocks the caller)."""
        ...


def tenant_shares(config: RouterConfig) -> dict[str, TenantShare]:
    """Fair-queue contract per tenant from the config (weight, band of its class, min_share)."""
    return {
        name: TenantShare(t.weight, config.slo_classes[t.slo_class].priority, t.min_share or 0.0)
        for name, t in config.tenants.items()
    }


def _no_observer(seconds: float) -> None:
    return None


def _take(counts: dict[str, int], rid: str, n: int) -> None:
    """``counts[rid] -= n``, the entry dropped at 0 or below."""
    left = counts.get(rid, 0) - n
    if left > 0:
        counts[rid] = left
    else:
        counts.pop(rid, None)


@dataclass(slots=True)
class RouterCore:
    """The router's decision state and request sequence (module docstring).

    Args:
        config: validated router configuration (classes, tenants, queue, admission, placement).
        clock: router clock (simulated ms).
        reserve: the :class:`ReservePort`.
        new_future: makes the future of a queue entry (``asyncio.get_running_loop().create_future``
            in the server).
        seed: tie-break seed of the placement policy.
        policy_name: a registry policy that replaces the YAML's ``placement`` (``pab``: the YAML's).
        replica_ids: the replicas now (the book's set; discovery changes it through
            :meth:`add_replica` / :meth:`remove_replica`).
        on_charge: ``(tenant, delta)`` after every fair-queue charge that moved the tenant's
            counter (the server shares it through the ledger; None: nobody).
        observe_placement, observe_reserve: wall seconds of each placement decision and Reserve
            call (metrics in the server, decision-time samples in the simulation).
        queue: the admission queue (default: the weighted fair queue of ``config``).

    Load (read by the contention cap, the metrics and the baseline profiles through :attr:`load`):
    ``replica_load`` counts, per replica, the requests this core placed there and has not seen end
    (granted at :meth:`place`, ended at :meth:`lease_done`: exact, router-local, never stale);
    ``replica_tokens`` their prompt + decode-estimate tokens (``max_tokens``, or
    ``fairness.default_max_tokens`` when the request gives none: what the router knows before the
    engine answers). :attr:`load` is the :class:`~router.placement.RouterLoad` over both counters
    plus the agents' engine metrics (:meth:`refresh_load`).
    """

    config: RouterConfig
    clock: Clock
    reserve: ReservePort
    new_future: Callable[[], Any]
    seed: int
    policy_name: str = "pab"
    replica_ids: Iterable[str] = ()
    on_charge: Callable[[str, float], None] | None = None
    observe_placement: Callable[[float], None] = _no_observer
    observe_reserve: Callable[[float], None] = _no_observer
    queue: Any = None
    book: BudgetBook = field(init=False)
    policy: PlacementPolicy = field(init=False)
    dispatcher: Dispatcher[Grant] = field(init=False)
    prefix: PrefixIndex | None = field(init=False, default=None)
    prefix_correction: PrefixCorrection = field(init=False, default_factory=PrefixCorrection)
    work_shed: WorkShed | None = field(init=False, default=None)
    replica_load: collections.Counter[str] = field(init=False, default_factory=collections.Counter)
    replica_tokens: collections.Counter[str] = field(init=False, default_factory=collections.Counter)
    load: RouterLoad = field(init=False)
    _applied_placement: dict[str, Any] = field(init=False, default_factory=dict)
    _leased: dict[str, tuple[str, int]] = field(init=False, default_factory=dict)
    _prompts: dict[str, tuple[str, int, int]] = field(init=False, default_factory=dict)
    _inline_seq: int = field(init=False, default=0)
    _load_seen: int = field(init=False, default=-1)
    _prefix_keys: dict[str, Sequence[int]] = field(init=False, default_factory=dict)
    held_queue: FlowControlQueue | None = field(init=False, default=None)
    _held_items: dict[WaitingRequest, FlowItem] = field(init=False, default_factory=dict)
    _held_busy: bool = field(init=False, default=False)
    _contention: ContentionCap = field(init=False)

    def __post_init__(self) -> None:
        config = self.config
        self.book = BudgetBook(self.clock, list(self.replica_ids))
        adm = config.admission
        self._contention = ContentionCap(adm.contention_max_inflight, adm.contention_keep_running)
        self.load = RouterLoad(self.replica_load, {}, 0, self.replica_tokens, collections.Counter(),
                               collections.Counter())  # fmt: skip
        self.policy = self._build_policy(config)
        self._applied_placement = config.placement.model_dump(exclude={"prefix_cache"})
        self._configure_prefix(config)
        self._configure_work_shed(config)
        if self.queue is None:
            fc = config.fairness
            self.queue = FairQueue(config.queue.max_requests, config.queue.max_tokens, tenant_shares(config),
                                   fc.w_prefill, fc.w_decode, fc.default_max_tokens, config.queue.aging_floor_share)
        self.dispatcher = Dispatcher(
            queue=self.queue, clock=self.clock, admit=self._admit_waiting, release_orphan=self._release_orphan,
            max_bypass=config.queue.max_bypass, hold_for=self._hold_for, skip_dominated=True, shed=self.shed,
            shed_recheck_ms=config.queue.shed_recheck_ms, probe=self.probe,
        )  # fmt: skip
        self.book.add_listener(self.dispatcher.wake_if_waiting)
        self._configure_held_queue()
        self.book.add_listener(self.dispatch_held)

    # ------------------------------------------------------------------ configuration

    def _build_policy(self, config: RouterConfig) -> PlacementPolicy:
        """The YAML's ``placement`` (profile or plugin chain), or the registry policy named at
        construction when it is not the default ``pab``; built with the core's :attr:`load`."""
        if self.policy_name != "pab":
            return default_registry().build(self.policy_name, seed=self.seed, load=self.load)
        return config.placement.build(self.seed, self.load)  # type: ignore[no-any-return]

    def _configure_prefix(self, config: RouterConfig) -> None:
        """Build (or drop) the prefix map for ``placement.prefix_cache`` (kept on for a policy that
        reads it, ``PlacementPolicy.prefix_map``: the cache-aware baselines); a map whose settings
        did not change is kept, with what it learned."""
        pc = config.placement.prefix_cache
        if not (pc.enabled or self.policy.prefix_map):
            self.prefix = None
            return
        tokens_per_key = max(1, round(pc.chunk_chars / config.admission.bytes_per_token))
        capacity = max(1, pc.capacity_tokens // tokens_per_key)
        if self.prefix is None or (self.prefix.capacity_keys, self.prefix.tokens_per_key) != (capacity, tokens_per_key):
            self.prefix = PrefixIndex(capacity, tokens_per_key)
            self.prefix_correction = PrefixCorrection()

    def _held_settings(self) -> FlowControlSettings | None:
        """The held queue's settings for the policy now: llm-d's (``DirectAdmission.flow_control``),
        :data:`HOLD_QUEUE` for a gate without them (``DirectAdmission.hold``), or None (no router
        queue)."""
        direct = self.policy.direct
        if direct is None:
            return None
        if direct.flow_control is not None:
            return direct.flow_control
        return HOLD_QUEUE if direct.hold is not None else None

    def _configure_held_queue(self) -> None:
        """Build (or drop) the held queue of the policy (:meth:`_held_settings`); one whose settings
        changed is rebuilt with its entries in their order (an entry over the new limits is refused
        ``flow-control-capacity``); without a router queue they are placed now."""
        fc = self._held_settings()
        old = self.held_queue
        if old is not None and fc is not None and old.settings == fc:
            return
        self.held_queue = FlowControlQueue(fc) if fc is not None else None
        if old is None:
            return
        for item in sorted(old, key=lambda i: i.seq):
            entry = item.payload
            self._held_items.pop(entry, None)
            if entry.future.done():
                continue
            if self.held_queue is None:  # placed now by the new profile (a pab one cannot: answered no-replica)
                if self.policy.direct is not None:
                    self._place_held(entry)
                else:
                    entry.future.set_exception(QueueTimeout("no-replica"))
                continue
            if fc is not None and fc.ttl_ms:
                item.deadline_ms = entry.deadline_ms = item.enqueued_ms + fc.ttl_ms
            else:
                item.deadline_ms = float("inf")  # the entry keeps its own deadline (the caller's bound)
            if self.held_queue.push(item):
                self._held_items[entry] = item
            else:
                entry.future.set_exception(QueueTimeout("flow-control-capacity"))

    def _configure_work_shed(self, config: RouterConfig) -> None:
        """Build (or drop) the state of ``admission.work_shed``; kept, with what it learned, when its
        settings did not change."""
        ws = config.admission.work_shed
        new = WorkShedSettings(ws.gain, ws.max_share, ws.window, ws.horizon, ws.min_samples) if ws.enabled else None
        old = self.work_shed
        self.work_shed = None if new is None else old if old is not None and old.settings == new else WorkShed(new)

    def apply_config(self, config: RouterConfig) -> None:
        """Swap in a validated configuration: queue bounds and tenants, fairness weights, dispatcher
        knobs, placement (rebuilt when it changed; the seed kept unless the YAML sets one), prefix
        map and work shedding. Queued and running requests continue."""
        self.config = config
        fc = config.fairness
        self.queue.set_bounds(config.queue.max_requests, config.queue.max_tokens)
        self.queue.set_tenants(tenant_shares(config))
        self.queue.w_prefill, self.queue.w_decode = fc.w_prefill, fc.w_decode
        self.queue.default_max_tokens = fc.default_max_tokens
        self.queue.aging_floor_share = config.queue.aging_floor_share
        self.dispatcher.max_bypass = config.queue.max_bypass
        self.dispatcher.shed_recheck_ms = config.queue.shed_recheck_ms
        self._contention.cap = config.admission.contention_max_inflight
        self._contention.keep_running = config.admission.contention_keep_running
        new_pl = config.placement.model_dump(exclude={"prefix_cache"})
        if new_pl != self._applied_placement:
            if new_pl.get("seed") is not None:
                self.seed = new_pl["seed"]
            self.policy = self._build_policy(config)
            self._applied_placement = new_pl
            self._configure_held_queue()
        self._configure_prefix(config)
        self._configure_work_shed(config)
        self.dispatcher.wake()

    def add_replica(self, replica_id: str) -> None:
        """A replica joined: it becomes placeable with its first snapshot."""
        self.book.add_replica(replica_id)
        self.dispatcher.wake()

    def remove_replica(self, replica_id: str) -> None:
        """A replica left: its budget, prefix-map entries and correction are forgotten."""
        self.book.remove_replica(replica_id)
        if self.prefix is not None:
            self.prefix.forget(replica_id)
        self.prefix_correction.forget(replica_id)
        self.dispatcher.wake()

    # ------------------------------------------------------------------ accounting

    def decode_estimate(self, max_tokens: int) -> int:
        """The decode tokens charged at dispatch (router/charges.py ``decode_estimate``)."""
        return decode_estimate(max_tokens, self.config.fairness.default_max_tokens)

    def charge(self, tenant: str, prefill_tokens: int, decode_tokens: int) -> None:
        """Count service for the fair queue (negative = refund); ``on_charge`` hears the delta."""
        delta = self.queue.charge(tenant, prefill_tokens, decode_tokens)
        if self.on_charge is not None and delta:
            self.on_charge(tenant, delta)

    def charge_dispatch(self, req: CoreRequest) -> None:
        """The charge of a request that got its lease: prompt + the decode estimate."""
        self.charge(req.tenant, req.prompt_tokens, self.decode_estimate(req.max_tokens))

    def _count(self, grant: Grant, tokens: int, prompt: int = 0, uncached: int = 0) -> None:
        """``grant``'s request now counts in its replica's load (``tokens``: prompt + decode estimate;
        ``prompt`` and ``uncached``: its whole and uncached prompt tokens, :attr:`load`'s
        ``prompt_tokens`` and ``prefill_tokens``, the latter until :meth:`prefill_done`)."""
        rid = grant.replica_id
        self._leased[grant.lease_id] = (rid, tokens)
        self.replica_load[rid] += 1
        self.replica_tokens[rid] += tokens
        if prompt > 0:
            self._prompts[grant.lease_id] = (rid, prompt, uncached)
            self.load.prompt_tokens[rid] = self.load.prompt_tokens.get(rid, 0) + prompt
            self.load.prefill_tokens[rid] = self.load.prefill_tokens.get(rid, 0) + uncached

    def prefill_done(self, grant: Grant) -> None:
        """The router saw ``grant``'s first token: its uncached prompt tokens leave :attr:`load`'s
        ``prefill_tokens`` (Dynamo decrements active prefill tokens there too); a held request
        may start (:meth:`dispatch_held`). Idempotent."""
        got = self._prompts.get(grant.lease_id)
        if got is None or got[2] == 0:
            return
        rid, prompt, uncached = got
        self._prompts[grant.lease_id] = (rid, prompt, 0)
        _take(self.load.prefill_tokens, rid, uncached)
        if self.held_queue is not None:
            self.dispatch_held()

    def lease_done(self, grant: Grant) -> None:
        """The request of ``grant`` ended (served, failed, released or gone): it no longer counts
        in its replica's load (requests and tokens). Idempotent."""
        got = self._leased.pop(grant.lease_id, None)
        if got is not None:
            rid, tokens = got
            self.replica_load[rid] -= 1
            if self.replica_load[rid] <= 0:
                del self.replica_load[rid]
            self.replica_tokens[rid] -= tokens
            if self.replica_tokens[rid] <= 0:
                del self.replica_tokens[rid]
        prompts = self._prompts.pop(grant.lease_id, None)
        if prompts is not None:
            rid, prompt, uncached = prompts
            _take(self.load.prompt_tokens, rid, prompt)
            _take(self.load.prefill_tokens, rid, uncached)
            if self.held_queue is not None:
                self.dispatch_held()

    def refresh_load(self) -> None:
        """Bring :attr:`load`'s engine metrics (``scraped``) up to the book, when it changed since the
        last call (``load.version`` is bumped then).

        Each replica whose budget snapshot is fresh gets the snapshot's ``num_running``,
        ``num_waiting`` and ``kv_usage`` (proto ``BudgetSnapshot`` fields 8-10; router/budgets.py
        ``ReplicaBudget``), stamped with its arrival on the router clock. Where they come from and
        how stale they can be: the agent scrapes its engine's ``/metrics``
        (``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``)
        every ``--metrics-interval-ms`` (50 ms, llm-d's refresh) and pushes a snapshot when they
        changed, at most one per ``--min-push-interval-ms`` (5 ms) and at least every
        ``--push-interval-ms`` (100 ms); so a figure is up to one scrape period plus the coalescing
        and one network hop old (about 55 ms), and never older than the snapshot's TTL (a stale
        replica has no entry, and the baselines' ``fresh`` filter drops it). A freshness that runs out
        between two changes of the book is seen at the next change (snapshots of any replica arrive
        every ``--push-interval-ms`` at the latest).
        """
        book = self.book
        if book.version == self._load_seen:
            return
        self._load_seen = book.version
        now = self.clock.now_ms()
        scraped: dict[str, MetricsSample] = {}
        for rid in book.replica_ids():
            b = book.get(rid)
            if b is not None and b.received_ms is not None and book.is_fresh(b, now):
                scraped[rid] = MetricsSample(b.num_running, b.num_waiting, b.kv_usage, b.received_ms)
        self.load.scraped = scraped
        self.load.version += 1

    def release(self, grant: Grant, reason: str) -> None:
        """Give ``grant`` back: the load count at once; the agent's lease through the port (an
        inline admission has none: the book is poked so the dispatcher retries, as a Release
        answer would; a direct grant has nothing to give back)."""
        self.lease_done(grant)
        if grant.direct:
            return
        if grant.inline:
            self.book.notify()
            return
        self.reserve.release(grant.lease_id, reason)

    async def _release_orphan(self, grant: Grant) -> None:
        self.release(grant, "client-gone")

    def contention_excluded(self) -> frozenset[str]:
        """Replicas at the contention cap (router/admission.py :class:`ContentionCap`)."""
        return self._contention.excluded(self.queue.backlogged_tenants(), self.replica_load)

    # ------------------------------------------------------------------ prefix map

    def track_prefix(self, req: CoreRequest) -> None:
        """Remember the request's prefix keys while it is placed (no-op without a map or keys)."""
        if self.prefix is not None and req.prefix_keys:
            self._prefix_keys[req.request_id] = req.prefix_keys

    def forget_prefix(self, request_id: str) -> None:
        """The request is placed for good or gone: drop its keys."""
        self._prefix_keys.pop(request_id, None)

    def cached(self, request_id: str, prompt_tokens: int) -> tuple[dict[str, int], dict[str, int]]:
        """(raw, discounted) prompt tokens the prefix map estimates each replica holds for this
        request: the map's estimate, and the same discounted where an engine measured fewer hits
        than the map promised (router/prefix_correction.py); both empty without a map or keys."""
        prefix, keys = self.prefix, self._prefix_keys.get(request_id)
        raw = prefix.cached_tokens(keys, prompt_tokens) if prefix is not None and keys else {}
        return raw, (self.prefix_correction.discount(raw, self.book.prefix_measured) if raw else raw)

    def priced(self, request_id: str, prompt_tokens: int) -> int:
        """The prompt tokens the shedding rule prices (router/shedding.py ``priced_tokens``): what
        is left to compute on the warmest replica."""
        return priced_tokens(prompt_tokens, self.cached(request_id, prompt_tokens)[1]) if self.prefix else prompt_tokens

    # ------------------------------------------------------------------ predictions and shedding

    def margin_ms(self, slo_class: str) -> float:
        """The agents' safety margin for the class (router/shedding.py ``agent_margin_ms``)."""
        return agent_margin_ms(self.book.views(), slo_class)

    def predict(self, slo_class: str, band: int, prompt_tokens: int, own_tokens: int = 0,
                waited_ms: float = 0.0) -> tuple[float, float] | None:
        """(predicted queue wait, predicted prefill) in simulated ms, or None without a usable replica
        (router/shedding.py ``predict_start``; ``own_tokens``: the request's own when it is queued
        already, not counted as ahead of it; ``waited_ms``: since its arrival)."""
        tokens = max(0, self.queue.tokens_ahead(band) - own_tokens)
        return predict_start(self.book.views(), self.book.drain, slo_class, prompt_tokens, tokens, MAX_DRAIN_RATE,
                             self.clock.now_ms(), waited_ms)  # fmt: skip

    def shed(self, entry: WaitingRequest, now_ms: float) -> bool:
        """A queued sheddable request that the dispatcher could not place: True when the prediction
        on its priced tokens (its own not counted as ahead of it) says it can no longer start in
        time (router/shedding.py ``infeasible``)."""
        prediction = self.predict(entry.slo_class, entry.priority, self.priced(entry.request_id, entry.prompt_tokens),
                                  entry.prompt_tokens, max(0.0, now_ms - entry.arrived_ms))  # fmt: skip
        return infeasible(now_ms, entry.first_token_deadline_ms, prediction, self.margin_ms(entry.slo_class))

    def refuse_by_work(self, req: CoreRequest, views: list[ReplicaView] | None = None) -> bool:
        """router/work_shed.py at a new request's arrival (a sheddable class, ``admission.work_shed``
        on): True = answer it 429 ``work-shed``. Priced on the whole prompt and the decode estimate.
        Never for a baseline profile (it admits everything)."""
        if self.work_shed is None or self.policy.direct is not None or \
                not self.config.slo_classes[req.slo_class].sheddable:  # fmt: skip
            return False
        return refuse_by_work(self.work_shed, self.book.views() if views is None else views, req.prompt_tokens,
                              self.decode_estimate(req.max_tokens))  # fmt: skip

    def budget_refused(self) -> None:
        """Tell work shedding that a request was refused for budget (slo-infeasible or its queue time)."""
        if self.work_shed is not None:
            self.work_shed.budget_refused()

    # ------------------------------------------------------------------ placement

    def placement_request(self, slo_class: str, prompt_tokens: int, request_id: str, exclude: frozenset[str],
                          arrival_ms: float, attempt: Attempt) -> tuple[PlacementRequest, dict[str, int]]:
        """(placement request, raw cached) for one placement now: the request's age, the contention
        cap, the start window and the prefix map's estimates (no side effect)."""
        adm = self.config.admission
        waited_ms = max(0.0, self.clock.now_ms() - arrival_ms)
        raw, cached = self.cached(request_id, prompt_tokens)
        preq = PlacementRequest(
            slo_class, prompt_tokens, exclude | attempt.avoid | self.contention_excluded(), waited_ms,
            on_time_only=attempt.on_time_only, window_steps=adm.start_window_steps, step_tokens=adm.step_tokens,
            cached_tokens=cached, request_id=request_id,
        )
        return preq, raw

    def probe(self, entry: WaitingRequest, attempt: Attempt) -> bool:
        """The dispatcher's watchdog probe: would the placement put ``entry`` somewhere now
        (router/admission_queue.py ``Dispatcher.probe``; no Reserve, no bookkeeping)."""
        preq, _ = self.placement_request(entry.slo_class, entry.prompt_tokens, entry.request_id, entry.exclude,
                                         entry.arrived_ms, attempt)  # fmt: skip
        return bool(self.policy.place(preq, self.book.views()).candidates)

    def _hold_for(self, entry: WaitingRequest) -> str | None:
        """The replica to hold for a starving queue head (router/admission.py ``hold_replica``)."""
        return hold_replica(entry.slo_class, entry.prompt_tokens, entry.exclude, self.book.views())

    async def place(self, slo_class: str, prompt_tokens: int, max_tokens: int, request_id: str,
                    exclude: frozenset[str], arrival_ms: float, attempt: Attempt = Attempt()) -> Grant | None:
        """Placement, then Reserve on the candidates in order (module docstring, step 3); None when
        none granted. A Reserve's answer updates the book. A baseline profile's placement is direct
        (:meth:`place_direct`).

        The agent is asked for an on-time start (Reserve ``on_time_only``, or ``x-fairbatch-on-time``
        with an inline admission) when the placement was on time only (the dispatcher's first
        phase) or the class is sheddable (never served late): the router's view lacks what other
        router copies placed since the last push, so only the agent can tell that a start is still
        on time (issue 27: 4 router copies served sheddable requests late)."""
        if self.policy.direct is not None:
            return self.place_direct(slo_class, prompt_tokens, max_tokens, request_id, exclude)[0]
        t0 = time.perf_counter()
        preq, raw = self.placement_request(slo_class, prompt_tokens, request_id, exclude, arrival_ms, attempt)
        cached = preq.cached_tokens
        policy, prefix = self.policy, self.prefix  # a reload may swap them while the Reserves are awaited
        result = policy.place(preq, self.book.views())
        self.observe_placement(time.perf_counter() - t0)
        adm = self.config.admission
        slo = self.config.slo_classes.get(slo_class)
        on_time_only = attempt.on_time_only or (slo is not None and slo.sheddable)
        # no round trip where the agent decides when the request arrives (router/admission.py use_inline)
        inline = bool(result.candidates) and use_inline(adm.lease_mode, self.book.inline_admission(result.candidates[0]))
        for replica_id in offer_replicas(result.candidates, inline, DEFAULT_MAX_CANDIDATES):
            uncached = lease_tokens(prompt_tokens, cached, replica_id)  # the prefill left to compute
            self.book.take_local(replica_id, slo_class, uncached, None if inline else request_id)
            if inline:
                self._inline_seq += 1
                grant = Grant(replica_id, f"inline-{self._inline_seq}", True, uncached, on_time_only,
                              alternates=tuple(c for c in result.candidates if c != replica_id))
            else:
                t1 = time.perf_counter()
                waited_ms = max(0.0, self.clock.now_ms() - arrival_ms)  # refused Reserves before took time
                try:
                    answer = await self.reserve.reserve(replica_id, slo_class, uncached, request_id, max_tokens,
                                                        waited_ms, on_time_only)  # fmt: skip
                finally:
                    self.book.forget_take(replica_id, request_id)  # answered below, or no answer
                self.observe_reserve(time.perf_counter() - t1)
                if answer.pab_ms >= 0:
                    self.book.apply_reserve(replica_id, slo_class, answer.pab_ms, answer.pab_tokens)
                if not answer.granted:
                    continue
                grant = Grant(replica_id, answer.lease_id,
                              alternates=tuple(c for c in result.candidates if c != replica_id))
            keys = self._prefix_keys.get(request_id)
            if prefix is not None and keys:  # post-decision: the replica now holds this prompt
                prefix.insert(replica_id, keys)
                self.prefix_correction.record(replica_id, raw.get(replica_id, 0), prompt_tokens)
            policy.after_decision(preq, replica_id)  # post-decision hooks of the placement plugins
            self._count(grant, prompt_tokens + self.decode_estimate(max_tokens))
            return grant
        return None

    def place_direct(self, slo_class: str, prompt_tokens: int, max_tokens: int, request_id: str,
                     exclude: frozenset[str], ttft_slo_ms: float = 0.0,
                     tpot_slo_ms: float = 0.0) -> tuple[Grant | None, str]:  # fmt: skip
        """A baseline profile's placement (module docstring): the policy on the book's views and the
        core's :attr:`load` (refreshed first), the prefix map's raw estimates (no correction: the
        imitated routers have none), then at once a direct grant on the first candidate with the
        next ones as its fallbacks (at most ``DEFAULT_MAX_CANDIDATES`` in all); the prefix map learns
        the pick, the hooks see it. (None, the name of the filter that left no replica) when none.
        The placement request carries the request's id and SLO (``ttft_slo_ms`` / ``tpot_slo_ms``
        when > 0, else its class's) for the policies that predict latency."""
        t0 = time.perf_counter()
        policy, prefix = self.policy, self.prefix
        self.refresh_load()
        keys = self._prefix_keys.get(request_id)
        cached = prefix.cached_tokens(keys, prompt_tokens) if prefix is not None and keys else {}
        slo = self.config.slo_classes.get(slo_class)
        preq = PlacementRequest(slo_class, prompt_tokens, exclude, cached_tokens=cached, request_id=request_id,
                                ttft_slo_ms=ttft_slo_ms or (slo.ttft_ms if slo else 0.0),
                                tpot_slo_ms=tpot_slo_ms or (slo.tpot_ms if slo else 0.0),
                                sheddable=bool(slo and slo.sheddable))  # fmt: skip
        result = policy.place(preq, self.book.views())
        self.observe_placement(time.perf_counter() - t0)
        if not result.candidates:
            return None, result.reason
        first, *rest = result.candidates[:DEFAULT_MAX_CANDIDATES]
        if prefix is not None and keys:  # SGLang / vllm-router / llm-d learn from their own decision
            prefix.insert(first, keys)
        policy.after_decision(preq, first)
        assert policy.direct is not None
        return self._direct_grant(first, tuple(rest), policy.direct.queue_cap_tokens, prompt_tokens,
                                  prompt_tokens + self.decode_estimate(max_tokens),
                                  max(0, prompt_tokens - cached.get(first, 0))), ""  # fmt: skip

    def _direct_grant(self, replica_id: str, fallbacks: tuple[str, ...], cap: int | None, prompt_tokens: int,
                      tokens: int, uncached: int | None = None) -> Grant:  # fmt: skip
        self._inline_seq += 1
        grant = Grant(replica_id, f"direct-{self._inline_seq}", prompt_tokens=prompt_tokens, direct=True,
                      fallbacks=fallbacks, queue_cap_tokens=cap)
        self._count(grant, tokens, prompt_tokens, prompt_tokens if uncached is None else uncached)
        return grant

    def redirect(self, grant: Grant, req: CoreRequest) -> Grant | None:
        """The replica of direct ``grant`` (for ``req``) refused it (its queue cap): the request ends
        there and goes to the placement's next candidate (a new direct grant with the rest as
        fallbacks), or None when none is left. The prefix map and the hooks keep the first pick."""
        self.lease_done(grant)
        if not grant.fallbacks:
            return None
        return self._direct_grant(grant.fallbacks[0], grant.fallbacks[1:], grant.queue_cap_tokens,
                                  grant.prompt_tokens, req.prompt_tokens + self.decode_estimate(req.max_tokens))

    async def _admit_waiting(self, entry: WaitingRequest, attempt: Attempt = Attempt()) -> Grant | None:
        return await self.place(entry.slo_class, entry.prompt_tokens, entry.max_tokens, entry.request_id,
                                entry.exclude, entry.arrived_ms, attempt)  # fmt: skip

    async def acquire(self, req: CoreRequest, exclude: frozenset[str] = frozenset(),
                      avoid_now: frozenset[str] = frozenset(), previous: Grant | None = None) -> Acquired:
        """Step 2 of the module docstring: :class:`Placed` when a replica fits and nobody waits,
        else :class:`Queued` (the dispatcher resolves its future) or :class:`Refused`.

        ``exclude``: replicas that failed for this request; ``avoid_now``: replicas left out of the
        immediate placement only (an inline admission they refused). A placement that raises is a
        ``placement-error`` refusal for this request alone. The caller charges the request
        (:meth:`charge_dispatch`) once it holds a grant.

        A baseline profile (``policy.direct``): :class:`Placed` at once (:meth:`place_direct`, never
        queued), or refused ``no-replica``; ``previous``: the request's last grant, whose next
        candidate is taken (:meth:`redirect`; refused ``queue-cap`` when none is left) when its
        replica refused it.
        """
        if self.policy.direct is not None:
            return self._acquire_direct(req, exclude | avoid_now, previous)
        replica_ids = set(self.book.replica_ids())
        if no_replica_left(replica_ids, exclude):  # router/arrival.py
            return Refused("no-replica")
        place_exclude = place_now_exclude(replica_ids, exclude, avoid_now, len(self.queue))
        if place_exclude is not None:  # nobody waits: placed at once when a replica fits
            try:
                grant = await self.place(req.slo_class, req.prompt_tokens, req.max_tokens, req.request_id,
                                         place_exclude, req.arrival_ms)  # fmt: skip
            except Exception as exc:  # noqa: BLE001 - one request's failure answers that request only
                log.error("request %s: placement failed: %s", req.request_id, type(exc).__name__, exc_info=exc)
                return Refused("placement-error", detail=type(exc).__name__)
            if grant is not None:
                return Placed(grant)
        now = self.clock.now_ms()
        slo = self.config.slo_classes[req.slo_class]
        band = slo.priority
        decision = queue_or_refuse(now, req.arrival_ms, slo.ttft_ms, slo.max_queue_ms, slo.sheddable,  # router/arrival.py
                                   lambda: self.predict(req.slo_class, band, self.priced(req.request_id,
                                                                                         req.prompt_tokens),
                                                        0, max(0.0, now - req.arrival_ms)),
                                   lambda: self.margin_ms(req.slo_class))  # fmt: skip
        if isinstance(decision, Refuse):
            return Refused(decision.reason, decision.wait_ms)
        if decision.deadline_ms <= now:  # its wait would time out at once
            return Refused(decision.expire_reason)
        entry = WaitingRequest(
            request_id=req.request_id, tenant=req.tenant, slo_class=req.slo_class, prompt_tokens=req.prompt_tokens,
            max_tokens=req.max_tokens, enqueued_ms=now, deadline_ms=decision.deadline_ms, future=self.new_future(),
            exclude=exclude, priority=band, first_token_deadline_ms=decision.first_token_deadline_ms,
            expire_reason=decision.expire_reason, arrival_ms=req.arrival_ms, promote_at_ms=decision.promote_at_ms,
            sheddable=slo.sheddable,
        )  # fmt: skip
        before = self.queue.counter(req.tenant)
        try:
            after = self.queue.push(entry)
        except QueueFull:
            return Refused("queue-full")
        self.dispatcher.wake()
        return Queued(entry, after if after > before else None)

    def _acquire_direct(self, req: CoreRequest, exclude: frozenset[str], previous: Grant | None) -> Acquired:
        if previous is not None and previous.direct and previous.refused:
            nxt = self.redirect(previous, req)
            return Refused("queue-cap") if nxt is None else Placed(nxt)
        if self.held_queue is not None:
            held = self._hold(req, exclude)
            if held is not None:
                return held
        try:
            grant, reason = self.place_direct(req.slo_class, req.prompt_tokens, req.max_tokens, req.request_id,
                                              exclude, req.ttft_slo_ms, req.tpot_slo_ms)  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - one request's failure answers that request only
            log.error("request %s: placement failed: %s", req.request_id, type(exc).__name__, exc_info=exc)
            return Refused("placement-error", detail=type(exc).__name__)
        if grant is None:
            return Refused("overloaded", detail=reason) if reason in OVERLOAD_FILTERS else \
                Refused("no-replica", detail=reason)  # fmt: skip
        return Placed(grant)

    # ------------------------------------------------------------------ the held queue (baselines)

    def held(self) -> int:
        """Requests waiting in the held queue of a baseline with a router queue (0 without one)."""
        q = self.held_queue
        return 0 if q is None else sum(1 for item in q if not item.payload.future.done())

    def has_held(self) -> bool:
        """Whether the held queue has any entry (O(1); entries whose waiter is gone count until
        :meth:`dispatch_held` drops them): the fleet simulation asks this on every token."""
        return self.held_queue is not None and len(self.held_queue) > 0

    def saturated(self) -> bool:
        """The held queue's gate on the core's state now: llm-d's saturation detector
        (router/placement/saturation.py) on the scraped engine metrics of every replica of the
        book, aged on the core's clock (``llm-d-flow-control``), or the policy's
        :class:`~router.placement.core.SaturationGate` on the book's views (``dynamo-kv``). False
        without a router queue."""
        direct = self.policy.direct
        if direct is None or self.held_queue is None:
            return False
        if direct.flow_control is not None:
            self.refresh_load()
            return direct.flow_control.detector.saturated(self.load.scraped, self.book.replica_ids(),
                                                          self.clock.now_ms())  # fmt: skip
        return direct.hold is not None and direct.hold.saturated(self.book.views())

    def _hold(self, req: CoreRequest, exclude: frozenset[str]) -> Acquired | None:
        """An arrival under a baseline with a router queue: None (place it at once: the gate is open;
        whoever waited was placed first, as llm-d's dispatch cycle and Dynamo's scheduler queue
        empty their queues while there is room), else :class:`Queued` in the held queue, or refused
        ``flow-control-shed`` (a sheddable class with llm-d's ``reject_sheddable``) or
        ``flow-control-capacity`` (over a capacity limit). A flow-controlled entry's deadline is
        its TTL (none by default); a held one's otherwise is arrival + the class's ``max_queue_ms``,
        which the caller's wait bounds."""
        q = self.held_queue
        assert q is not None
        self.dispatch_held()
        if not len(q) and not self.saturated():
            return None
        fc = q.settings
        slo = self.config.slo_classes[req.slo_class]
        flow = self.policy.direct is not None and self.policy.direct.flow_control is not None
        if flow and slo.sheddable and fc.reject_sheddable:
            return Refused("flow-control-shed")
        now = self.clock.now_ms()
        ttl = now + fc.ttl_ms if fc.ttl_ms is not None else float("inf")
        entry = WaitingRequest(
            request_id=req.request_id, tenant=req.tenant, slo_class=req.slo_class, prompt_tokens=req.prompt_tokens,
            max_tokens=req.max_tokens, enqueued_ms=now, deadline_ms=ttl if flow else req.arrival_ms + slo.max_queue_ms,
            future=self.new_future(), exclude=exclude, priority=slo.priority, arrival_ms=req.arrival_ms,
            sheddable=slo.sheddable, **({"expire_reason": "flow-control-ttl"} if flow else {}),
        )  # fmt: skip
        # llm-d counts the request body's bytes; the router's estimate of them: prompt tokens * bytes per token
        size = int(req.prompt_tokens * self.config.admission.bytes_per_token)
        band = band_key(slo.priority, slo.sheddable) if flow else HOLD_BAND
        item = FlowItem(req.tenant, band, size, now, ttl, entry)
        if not q.push(item):
            return Refused("flow-control-capacity")
        self._held_items[entry] = item
        return Queued(entry)

    def dispatch_held(self) -> int:
        """The held queue's dispatch cycle (no-op without one): first every entry whose TTL passed
        fails (:class:`~router.admission_queue.QueueTimeout` ``flow-control-ttl``), then, while the
        gate is open (:meth:`saturated`, asked again after each placement: Dynamo's gate counts the
        prefill just placed; llm-d's detector reads scraped metrics, which placing does not change,
        so one pass empties its queue while the pool has room: llm-d's "thundering herd" between
        scrapes), the next entry (highest band, the fairness policy's flow, FCFS) is placed by the
        profile (:meth:`place_direct`) and its future resolved with the grant (or failed:
        ``overloaded`` / ``no-replica`` when no replica passed the filters, ``PlacementFailed``
        when placement raised). An entry whose future is already done (its client left) is
        dropped. Re-entrant calls (from a future's callback) return at once. Returns the number of
        entries granted."""
        q = self.held_queue
        if q is None or not len(q) or self._held_busy:
            return 0
        self._held_busy = True
        try:
            for item in q.expire(self.clock.now_ms()):
                entry = item.payload
                self._held_items.pop(entry, None)
                if not entry.future.done():
                    entry.future.set_exception(QueueTimeout(entry.expire_reason))
            granted = 0
            while len(q) and not self.saturated():
                item = q.pop()
                assert item is not None
                entry = item.payload
                self._held_items.pop(entry, None)
                if not entry.future.done():
                    granted += self._place_held(entry)
            return granted
        finally:
            self._held_busy = False

    def _place_held(self, entry: WaitingRequest) -> int:
        """Place a held entry now and resolve its future; 1 when granted, else 0."""
        try:
            grant, reason = self.place_direct(entry.slo_class, entry.prompt_tokens, entry.max_tokens, entry.request_id,
                                              entry.exclude)  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - one request's failure answers that request only
            log.error("request %s: placement failed: %s", entry.request_id, type(exc).__name__, exc_info=exc)
            entry.future.set_exception(PlacementFailed(type(exc).__name__))
            return 0
        if grant is None:
            entry.future.set_exception(QueueTimeout("overloaded" if reason in OVERLOAD_FILTERS else "no-replica"))
            return 0
        entry.future.set_result(grant)
        return 1

    def held_next_deadline_ms(self) -> float | None:
        """When the drivers must call :meth:`dispatch_held` at the latest (the earliest TTL of a
        held entry, router clock ms); None when nothing waits with a TTL."""
        return self.held_queue.next_deadline_ms() if self.held_queue is not None else None

    def leave_queue(self, entry: WaitingRequest) -> None:
        """``entry`` is done waiting (granted, refused, expired or its client gone): take it out of
        whichever queue holds it (the fair queue or the held queue). Idempotent."""
        item = self._held_items.pop(entry, None)
        if item is not None and self.held_queue is not None:
            self.held_queue.remove(item)
        self.queue.remove(entry)

    def after_attempt(self, tries: RelayAttempts, req: CoreRequest, grant: Grant, kind: str,
                      pab_ms: float = -1.0, pab_tokens: int = -1) -> RelayAction:
        """Step 5: a relay attempt on ``grant`` ended as ``kind`` (router/relay.py outcome kinds).
        The rule of router/admission.py ``RelayAttempts.after``; the charge is refunded when nothing
        was generated, the lease released or settled, and an agent's refusal on arrival
        (``lease_refused``, with the budget it reported: ``pab_ms`` >= 0) updates the book."""
        action = tries.after(kind, grant.replica_id)
        grant.refused = kind == "lease_refused"
        if action.refund:
            self.charge(req.tenant, -req.prompt_tokens, -self.decode_estimate(req.max_tokens))
        if action.release is not None:
            self.release(grant, action.release)
        else:
            self.lease_done(grant)
        if kind == "lease_refused" and pab_ms >= 0:
            self.book.apply_reserve(grant.replica_id, req.slo_class, pab_ms, pab_tokens)
        return action

    # ------------------------------------------------------------------ latency learning

    @property
    def latency_predictor(self) -> LatencyPredictor | None:
        """The online latency model of a policy that has one (``llm-d-predicted-latency``), else None.
        The driver trains it when :meth:`LatencyPredictor.refit_due` says so: the simulation in place
        at simulated times, the server in a worker thread (router/wiring.py)."""
        return getattr(self.policy, "predictor", None)

    def latency_first_token(self, request_id: str) -> None:
        """The request's first token reached the router (its prompt is no longer in flight)."""
        hook = getattr(self.policy, "first_token", None)
        if hook is not None:
            hook(request_id)

    def latency_observed(self, request_id: str, ttft_ms: float | None, tpot_ms: float | None) -> None:
        """The request ended with its TTFT and TPOT as the router measured them (ms; None: not
        measured): the training signal of a policy that learns latency (no-op for the others)."""
        hook = getattr(self.policy, "observe_latency", None)
        if hook is not None:
            hook(request_id, ttft_ms, tpot_ms)

    def latency_forget(self, request_id: str) -> None:
        """The request ended without a measurement (failed, refused, client gone)."""
        hook = getattr(self.policy, "forget", None)
        if hook is not None:
            hook(request_id)

    @staticmethod
    def attempts(max_tries: int) -> RelayAttempts:
        """The bounds of one request's relay attempts (``max_tries`` replicas on failures, at most
        ``MAX_ADMIT_REFUSALS`` inline refusals)."""
        return RelayAttempts(max_tries, MAX_ADMIT_REFUSALS)
