"""The router's wiring and lifecycle: what one router process holds besides its HTTP handlers.

:class:`RouterWiring` builds the process's parts and hands them to each other: the request core
(router/core.py) on its gRPC port (:class:`GrpcReserve`, over router/budget_client.py), the relay
(router/relay.py), the tenant ledger (router/ledger.py, local or Redis), the tracer, the model
catalog and the metrics. It starts and stops them (budget subscriptions, the dispatcher's task,
discovery, the shared-counter sync), applies a replica set from discovery (router/discovery.py:
an added replica gets its WatchBudget subscription and becomes placeable with its first snapshot;
a removed one is unsubscribed and its in-flight requests fail as on a replica failure) and swaps
in a configuration while serving (:meth:`RouterWiring.reload`: new tenants, keys, classes, limits
and queue bounds apply to new requests; queued and running requests continue; replicas,
discovery, redis_url and telemetry need a restart). The HTTP front door (router/server.py) and
its side endpoints (router/endpoints.py) are built on it.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any

from fairbatch_common.aio import stop_task, within
from fairbatch_common.clock import Clock
from fairbatch_common.telemetry import make_tracer
from router.admission import MAX_RELAY_TRIES
from router.admission_queue import Dispatcher, PlacementFailed, QueueTimeout, WaitingRequest
from router.answers import (
    FLOW_CONTROL_REASONS,
    Answer,
    flow_control,
    overloaded,
    placement_error,
    queue_cap,
    queue_expired,
    queue_full,
    slo_infeasible,
)
from router.auth import ApiKeyAuthenticator, Principal
from router.budget_client import BudgetClient, ReserveResult
from router.budgets import BudgetBook
from router.config import ConfigError, ReplicaConfig, RouterConfig, SloClassConfig, load_config
from router.core import CoreRequest, Grant, Placed, Refused, RouterCore
from router.discovery import DiscoverySource, build_discovery, diff_replicas
from router.fair_queue import FairQueue
from router.ledger import Ledger, TenantLimits, build_ledger
from router.metrics import RouterMetrics
from router.openai_surface import ModelCatalog
from router.placement import PlacementPolicy
from router.prefix_correction import PrefixCorrection
from router.prefix_index import PrefixIndex
from router.relay import Relay, UpstreamAbort
from router.work_shed import WorkShed

log = logging.getLogger("router.server")


def tenant_limits(config: RouterConfig) -> dict[str, TenantLimits]:
    """Ledger quotas per tenant from the config."""
    return {
        name: TenantLimits(t.max_concurrency, t.tokens_per_minute, t.requests_per_minute)
        for name, t in config.tenants.items()
    }


class RouterWiring:
    """All router state for one process; dependencies are built here and passed down.

    Args:
        config: validated configuration.
        clock: router clock (simulated ms).
        router_id: name in Reserve/WatchBudget calls and logs.
        policy: placement policy name from the registry (default ``pab``: the YAML's ``placement``).
        seed: RNG seed for tie-breaks among replicas of equal score (None: the YAML's
            ``placement.seed``, else a random seed per process).
        max_relay_tries: replicas tried when one fails before its first byte.
        discovery: source of the replica set (default: built from ``config.discovery``; None
            there for ``static``, the ``replicas`` list).
        agent_token: shared secret the agents require (``x-fairbatch-token`` on gRPC metadata and on
            the HTTP hop); None = none (``FAIRBATCH_AGENT_TOKEN`` in the CLI).
        otlp_endpoint: span exporter endpoint (``--otlp-endpoint``), before ``telemetry.otlp_endpoint``
            and the ``OTEL_*`` variables (fairbatch_common/telemetry.py).
    """

    def __init__(
        self,
        config: RouterConfig,
        clock: Clock | None = None,
        router_id: str = "router-0",
        policy: str = "pab",
        seed: int | None = None,
        max_relay_tries: int = MAX_RELAY_TRIES,
        discovery: DiscoverySource | None = None,
        agent_token: str | None = None,
        otlp_endpoint: str | None = None,
        redis_password: str | None = None,
    ) -> None:
        self._agent_token = agent_token
        self.config = config
        self.clock = clock or Clock(1.0)
        self.router_id = router_id
        self.max_relay_tries = max(1, max_relay_tries)
        self.replicas = {r.id: r for r in config.replicas}
        self.auth = ApiKeyAuthenticator(config)
        if seed is None:
            seed = config.placement.seed
        if seed is None:
            seed = random.SystemRandom().randrange(2**63)
        self.metrics = RouterMetrics([c.ttft_ms for c in config.slo_classes.values()],
                                     [c.tpot_ms for c in config.slo_classes.values()])
        self.metrics.config_generation.set(1)
        self.metrics.replicas.set(len(self.replicas))
        self._shared_counters = config.redis_url is not None
        self._background: set[asyncio.Task[Any]] = set()
        self.core = RouterCore(
            config, self.clock, GrpcReserve(self), lambda: asyncio.get_running_loop().create_future(), seed,
            policy_name=policy, replica_ids=self.replicas, on_charge=self._share_charge,
            observe_placement=self.metrics.placement_seconds.observe, observe_reserve=self.metrics.reserve_seconds.observe,
        )  # fmt: skip
        self.limits = tenant_limits(config)
        self.budgets = BudgetClient(
            config.replicas, self.core.book, self.clock, router_id, config.admission.reserve_timeout_ms,
            agent_token=agent_token,
        )
        self.relay = Relay()
        self.discovery = discovery if discovery is not None else build_discovery(config.discovery)
        self._discovery_task: asyncio.Task[None] | None = None
        self._inflight: dict[str, set[UpstreamAbort]] = {}
        self.ledger: Ledger = build_ledger(config, self.clock, self._on_ledger_degraded, redis_password)
        self._sync_task: asyncio.Task[None] | None = None
        self._refit_task: asyncio.Task[None] | None = None
        self.tracer = make_tracer(config.telemetry.service_name, otlp_endpoint or config.telemetry.otlp_endpoint,
                                  config.telemetry.sample_ratio)
        self._upstream_headers = {"Content-Type": "application/json", "Accept-Encoding": "identity",
                                  **({"x-fairbatch-token": agent_token} if agent_token else {})}
        self._dispatch_task: asyncio.Task[None] | None = None
        self.catalog = ModelCatalog(lambda: self.relay.session, lambda: [r.http_url for r in self.replicas.values()],
                                    fallback_model=config.model,
                                    headers={"x-fairbatch-token": agent_token} if agent_token else None)  # fmt: skip

    # the core's state, as the tests and the metrics read it
    @property
    def book(self) -> BudgetBook:
        """The budget book (router/budgets.py) of the core."""
        return self.core.book

    @property
    def queue(self) -> FairQueue:
        """The weighted fair queue of the core."""
        return self.core.queue  # type: ignore[no-any-return]

    @property
    def dispatcher(self) -> Dispatcher[Grant]:
        """The queue's dispatcher (router/admission_queue.py)."""
        return self.core.dispatcher

    @property
    def policy(self) -> PlacementPolicy:
        """The placement policy in force."""
        return self.core.policy

    @property
    def prefix(self) -> PrefixIndex | None:
        """The prefix map (``placement.prefix_cache``), None when off."""
        return self.core.prefix

    @property
    def prefix_correction(self) -> PrefixCorrection:
        """The prefix map's correction by the engines' measured hits."""
        return self.core.prefix_correction

    @property
    def work_shed(self) -> WorkShed | None:
        """Work-aware shedding (``admission.work_shed``), None when off."""
        return self.core.work_shed

    @property
    def seed(self) -> int:
        """The placement tie-break seed."""
        return self.core.seed

    def replica_load(self, replica_id: str) -> int:
        """Requests this router holds a lease for on the replica, not yet ended (granted, being relayed)."""
        return self.core.replica_load.get(replica_id, 0)


    async def start(self) -> None:
        """Open the relay session, the budget subscriptions and the dispatcher."""
        await self.relay.start()
        await self.ledger.start()
        await self.budgets.start()
        self._dispatch_task = asyncio.create_task(self.dispatcher.run(), name="dispatcher")
        if self.discovery is not None:
            self._discovery_task = asyncio.create_task(self._run_discovery(self.discovery), name="discovery")
        if self._shared_counters:
            self._sync_task = asyncio.create_task(self._sync_counters(), name="vtc-sync")
        self._refit_task = asyncio.create_task(self._refit_latency(), name="latency-refit")

    async def close(self) -> None:
        """Stop discovery and the dispatcher, finish background releases (bounded), close clients."""
        if self._discovery_task is not None:
            await stop_task(self._discovery_task, 2.0)
            self._discovery_task = None
        if self._dispatch_task is not None:
            await stop_task(self._dispatch_task)
            self._dispatch_task = None
        if self._refit_task is not None:
            await stop_task(self._refit_task)
            self._refit_task = None
        if self._sync_task is not None:
            await stop_task(self._sync_task)
            self._sync_task = None
        if self._background:
            await asyncio.wait(list(self._background), timeout=2.0)
        await self.catalog.close()
        await self.budgets.close()
        await self.relay.close()
        await self.ledger.close()

    async def _refit_latency(self, tick_s: float = 1.0) -> None:
        """The training loop of a policy with a latency model (``llm-d-predicted-latency``; llm-d's
        training server retrains every 10 s): every ``tick_s`` it asks the model whether a training
        is due, copies its samples on the event loop, trains in a worker thread and installs the
        result on the loop, so that no placement waits for a training. A failed training is logged
        and the old model kept."""
        from router.placement.latency_predictor import train

        while True:
            await asyncio.sleep(tick_s)
            predictor = self.core.latency_predictor
            now = self.clock.now_ms()
            if predictor is None or not predictor.refit_due(now):
                continue
            try:
                fitted = await asyncio.to_thread(train, predictor.snapshot(now))
            except Exception:  # noqa: BLE001 - keep serving on the old model
                log.exception("latency model training failed")
                continue
            if self.core.latency_predictor is predictor:  # not swapped by a reload meanwhile
                predictor.install(fitted)

    # ------------------------------------------------------------------ replicas (discovery)

    async def _run_discovery(self, source: DiscoverySource) -> None:
        """Run the discovery source; a crash is logged and the source restarted after 5 s (bounded
        rate), the known replicas kept meanwhile."""
        while True:
            try:
                await source.run(self.apply_replicas)
                return
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - keep serving the replicas we know
                log.exception("discovery failed; restarting it in 5 s")
                await asyncio.sleep(5.0)

    def apply_replicas(self, desired: Mapping[str, ReplicaConfig]) -> None:
        """Make the replica set ``desired`` (by id): subscribe the new ones, drop the vanished ones
        (their in-flight requests fail as on a replica failure). Synchronous; call in the loop."""
        diff = diff_replicas(self.replicas, desired)
        for rid in diff.removed:
            self._remove_replica(rid)
        for rep in diff.added:
            self.replicas[rep.id] = rep
            self.core.add_replica(rep.id)
            self.budgets.add(rep)
            self.metrics.replica_changes.labels("added").inc()
            log.info("replica %s added (%s, %s)", rep.id, rep.http_url, rep.grpc_target)
        if diff:
            self.metrics.replicas.set(len(self.replicas))

    def _remove_replica(self, rid: str) -> None:
        self.replicas.pop(rid, None)
        aborts = self._inflight.pop(rid, set())
        for handle in aborts:
            handle.abort(f"replica {rid} was removed")
        self.metrics.replica_aborts.inc(len(aborts))
        self.core.remove_replica(rid)
        self.budgets.remove(rid)
        self.metrics.replica_changes.labels("removed").inc()
        self.metrics.forget_replica(rid)
        log.info("replica %s removed (%d in-flight requests failed over)", rid, len(aborts))

    # ------------------------------------------------------------------ configuration and ledger

    def apply_config(self, config: RouterConfig) -> list[str]:
        """Swap in a validated configuration while serving; returns warnings for parts that need a
        restart (replicas, redis_url, telemetry), which keep their old values."""
        warnings = []
        if [r.model_dump() for r in config.replicas] != [r.model_dump() for r in self.config.replicas]:
            warnings.append("replicas changed: restart the router to apply")
            config = config.model_copy(update={"replicas": self.config.replicas})
        if config.discovery != self.config.discovery:
            warnings.append("discovery changed: restart the router to apply")
            config = config.model_copy(update={"discovery": self.config.discovery})
        if config.redis_url != self.config.redis_url:
            warnings.append("redis_url changed: restart the router to apply")
        if config.telemetry != self.config.telemetry:
            warnings.append("telemetry changed: restart the router to apply")
        self.config = config
        self.auth = ApiKeyAuthenticator(config)
        self.limits = tenant_limits(config)
        self.core.apply_config(config)
        self.metrics.config_generation.inc()
        return warnings

    def reload(self, path: str) -> bool:
        """Load ``path`` and apply it; an invalid file is refused (logged, counted) and the old
        configuration kept. Returns True when applied."""
        try:
            config = load_config(path)
        except ConfigError as exc:
            self.metrics.observe_reload(False)
            log.error("config reload refused, keeping the running configuration: %s", exc)
            return False
        for w in self.apply_config(config):
            log.warning("config reload: %s", w)
        self.metrics.observe_reload(True)
        log.info("config reloaded from %s (%d tenants, %d keys)", path, len(config.tenants), len(config.api_keys))
        return True

    def _on_ledger_degraded(self, degraded: bool) -> None:
        self.metrics.ledger_degraded.set(1 if degraded else 0)

    async def _sync_counters(self) -> None:
        """Merge the shared VTC counters into the queue every ``counter_sync_ms`` (bounded calls)."""
        while True:
            await asyncio.sleep(self.clock.to_wall_s(self.config.fairness.counter_sync_ms))
            try:
                self.queue.merge_counters(await self.ledger.counters())
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the ledger degrades itself; never stop syncing
                log.exception("VTC counter sync failed")

    def _share_charge(self, tenant: str, delta: float) -> None:
        """A fair-queue charge moved ``tenant``'s counter: share it through the ledger (background)."""
        if self._shared_counters:
            self._spawn(self.ledger.add_service(tenant, delta))

    def predict(self, slo_class: str, band: int, prompt_tokens: int, own_tokens: int = 0,
                waited_ms: float = 0.0) -> tuple[float, float] | None:
        """The core's queue-wait prediction (router/core.py ``RouterCore.predict``)."""
        return self.core.predict(slo_class, band, prompt_tokens, own_tokens, waited_ms)


    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ------------------------------------------------------------------ leases

    async def _acquire(self, req: CoreRequest, exclude: frozenset[str], avoid_now: frozenset[str] = frozenset(),
                       previous: Grant | None = None,
                       on_queued: Callable[[WaitingRequest], Awaitable[None]] | None = None) -> Grant | Refused:
        """A lease for this request: the core's answer (router/core.py ``RouterCore.acquire``),
        waiting for the dispatcher when it was queued. Charged once granted. Both drivers of the
        process use it: the HTTP front door (router/server.py) and the ext_proc picker
        (router/ext_proc.py).

        ``avoid_now``: replicas left out of the immediate placement only (an inline admission they
        refused); the queue entry may use them again once their budget frees. ``previous``: the
        request's last grant (a baseline profile's refused one goes to its next candidate).
        ``on_queued``: awaited once the request waits in the queue, before the wait (the picker
        extends Envoy's message timeout there); the wait is bounded by the entry's deadline either way.
        """
        with self.tracer.start_as_current_span("router.placement") as span:
            got = await self.core.acquire(req, exclude, avoid_now, previous)
            if isinstance(got, Placed):
                span.set_attribute("fairbatch.replica", got.grant.replica_id)
        if isinstance(got, Refused):
            return got
        if isinstance(got, Placed):
            self.core.charge_dispatch(req)
            return got.grant
        entry = got.entry
        if self._shared_counters and got.lifted_counter is not None:
            self._spawn(self.ledger.lift(req.tenant, got.lifted_counter))
        self.metrics.queue_depth.set(len(self.queue))
        now = entry.enqueued_ms
        try:
            if on_queued is not None:
                await on_queued(entry)
            wait_s = None if entry.deadline_ms == float("inf") else self.clock.to_wall_s(entry.deadline_ms - now)
            grant = await within(entry.future, wait_s)  # no deadline: llm-d flow control without a TTL
            self.core.charge_dispatch(req)
            return grant  # type: ignore[no-any-return]
        except TimeoutError:
            return Refused(entry.expire_reason, queued=True)
        except QueueTimeout as exc:
            return Refused(exc.reason, queued=True)
        except PlacementFailed as exc:
            return Refused("placement-error", detail=exc.reason, queued=True)
        except asyncio.CancelledError:
            # the client left; a grant handed over in the same instant must not leak
            fut = entry.future
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self._release(fut.result(), "client-disconnect")
            raise
        finally:
            self.core.leave_queue(entry)  # the fair queue's or the flow-control queue's entry
            self.metrics.queue_depth.set(len(self.queue))
            self.metrics.queue_wait.observe((self.clock.now_ms() - now) / 1000.0)

    def _refusal_answer(self, got: Refused, principal: Principal, slo: SloClassConfig) -> Answer:
        """The answer of one of the core's refusals (router/answers.py), for either driver."""
        if got.reason in ("queue-full", "queue-cap"):
            return queue_full() if got.reason == "queue-full" else queue_cap()
        if got.reason == "overloaded":
            return overloaded()
        if got.reason == "placement-error":
            return placement_error(got.detail)
        if got.reason in FLOW_CONTROL_REASONS:  # llm-d-flow-control (router/core.py)
            return flow_control(got.reason)
        if got.reason == "slo-infeasible" and not got.queued:  # predicted at arrival
            return slo_infeasible(principal.slo_class, slo.ttft_ms, got.wait_ms, self.clock.to_wall_s(got.wait_ms))
        usable = got.reason == "slo-infeasible" or any(v.healthy and v.fresh for v in self.book.views())
        return queue_expired(got.reason, principal.slo_class, slo.ttft_ms, slo.max_queue_ms, usable)

    def _release(self, grant: Grant, reason: str) -> None:
        """Release ``grant`` (router/core.py ``RouterCore.release``; never delays the response)."""
        self.core.release(grant, reason)


class GrpcReserve:
    """The core's :class:`~router.core.ReservePort` over the agents' gRPC service
    (router/budget_client.py); a Release runs in the router's background."""

    __slots__ = ("_router",)

    def __init__(self, router: RouterWiring) -> None:
        self._router = router

    async def reserve(self, replica_id: str, slo_class: str, prompt_tokens: int, request_id: str,
                      max_tokens: int, waited_ms: float, on_time_only: bool = False) -> ReserveResult:
        return await self._router.budgets.reserve(replica_id, slo_class, prompt_tokens, request_id, max_tokens,
                                                  waited_ms, on_time_only)  # fmt: skip

    def release(self, lease_id: str, reason: str) -> None:
        self._router._spawn(self._router.budgets.release(lease_id, reason))
