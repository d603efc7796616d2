"""Router <-> agent shared token and the engine API key (issue 14, exposure), over real gRPC and HTTP.

- an agent with a token refuses gRPC calls (WatchBudget, Reserve, Release) without it (UNAUTHENTICATED) and
  HTTP generation and /v1/models without ``x-fairbatch-token`` (401); /health and /metrics stay open;
- a router with the same token gets budgets, leases and answers from that agent; a router without it gets
  none (its requests end 503 no-replica);
- an agent with an engine API key sends ``Authorization: Bearer <key>`` to the engine in place of whatever
  the client sent.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import grpc
import pytest
from aiohttp import web

from loadgen.procs import free_port
from proto import admission_pb2, admission_pb2_grpc
from replica_agent.admission_server import start_grpc_server
from fairbatch_common.http_guard import make_runner
from replica_agent.proxy import Proxy, ProxyConfig, make_session
from fairbatch_common.telemetry import make_tracer
from router.config import RouterConfig, hash_api_key
from router.server import Router
from tests.integration.test_agent_grpc import make_agent

TOKEN = "shared-token-123"
API_KEY = "sk-client-key"


class FakeEngine:
    """An engine that records the Authorization it gets and streams two tokens."""

    def __init__(self, api_key: str | None = None) -> None:
        self.api_key = api_key
        self.auth: list[str | None] = []

    async def completions(self, request: web.Request) -> web.StreamResponse:
        self.auth.append(request.headers.get("Authorization"))
        if self.api_key and request.headers.get("Authorization") != f"Bearer {self.api_key}":
            return web.json_response({"error": {"message": "Unauthorized"}}, status=401)
        body = json.loads(await request.read())
        if not body.get("stream"):  # a whole answer, as vLLM sends a non-stream request's
            return web.json_response({"id": "c", "object": "text_completion", "choices": [
                {"index": 0, "text": "ab", "finish_reason": "length"}], "usage": {"prompt_tokens": 1, "completion_tokens": 2}})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for t in ("a", "b"):
            await resp.write(b'data: {"id":"c","choices":[{"index":0,"text":"%s","finish_reason":null}]}\n\n' % t.encode())
        await resp.write(b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":1,"completion_tokens":2}}\n\n')
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def health(self, request: web.Request) -> web.Response:
        return web.Response()


async def serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = make_runner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


@pytest.fixture
async def stack():
    """Fake engine + agent (HTTP proxy and gRPC) with ``TOKEN``; yields a starter for routers."""
    engine = FakeEngine()
    eapp = web.Application()
    eapp.router.add_post("/v1/completions", engine.completions)
    eapp.router.add_get("/health", engine.health)
    erunner, eurl = await serve(eapp)
    agent = make_agent()
    pcfg = ProxyConfig(engine_url=eurl, agent_token=TOKEN)
    session = make_session(pcfg)
    arunner, aurl = await serve(Proxy(agent, pcfg, session, make_tracer("t")).app())
    server, gport = await start_grpc_server(agent, "127.0.0.1", 0, TOKEN)
    runners: list[web.AppRunner] = []

    async def router(token: str | None) -> str:
        config = RouterConfig.model_validate({
            "model": "m",
            "slo_classes": {"interactive": {"ttft_ms": 500, "tpot_ms": 50, "max_queue_ms": 600}},
            "tenants": {"acme": {"weight": 1, "slo_class": "interactive"}},
            "api_keys": {hash_api_key(API_KEY): "acme"},
            "replicas": [{"id": "r0", "http_url": aurl, "grpc_target": f"127.0.0.1:{gport}"}],
        })
        r = Router(config, agent_token=token)
        runner, url = await serve(r.build_app())
        runners.append(runner)
        return url

    try:
        yield aurl, gport, router, engine, agent
    finally:
        for r in runners:
            await r.cleanup()
        await server.stop(grace=None)
        await arunner.cleanup()
        await session.close()
        await erunner.cleanup()


async def test_agent_refuses_grpc_and_http_without_the_token(stack) -> None:
    aurl, gport, _, engine, agent = stack
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gport}") as channel:
        stub = admission_pb2_grpc.AdmissionServiceStub(channel)
        req = admission_pb2.ReserveRequest(slo_class="interactive", prompt_tokens=10, request_id="x")
        for md in (None, (("x-fairbatch-token", "wrong"),)):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Reserve(req, metadata=md, timeout=2)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Release(admission_pb2.ReleaseRequest(lease_id="l"), timeout=2)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        call = stub.WatchBudget(admission_pb2.WatchBudgetRequest(router_id="x"))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await asyncio.wait_for(call.read(), 2)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert len(agent.leases) == 0
        good = await stub.Reserve(req, metadata=(("x-fairbatch-token", TOKEN),), timeout=2)
        assert good.granted
        await stub.Release(admission_pb2.ReleaseRequest(lease_id=good.lease_id),
                           metadata=(("x-fairbatch-token", TOKEN),), timeout=2)
    body = {"model": "m", "prompt": "hi", "max_tokens": 2}
    async with aiohttp.ClientSession() as s:
        async with s.post(aurl + "/v1/completions", json=body, headers={"x-fairbatch-lease": "t-1"}) as r:
            assert r.status == 401 and (await r.json())["error"]["code"] == "invalid_token"
        async with s.get(aurl + "/v1/models") as r:
            assert r.status == 401
        async with s.get(aurl + "/health") as r:
            assert r.status == 200
        async with s.get(aurl + "/metrics") as r:
            assert r.status == 200
        async with s.post(aurl + "/v1/completions", json=body, headers={"x-fairbatch-token": TOKEN}) as r:
            assert r.status == 200 and (await r.json())["choices"][0]["text"] == "ab"
    assert len(engine.auth) == 1  # the refused ones never reached the engine


async def test_router_with_the_token_is_served_and_without_it_is_not(stack) -> None:
    _, _, router, engine, agent = stack
    with_token, without = await router(TOKEN), await router(None)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": "m", "prompt": "x" * 40, "max_tokens": 2, "stream": True}
    async with aiohttp.ClientSession() as s:
        loop = asyncio.get_running_loop()
        end = loop.time() + 5
        while loop.time() < end:
            health = await (await s.get(with_token + "/health")).json()
            if health["replicas_usable"]:
                break
            await asyncio.sleep(0.05)
        async with s.post(with_token + "/v1/completions", json=body, headers=headers) as r:
            assert r.status == 200
            raw = await r.read()
        assert b'"text":"a"' in raw and raw.endswith(b"data: [DONE]\n\n")
        assert (await (await s.get(without + "/health")).json())["status"] == "degraded"
        async with s.post(without + "/v1/completions", json=body, headers=headers) as r:
            assert r.status == 503 and r.headers["x-fairbatch-reason"] == "no-replica"
    assert len(engine.auth) == 1 and len(agent.leases) == 0


async def test_engine_api_key_replaces_the_clients_authorization() -> None:
    engine = FakeEngine(api_key="engine-secret")
    eapp = web.Application()
    eapp.router.add_post("/v1/completions", engine.completions)
    erunner, eurl = await serve(eapp)
    results = {}
    for key in (None, "engine-secret"):
        pcfg = ProxyConfig(engine_url=eurl, engine_api_key=key)
        assert "engine-secret" not in repr(pcfg)  # never in a log line that prints the config
        session = make_session(pcfg)
        arunner, aurl = await serve(Proxy(make_agent(), pcfg, session, make_tracer("t")).app())
        async with aiohttp.ClientSession() as s:
            async with s.post(aurl + "/v1/completions", data=json.dumps({"model": "m", "prompt": "hi"}),
                              headers={"Authorization": "Bearer client-key"}) as r:
                results[key] = r.status
        await arunner.cleanup()
        await session.close()
    await erunner.cleanup()
    assert results == {None: 401, "engine-secret": 200}
    assert engine.auth == ["Bearer client-key", "Bearer engine-secret"]
