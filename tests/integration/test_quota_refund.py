"""Issue 30, item 4, over loopback: a request the engine refuses gives its tenant's rate buckets back.

Tenant acme has 5,000 tokens per minute. A completion of a 20,000-token prompt with ``max_tokens``
20,000 passes the router's own checks (each alone fits the 32,768-token context) and is charged
min(40,000, 5,000) = the whole bucket; the simulated engine refuses it (400: prompt + max_tokens
over its context, as vLLM does). Before the fix the tenant's next
8-token request got 429 ``tenant-rate``; now the refused request's charge is refunded and it is
served.
"""

from __future__ import annotations

import aiohttp
import pytest

from loadgen.sim.tokenizer import make_prompt

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
