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
:class:`~fairbatch_common.clock.Clock`; metric durations in seconds are wall seconds.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Coroutine, Mapping
from typing import Any

import aiohttp
from aiohttp import web
from opentelemetry import trace
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from fairbatch_common.aio import stop_task, within
from fairbatch_common.api_schema import ApiError, validate_request
from fairbatch_common.clock import Clock
from fairbatch_common.http_guard import (
    REQUEST_ID,
    api_error_response,
    bounded_expect_handler,
    client_request_id,
    error_middleware,
    json_error,
    new_request_id,
    read_body,
)
from fairbatch_common.openai_stream import requested_choices
from fairbatch_common.stall import default_stall_ms
from fairbatch_common.telemetry import extract_context, genai_request_attributes, inject_context, make_tracer
from fairbatch_common.telemetry import set_http_status
from router.admission import MAX_RELAY_TRIES, prompt_decision
from router.admission_queue import Dispatcher, PlacementFailed, QueueTimeout
from router.answers import Answer, no_budget, placement_error, queue_expired, queue_full
from router.answers import slo_infeasible, tenant_over, work_shed
from router.arrival import queue_full_before_body
from router.auth import ApiKeyAuthenticator, Principal
from router.budget_client import BudgetClient, ReserveResult
from router.budgets import BudgetBook
from router.charges import decode_correction
from router.config import ConfigError, ReplicaConfig, RouterConfig, SloClassConfig, load_config
from router.core import CoreRequest, Grant, Placed, Refused, RouterCore, tenant_shares
from router.discovery import DiscoverySource, build_discovery, diff_replicas
from router.fair_queue import FairQueue
from router.ledger import CONCURRENCY_RETRY_MS, Ledger, Refusal, TenantLimits, build_ledger
from router.metrics import RouterMetrics
from router.openai_surface import REFUSED_PATHS, RELAYED_PATHS, ModelCatalog, model_not_found, unsupported
from router.placement import PlacementPolicy, largest_max_prompt
from router.relay import Relay, RelayOutcome, UpstreamAbort
from router.prefix_correction import PrefixCorrection
from router.prefix_index import PrefixIndex, text_block_keys
from router.tokens import PromptError, estimate_prompt_tokens, prompt_is_exact, prompt_text
from router.work_shed import BUDGET_REASONS, WorkShed

__all__ = ["Grant", "Router", "answer_response", "build_app", "openai_error", "tenant_limits", "tenant_shares"]

log = logging.getLogger(__name__)

_ROUTER_KEY = web.AppKey("fairbatch_router", object)
FIRST_BYTE_MS = web.RequestKey("fairbatch_first_byte_ms", float)
RELAY_EVENTS = web.RequestKey("fairbatch_relay_events", int)
STREAM_SHAPE = web.RequestKey("fairbatch_stream_shape", tuple)


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
            config, self.clock, _GrpcReserve(self), lambda: asyncio.get_running_loop().create_future(), seed,
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
        self.ledger: Ledger = build_ledger(config, self.clock, self._on_ledger_degraded)
        self._sync_task: asyncio.Task[None] | None = None
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
            self.metrics.config_reloads.labels("invalid").inc()
            log.error("config reload refused, keeping the running configuration: %s", exc)
            return False
        for w in self.apply_config(config):
            log.warning("config reload: %s", w)
        self.metrics.config_reloads.labels("ok").inc()
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
        """Release ``grant`` (router/core.py ``RouterCore.release``; never delays the response)."""
        self.core.release(grant, reason)

    async def _acquire(self, req: CoreRequest, exclude: frozenset[str],
                       avoid_now: frozenset[str] = frozenset()) -> Grant | Refused:
        """A lease for this request: the core's answer (router/core.py ``RouterCore.acquire``),
        waiting for the dispatcher when it was queued. Charged once granted.

        ``avoid_now``: replicas left out of the immediate placement only (an inline admission they
        refused); the queue entry may use them again once their budget frees.
        """
        with self.tracer.start_as_current_span("router.placement") as span:
            got = await self.core.acquire(req, exclude, avoid_now)
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
            grant = await within(entry.future, self.clock.to_wall_s(entry.deadline_ms - now))
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
        req = CoreRequest(request_id, principal.tenant, principal.slo_class, prompt_tokens, max_tokens, arrival_ms,
                          text_block_keys(prompt_text(body, chat), self.config.placement.prefix_cache.chunk_chars)
                          if self.core.prefix is not None else ())  # fmt: skip
        if self.core.refuse_by_work(req, views):
            return self._answer(work_shed(principal.slo_class))

        quota = await self.ledger.acquire(
            principal.tenant, request_id, limits, prompt_tokens + self.core.decode_estimate(max_tokens)
        )
        if isinstance(quota, Refusal):
            return self._answer(tenant_over(quota.reason, principal.tenant, self.clock.to_wall_s(quota.retry_after_ms)))
        self.core.track_prefix(req)
        try:
            return await self._serve_placed(request, principal, raw, req, valid.stream)
        finally:
            self.core.forget_prefix(request_id)
            self._spawn(self.ledger.release(quota))

    async def _serve_placed(
        self, request: web.Request, principal: Principal, raw: bytes, req: CoreRequest, stream: bool,
    ) -> tuple[str, web.StreamResponse]:
        """Acquire a lease (the core), relay, and follow the core's rule after each attempt."""
        last: RelayOutcome | None = None
        last_replica = ""
        core = self.core
        tries = core.attempts(self.max_relay_tries)  # router/admission.py: bounds, exclusions
        slo = principal.slo
        while tries.next_try():
            # after an inline refusal: placed elsewhere at once when another replica fits, else
            # queued for any replica (the refusing one's answer already updated the view)
            got = await self._acquire(req, tries.exclude, tries.refused_on)
            if isinstance(got, Refused):
                if got.reason == "no-replica":
                    break
                if got.reason in BUDGET_REASONS:
                    core.budget_refused()
                return self._answer(self._refusal_answer(got, principal, slo))
            grant = got
            outcome = await self._forward(request, principal, grant, raw, req.request_id, req.arrival_ms, stream)
            action = core.after_attempt(tries, req, grant, outcome.kind, outcome.pab_ms, outcome.pab_tokens)
            if outcome.kind == "lease_refused":  # the agent's budget was gone on arrival: nothing ran
                self.metrics.admit_refusals.labels(grant.replica_id).inc()
            if action.next == "give_up":
                return self._answer(no_budget(tries.refusals))
            if action.next == "replace":  # not a failure of the replica: re-place as after a refused Reserve
                continue
            if action.next == "answer":
                if outcome.kind == "ok":
                    self.budgets.forget(grant.lease_id)
                    if not stream and isinstance(outcome.response, web.Response):
                        self._correct_decode(principal.tenant, outcome.response, core.decode_estimate(req.max_tokens))
                elif outcome.kind == "refused":
                    log.info("request %s: replica %s refused it: %s", req.request_id, grant.replica_id, outcome.detail)
                elif outcome.kind == "client_gone":
                    return action.outcome, outcome.response or web.Response(status=499)
                return action.outcome, outcome.response  # type: ignore[return-value]
            log.warning("request %s: replica %s failed before the first byte: %s",
                        req.request_id, grant.replica_id, outcome.detail)
            last, last_replica = outcome, grant.replica_id
        if last is not None and last.status and last.error_body:
            return "upstream_error", web.Response(
                status=last.status, body=last.error_body,
                headers={"Content-Type": last.error_content_type, "x-fairbatch-replica": last_replica},
            )
        return "upstream_error", openai_error(
            503, "No replica could serve the request (upstream failures).", "service_unavailable", 503
        )

    def _refusal_answer(self, got: Refused, principal: Principal, slo: SloClassConfig) -> Answer:
        """The answer of one of the core's refusals (router/answers.py)."""
        if got.reason == "queue-full":
            return queue_full()
        if got.reason == "placement-error":
            return placement_error(got.detail)
        if got.reason == "slo-infeasible" and not got.queued:  # predicted at arrival
            return slo_infeasible(principal.slo_class, slo.ttft_ms, got.wait_ms, self.clock.to_wall_s(got.wait_ms))
        usable = got.reason == "slo-infeasible" or any(v.healthy and v.fresh for v in self.book.views())
        return queue_expired(got.reason, principal.slo_class, slo.ttft_ms, slo.max_queue_ms, usable)

    @staticmethod
    def _answer(answer: Answer) -> tuple[str, web.StreamResponse]:
        """(outcome, response) of one of the router's refusals (router/answers.py)."""
        return answer.outcome, answer_response(answer)

    def _correct_decode(self, tenant: str, response: web.Response, estimate: int) -> None:
        """Correct the decode charge with a non-stream answer's ``usage.completion_tokens``
        (router/charges.py ``decode_correction``)."""
        delta = decode_correction(response.body, estimate)
        if delta:
            self.core.charge(tenant, 0, delta)

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
        the stall timeout (``stall_timeout_ms``, else fairbatch_common/stall.py ``default_stall_ms``:
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



class _GrpcReserve:
    """The core's :class:`~router.core.ReservePort` over the agents' gRPC service
    (router/budget_client.py); a Release runs in the router's background."""

    __slots__ = ("_router",)

    def __init__(self, router: Router) -> None:
        self._router = router

    async def reserve(self, replica_id: str, slo_class: str, prompt_tokens: int, request_id: str,
                      max_tokens: int, waited_ms: float) -> ReserveResult:
        return await self._router.budgets.reserve(replica_id, slo_class, prompt_tokens, request_id, max_tokens,
                                                  waited_ms)  # fmt: skip

    def release(self, lease_id: str, reason: str) -> None:
        self._router._spawn(self._router.budgets.release(lease_id, reason))


def build_app(
    config: RouterConfig, clock: Clock | None = None, router_id: str = "router-0", **kwargs: Any
) -> tuple[web.Application, Router]:
    """Build a :class:`Router` and its aiohttp application (started by the app's startup hook)."""
    router = Router(config, clock, router_id, **kwargs)
    return router.build_app(), router
