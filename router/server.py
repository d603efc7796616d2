"""The router's HTTP front door (aiohttp): OpenAI-compatible generation endpoints.

One request's path (docs/design.md section 5): authenticate (API key -> tenant, or a trusted gateway
header) -> classify (tenant -> SLO class) -> read and validate the body, estimate prompt tokens ->
quotas (ledger: request and token buckets, concurrency; 429 tenant-rate / tenant-concurrency) ->
the request core (router/core.py: work shedding, place and Reserve now, or queue in the weighted
fair queue, or refuse; a baseline placement profile: placed at once, no lease; the answers are
values) -> relay to the replica's agent, bytes unchanged ->
the core's rule after the attempt (refund, release, try the next replica). This module does the
HTTP part only: parse, call the core, carry out its answers (router/answers.py), relay
(router/relay.py), metrics and spans. The process's wiring, lifecycle and reload live in
router/wiring.py, the side endpoints (models, tokenizer, health, metrics) in router/endpoints.py.

Fairness accounting (VTC): a request is charged ``w_prefill * prompt + w_decode * max_tokens`` when
it gets its lease (``fairness.default_max_tokens`` when it gives no max_tokens). The relay does not
parse stream chunks, so a streamed request keeps that estimate; a non-stream answer is buffered
anyway, so its ``usage.completion_tokens`` corrects the decode part at completion. A request whose
replica failed before its first byte is refunded.

Every reservation is freed on every error path (Release RPC in the background); a successful
request's lease is consumed by the agent. Times are simulated ms from the router's
:class:`~fairbatch_common.clock.Clock`; metric durations in seconds are wall seconds.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import Sequence
from typing import Any

from aiohttp import web
from opentelemetry import trace

from fairbatch_common.clock import Clock
from fairbatch_common.api_schema import ApiError, ValidRequest, validate_request
from fairbatch_common.http_guard import (
    REQUEST_ID,
    api_error_response,
    bounded_expect_handler,
    client_request_id,
    new_request_id,
    off_loop,
    read_body,
)
from fairbatch_common.openai_stream import requested_choices
from fairbatch_common.stall import default_stall_ms
from fairbatch_common.telemetry import extract_context, genai_request_attributes, inject_context, set_http_status
from router.admission import prompt_decision
from router.answers import Answer, no_budget, queue_full, tenant_over, work_shed
from router.arrival import queue_full_before_body
from router.auth import Principal
from router.charges import decode_correction, quota_refunded, quota_refunded_on_disconnect
from router.config import RouterConfig, SloClassConfig
from router.core import CoreRequest, Grant, Refused, tenant_shares
from router.endpoints import AuxEndpoints, answer_response, metrics_http_errors, openai_error, openai_http_errors
from router.ledger import CONCURRENCY_RETRY_MS, Refusal, TenantLimits
from router.migration import StreamResume, continuation_body, continuation_sizes, decide, migratable, remaining_tokens
from router.openai_surface import REFUSED_PATHS, RELAYED_PATHS, model_not_found
from router.placement import largest_max_prompt
from router.placement.predicted_latency import TPOT_SLO_HEADER, TTFT_SLO_HEADER, slo_header_ms
from router.prefix_index import text_block_keys
from router.relay import RelayOutcome, UpstreamAbort
from router.tokens import PromptError, estimate_prompt_tokens, prompt_text
from router.wiring import RouterWiring, tenant_limits
from router.work_shed import BUDGET_REASONS

__all__ = ["Grant", "Router", "RouterWiring", "answer_response", "build_app", "openai_error", "tenant_limits",
           "tenant_shares"]

log = logging.getLogger(__name__)

_ROUTER_KEY = web.AppKey("fairbatch_router", object)
FIRST_BYTE_MS = web.RequestKey("fairbatch_first_byte_ms", float)
GRANT = web.RequestKey("fairbatch_grant", Grant)
"""The request's current grant: its first byte relayed ends its prefill in the core's load view
(``RouterCore.prefill_done``: Dynamo's and llm-d-sticky's router-local prefill tokens)."""
RELAY_EVENTS = web.RequestKey("fairbatch_relay_events", int)
STREAM_SHAPE = web.RequestKey("fairbatch_stream_shape", tuple)


SILENCE_GRACE_S = 5.0
"""Wall seconds added to twice a class's stall timeout before a silent agent is given up (:meth:`Router.silence_s`)."""


class Router(AuxEndpoints):
    """The router process: wiring (router/wiring.py), side endpoints (router/endpoints.py) and the
    generation path below. Arguments: :class:`router.wiring.RouterWiring`."""

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

    async def _on_startup(self, app: web.Application) -> None:
        await self.start()

    async def _on_cleanup(self, app: web.Application) -> None:
        await self.close()

    async def _on_response_prepare(self, request: web.Request, response: web.StreamResponse) -> None:
        if FIRST_BYTE_MS not in request:  # a stream's first event is written right after this hook
            request[FIRST_BYTE_MS] = self.clock.now_ms()
            grant = request.get(GRANT)
            if grant is not None:
                self.core.prefill_done(grant)
        if "x-request-id" not in response.headers:
            rid = request.get(REQUEST_ID) or client_request_id(request.headers.get("x-request-id")) or new_request_id()
            response.headers["x-request-id"] = rid

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
                self.core.latency_forget(request_id)
                raise
            ttft_s, tpot_s = self._observe(request, principal, outcome, response.status, arrival_ms, chat)
            if ttft_s is None:  # the training signal of a policy that learns latency (llm-d-predicted-latency)
                self.core.latency_forget(request_id)
            else:
                self.core.latency_observed(request_id, ttft_s * 1000.0, None if tpot_s is None else tpot_s * 1000.0)
            span.set_attribute("fairbatch.outcome", outcome)
            set_http_status(span, response.status, "upstream_error" if outcome == "upstream_error" else None)
            return response

    def _observe(
        self, request: web.Request, principal: Principal, outcome: str, code: int, arrival_ms: float, chat: bool
    ) -> tuple[float | None, float | None]:
        """Record one answered request in the metrics (router/metrics.py: TTFT to the first byte relayed,
        a non-stream answer's whole body; TPOT over the relayed events per choice, chat's role event
        and the usage event not counted); returns (TTFT s, TPOT s), None where not measured."""
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
        return ttft_s, tpot_s

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
        adm = self.config.admission
        chunk = self.config.placement.prefix_cache.chunk_chars if self.core.prefix is not None else 0
        # decode, validate and price the body; in a worker thread when it is large (issue 30 item 8)
        priced = await off_loop(len(raw), price_body, raw, chat, largest_max_prompt(views), adm.bytes_per_token,
                                chunk)  # fmt: skip
        valid = priced.valid
        body = valid.body
        if not isinstance(body.get("model"), str) or not body["model"]:
            return "bad_request", openai_error(400, "'model' is required.", param="model")
        served = await self.catalog.served_for(body["model"])  # before any quota or lease; no fetch on the hot path
        if served is not None and body["model"] not in served:
            return "bad_request", model_not_found(body["model"], served)
        if priced.prompt_error:
            return "bad_request", openai_error(400, priced.prompt_error, param="messages" if chat else "prompt")
        prompt_tokens = priced.prompt_tokens
        if valid.stream:  # for the TPOT metric (:meth:`_observe`)
            opts = body.get("stream_options")
            with_usage = isinstance(opts, dict) and bool(opts.get("include_usage"))
            request[STREAM_SHAPE] = (requested_choices(body), with_usage)
        genai_request_attributes(trace.get_current_span(), chat, body, valid.max_tokens)
        max_tokens = (valid.max_tokens or 0) * requested_choices(body)  # n > 1: n sequences decode, each up to max_tokens
        cap = prompt_decision(prompt_tokens, valid.prompt_ids is not None, views, adm.bytes_per_token,
                              adm.estimate_refuse_factor)  # fmt: skip
        if cap.refusal is not None:
            return "bad_request", openai_error(400, cap.refusal, param="messages" if chat else "prompt",
                                               code="context_length_exceeded")  # fmt: skip
        prompt_tokens = cap.tokens
        req = CoreRequest(request_id, principal.tenant, principal.slo_class, prompt_tokens, max_tokens, arrival_ms,
                          priced.block_keys if self.core.prefix is not None else (),
                          slo_header_ms(request.headers.get(TTFT_SLO_HEADER)),
                          slo_header_ms(request.headers.get(TPOT_SLO_HEADER)))  # fmt: skip
        if self.core.refuse_by_work(req, views):
            return self._answer(work_shed(principal.slo_class))

        quota = await self.ledger.acquire(
            principal.tenant, request_id, limits, prompt_tokens + self.core.decode_estimate(max_tokens)
        )
        if isinstance(quota, Refusal):
            return self._answer(tenant_over(quota.reason, principal.tenant, self.clock.to_wall_s(quota.retry_after_ms)))
        self.core.track_prefix(req)
        refunded = False
        try:
            resume = (StreamResume(body, chat, prompt_tokens=prompt_tokens) if self.config.migration.max_migrations > 0
                      and migratable(body, chat, valid.stream) else None)  # fmt: skip
            outcome, response = await self._serve_placed(request, principal, raw, req, valid.stream, resume)
            if quota_refunded(outcome, response.prepared):  # router/charges.py: nothing was generated
                # before the answer goes out: a client that retries at once must find its quota back (one
                # Redis round trip, bounded by ledger.timeout_ms; shielded from the client leaving meanwhile)
                refunded = True
                await asyncio.shield(self.ledger.refund(quota, limits))
            return outcome, response
        except asyncio.CancelledError:  # the client left; queued (never sent to a replica): nothing ran
            if not refunded and quota_refunded_on_disconnect(GRANT in request):
                self._spawn(self.ledger.refund(quota, limits))
            raise
        finally:
            self.core.forget_prefix(request_id)
            self._spawn(self.ledger.release(quota))

    async def _serve_placed(
        self, request: web.Request, principal: Principal, raw: bytes, req: CoreRequest, stream: bool,
        resume: StreamResume | None = None,
    ) -> tuple[str, web.StreamResponse]:
        """Acquire a lease (the core), relay, and follow the core's rule after each attempt; a
        migratable stream (``resume``) that fails after its first byte goes on in :meth:`_migrate`."""
        last: RelayOutcome | None = None
        last_replica = ""
        core = self.core
        tries = core.attempts(self.max_relay_tries)  # router/admission.py: bounds, exclusions
        slo = principal.slo
        grant: Grant | None = None

        async def queued(_entry: object) -> None:
            tries.waited()  # a wait for budget, bounded by the queue deadline: refusals count afresh

        while tries.next_try():
            # after an inline refusal: placed elsewhere at once when another replica fits, else
            # queued for any replica (the refusing one's answer already updated the view)
            got = await self._acquire(req, tries.exclude, tries.refused_on, grant, on_queued=queued)
            if isinstance(got, Refused):
                if got.reason == "no-replica":
                    break
                if got.reason in BUDGET_REASONS:
                    core.budget_refused()
                return self._answer(self._refusal_answer(got, principal, slo))
            grant = got
            request[GRANT] = grant
            outcome = await self._forward(request, principal, grant, raw, req.request_id, req.arrival_ms, stream,
                                          resume)  # fmt: skip
            action = core.after_attempt(tries, req, grant, outcome.kind, outcome.pab_ms, outcome.pab_tokens)
            if resume is not None and outcome.kind == "upstream_error" and outcome.response is not None:
                return await self._migrate(request, principal, req, resume, outcome, grant)
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
        stream: bool = True, resume: StreamResume | None = None, resp: web.StreamResponse | None = None,
        on_first: Any = None,
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
        grant.add_headers(headers)  # the agent's admission: lease, inline admit (+ on-time) or direct (router/core.py)
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
                if resume is not None:  # a migratable stream (router/migration.py): events parsed, failure kept open
                    outcome = await self.relay.forward_resumable(
                        request, replica.http_url, request.path, raw, headers, response_headers, resume, resp, abort,
                        self.silence_s(principal.slo), on_first, self.client_stall_s(principal.slo),
                    )
                else:
                    outcome = await self.relay.forward(
                        request, replica.http_url, request.path, raw, headers, response_headers, abort,
                        # a stream only: a non-stream answer is silent until the end, the agent watching its engine
                        # by /metrics meanwhile (a long one may take minutes)
                        self.silence_s(principal.slo) if stream else None,
                        self.client_stall_s(principal.slo) if stream else None,
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

    async def _migrate(
        self, request: web.Request, principal: Principal, req: CoreRequest, state: StreamResume,
        outcome: RelayOutcome, grant: Grant,
    ) -> tuple[str, web.StreamResponse]:
        """Continue a stream whose attempt on ``grant`` failed after its first byte (the core already
        released that grant): router/migration.py ``decide`` says whether; each continuation is a
        new placement through the core as a request arriving now (the failed replicas excluded, the
        class's ``max_queue_ms`` from now), its
        request built by ``continuation_body`` and relayed into the same client response. Bounded by
        ``migration.max_migrations``. The tenant is charged once, for the original request: each
        continuation's charge is refunded. Returns (outcome, response): ``ok`` when a continuation
        relayed ``[DONE]``, ``client_disconnect``, else ``upstream_error`` after the SSE error event."""
        resp = outcome.response
        assert resp is not None
        core = self.core
        loop = asyncio.get_running_loop()
        cause = outcome.cause or "disconnect"
        detail = outcome.detail
        exclude = {grant.replica_id}
        failed_at = loop.time()
        added = 0.0

        def first_event() -> None:  # the continuation's first event relayed: its prefill is done
            nonlocal added
            added += loop.time() - failed_at
            core.prefill_done(grant)

        while True:
            log.warning("request %s: replica %s failed mid-stream (%s) after %d tokens", req.request_id,
                        grant.replica_id, cause, state.tokens)  # fmt: skip
            decision = decide(state, self.config.migration.max_migrations, req.prompt_tokens,
                              largest_max_prompt(self.book.views()))  # fmt: skip
            if decision.reason == "complete":  # every token went out: end the stream as the engine would have
                self.metrics.migrations.labels(cause, "complete").inc()
                try:
                    await resp.write(b"data: [DONE]\n\n")
                    await resp.write_eof()
                except (ConnectionError, RuntimeError):
                    return "client_disconnect", resp
                return "ok", resp
            if not decision.go:
                self.metrics.migrations.labels(cause, decision.reason.replace("-", "_")).inc()
                await self.relay.end_with_error(resp, detail)
                return "upstream_error", resp
            body = continuation_body(state.body, state)
            assert body is not None
            state.next_attempt()
            left = remaining_tokens(state.body, state.tokens)
            # placed as a request arriving now (its queue bound and TTFT feasibility from now: the client
            # already has its first token; judged from the original arrival it would be shed or expired)
            cprompt, cmax = continuation_sizes(req.prompt_tokens, req.max_tokens, state.base_tokens)
            creq = dataclasses.replace(req, prompt_tokens=cprompt, max_tokens=cmax if left is None else left,
                                       arrival_ms=self.clock.now_ms())
            tries = core.attempts(1)
            tries.exclude = frozenset(exclude)
            tries.next_try()
            got = await self._acquire(creq, tries.exclude, frozenset(), None)
            if isinstance(got, Refused):
                self.metrics.migrations.labels(cause, "no_replica").inc()
                await self.relay.end_with_error(resp, f"{detail}; no replica could continue the stream ({got.reason})")
                return "upstream_error", resp
            grant = got
            request[GRANT] = grant
            raw = json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
            outcome = await self._forward(request, principal, grant, raw, f"{req.request_id}-m{state.migrations}",
                                          creq.arrival_ms, True, state, resp, first_event)  # fmt: skip
            action = core.after_attempt(tries, creq, grant, outcome.kind, outcome.pab_ms, outcome.pab_tokens)
            if not action.refund:  # charged once: the original request's charge covers the continuation
                core.charge(creq.tenant, -creq.prompt_tokens, -core.decode_estimate(creq.max_tokens))
            request[RELAY_EVENTS] = state.events
            if outcome.kind == "ok":
                self.budgets.forget(grant.lease_id)
                self.metrics.migrations.labels(cause, "resumed").inc()
                self.metrics.migration_added.observe(added)
                return "ok", resp
            if outcome.kind == "client_gone":
                self.metrics.migrations.labels(cause, "client_gone").inc()
                return "client_disconnect", resp
            if outcome.kind == "refused":  # the engine refused the continuation (e.g. its context): no retry
                self.metrics.migrations.labels(cause, "failed").inc()
                await self.relay.end_with_error(resp, f"{detail}; the continuation was refused: {outcome.detail}")
                return "upstream_error", resp
            self.metrics.migrations.labels(cause, "failed").inc()
            exclude.add(grant.replica_id)
            cause = outcome.cause or "disconnect"
            detail = outcome.detail or detail
            failed_at = loop.time()

    def client_stall_s(self, slo: SloClassConfig) -> float:
        """Wall seconds a streaming client of class ``slo`` may read nothing (its send buffer full,
        the relay paused) before it is cut and its engine request aborted: the class's stall timeout
        (``stall_timeout_ms``, else fairbatch_common/stall.py ``default_stall_ms``; issue 30: 50
        clients that stopped reading held both engines of a fleet for 125 s)."""
        return self.clock.to_wall_s(slo.stall_timeout_ms or default_stall_ms(slo.ttft_ms, slo.tpot_ms))

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


def build_app(
    config: RouterConfig, clock: Clock | None = None, router_id: str = "router-0", **kwargs: Any
) -> tuple[web.Application, Router]:
    """Build a :class:`Router` and its aiohttp application (started by the app's startup hook)."""
    router = Router(config, clock, router_id, **kwargs)
    return router.build_app(), router


@dataclasses.dataclass(frozen=True, slots=True)
class PricedBody:
    """A generation request's body, checked and priced (:func:`price_body`).

    Attributes:
        valid: the validated request (fairbatch_common/api_schema.py).
        prompt_tokens: its prompt tokens: exact for token ids (``valid.prompt_ids``), else the estimate
            at ``bytes_per_token`` (router/tokens.py); 0 when ``prompt_error`` is set.
        prompt_error: why the prompt cannot be priced (router/tokens.py ``PromptError``), else "".
        block_keys: the prompt's prefix-map keys (router/prefix_index.py), () unless asked for.
    """

    valid: ValidRequest
    prompt_tokens: int
    prompt_error: str
    block_keys: Sequence[int]


def price_body(raw: bytes, chat: bool, max_context: int, bytes_per_token: float, chunk_chars: int) -> PricedBody:
    """Decode, validate and price one body (pure: the router runs it in a worker thread for a large
    body, fairbatch_common/http_guard.py ``off_loop``). ``chunk_chars`` > 0: also the prefix-map keys
    of its text in chunks of that many characters.

    Raises:
        ApiError: the body is not a valid request (400).
    """
    valid = validate_request(raw, chat, max_context)
    if valid.prompt_ids is not None:
        tokens, error = valid.prompt_ids, ""
    else:
        try:
            tokens, error = estimate_prompt_tokens(valid.body, chat, bytes_per_token), ""
        except PromptError as exc:
            tokens, error = 0, str(exc)
    keys = text_block_keys(prompt_text(valid.body, chat), chunk_chars) if chunk_chars > 0 and not error else ()
    return PricedBody(valid, tokens, error, keys)
