"""The router's side endpoints: model catalog, tokenizer relay, health and metrics, and the
OpenAI-format error answers every handler uses.

:class:`AuxEndpoints` is mixed into :class:`router.server.Router` (it reads the wiring's state:
router/wiring.py); the generation path lives in router/server.py.
"""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from fairbatch_common.api_schema import ApiError
from fairbatch_common.http_guard import api_error_response, error_middleware, json_error, read_body
from router.answers import Answer
from router.openai_surface import unsupported
from router.wiring import RouterWiring


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


openai_http_errors = error_middleware("router", not_found=unsupported)  # any unrouted path: unsupported_endpoint
metrics_http_errors = error_middleware("router")  # the metrics port serves no OpenAI path
"""aiohttp's own HTTP errors (404, 405, 413), :class:`ApiError` refusals and our own bugs (500 with the
request id) as OpenAI-format JSON, like every other answer of the router."""


class AuxEndpoints(RouterWiring):
    """GET /v1/models[/{id}], refused OpenAI paths, POST /tokenize and /detokenize, /health, /metrics."""

    def _refuse_unauthenticated(self, request: web.Request) -> web.Response | None:
        """401 ``invalid_api_key`` when the request names no tenant the authenticator accepts, else None
        (every ``/v1`` path asks for a key, as vLLM with ``--api-key`` and OpenAI do)."""
        if self.auth.identify(request.headers, request.remote) is None:
            return openai_error(401, self.auth.refusal(request.headers, request.remote), code="invalid_api_key")
        return None

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
