"""Issue 30, item 4, over loopback: a request that got nothing gives its tenant's rate buckets back.

Tenant acme has 5,000 tokens per minute. A completion of a 20,000-token prompt with ``max_tokens``
20,000 passes the router's own checks (each alone fits the 32,768-token context) and is charged
min(40,000, 5,000) = the whole bucket; the simulated engine refuses it (400: prompt + max_tokens
over its context, as vLLM does). Before the fix the tenant's next
8-token request got 429 ``tenant-rate``; now the refused request's charge is refunded and it is
served.

With the shared Redis ledger (a real redis-server): the same refusal gives back the request of the
requests-per-minute bucket too (2 per minute: the refused request, then two served, the third
refused ``tenant-rate``: the refund gives back exactly one request). A request whose client leaves
while it is queued (no budget anywhere) gives its request and tokens back as well.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from fake_agents import API_KEY, PROMPT, FakeAdmission, FakeUpstream, LoopbackFleet
from fairbatch_common.clock import Clock
from loadgen.sim.tokenizer import make_prompt
from router.config import RouterConfig, hash_api_key
from router.server import Router
from tests.redis_fixture import RedisServer, redis_clean, redis_server  # noqa: F401

pytestmark = pytest.mark.timeout(120)


async def test_an_engine_refusal_refunds_the_tenants_rate_bucket(fleet_factory) -> None:
    fleet = fleet_factory(1, time_scale=0.2, tenants={
        "acme": {"weight": 1, "slo_class": "interactive", "tokens_per_minute": 5000},
        "beta": {"weight": 1, "slo_class": "interactive"}})
    headers = {"Authorization": f"Bearer {fleet.api_keys['acme']}"}
    url = fleet.router_url + "/v1/completions"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        body = {"model": "llama-3-8b-a100", "prompt": make_prompt(20_000), "max_tokens": 20_000}
        async with s.post(url, json=body, headers=headers) as r:
            assert r.status == 400, await r.text()  # the engine's refusal, relayed
            assert "x-fairbatch-replica" in r.headers  # it reached the engine: the router took the quota
        for _ in range(3):  # three more within the minute: each fits the 5,000-token bucket again
            async with s.post(url, json={"model": "llama-3-8b-a100", "prompt": make_prompt(8), "max_tokens": 4},
                              headers=headers) as r:
                assert r.status == 200, (r.status, r.headers.get("x-fairbatch-reason"))



@pytest.mark.redis
async def test_an_engine_refusal_refunds_both_shared_buckets(fleet_factory, redis_clean: RedisServer) -> None:
    fleet = fleet_factory(1, time_scale=0.2, redis_url=redis_clean.url, tenants={
        "acme": {"weight": 1, "slo_class": "interactive", "tokens_per_minute": 5000, "requests_per_minute": 2},
        "beta": {"weight": 1, "slo_class": "interactive"}})
    headers = {"Authorization": f"Bearer {fleet.api_keys['acme']}"}
    url = fleet.router_url + "/v1/completions"
    small = {"model": "llama-3-8b-a100", "prompt": make_prompt(8), "max_tokens": 4}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        body = {"model": "llama-3-8b-a100", "prompt": make_prompt(20_000), "max_tokens": 20_000}
        async with s.post(url, json=body, headers=headers) as r:
            assert r.status == 400, await r.text()
        for _ in range(2):  # 2 requests per minute: both fit again after the refund
            async with s.post(url, json=small, headers=headers) as r:
                assert r.status == 200, (r.status, r.headers.get("x-fairbatch-reason"))
        async with s.post(url, json=small, headers=headers) as r:  # the third within the minute does not
            assert r.status == 429 and r.headers["x-fairbatch-reason"] == "tenant-rate"
        async with s.get(fleet.router_url + "/metrics") as r:
            assert "fairbatch_router_ledger_degraded 0.0" in await r.text()  # the buckets lived in Redis


async def test_a_client_gone_while_queued_gets_its_quota_back() -> None:
    """No replica has budget: the request waits in the queue; its client leaves. Tenant acme has 1
    request and 5,000 tokens per minute: refunded, the next request is taken (queued, not 429
    ``tenant-rate``), and once a budget appears it is served."""
    fleet = LoopbackFleet()
    try:
        http_url, target = await fleet.start_replica(FakeAdmission("r0", 0.0), FakeUpstream("r0", "ok"))
        config = RouterConfig.model_validate({
            "model": "sim-model",
            "slo_classes": {"interactive": {"ttft_ms": 5000, "tpot_ms": 50, "max_queue_ms": 5000,
                                            "sheddable": False}},
            "tenants": {"acme": {"weight": 1, "slo_class": "interactive", "requests_per_minute": 1,
                                 "tokens_per_minute": 5000}},
            "api_keys": {hash_api_key(API_KEY): "acme"},
            "replicas": [{"id": "r0", "http_url": http_url, "grpc_target": target}],
            "admission": {"bytes_per_token": 4.0, "reserve_timeout_ms": 500, "lease_mode": "reserve"},
        })
        router = Router(config, Clock(1.0), "test-router")
        await fleet.serve_router(router)
        await fleet.wait_fresh({"r0"})
        body = {"model": "sim-model", "prompt": PROMPT, "max_tokens": 4}
        first = asyncio.create_task(fleet.request(body))
        await fleet.wait(lambda: len(router.queue) == 1, "the first request to queue")
        first.cancel()  # the client leaves while queued
        await asyncio.gather(first, return_exceptions=True)
        await fleet.wait(lambda: len(router.queue) == 0, "the queue to drop it")
        # 1 request + 104 tokens taken, then given back (a background task of the router)
        await fleet.wait(lambda: not router._background, "the refund and the release to run")
        second = asyncio.create_task(fleet.request(body))
        await fleet.wait(lambda: len(router.queue) == 1 or second.done(), "the second request")
        assert not second.done(), "refused at once: the first request's quota was not given back"
        fleet.admission["r0"].set_budget(4000.0)
        resp = await asyncio.wait_for(second, 10)
        assert resp.status == 200, await resp.text()
    finally:
        await fleet.stop()
