"""The router's HTTP front door (aiohttp): OpenAI-compatible endpoints, request path, metrics.

One request's path (docs/design.md section 5): authenticate (API key -> tenant, or a trusted gateway
header) -> classify (tenant -> SLO class) -> estimate prompt tokens -> quotas (ledger: request and
token buckets, concurrency; 429 tenant-rate / tenant-concurrency) -> place (filters -> scorers ->
picker) and Reserve on the best replica, falling back to the next on refusal -> else, unless a
sheddable request's first-token deadline is already out of reach (429 slo-infeasible), wait in the
bounded weighted fair queue (:mod:`router.fair_queue`), woken on every budget update and release
-> relay to the replica's agent, bytes unchanged.

The decisions on that path are pure functions this module only carries out (docs/architecture.md
"Who decides what"): router/arrival.py (queue-full before the body, place now or queue, queue or
refuse), router/admission.py (prompt cap, contention cap, held replica, which candidates get a
Reserve and for how many tokens, what follows a relay attempt), router/answers.py (which status
and reason a refusal gets) and router/charges.py (the fair-queue charge).

Fairness accounting (VTC): a request is charged ``w_prefill * prompt + w_decode * max_tokens`` when
it gets its lease (``fairness.default_max_tokens`` when it gives no max_tokens). The relay does not
parse stream chunks, so a streamed request keeps that estimate; a non-stream answer is buffered
anyway, so its ``usage.completion_tokens`` corrects the decode part at completion. A request whose
replica failed before its first byte is refunded.

The configuration can be swapped while serving (:meth:`Router.reload`): new tenants, keys,
classes, limits and queue bounds apply to new requests; queued and running requests continue.

Replicas are the static ``replicas`` list, or come and go at run time from a discovery source
(:mod:`router.discovery`, :meth:`Router.apply_replicas`): an added replica gets its WatchBudget
subscription and becomes placeable with its first snapshot; a removed one is unsubscribed and
dropped, and its in-flight requests fail as on a replica failure (not yet started: retried
elsewhere; streams that already sent bytes: ended with the SSE error event).

Every reservation is freed on every error path (Release RPC in the background); a successful
request's lease is consumed by the agent. Times are simulated ms from the router's
:class:`~replica_agent.clock.Clock`; metric durations in seconds are wall seconds.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import random
import time
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from opentelemetry import trace
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from replica_agent.aio import stop_task, within
from replica_agent.api_schema import ApiError, validate_request
from replica_agent.clock import Clock
from replica_agent.http_guard import (
    REQUEST_ID,
    api_error_response,
    bounded_expect_handler,
    client_request_id,
    error_middleware,
    json_error,
    new_request_id,
    read_body,
)
from replica_agent.openai_stream import requested_choices
from replica_agent.proxy import default_stall_ms
from replica_agent.telemetry import extract_context, genai_request_attributes, inject_context, make_tracer
from replica_agent.telemetry import set_http_status
from router.admission import (
    MAX_ADMIT_REFUSALS,
    MAX_RELAY_TRIES,
    RelayAttempts,
    contention_excluded,
    hold_replica,
    lease_tokens,
    offer_replicas,
    prompt_decision,
    use_inline,
)
from router.admission_queue import Attempt, Dispatcher, PlacementFailed, QueueFull, QueueTimeout, WaitingRequest
from router.answers import Answer, no_budget, placement_error, queue_expired, queue_full
from router.answers import slo_infeasible, tenant_over, work_shed
from router.arrival import Refuse, no_replica_left, place_now_exclude, queue_full_before_body, queue_or_refuse
from router.auth import ApiKeyAuthenticator, Principal
from router.budget_client import BudgetClient
from router.budgets import BudgetBook
from router.charges import decode_correction, decode_estimate
from router.config import ConfigError, ReplicaConfig, RouterConfig, SloClassConfig, load_config
from router.discovery import DiscoverySource, build_discovery, diff_replicas
from router.fair_queue import FairQueue, TenantShare
from router.ledger import CONCURRENCY_RETRY_MS, Ledger, Refusal, TenantLimits, build_ledger
from router.metrics import RouterMetrics
from router.openai_surface import REFUSED_PATHS, RELAYED_PATHS, ModelCatalog, model_not_found, unsupported
from router.placement import (
    DEFAULT_MAX_CANDIDATES,
    PlacementPolicy,
    PlacementRequest,
    ReplicaView,
    default_registry,
    largest_max_prompt,
)
from router.relay import Relay, RelayOutcome, UpstreamAbort
from router.shedding import MAX_DRAIN_RATE, agent_margin_ms, infeasible, predict_start, priced_tokens
from router.prefix_correction import PrefixCorrection
from router.prefix_index import PrefixIndex, text_block_keys
from router.tokens import PromptError, estimate_prompt_tokens, prompt_is_exact, prompt_text
from router.work_shed import BUDGET_REASONS, WorkShed, WorkShedSettings, refuse_by_work

log = logging.getLogger(__name__)

MAX_RESERVE_CANDIDATES = DEFAULT_MAX_CANDIDATES  # Reserve calls per placement before giving up for this pass
_ROUTER_KEY = web.AppKey("fairbatch_router", object)
FIRST_BYTE_MS = web.RequestKey("fairbatch_first_byte_ms", float)
RELAY_EVENTS = web.RequestKey("fairbatch_relay_events", int)
STREAM_SHAPE = web.RequestKey("fairbatch_stream_shape", tuple)


@dataclass(slots=True)
class Grant:
    """A lease on one replica for one request.

    Attributes:
        replica_id: the replica.
        lease_id: the agent's lease id (``reserve`` mode), or the router's own key of an inline
            admission (``inline`` mode: no lease exists on the agent until the request arrives).
        inline: admitted on the router's view; the agent decides on arrival (``x-fairbatch-admit``).
        prompt_tokens: the prompt tokens placed, less those the replica is estimated to hold in its
            prefix cache (sent in ``x-fairbatch-admit``).
    """

    replica_id: str
    lease_id: str
    inline: bool = False
    prompt_tokens: int = 0


class NoReplica(Exception):
    """Every replica has been tried (and failed) for this request."""


class SloInfeasible(Exception):
    """A sheddable request cannot meet its first-token deadline (predicted).

    Attributes:
        wait_ms: predicted queue wait (simulated ms).
    """

    def __init__(self, wait_ms: float) -> None:
        super().__init__(f"predicted wait {wait_ms:.0f} ms")
        self.wait_ms = wait_ms


def tenant_shares(config: RouterConfig) -> dict[str, TenantShare]:
    """Fair-queue contract per tenant from the config (weight, band of its class, min_share)."""
    return {
        name: TenantShare(t.weight, config.slo_classes[t.slo_class].priority, t.min_share or 0.0)
        for name, t in config.tenants.items()
    }


def tenant_limits(config: RouterConfig) -> dict[str, TenantLimits]:
    """Ledger quotas per tenant from the config."""
    return {
        name: TenantLimits(t.max_concurrency, t.tokens_per_minute, t.requests_per_minute)
        for name, t in config.tenants.items()
    }


def openai_error(
    status: int,
    message: str,
    err_type: str = "invalid_request_error",
    code: str | int | None = None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    """An OpenAI-format error response ``{"error": {"message", "type", "param", "code"}}``."""
    return json_error(status, message, err_type, code, param, headers)


def answer_response(answer: Answer) -> web.Response:
    """The response of one of the router's refusals (router/answers.py): OpenAI-format error JSON with
    ``Retry-After`` and ``x-fairbatch-reason``."""
    return openai_error(answer.status, answer.message, answer.err_type, answer.code,
                        headers={"Retry-After": str(answer.retry_after_s), "x-fairbatch-reason": answer.code})


SILENCE_GRACE_S = 5.0
"""Wall seconds added to twice a class's stall timeout before a silent agent is given up (:meth:`Router.silence_s`)."""

openai_http_errors = error_middleware("router", not_found=unsupported)  # any unrouted path: unsupported_endpoint
metrics_http_errors = error_middleware("router")  # the metrics port serves no OpenAI path
"""aiohttp's own HTTP errors (404, 405, 413), :class:`ApiError` refusals and our own bugs (500 with the
request id) as OpenAI-format JSON, like every other answer of the router."""


class Router:
    """All router state for one process; dependencies are built here and passed down.

    Args:
        config: validated configuration.
        clock: router clock (simulated ms).
        router_id: name in Reserve/WatchBudget calls and logs.
        policy: placement policy name from the registry (default ``pab``).
        seed: RNG seed for tie-breaks among replicas of equal score (None: the YAML's
            ``placement.seed``, else a random seed per process).
        max_relay_tries: replicas tried when one fails before its first byte.
        discovery: source of the replica set (default: built from ``config.discovery``; None
            there for ``static``, the ``replicas`` list).
        agent_token: shared secret the agents require (``x-fairbatch-token`` on gRPC metadata and on
            the HTTP hop); None = none (``FAIRBATCH_AGENT_TOKEN`` in the CLI).
        otlp_endpoint: span exporter endpoint (``--otlp-endpoint``), before ``telemetry.otlp_endpoint``
            and the ``OTEL_*`` variables (replica_agent/telemetry.py).
        redis_password: password of ``redis_url``'s Redis (``FAIRBATCH_REDIS_PASSWORD`` in the CLI); None = none
            or the URL's own.
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
        self.book = BudgetBook(self.clock, self.replicas)
        if seed is None:
            seed = config.placement.seed
        if seed is None:
            seed = random.SystemRandom().randrange(2**63)
        self.seed = seed
        self._policy_name = policy
        self.policy: PlacementPolicy = self._build_policy(config)
        self._applied_placement = config.placement.model_dump(exclude={"prefix_cache"})
        self.prefix: PrefixIndex | None = None  # prefix-aware placement (placement.prefix_cache)
        self.prefix_correction = PrefixCorrection()  # the map discounted by the engines' measured hits
        self._prefix_keys: dict[str, list[int]] = {}  # request id -> its prompt's prefix keys, while placing
        self._configure_prefix(config)
        self._configure_work_shed(config)
        fc = config.fairness
        self.queue = FairQueue(
            config.queue.max_requests, config.queue.max_tokens, tenant_shares(config),
            fc.w_prefill, fc.w_decode, fc.default_max_tokens, config.queue.aging_floor_share,
        )
        self.limits = tenant_limits(config)
        self.dispatcher: Dispatcher[Grant] = Dispatcher(
            queue=self.queue,
            clock=self.clock,
            admit=self._admit_waiting,
            release_orphan=self._release_orphan,
            max_bypass=config.queue.max_bypass,
            hold_for=self._hold_for,
            skip_dominated=True,
            shed=self._shed,
            shed_recheck_ms=config.queue.shed_recheck_ms,
            probe=self._probe_waiting,
        )
        self.book.add_listener(self.dispatcher.wake)
        self.budgets = BudgetClient(
            config.replicas, self.book, self.clock, router_id, config.admission.reserve_timeout_ms,
            agent_token=agent_token,
        )
        self.relay = Relay()
        self.metrics = RouterMetrics([c.ttft_ms for c in config.slo_classes.values()],
                                     [c.tpot_ms for c in config.slo_classes.values()])
        self.metrics.config_generation.set(1)
        self.metrics.replicas.set(len(self.replicas))
        self.discovery = discovery if discovery is not None else build_discovery(config.discovery)
        self._discovery_task: asyncio.Task[None] | None = None
        self._inflight: dict[str, set[UpstreamAbort]] = {}
        self.ledger: Ledger = build_ledger(config, self.clock, self._on_ledger_degraded, redis_password)
        self._shared_counters = config.redis_url is not None
        self._sync_task: asyncio.Task[None] | None = None
        self.tracer = make_tracer(config.telemetry.service_name, otlp_endpoint or config.telemetry.otlp_endpoint,
                                  config.telemetry.sample_ratio)
        self._background: set[asyncio.Task[Any]] = set()
        self._leased: dict[str, str] = {}  # lease id -> replica id, until the request ends
        self._inline_seq = 0  # keys of inline admissions (Grant.lease_id)
        self._upstream_headers = {"Content-Type": "application/json", "Accept-Encoding": "identity",
                                  **({"x-fairbatch-token": agent_token} if agent_token else {})}
        self._replica_load: collections.Counter[str] = collections.Counter()
        self._dispatch_task: asyncio.Task[None] | None = None
        self.catalog = ModelCatalog(lambda: self.relay.session, lambda: [r.http_url for r in self.replicas.values()],
                                    fallback_model=config.model,
                                    headers={"x-fairbatch-token": agent_token} if agent_token else None)  # fmt: skip

    # ------------------------------------------------------------------ lifecycle

    def build_app(self) -> web.Application:
        """The aiohttp application (routes, lifecycle hooks, response headers)."""
        app = web.Application(client_max_size=self.config.http.max_body_bytes + 1, middlewares=[openai_http_errors])
        app[_ROUTER_KEY] = self
        expect = bounded_expect_handler(lambda: self.config.http.max_body_bytes)  # no 100 before a 413
        app.router.add_post("/v1/completions", self.handle_completions, expect_handler=expect)
        app.router.add_post("/v1/chat/completions", self.handle_chat, expect_handler=expect)
        app.router.add_get("/v1/models", self.handle_models)
        app.router.add_get("/v1/models/{model_id}", self.handle_model)
        for path in RELAYED_PATHS:
            app.router.add_post(path, self.handle_utility, expect_handler=expect)
        for path in REFUSED_PATHS:
            app.router.add_route("*", path, self.handle_unsupported)
        if self.config.http.metrics_port is None:
            app.router.add_get("/health", self.handle_health)
            app.router.add_get("/metrics", self.handle_metrics)
        else:  # names (replicas, tenants) only on the metrics port
            app.router.add_get("/health", self.handle_public_health)
        app.on_response_prepare.append(self._on_response_prepare)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    def build_metrics_app(self) -> web.Application:
        """The application of ``http.metrics_port``: ``/metrics`` and the detailed ``/health`` (no
        lifecycle hooks: the main application starts and stops the router)."""
        app = web.Application(middlewares=[metrics_http_errors])
        app.router.add_get("/health", self.handle_health)
        app.router.add_get("/metrics", self.handle_metrics)
        return app

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

    async def close(self) -> None:
        """Stop discovery and the dispatcher, finish background releases (bounded), close clients."""
        if self._discovery_task is not None:
            await stop_task(self._discovery_task, 2.0)
            self._discovery_task = None
        if self._dispatch_task is not None:
            await stop_task(self._dispatch_task)
            self._dispatch_task = None
        if self._sync_task is not None:
            await stop_task(self._sync_task)
            self._sync_task = None
        if self._background:
            await asyncio.wait(list(self._background), timeout=2.0)
        await self.catalog.close()
        await self.budgets.close()
        await self.relay.close()
        await self.ledger.close()

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
            self.book.add_replica(rep.id)
            self.budgets.add(rep)
            self.metrics.replica_changes.labels("added").inc()
            log.info("replica %s added (%s, %s)", rep.id, rep.http_url, rep.grpc_target)
        if diff:
            self.metrics.replicas.set(len(self.replicas))
            self.dispatcher.wake()

    def _remove_replica(self, rid: str) -> None:
        self.replicas.pop(rid, None)
        aborts = self._inflight.pop(rid, set())
        for handle in aborts:
            handle.abort(f"replica {rid} was removed")
        self.metrics.replica_aborts.inc(len(aborts))
        self.book.remove_replica(rid)
        if self.prefix is not None:
            self.prefix.forget(rid)
        self.prefix_correction.forget(rid)
        self.budgets.remove(rid)
        self.metrics.replica_changes.labels("removed").inc()
        self.metrics.forget_replica(rid)
        log.info("replica %s removed (%d in-flight requests failed over)", rid, len(aborts))

    # ------------------------------------------------------------------ configuration and ledger

    def _build_policy(self, config: RouterConfig) -> PlacementPolicy:
        """The placement policy: the YAML's ``placement`` section (profile or plugin chain), or the
        registry policy named at construction when it is not the default ``pab``."""
        if self._policy_name != "pab":
            return default_registry().build(self._policy_name, seed=self.seed)
        return config.placement.build(self.seed)  # type: ignore[no-any-return]

    def _configure_prefix(self, config: RouterConfig) -> None:
        """Build (or drop) the prefix map for ``placement.prefix_cache``; a map whose settings did not
        change is kept, with what it learned."""
        pc = config.placement.prefix_cache
        if not pc.enabled:
            self.prefix = None
            return
        tokens_per_key = max(1, round(pc.chunk_chars / config.admission.bytes_per_token))
        capacity = max(1, pc.capacity_tokens // tokens_per_key)
        if self.prefix is None or (self.prefix.capacity_keys, self.prefix.tokens_per_key) != (capacity, tokens_per_key):
            self.prefix = PrefixIndex(capacity, tokens_per_key)
            self.prefix_correction = PrefixCorrection()

    def _configure_work_shed(self, config: RouterConfig) -> None:
        """Build (or drop) the state of ``admission.work_shed`` (router/work_shed.py); kept, with what
        it learned, when its settings did not change."""
        ws = config.admission.work_shed
        new = WorkShedSettings(ws.gain, ws.max_share, ws.window, ws.horizon, ws.min_samples) if ws.enabled else None
        old: WorkShed | None = getattr(self, "work_shed", None)
        self.work_shed = None if new is None else old if old is not None and old.settings == new else WorkShed(new)

    def _refuse_by_work(self, principal: Principal, views: list[ReplicaView], prompt_tokens: int,
                        max_tokens: int) -> bool:
        """router/work_shed.py at a new request's arrival (sheddable classes, ``admission.work_shed``
        on): True = answer it 429 ``work-shed``. Priced on the whole prompt and the fair queue's decode
        estimate, as the fleet simulation does."""
        if self.work_shed is None or not principal.slo.sheddable:
            return False
        return refuse_by_work(self.work_shed, views, prompt_tokens, self._decode_estimate(max_tokens))

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
        fc = config.fairness
        self.queue.set_bounds(config.queue.max_requests, config.queue.max_tokens)
        self.queue.set_tenants(tenant_shares(config))
        self.queue.w_prefill, self.queue.w_decode = fc.w_prefill, fc.w_decode
        self.queue.default_max_tokens = fc.default_max_tokens
        self.queue.aging_floor_share = config.queue.aging_floor_share
        self.dispatcher.max_bypass = config.queue.max_bypass
        self.dispatcher.shed_recheck_ms = config.queue.shed_recheck_ms
        old_pl = self._applied_placement
        new_pl = config.placement.model_dump(exclude={"prefix_cache"})
        if new_pl != old_pl:  # a new profile or chain: rebuilt now (the tie-break seed kept unless changed)
            if new_pl.get("seed") is not None:
                self.seed = new_pl["seed"]
            self.policy = self._build_policy(config)
            self._applied_placement = new_pl
        self._configure_prefix(config)
        self._configure_work_shed(config)
        self.metrics.config_generation.inc()
        self.dispatcher.wake()
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

    def _charge(self, tenant: str, prefill_tokens: int, decode_tokens: int) -> None:
        """Count service for the fair queue and, when shared, in the ledger (background)."""
        delta = self.queue.charge(tenant, prefill_tokens, decode_tokens)
        if self._shared_counters and delta:
            self._spawn(self.ledger.add_service(tenant, delta))

    def _decode_estimate(self, max_tokens: int) -> int:
        """The decode tokens charged at dispatch (router/charges.py ``decode_estimate``)."""
        return decode_estimate(max_tokens, self.config.fairness.default_max_tokens)

    def _cached(self, request_id: str, prompt_tokens: int) -> tuple[dict[str, int], dict[str, int]]:
        """(raw, discounted) prompt tokens the prefix map estimates each replica holds for this
        request: the map's estimate, and the same discounted where an engine measured fewer hits
        than the map promised (router/prefix_correction.py); both empty without a map or keys."""
        prefix, keys = self.prefix, self._prefix_keys.get(request_id)
        raw = prefix.cached_tokens(keys, prompt_tokens) if prefix is not None and keys else {}
        return raw, (self.prefix_correction.discount(raw, self.book.prefix_measured) if raw else raw)

    def _priced(self, request_id: str, prompt_tokens: int) -> int:
        """The prompt tokens the shedding rule prices (router/shedding.py ``priced_tokens``, as the
        fleet simulation's routers do): what is left to compute on the warmest replica."""
        return priced_tokens(prompt_tokens, self._cached(request_id, prompt_tokens)[1]) if self.prefix else prompt_tokens

    def _shed(self, entry: WaitingRequest, now_ms: float) -> bool:
        """A queued sheddable request that the dispatcher could not place: True when the prediction
        (:meth:`predict` on its priced tokens, its own tokens not counted as ahead of it) says it can
        no longer start in time (router/shedding.py ``infeasible``)."""
        prediction = self.predict(entry.slo_class, entry.priority, self._priced(entry.request_id, entry.prompt_tokens),
                                  entry.prompt_tokens, max(0.0, now_ms - entry.arrival_ms))
        return infeasible(now_ms, entry.first_token_deadline_ms, prediction, self._margin_ms(entry.slo_class))

    def _margin_ms(self, slo_class: str) -> float:
        """The agents' safety margin for the class (router/shedding.py ``agent_margin_ms``)."""
        return agent_margin_ms(self.book.views(), slo_class)

    def predict(
        self, slo_class: str, band: int, prompt_tokens: int, own_tokens: int = 0, waited_ms: float = 0.0
    ) -> tuple[float, float] | None:
        """(predicted queue wait, predicted prefill) in simulated ms, or None without a usable replica
        (router/shedding.py ``predict_start``; ``own_tokens``: the request's own when it is queued
        already, not counted as ahead of it; ``waited_ms``: since its arrival)."""
        tokens = max(0, self.queue.tokens_ahead(band) - own_tokens)
        return predict_start(self.book.views(), self.book.drain, slo_class, prompt_tokens, tokens, MAX_DRAIN_RATE,
                             self.clock.now_ms(), waited_ms)

    async def _on_startup(self, app: web.Application) -> None:
        await self.start()

    async def _on_cleanup(self, app: web.Application) -> None:
        await self.close()

    async def _on_response_prepare(self, request: web.Request, response: web.StreamResponse) -> None:
        if FIRST_BYTE_MS not in request:  # a stream's first event is written right after this hook
            request[FIRST_BYTE_MS] = self.clock.now_ms()
        if "x-request-id" not in response.headers:
            rid = request.get(REQUEST_ID) or client_request_id(request.headers.get("x-request-id")) or new_request_id()
            response.headers["x-request-id"] = rid

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ------------------------------------------------------------------ leases

    def _release(self, grant: Grant, reason: str) -> None:
        """Release ``grant`` in the background (never delays the response). An inline admission
        has no lease on the agent (it was taken, or not, when the request arrived, and the agent
        frees it with the request): only the router's own count is dropped."""
        self._lease_done(grant)
        if grant.inline:
            self.book.notify()  # a slot freed here: wake the dispatcher as a Release answer would
            return
        self._spawn(self.budgets.release(grant.lease_id, reason))

    async def _release_orphan(self, grant: Grant) -> None:
        self._release(grant, "client-gone")

    async def _place_and_reserve(
        self,
        slo_class: str,
        prompt_tokens: int,
        max_tokens: int,
        request_id: str,
        exclude: frozenset[str],
        arrival_ms: float,
        attempt: Attempt = Attempt(),
    ) -> Grant | None:
        """Placement, then Reserve on the candidates in order; None when none granted.

        Both see the request's age ``waited_ms = now - arrival_ms`` (router clock, simulated ms):
        its TTFT has that much less time left (pab.py "Aged requests"); ``attempt`` says whether
        only on-time replicas count and which replicas are held for an entry ahead. Placement
        applies the start window of ``admission`` (``start_window_steps``, ``step_tokens``).
        """
        adm = self.config.admission
        t0 = time.perf_counter()
        prefix = self.prefix
        preq, raw, cached = self._placement_request(slo_class, prompt_tokens, request_id, exclude, arrival_ms, attempt)
        policy = self.policy  # a reload may swap it while the Reserves below are awaited
        result = policy.place(preq, self.book.views())
        self.metrics.placement_seconds.observe(time.perf_counter() - t0)
        # no round trip where the agent decides when the request arrives (router/admission.py use_inline)
        inline = bool(result.candidates) and use_inline(adm.lease_mode, self.book.inline_admission(result.candidates[0]))
        # which candidates, with which lease parameters: router/admission.py offer_replicas, lease_tokens
        for replica_id in offer_replicas(result.candidates, inline, MAX_RESERVE_CANDIDATES):
            uncached = lease_tokens(prompt_tokens, cached, replica_id)  # the prefill left to compute
            self.book.take_local(replica_id, slo_class, uncached)
            if inline:
                self._inline_seq += 1
                grant = Grant(replica_id, f"inline-{self._inline_seq}", True, uncached)
            else:
                t1 = time.perf_counter()
                waited_ms = max(0.0, self.clock.now_ms() - arrival_ms)  # refused Reserves before took time
                answer = await self.budgets.reserve(
                    replica_id, slo_class, uncached, request_id, max_tokens, waited_ms
                )
                self.metrics.reserve_seconds.observe(time.perf_counter() - t1)
                if not answer.granted:
                    continue
                grant = Grant(replica_id, answer.lease_id)
            keys = self._prefix_keys.get(request_id)
            if prefix is not None and keys:  # post-decision: the replica now holds this prompt
                prefix.insert(replica_id, keys)
                self.prefix_correction.record(replica_id, raw.get(replica_id, 0), prompt_tokens)
            policy.after_decision(preq, replica_id)  # post-decision hooks of the placement plugins
            self._leased[grant.lease_id] = replica_id
            self._replica_load[replica_id] += 1
            return grant
        return None

    def _placement_request(
        self, slo_class: str, prompt_tokens: int, request_id: str, exclude: frozenset[str], arrival_ms: float,
        attempt: Attempt,
    ) -> tuple[PlacementRequest, dict[str, int], dict[str, int]]:
        """(placement request, raw cached, discounted cached) for one placement now: the request's
        age, the contention cap, the start window and the prefix map's estimates (no side effect)."""
        adm = self.config.admission
        waited_ms = max(0.0, self.clock.now_ms() - arrival_ms)
        raw, cached = self._cached(request_id, prompt_tokens)
        preq = PlacementRequest(
            slo_class, prompt_tokens, exclude | attempt.avoid | self._contention_excluded(), waited_ms,
            on_time_only=attempt.on_time_only, window_steps=adm.start_window_steps, step_tokens=adm.step_tokens,
            cached_tokens=cached,
        )
        return preq, raw, cached

    def _probe_waiting(self, entry: WaitingRequest, attempt: Attempt) -> bool:
        """The dispatcher's watchdog probe: would the placement put ``entry`` somewhere now
        (router/admission_queue.py ``Dispatcher.probe``; no Reserve, no bookkeeping)."""
        preq, _, _ = self._placement_request(entry.slo_class, entry.prompt_tokens, entry.request_id, entry.exclude,
                                             entry.arrived_ms, attempt)
        return bool(self.policy.place(preq, self.book.views()).candidates)

    def _lease_done(self, grant: Grant) -> None:
        """The request of ``grant`` ended (served, failed, released or gone): it no longer counts
        in its replica's load. Idempotent."""
        rid = self._leased.pop(grant.lease_id, None)
        if rid is not None:
            self._replica_load[rid] -= 1
            if self._replica_load[rid] <= 0:
                del self._replica_load[rid]

    def replica_load(self, replica_id: str) -> int:
        """Requests this router holds a lease for on the replica, not yet ended (granted, being relayed)."""
        return self._replica_load.get(replica_id, 0)

    def _contention_excluded(self) -> frozenset[str]:
        """Replicas at the contention cap (router/admission.py ``contention_excluded``)."""
        return contention_excluded(self.config.admission.contention_max_inflight, self.queue.backlogged_tenants(),
                                   self._replica_load)  # fmt: skip

    async def _admit_waiting(self, entry: WaitingRequest, attempt: Attempt = Attempt()) -> Grant | None:
        return await self._place_and_reserve(
            entry.slo_class, entry.prompt_tokens, entry.max_tokens, entry.request_id, entry.exclude, entry.arrived_ms,
            attempt,
        )

    def _hold_for(self, entry: WaitingRequest) -> str | None:
        """The replica to hold for a starving queue head (router/admission.py ``hold_replica``)."""
        return hold_replica(entry.slo_class, entry.prompt_tokens, entry.exclude, self.book.views())

    async def _acquire(
        self,
        principal: Principal,
        prompt_tokens: int,
        max_tokens: int,
        request_id: str,
        exclude: frozenset[str],
        arrival_ms: float,
        avoid_now: frozenset[str] = frozenset(),
    ) -> Grant:
        """A lease for this request: at once when a replica fits and nobody waits, else via the queue.

        ``avoid_now``: replicas left out of the immediate placement only (an inline admission they
        refused); the queue entry may use them again once their budget frees.

        Raises:
            QueueFull: the queue is at its bound.
            QueueTimeout: ``max_queue_ms`` of the class passed while waiting.
            NoReplica: every replica already failed for this request.
            PlacementFailed: placement or Reserve raised for this request (at once or in the dispatcher).
        """
        replica_ids = self.replicas.keys()
        if no_replica_left(replica_ids, exclude):  # router/arrival.py
            raise NoReplica()
        place_exclude = place_now_exclude(replica_ids, exclude, avoid_now, len(self.queue))
        if place_exclude is not None:  # nobody waits: placed at once when a replica fits
            with self.tracer.start_as_current_span("router.placement") as span:
                try:
                    grant = await self._place_and_reserve(
                        principal.slo_class, prompt_tokens, max_tokens, request_id, place_exclude, arrival_ms,
                    )
                except Exception as exc:  # noqa: BLE001 - one request's failure answers that request only
                    log.error("request %s: placement failed: %s", request_id, type(exc).__name__, exc_info=exc)
                    raise PlacementFailed(type(exc).__name__) from None
                span.set_attribute("fairbatch.replica", grant.replica_id if grant else "")
            if grant is not None:
                self._charge(principal.tenant, prompt_tokens, self._decode_estimate(max_tokens))
                return grant
        now = self.clock.now_ms()
        slo, slo_class = principal.slo, principal.slo_class
        band = slo.priority
        decision = queue_or_refuse(now, arrival_ms, slo.ttft_ms, slo.max_queue_ms, slo.sheddable,  # router/arrival.py
                                   lambda: self.predict(slo_class, band, self._priced(request_id, prompt_tokens), 0,
                                                        max(0.0, now - arrival_ms)),
                                   lambda: self._margin_ms(slo_class))  # fmt: skip
        if isinstance(decision, Refuse):
            if decision.reason == "slo-infeasible":
                raise SloInfeasible(decision.wait_ms)
            raise QueueTimeout(decision.reason)
        deadline_ms, expire_reason = decision.deadline_ms, decision.expire_reason
        entry = WaitingRequest(
            request_id=request_id,
            tenant=principal.tenant,
            slo_class=principal.slo_class,
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
            enqueued_ms=now,
            deadline_ms=deadline_ms,
            future=asyncio.get_running_loop().create_future(),
            exclude=exclude,
            priority=band,
            first_token_deadline_ms=decision.first_token_deadline_ms,
            expire_reason=expire_reason,
            arrival_ms=arrival_ms,
            promote_at_ms=decision.promote_at_ms,
            sheddable=slo.sheddable,
        )
        before = self.queue.counter(principal.tenant)
        after = self.queue.push(entry)  # QueueFull propagates
        if self._shared_counters and after > before:
            self._spawn(self.ledger.lift(principal.tenant, after))
        self.metrics.queue_depth.set(len(self.queue))
        self.dispatcher.wake()
        try:
            grant = await within(entry.future, self.clock.to_wall_s(deadline_ms - now))
            self._charge(principal.tenant, prompt_tokens, self._decode_estimate(max_tokens))
            return grant
        except TimeoutError:
            raise QueueTimeout(expire_reason) from None
        except asyncio.CancelledError:
            # the client left; a grant handed over in the same instant must not leak
            fut = entry.future
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self._release(fut.result(), "client-disconnect")
            raise
        finally:
            self.queue.remove(entry)
            self.metrics.queue_depth.set(len(self.queue))
            self.metrics.queue_wait.observe((self.clock.now_ms() - now) / 1000.0)

    # ------------------------------------------------------------------ handlers

    async def handle_completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/completions."""
        return await self._handle_generate(request, chat=False)

    async def handle_chat(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/chat/completions."""
        return await self._handle_generate(request, chat=True)

    async def _handle_generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        arrival_ms = self.clock.now_ms()
        # The router's own id keys the quota slot, the queue entry, the lease and the agent's and engine's
        # request; the client's x-request-id (when well-formed) is only echoed back and logged.
        request_id = new_request_id()
        client_id = client_request_id(request.headers.get("x-request-id"))
        request[REQUEST_ID] = client_id or request_id
        parent = extract_context(request.headers) if "traceparent" in request.headers else None
        with self.metrics.inflight.track_inprogress(), self.tracer.start_as_current_span(
            "router.request", context=parent, kind=trace.SpanKind.SERVER
        ) as span:
            span.set_attribute("http.request.method", request.method)
            span.set_attribute("url.path", request.path)
            span.set_attribute("fairbatch.request_id", request_id)
            if client_id is not None:
                span.set_attribute("fairbatch.client_request_id", client_id)
            principal = self.auth.identify(request.headers, request.remote)
            if principal is None:
                self.metrics.observe_answer("unknown", "unknown", "unauthorized", 401, 0.0, None, None, 0.0, 0.0)
                return openai_error(401, self.auth.refusal(request.headers, request.remote), code="invalid_api_key")
            span.set_attribute("fairbatch.tenant", principal.tenant)
            span.set_attribute("fairbatch.slo_class", principal.slo_class)
            try:
                outcome, response = await self._serve(request, principal, chat, request_id, arrival_ms)
            except ApiError as exc:  # the body: too large, too slow, not valid (4xx in OpenAI's format)
                outcome, response = "bad_request", api_error_response(exc)
            except asyncio.CancelledError:  # client went away (queued or mid-relay); leases already freed
                self.metrics.requests.labels(principal.tenant, principal.slo_class, "client_disconnect").inc()
                raise
            self._observe(request, principal, outcome, response.status, arrival_ms, chat)
            span.set_attribute("fairbatch.outcome", outcome)
            set_http_status(span, response.status, "upstream_error" if outcome == "upstream_error" else None)
            return response

    def _observe(
        self, request: web.Request, principal: Principal, outcome: str, code: int, arrival_ms: float, chat: bool
    ) -> None:
        """Record one answered request in the metrics (router/metrics.py: TTFT to the first byte relayed,
        a non-stream answer's whole body; TPOT over the relayed events per choice, chat's role event
        and the usage event not counted)."""
        now = self.clock.now_ms()
        first = request.get(FIRST_BYTE_MS)
        ttft_s = ((now if first is None else first) - arrival_ms) / 1000.0 if outcome == "ok" else None
        tpot_s = None
        choices, usage = request.get(STREAM_SHAPE, (0, False))
        if outcome == "ok" and first is not None and choices > 0:
            tokens = (request.get(RELAY_EVENTS, 0) - usage) / choices - (1 if chat else 0)
            if tokens >= 2:
                tpot_s = (now - first) / 1000.0 / (tokens - 1)
        slo = principal.slo
        self.metrics.observe_answer(principal.tenant, principal.slo_class, outcome, code, (now - arrival_ms) / 1000.0,
                                    ttft_s, tpot_s, slo.ttft_ms / 1000.0, slo.tpot_ms / 1000.0)  # fmt: skip

    async def _serve(
        self, request: web.Request, principal: Principal, chat: bool, request_id: str, arrival_ms: float
    ) -> tuple[str, web.StreamResponse]:
        """Body, validation, prompt estimate, quota, then placement (:meth:`_serve_placed`).

        Raises:
            ApiError: the body is too large (413), too slow (408), compressed (415) or not a valid
                request (400); the caller answers it.
        """
        if queue_full_before_body(len(self.queue), self.queue.max_requests):  # router/arrival.py
            return self._answer(queue_full())
        limits = self.limits.get(principal.tenant, TenantLimits())
        if await self.ledger.at_concurrency(principal.tenant, limits):  # also known before the body
            return self._answer(tenant_over("tenant-concurrency", principal.tenant,
                                            self.clock.to_wall_s(CONCURRENCY_RETRY_MS)))  # fmt: skip
        http = self.config.http
        raw = await read_body(request, http.max_body_bytes, http.body_timeout_s)
        views = self.book.views()
        valid = validate_request(raw, chat, largest_max_prompt(views))
        body = valid.body
        if not isinstance(body.get("model"), str) or not body["model"]:
            return "bad_request", openai_error(400, "'model' is required.", param="model")
        served = await self.catalog.served_for(body["model"])  # before any quota or lease; no fetch on the hot path
        if served is not None and body["model"] not in served:
            return "bad_request", model_not_found(body["model"], served)
        try:
            prompt_tokens = estimate_prompt_tokens(body, chat, self.config.admission.bytes_per_token)
        except PromptError as exc:
            return "bad_request", openai_error(400, str(exc), param="messages" if chat else "prompt")
        if valid.stream:  # for the TPOT metric (:meth:`_observe`)
            opts = body.get("stream_options")
            with_usage = isinstance(opts, dict) and bool(opts.get("include_usage"))
            request[STREAM_SHAPE] = (requested_choices(body), with_usage)
        genai_request_attributes(trace.get_current_span(), chat, body, valid.max_tokens)
        max_tokens = (valid.max_tokens or 0) * requested_choices(body)  # n > 1: n sequences decode, each up to max_tokens
        adm = self.config.admission
        cap = prompt_decision(prompt_tokens, prompt_is_exact(body, chat), views, adm.bytes_per_token,
                              adm.estimate_refuse_factor)  # fmt: skip
        if cap.refusal is not None:
            return "bad_request", openai_error(400, cap.refusal, param="messages" if chat else "prompt",
                                               code="context_length_exceeded")  # fmt: skip
        prompt_tokens = cap.tokens
        if self._refuse_by_work(principal, views, prompt_tokens, max_tokens):
            return self._answer(work_shed(principal.slo_class))

        quota = await self.ledger.acquire(
            principal.tenant, request_id, limits, prompt_tokens + self._decode_estimate(max_tokens)
        )
        if isinstance(quota, Refusal):
            return self._answer(tenant_over(quota.reason, principal.tenant, self.clock.to_wall_s(quota.retry_after_ms)))
        if self.prefix is not None:
            self._prefix_keys[request_id] = text_block_keys(prompt_text(body, chat),
                                                            self.config.placement.prefix_cache.chunk_chars)
        try:
            return await self._serve_placed(request, principal, raw, request_id, arrival_ms, prompt_tokens, max_tokens,
                                            valid.stream)
        finally:
            self._prefix_keys.pop(request_id, None)
            self._spawn(self.ledger.release(quota))

    async def _serve_placed(
        self, request: web.Request, principal: Principal, raw: bytes, request_id: str, arrival_ms: float,
        prompt_tokens: int, max_tokens: int, stream: bool,
    ) -> tuple[str, web.StreamResponse]:
        last: RelayOutcome | None = None
        last_replica = ""
        decode_estimate = self._decode_estimate(max_tokens)
        tries = RelayAttempts(self.max_relay_tries, MAX_ADMIT_REFUSALS)  # router/admission.py: bounds, exclusions
        slo = principal.slo
        while tries.next_try():
            try:
                # after an inline refusal: placed elsewhere at once when another replica fits, else
                # queued for any replica (the refusing one's answer already updated the view)
                grant = await self._acquire(principal, prompt_tokens, max_tokens, request_id, tries.exclude,
                                            arrival_ms, tries.refused_on)  # fmt: skip
            except QueueFull:
                return self._answer(queue_full())
            except SloInfeasible as exc:
                if self.work_shed is not None:
                    self.work_shed.budget_refused()
                return self._answer(slo_infeasible(principal.slo_class, slo.ttft_ms, exc.wait_ms,
                                                   self.clock.to_wall_s(exc.wait_ms)))  # fmt: skip
            except QueueTimeout as exc:
                if self.work_shed is not None and exc.reason in BUDGET_REASONS:
                    self.work_shed.budget_refused()
                usable = exc.reason == "slo-infeasible" or any(v.healthy and v.fresh for v in self.book.views())
                return self._answer(queue_expired(exc.reason, principal.slo_class, slo.ttft_ms, slo.max_queue_ms,
                                                  usable))  # fmt: skip
            except NoReplica:
                break
            except PlacementFailed as exc:  # placement raised for this request: answered, never retried
                return self._answer(placement_error(exc.reason))
            outcome = await self._forward(request, principal, grant, raw, request_id, arrival_ms, stream)
            action = tries.after(outcome.kind, grant.replica_id)  # router/admission.py after_relay
            if action.refund:  # nothing was generated: the dispatch charge goes back
                self._charge(principal.tenant, -prompt_tokens, -decode_estimate)
            if action.release is not None:
                self._release(grant, action.release)
            else:
                self._lease_done(grant)
            if outcome.kind == "lease_refused":  # the agent's budget was gone on arrival: nothing ran
                if outcome.pab_ms >= 0:
                    self.book.apply_reserve(grant.replica_id, principal.slo_class, outcome.pab_ms, outcome.pab_tokens)
                self.metrics.admit_refusals.labels(grant.replica_id).inc()
            if action.next == "give_up":
                return self._answer(no_budget(tries.refusals))
            if action.next == "replace":  # not a failure of the replica: re-place as after a refused Reserve
                continue
            if action.next == "answer":
                if outcome.kind == "ok":
                    self.budgets.forget(grant.lease_id)
                    if not stream and isinstance(outcome.response, web.Response):
                        self._correct_decode(principal.tenant, outcome.response, decode_estimate)
                elif outcome.kind == "refused":
                    log.info("request %s: replica %s refused it: %s", request_id, grant.replica_id, outcome.detail)
                elif outcome.kind == "client_gone":
                    return action.outcome, outcome.response or web.Response(status=499)
                return action.outcome, outcome.response  # type: ignore[return-value]
            log.warning("request %s: replica %s failed before the first byte: %s",
                        request_id, grant.replica_id, outcome.detail)
            last, last_replica = outcome, grant.replica_id
        if last is not None and last.status and last.error_body:
            return "upstream_error", web.Response(
                status=last.status, body=last.error_body,
                headers={"Content-Type": last.error_content_type, "x-fairbatch-replica": last_replica},
            )
        return "upstream_error", openai_error(
            503, "No replica could serve the request (upstream failures).", "service_unavailable", 503
        )

    @staticmethod
    def _answer(answer: Answer) -> tuple[str, web.StreamResponse]:
        """(outcome, response) of one of the router's refusals (router/answers.py)."""
        return answer.outcome, answer_response(answer)

    def _correct_decode(self, tenant: str, response: web.Response, estimate: int) -> None:
        """Correct the decode charge with a non-stream answer's ``usage.completion_tokens``
        (router/charges.py ``decode_correction``)."""
        delta = decode_correction(response.body, estimate)
        if delta:
            self._charge(tenant, 0, delta)

    async def _forward(
        self, request: web.Request, principal: Principal, grant: Grant, raw: bytes, request_id: str, arrival_ms: float,
        stream: bool = True,
    ) -> RelayOutcome:
        replica = self.replicas.get(grant.replica_id)
        if replica is None:  # removed by discovery between Reserve and here
            return RelayOutcome("retryable", detail=f"replica {grant.replica_id} was removed")
        abort = UpstreamAbort()
        inflight = self._inflight.setdefault(grant.replica_id, set())
        inflight.add(abort)
        queued_ms = max(0.0, self.clock.now_ms() - arrival_ms)
        headers = self._upstream_headers.copy()  # the fixed part, built once
        headers["x-request-id"] = request_id
        headers["x-fairbatch-slo-class"] = principal.slo_class
        headers["x-fairbatch-tenant"] = principal.tenant
        headers["x-fairbatch-queued-ms"] = f"{queued_ms:.3f}"
        if grant.inline:
            headers["x-fairbatch-admit"] = str(grant.prompt_tokens)
        else:
            headers["x-fairbatch-lease"] = grant.lease_id
        # x-fairbatch-request-id: the router's own id, the one the agent and the engine log (the client's
        # x-request-id is only echoed), so a client can find its request in the replica's logs
        response_headers = {"x-request-id": request.get(REQUEST_ID) or request_id, "x-fairbatch-replica": grant.replica_id,
                            "x-fairbatch-request-id": request_id}  # fmt: skip
        with self.tracer.start_as_current_span("router.relay", kind=trace.SpanKind.CLIENT) as span:
            span.set_attribute("http.request.method", "POST")
            span.set_attribute("url.full", replica.http_url + request.path)
            span.set_attribute("fairbatch.replica", grant.replica_id)
            inject_context(headers)
            try:
                outcome = await self.relay.forward(
                    request, replica.http_url, request.path, raw, headers, response_headers, abort,
                    # a stream only: a non-stream answer is silent until the end, the agent watching its engine
                    # by /metrics meanwhile (a long one may take minutes)
                    self.silence_s(principal.slo) if stream else None,
                )
            except asyncio.CancelledError:
                self._release(grant, "client-disconnect")
                raise
            except BaseException:
                self._release(grant, "router-error")
                raise
            finally:
                inflight.discard(abort)
            span.set_attribute("fairbatch.relay_outcome", outcome.kind)
            failed = outcome.kind in ("retryable", "upstream_error")
            set_http_status(span, outcome.status or None, outcome.kind if failed else None)
        request[RELAY_EVENTS] = outcome.events
        if outcome.response is not None:
            outcome.response.headers.setdefault("x-fairbatch-replica", grant.replica_id)
        return outcome

    def _refuse_unauthenticated(self, request: web.Request) -> web.Response | None:
        """401 ``invalid_api_key`` when the request names no tenant the authenticator accepts, else None
        (every ``/v1`` path asks for a key, as vLLM with ``--api-key`` and OpenAI do)."""
        if self.auth.identify(request.headers, request.remote) is None:
            return openai_error(401, self.auth.refusal(request.headers, request.remote), code="invalid_api_key")
        return None

    def silence_s(self, slo: SloClassConfig) -> float:
        """Wall seconds an agent may send nothing on a streamed generation request of class ``slo``
        before the router gives the attempt up: twice the class's stall timeout plus
        :data:`SILENCE_GRACE_S` (a non-stream answer keeps the pool's limit: it is silent until done).

        A running agent is never silent that long: it ends a request whose engine sent nothing for
        the stall timeout (``stall_timeout_ms``, else replica_agent/proxy.py ``default_stall_ms``:
        3 s for TTFT 500 / TPOT 50 ms) with an error of its own. So the limit only fires on an agent
        that froze or whose host did (a user's trial: ``kill -STOP`` on the agent held a client's
        stream for as long as it was stopped; the pool's limit was 600 s)."""
        stall_ms = slo.stall_timeout_ms or default_stall_ms(slo.ttft_ms, slo.tpot_ms)
        return 2.0 * self.clock.to_wall_s(stall_ms) + SILENCE_GRACE_S

    async def handle_models(self, request: web.Request) -> web.Response:
        """GET /v1/models: the replicas' own model cards (router/openai_surface.py); tenant auth first."""
        return self._refuse_unauthenticated(request) or await self.catalog.list_response()

    async def handle_model(self, request: web.Request) -> web.Response:
        """GET /v1/models/{id}: one card, or 404 ``model_not_found``; tenant auth first."""
        return self._refuse_unauthenticated(request) or await self.catalog.model_response(
            request.match_info["model_id"])

    async def handle_unsupported(self, request: web.Request) -> web.Response:
        """An OpenAI path the router refuses: 404 naming what is supported."""
        return unsupported(request.method, request.path)

    async def handle_utility(self, request: web.Request) -> web.Response:
        """POST /tokenize, /detokenize: tenant auth, then relayed to a healthy replica (no lease:
        the engine runs no forward pass for them)."""
        principal = self.auth.identify(request.headers, request.remote)
        if principal is None:
            return openai_error(401, self.auth.refusal(request.headers, request.remote), code="invalid_api_key")
        try:
            raw = await read_body(request, self.config.http.max_body_bytes, self.config.http.body_timeout_s)
        except ApiError as exc:
            return api_error_response(exc)
        usable = [v.replica_id for v in self.book.views() if v.healthy and v.fresh and v.replica_id in self.replicas]
        for rid in usable or list(self.replicas):
            try:
                async with self.relay.session.post(
                    self.replicas[rid].http_url + request.path, data=raw,
                    headers={"Content-Type": "application/json", "x-fairbatch-tenant": principal.tenant,
                             **({"x-fairbatch-token": self._agent_token} if self._agent_token else {})},
                    timeout=aiohttp.ClientTimeout(total=10.0),
                ) as up:
                    body = await up.read()
                    if up.status in (502, 503, 504):
                        continue
                    return web.Response(status=up.status, body=body, headers={
                        "Content-Type": up.headers.get("Content-Type", "application/json"), "x-fairbatch-replica": rid})
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                continue
        return openai_error(503, "No replica could serve the request.", "service_unavailable", "no-replica")

    async def handle_health(self, request: web.Request) -> web.Response:
        """GET /health: 200 while the process serves (liveness and readiness: a router with no usable
        replica still answers, with 503 ``no-replica`` per request, rather than vanishing from its
        Service); ``status`` is ``degraded`` when no replica is healthy with a fresh budget."""
        views = self.book.views()
        usable = [v.replica_id for v in views if v.healthy and v.fresh]
        return web.json_response(
            {"status": "ok" if usable else "degraded", "replicas": len(views), "replicas_usable": usable,
             "queue_depth": len(self.queue)}
        )

    async def handle_public_health(self, request: web.Request) -> web.Response:
        """GET /health on the public port when a metrics port is configured: 200 with ``status`` only
        (``ok`` or ``degraded``), no replica ids or counts."""
        usable = any(v.healthy and v.fresh for v in self.book.views())
        return web.json_response({"status": "ok" if usable else "degraded"})

    async def handle_metrics(self, request: web.Request) -> web.Response:
        """GET /metrics (Prometheus text format)."""
        now = self.clock.now_ms()
        m = self.metrics
        m.queue_depth.set(len(self.queue))
        m.dispatch_stalled.set(self.dispatcher.stalled_ms(now) / 1000.0)
        for tenant, value in self.queue.counters().items():
            m.tenant_vtc.labels(tenant).set(value)
        hold = self.dispatcher.hold
        spare: dict[str, float] = {}
        empty: dict[str, int] = {}
        for view in self.book.views(now):
            rid = view.replica_id
            m.replica_inflight.labels(rid).set(self.replica_load(rid))
            stored = self.book.get(rid)
            waiting = stored.num_waiting if stored is not None and view.fresh else 0
            m.replica_queued.labels(rid).set(waiting + (1 if hold is not None and hold[1] == rid else 0))
            age = self.book.age_ms(view.replica_id, now)
            m.budget_age.labels(view.replica_id).set(-1.0 if age is None else age / 1000.0)
            for name, budget in view.classes.items():
                usable = budget.pab_ms if (view.healthy and view.fresh) else 0.0
                m.replica_pab.labels(view.replica_id, name).set(usable / 1000.0)
                spare[name] = spare.get(name, 0.0) + usable / 1000.0
                empty[name] = empty.get(name, 0) + (usable <= 0.0)
        for name in self.config.slo_classes:
            m.fleet_pab.labels(name).set(spare.get(name, 0.0))
            m.fleet_replicas_without_pab.labels(name).set(empty.get(name, len(self.replicas)))
        return web.Response(body=generate_latest(m.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


def build_app(
    config: RouterConfig, clock: Clock | None = None, router_id: str = "router-0", **kwargs: Any
) -> tuple[web.Application, Router]:
    """Build a :class:`Router` and its aiohttp application (started by the app's startup hook)."""
    router = Router(config, clock, router_id, **kwargs)
    return router.build_app(), router
