"""The router as the endpoint picker of a Kubernetes inference gateway: an Envoy ext_proc gRPC server.

``fairbatch-router --config fairbatch.yaml --ext-proc-port 9002`` serves, beside the HTTP front door
and on the same request core (router/core.py, built by router/wiring.py: one budget book, one fair
queue, one placement policy, one ledger for both drivers), Envoy's
``envoy.service.ext_proc.v3.ExternalProcessor/Process`` as the Gateway API Inference Extension's
endpoint picker (EPP). The protocol is GIE's ``docs/proposals/004-endpoint-picker-protocol``; its keys
and the pure mapping of messages live in router/epp_protocol.py.

One ext_proc stream is one HTTP request in the gateway:

1. ``request_headers``: the answer is given here; the body is never asked for nor held (a chunk the
   proxy sends anyway is answered at once, CONTINUE, or echoed back in ``FULL_DUPLEX_STREAMED``
   mode, nothing kept). Tenant: ``x-gateway-inference-fairness-id`` or ``auth.trusted_header`` from a
   peer in ``auth.trusted_networks`` (router/auth.py, the HTTP router's rule), else the bearer key;
   class: ``x-gateway-inference-objective`` or ``x-fairbatch-slo-class`` from a trusted peer, else
   the tenant's; size: router/epp_protocol.py "Pricing". Then the HTTP router's sequence: queue
   bound, tenant concurrency, prompt cap, work shedding, quota, and the core's placement
   (:meth:`router.wiring.RouterWiring._acquire`): placed at once, or the stream is held while the
   request waits in the fair queue (bounded by the class's ``max_queue_ms``; the proxy's message
   timeout is extended to it with ``override_message_timeout``), or refused.
2. A pick answers with the endpoints, primary first then up to ``max_fallbacks`` of the placement's
   other candidates (only where every agent on the list decides ``x-fairbatch-admit`` on arrival:
   inline admission), as the ``x-gateway-destination-endpoint`` header and the same string in the
   ``envoy.lb`` dynamic metadata; the request that goes upstream gets the headers the HTTP router
   sends its agents (``x-fairbatch-admit`` or ``x-fairbatch-lease``, class, tenant, queued time, the
   router's request id, the agent token) and loses ``Authorization``. A refusal is an
   ``ImmediateResponse``: 429 with ``Retry-After`` and ``x-fairbatch-reason`` (over budget or quota),
   503 (no endpoint ready, or none left in the subset hint), 400/401/413/415 as the HTTP router answers
   them; the body is the OpenAI-format error JSON.
3. ``response_headers`` (with ``x-gateway-destination-endpoint-served`` in the ``envoy.lb``
   metadata) tell the outcome, by the HTTP relay's rule (router/epp_protocol.py
   ``response_outcome``); an agent's 409 refusal of the inline admission is replaced by the HTTP
   router's 503 ``no-budget`` answer. Their arrival is the upstream's first byte (the agent sends
   its response headers with the first chunk, replica_agent/proxy.py ``FirstChunkStreamResponse``,
   and vLLM's stream starts with the first token): the moment the HTTP router's ``prepare`` hook
   takes for the first token, so the grant's prompt leaves the core's in-prefill load there
   (router/core.py ``prefill_done``) as at the front door, with no body asked for. The lease is
   settled (router/core.py ``after_attempt``: kept, refunded or released) at the stream's end:
   ``response_trailers``, a response message with ``end_of_stream``, or the stream's close,
   whichever comes first; a stream that closes (or is cancelled) before any response releases the
   lease; a fallback that served releases the primary's.
   A stream silent for ``settle_timeout_s`` after the pick is settled as it stands.

Other paths (``/v1/models``, ``/tokenize``...) are authenticated and sent to a usable replica without
a lease, as the HTTP router relays them.

Bounded: streams (``max_streams``, the gRPC server refuses more with RESOURCE_EXHAUSTED), the queue
(its bounds and deadlines), the settle timer. Logs name the request id, tenant and class, never a
header value or the prompt. gRPC health (``grpc.health.v1.Health``): ``liveness``, ``readiness`` and
``envoy.service.ext_proc.v3.ExternalProcessor`` (and ``""``) are SERVING while the picker serves (a
picker with no usable replica answers 503 per request rather than leave its Service), NOT_SERVING
from the start of a drain.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from dataclasses import replace
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from fairbatch_common.http_guard import new_request_id
from router.admission import prompt_decision
from router.admission_queue import WaitingRequest
from router.answers import Answer, no_budget, queue_cap, queue_full, tenant_over, work_shed
from router.arrival import queue_full_before_body
from router.auth import Principal
from router.core import CoreRequest, Grant, Refused
from router.epp_protocol import (
    BODY_MODES_ECHOED,
    FAIRNESS_ID,
    answer_response,
    continue_response,
    echo_body,
    endpoint_of,
    extend_timeout,
    header_map,
    openai_immediate,
    peer_address,
    pick_class,
    pick_response,
    price_prompt,
    refused_budget,
    response_outcome,
    served_endpoint,
    status_of,
    subset_hint,
)
from router.charges import quota_refunded
from router.ledger import CONCURRENCY_RETRY_MS, Refusal, TenantLimits, Ticket
from router.placement import largest_max_prompt
from router.wiring import RouterWiring
from router.work_shed import BUDGET_REASONS

log = logging.getLogger(__name__)

SERVICE_NAME = ep.DESCRIPTOR.services_by_name["ExternalProcessor"].full_name
"""``envoy.service.ext_proc.v3.ExternalProcessor``: a health service name, as GIE's EPP reports it."""

HEALTH_SERVICES = ("", "liveness", "readiness", SERVICE_NAME)

GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
"""Paths placed with a lease (POST); every other path goes to a usable replica without one."""

SETTLE_TIMEOUT_S = 900.0
"""Wall seconds a picked request's stream may stay silent before its lease is settled as it stands."""

QUEUE_TIMEOUT_MARGIN_S = 1.0
"""Wall seconds added to a queued request's deadline in the ``override_message_timeout`` it asks for."""

MAX_FALLBACKS = 2
"""Fallback endpoints listed after the primary (at most the placement's other candidates: 2 of ``pab``'s 3)."""

ADMISSION_HEADERS = ("x-fairbatch-admit", "x-fairbatch-lease", "x-fairbatch-on-time", "x-fairbatch-direct",
                     "x-fairbatch-queue-cap")
"""The headers by which an agent admits a request (router/core.py ``Grant.add_headers``): set by the
picker from its grant, removed from the request otherwise."""

_OUTCOME = {"ok": "ok", "refused": "upstream_refused", "retryable": "upstream_error",
            "upstream_error": "upstream_error", "lease_refused": "upstream_error", "client_gone": "client_disconnect"}
"""A settled pick's outcome label by its relay kind (the front door's words: an agent's refusal of the
admission is ``upstream_error``, as the front door's ``no-budget`` answer is)."""


def no_replica(detail: str) -> Answer:
    """503 ``no-replica`` (no endpoint ready, or none in the subset hint: 004 "Endpoint Subset")."""
    return Answer("no_replica", 503, "no-replica", f"No replica is available ({detail}).",
                  err_type="service_unavailable")


class ExtProcPicker(ep_grpc.ExternalProcessorServicer):
    """The ``Process`` stream handler (module docstring) on a router's wiring.

    Args:
        wiring: the router process's wiring (router/wiring.py): core, auth, ledger, metrics, replicas.
        max_fallbacks: fallback endpoints listed after the primary.
        settle_timeout_s: see :data:`SETTLE_TIMEOUT_S`.
    """

    def __init__(self, wiring: RouterWiring, max_fallbacks: int = MAX_FALLBACKS,
                 settle_timeout_s: float = SETTLE_TIMEOUT_S) -> None:  # fmt: skip
        self.wiring = wiring
        self.max_fallbacks = max(0, max_fallbacks)
        self.settle_timeout_s = settle_timeout_s
        self._rotate = 0
        self._pick_counters: dict[tuple[str, str, str], Any] = {}

    def count(self, tenant: str, slo_class: str, outcome: str) -> None:
        """``fairbatch_router_ext_proc_requests_total{tenant,slo_class,outcome}`` += 1 (the labelled
        child kept: tenants and classes are the config's, outcomes a fixed set)."""
        key = (tenant, slo_class, outcome)
        child = self._pick_counters.get(key)
        if child is None:
            child = self._pick_counters[key] = self.wiring.metrics.picks.labels(tenant, slo_class, outcome)
        child.inc()

    async def Process(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> None:  # noqa: N802
        """One HTTP request's ext_proc stream (module docstring)."""
        stream = _Stream(self, context)
        gauge = self.wiring.metrics.pick_streams
        gauge.inc()
        try:
            await stream.run()
        finally:
            stream.end()
            gauge.dec()

    def utility_endpoints(self) -> list[str]:
        """Endpoints for a request without a lease: the usable replicas (healthy, fresh), rotated per
        request, at most ``1 + max_fallbacks``; every known replica when none is usable."""
        w = self.wiring
        usable = [v.replica_id for v in w.book.views() if v.healthy and v.fresh and v.replica_id in w.replicas]
        rids = usable or list(w.replicas)
        if not rids:
            return []
        self._rotate = (self._rotate + 1) % len(rids)
        rids = rids[self._rotate:] + rids[:self._rotate]
        return [endpoint_of(w.replicas[r].http_url) for r in rids[: 1 + self.max_fallbacks]]


class _Stream:
    """The state of one ext_proc stream: the pick, then the settlement of its lease."""

    __slots__ = ("picker", "w", "context", "peer", "echo_request", "echo_response", "principal", "req", "grant",
                 "ticket", "endpoints", "replica_by_endpoint", "status", "outcome", "served", "pab", "settled",
                 "timer")

    def __init__(self, picker: ExtProcPicker, context: grpc.aio.ServicerContext) -> None:
        self.picker = picker
        self.w = picker.wiring
        self.context = context
        self.peer = peer_address(context.peer() or "")
        self.echo_request = self.echo_response = False
        self.principal: Principal | None = None
        self.req: CoreRequest | None = None
        self.grant: Grant | None = None
        self.ticket: Ticket | None = None
        self.endpoints: list[str] = []
        self.replica_by_endpoint: dict[str, str] = {}
        self.status = 0
        self.outcome = ""
        self.served: str | None = None
        self.pab = (-1.0, -1)
        self.settled = False
        self.timer: asyncio.TimerHandle | None = None

    # ------------------------------------------------------------------ the stream

    async def run(self) -> None:
        ctx = self.context
        msg = await ctx.read()
        if msg is grpc.aio.EOF:
            return
        cfg = msg.protocol_config
        self.echo_request = cfg.request_body_mode in BODY_MODES_ECHOED
        self.echo_response = cfg.response_body_mode in BODY_MODES_ECHOED
        if msg.WhichOneof("request") == "request_headers":
            await ctx.write(await self.pick(msg))
        else:  # a stream that does not start with the request headers: pass everything through
            await ctx.write(self.passthrough(msg))
        while True:
            msg = await ctx.read()
            if msg is grpc.aio.EOF:
                return
            await ctx.write(self.on_message(msg))

    def passthrough(self, msg: ep.ProcessingRequest) -> ep.ProcessingResponse:
        """The answer to a message that changes nothing (CONTINUE, or the body chunk echoed)."""
        kind = msg.WhichOneof("request") or "request_headers"
        if kind == "request_body" and self.echo_request:
            return echo_body(kind, msg.request_body)
        if kind == "response_body" and self.echo_response:
            return echo_body(kind, msg.response_body)
        return continue_response(kind)

    def on_message(self, msg: ep.ProcessingRequest) -> ep.ProcessingResponse:
        """A message after the pick: the response's headers tell the outcome, its end settles."""
        kind = msg.WhichOneof("request")
        if self.grant is None or self.settled or kind is None:
            return self.passthrough(msg)
        if kind == "response_headers":
            headers = header_map(msg.response_headers)
            self.status = status_of(headers)
            self.served = served_endpoint(msg.metadata_context)
            self.outcome = response_outcome(self.status, headers)
            if self.outcome == "lease_refused":  # the agent's 409: its budget (or queue cap) was gone on arrival
                self.pab = refused_budget(headers)
                direct = self.grant.direct
                self.settle()
                return answer_response(queue_cap() if direct else no_budget(1))
            # the upstream's first byte: its prefill is over (module docstring, step 3)
            self.w.core.prefill_done(self.grant)
            rid = self.replica_by_endpoint.get(self.served or "", self.grant.replica_id)
            resp = continue_response(kind, {"x-fairbatch-replica": rid,
                                            "x-fairbatch-request-id": self.req.request_id if self.req else ""})
            if msg.response_headers.end_of_stream:
                self.settle()
            return resp
        resp = self.passthrough(msg)
        if kind == "response_trailers" or (kind == "response_body" and msg.response_body.end_of_stream):
            self.settle()
        return resp

    def end(self) -> None:
        """The stream is over (closed, cancelled or failed): settle what is still held."""
        if self.grant is not None and not self.settled:
            self.settle()
        elif self.grant is None:  # cancelled while it waited: nothing started
            self.give_quota_back(True)

    # ------------------------------------------------------------------ the pick

    def refuse(self, answer: Answer) -> ep.ProcessingResponse:
        p = self.principal
        if p is not None:
            self.picker.count(p.tenant, p.slo_class, answer.outcome)
            log.debug("ext_proc: %s/%s refused %s", p.tenant, p.slo_class, answer.code)
        return answer_response(answer)

    def client_error(self, status: int, message: str, code: str | None, param: str | None = None,
                     outcome: str = "bad_request") -> ep.ProcessingResponse:  # fmt: skip
        p = self.principal
        self.picker.count(p.tenant if p else "unknown", p.slo_class if p else "unknown", outcome)
        return openai_immediate(status, message, "invalid_request_error", code, param)

    async def pick(self, msg: ep.ProcessingRequest) -> ep.ProcessingResponse:
        """The answer to ``request_headers`` (module docstring, steps 1 and 2)."""
        w = self.w
        headers = header_map(msg.request_headers)
        peer = self.peer
        principal = w.auth.identify(headers, peer, (FAIRNESS_ID,))
        if principal is None:
            return self.client_error(401, w.auth.refusal(headers, peer, (FAIRNESS_ID,)), "invalid_api_key",
                                     outcome="unauthorized")
        trusted = w.auth.trusted_source(peer)
        cls = pick_class(headers, trusted, w.config.slo_classes)
        if cls is not None and cls != principal.slo_class:
            principal = replace(principal, slo_class=cls, slo=w.config.slo_classes[cls])
        self.principal = principal
        path = (headers.get(":path") or "").split("?", 1)[0]
        if path not in GENERATION_PATHS or (headers.get(":method") or "POST") != "POST":
            return self.pick_utility(principal)
        return await self.pick_generation(msg, headers, principal, trusted, path)

    def _upstream_headers(self, principal: Principal, request_id: str) -> dict[str, str]:
        out = {"x-request-id": request_id, "x-fairbatch-tenant": principal.tenant,
               "x-fairbatch-slo-class": principal.slo_class}
        token = self.w._agent_token
        if token:
            out["x-fairbatch-token"] = token
        return out

    def pick_utility(self, principal: Principal) -> ep.ProcessingResponse:
        """A request that takes no lease (module docstring): a usable replica, no admission."""
        endpoints = self.picker.utility_endpoints()
        if not endpoints:
            return self.refuse(no_replica("no replica is known"))
        self.picker.count(principal.tenant, principal.slo_class, "utility")
        return pick_response(endpoints, self._upstream_headers(principal, new_request_id()),
                             ("authorization", *ADMISSION_HEADERS))

    async def pick_generation(self, msg: ep.ProcessingRequest, headers: dict[str, str], principal: Principal,
                              trusted: bool, path: str) -> ep.ProcessingResponse:
        w = self.w
        core = w.core
        arrival_ms = w.clock.now_ms()
        request_id = new_request_id()
        tenant = principal.tenant
        encoding = (headers.get("content-encoding") or "").strip().lower()
        if encoding not in ("", "identity"):
            return self.client_error(415, "Content-Encoding is not supported; send the JSON body uncompressed.",
                                     "unsupported_content_encoding")
        if queue_full_before_body(len(w.queue), w.queue.max_requests):  # router/arrival.py
            return self.refuse(queue_full())
        limits = w.limits.get(tenant, TenantLimits())
        if await w.ledger.at_concurrency(tenant, limits):
            return self.refuse(tenant_over("tenant-concurrency", tenant, w.clock.to_wall_s(CONCURRENCY_RETRY_MS)))
        adm, http = w.config.admission, w.config.http
        views = w.book.views()
        size = price_prompt(headers, trusted, adm.bytes_per_token, largest_max_prompt(views), http.max_body_bytes)
        if size is None:
            return self.client_error(413, f"The body ({headers.get('content-length')} bytes) is larger than the "
                                          f"limit of {http.max_body_bytes} bytes.", "body_too_large")
        param = "messages" if path.endswith("chat/completions") else "prompt"
        cap = prompt_decision(size.tokens, size.exact, views, adm.bytes_per_token, adm.estimate_refuse_factor)
        if cap.refusal is not None:
            return self.client_error(400, cap.refusal, "context_length_exceeded", param)
        exclude: frozenset[str] = frozenset()
        subset = subset_hint(msg.metadata_context)
        if subset is not None:  # 004 "Endpoint Subset": only these, 503 when none is eligible
            by_endpoint = {endpoint_of(r.http_url): rid for rid, r in w.replicas.items()}
            allowed = {by_endpoint[e] for e in subset if e in by_endpoint}
            if not allowed:
                return self.refuse(no_replica("none of the subset hint's endpoints is a replica"))
            exclude = frozenset(w.replicas) - allowed
        req = CoreRequest(request_id, tenant, principal.slo_class, cap.tokens, 0, arrival_ms)
        if core.refuse_by_work(req, views):
            return self.refuse(work_shed(principal.slo_class))
        quota = await w.ledger.acquire(tenant, request_id, limits, cap.tokens + core.decode_estimate(0))
        if isinstance(quota, Refusal):
            return self.refuse(tenant_over(quota.reason, tenant, w.clock.to_wall_s(quota.retry_after_ms)))
        self.ticket = quota
        got = await w._acquire(req, exclude, on_queued=self._queued)
        if isinstance(got, Refused):  # nothing started: the quota taken goes back (router/charges.py)
            answer = no_replica("every replica was left out") if got.reason == "no-replica" else \
                w._refusal_answer(got, principal, principal.slo)
            self.give_quota_back(quota_refunded(answer.outcome, False))
            if got.reason in BUDGET_REASONS:
                core.budget_refused()
            return self.refuse(answer)
        return self.picked(req, principal, got, exclude)

    async def _queued(self, entry: WaitingRequest) -> None:
        """The request waits in the queue: ask the proxy to wait as long (its deadline, wall seconds)."""
        w = self.w
        wait_s = w.clock.to_wall_s(max(0.0, entry.deadline_ms - w.clock.now_ms()))
        await self.context.write(extend_timeout(wait_s + QUEUE_TIMEOUT_MARGIN_S))

    def picked(self, req: CoreRequest, principal: Principal, grant: Grant,
               exclude: frozenset[str]) -> ep.ProcessingResponse:  # fmt: skip
        """The headers response of a grant (module docstring, step 2); the settle timer starts."""
        w = self.w
        replicas = w.replicas
        primary = replicas.get(grant.replica_id)
        self.req, self.grant = req, grant
        if primary is None:  # removed by discovery while it was placed: settled as a failed attempt
            self.outcome = "retryable"
            self.settle()
            return self.refuse(no_replica(f"replica {grant.replica_id} was removed"))
        endpoint = endpoint_of(primary.http_url)
        self.endpoints = [endpoint]
        self.replica_by_endpoint = {endpoint: grant.replica_id}
        # a fallback's agent decides x-fairbatch-admit itself, or admits a direct grant as it is; a lease
        # id names one agent, so a Reserve grant has none
        fallbacks = grant.fallbacks if grant.direct else grant.alternates if grant.inline else ()
        if fallbacks:
            for rid in fallbacks:
                if len(self.endpoints) > self.picker.max_fallbacks:
                    break
                rep = replicas.get(rid)
                if rep is None or rid in exclude or not (grant.direct or w.book.inline_admission(rid)):
                    continue
                ep_ = endpoint_of(rep.http_url)
                self.endpoints.append(ep_)
                self.replica_by_endpoint[ep_] = rid
        now = w.clock.now_ms()
        upstream = self._upstream_headers(principal, req.request_id)
        upstream["x-fairbatch-queued-ms"] = f"{max(0.0, now - req.arrival_ms):.3f}"
        grant.add_headers(upstream)  # the agent's admission: lease, inline admit (+ on-time) or direct (router/core.py)
        # the client's own admission headers never reach the agent
        remove = ("authorization", *(h for h in ADMISSION_HEADERS if h not in upstream))
        self.timer = asyncio.get_running_loop().call_later(self.picker.settle_timeout_s, self.settle)
        return pick_response(self.endpoints, upstream, remove)

    # ------------------------------------------------------------------ settlement

    def settle(self) -> None:
        """Settle the lease once (module docstring, step 3) and give the quota slot back."""
        if self.settled or self.grant is None or self.req is None:
            return
        self.settled = True
        if self.timer is not None:
            self.timer.cancel()
        w, grant, req = self.w, self.grant, self.req
        kind = self.outcome or "client_gone"
        served = self.served
        if served is not None and served != self.endpoints[0] and served in self.replica_by_endpoint:
            # the proxy went down the list: the primary failed or refused; the fallback's agent
            # admitted the request itself, and the request was served there (charge kept)
            w.core.release(grant, "fallback-served")
            outcome = "fallback_served" if kind == "ok" else _OUTCOME[kind]
        else:
            pab_ms, pab_tokens = self.pab
            w.core.after_attempt(w.core.attempts(1), req, grant, kind, pab_ms, pab_tokens)
            if kind == "ok" and not grant.inline:
                w.budgets.forget(grant.lease_id)
            outcome = _OUTCOME[kind]
            if kind == "lease_refused":
                w.metrics.admit_refusals.labels(grant.replica_id).inc()
        # no generation (an engine's 4xx, a 5xx before the first byte, the agents' refusals): the rate
        # buckets get the request back, as the front door gives them back (router/charges.py)
        self.give_quota_back(quota_refunded(outcome, False))
        self.picker.count(req.tenant, req.slo_class, outcome)

    def give_quota_back(self, refund: bool) -> None:
        """Release the concurrency slot of the quota ticket (and refund its rate buckets when ``refund``):
        at once where the ledger needs no I/O (``Ledger.settle_now``), else in the background."""
        ticket, w = self.ticket, self.w
        if ticket is None:
            return
        self.ticket = None
        limits = w.limits.get(ticket.tenant, TenantLimits()) if refund else None
        if w.ledger.settle_now(ticket, limits):
            return
        if limits is not None:
            w._spawn(w.ledger.refund(ticket, limits))
        w._spawn(w.ledger.release(ticket))


def _is_ip_endpoint(endpoint: str) -> bool:
    host = endpoint.rsplit(":", 1)[0].strip("[]")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


async def start_ext_proc(wiring: RouterWiring, host: str, port: int, max_streams: int = 10_000,
                         max_fallbacks: int = MAX_FALLBACKS,
                         settle_timeout_s: float = SETTLE_TIMEOUT_S) -> tuple[grpc.aio.Server, health_aio.HealthServicer, int]:
    """Serve the picker and the gRPC health services on ``host:port`` (0: any free port); returns the
    server, its health servicer and the bound port. The wiring must be started by the caller."""
    named = sorted(rid for rid, r in wiring.replicas.items() if not _is_ip_endpoint(endpoint_of(r.http_url)))
    if named:  # Envoy's override-host balancing takes IP:port only (004 "Destination Endpoint")
        log.warning("ext_proc: replicas %s are addressed by name, not IP: a gateway cannot route to them "
                    "(use discovery kubernetes or dns, or IPs in replicas)", ", ".join(named))
    server = grpc.aio.server(maximum_concurrent_rpcs=max_streams)
    ep_grpc.add_ExternalProcessorServicer_to_server(ExtProcPicker(wiring, max_fallbacks, settle_timeout_s), server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind the ext_proc port {host}:{port}")
    for name in HEALTH_SERVICES:
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    await server.start()
    return server, health, bound


async def stop_ext_proc(server: grpc.aio.Server, health: health_aio.HealthServicer, grace_s: float) -> None:
    """Drain: health NOT_SERVING at once (readiness drops the pod from its Service), then let open
    streams finish within ``grace_s`` wall seconds."""
    await health.enter_graceful_shutdown()
    await server.stop(grace_s)
