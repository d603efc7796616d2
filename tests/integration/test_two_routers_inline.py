"""Two real routers, one real agent, inline admission (no Reserve round trip): no budget spent twice.

Both routers see the same budget stream. A simultaneous burst through both makes each place on its
own view (``take_local``) as much as the replica's PAB holds, so together they forward about twice
what fits. The agent decides each arrival against its exact state: what fits is admitted, the rest
is refused with 409 and re-placed by its router once budget frees. Worked numbers (llama-3-8b-a100:
a = 9.8626, b = 0.0726711 ms/token; class TTFT 1000 ms, margin 0.1: H = 900 ms): a 3000-token
prompt costs a + b * 3000 = 227.9 ms and holds b * 3000 = 218.0 ms of in-flight reservation. Each
router's view loses 227.9 ms per placement (900 -> 672.1 -> 444.2 -> 216.3), so each places 3 at
once: 6 arrive, 6 * 218.0 = 1308 ms of a 900 ms horizon, and the agent admits 4 (872.0 ms).
"""

from __future__ import annotations

import asyncio
import re

import aiohttp
import pytest

from loadgen.procs import free_port, script
from loadgen.sim.tokenizer import make_prompt
from tests.integration.conftest import wait_all_replicas_usable

pytestmark = pytest.mark.timeout(180)

H_MS = 900.0


def metric(text: str, name: str, labels: str = "") -> float:
    """Sum of the samples of ``name`` (whose label set contains ``labels``) in a Prometheus text page."""
    total = 0.0
    for m in re.finditer(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", text, re.M):
        if labels in (m.group(1) or ""):
            total += float(m.group(2))
    return total


async def test_two_routers_inline_never_spend_one_budget_twice(fleet_factory) -> None:
    # one engine + agent + router 1 (lease_mode inline, the default); the agent pushes at most every
    # 100 ms, so a burst inside one interval is placed by both routers on the same, unchanged view;
    # no start window (it alone would keep each router at 2 placements, which fit together)
    fleet = fleet_factory(1, agent_args=["--min-push-interval-ms", "100"], admission={"start_window_steps": 0})
    port2 = free_port()
    r2 = fleet.group.start("router2", script("fairbatch-router") + [
        "--config", str(fleet.config_path), "--port", str(port2), "--time-scale", "1"])
    url2 = f"http://127.0.0.1:{port2}"
    fleet.group.wait_http_ok(r2, f"{url2}/health")
    wait_all_replicas_usable(url2, 1)
    agent = fleet.agent_urls[0]
    headers = {"Authorization": f"Bearer {fleet.api_keys['acme']}"}
    body = {"model": "llama-3-8b-a100", "prompt": make_prompt(3000), "max_tokens": 4, "ignore_eos": True,
            "stream": True}
    peak = 0.0
    done = asyncio.Event()

    async def watch(s: aiohttp.ClientSession) -> None:  # the agent's own in-flight reservation, sampled
        nonlocal peak
        while not done.is_set():
            async with s.get(agent + "/metrics") as r:
                peak = max(peak, 1000.0 * metric(await r.text(), "fairbatch_agent_inflight_reservation_seconds",
                                                 'slo_class="interactive"'))
            await asyncio.sleep(0.01)

    async def one(s: aiohttp.ClientSession, url: str) -> tuple[int, bytes]:
        async with s.post(url + "/v1/completions", json=body, headers=headers) as r:
            return r.status, await r.read()

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        watcher = asyncio.create_task(watch(s))
        results = await asyncio.gather(*(one(s, url) for _ in range(6) for url in (fleet.router_url, url2)))
        done.set()
        await watcher
        assert [st for st, _ in results] == [200] * 12
        assert all(raw.rstrip().endswith(b"data: [DONE]") for _, raw in results)
        async with s.get(agent + "/metrics") as r:
            agent_metrics = await r.text()
        refused = 0.0
        for url in (fleet.router_url, url2):
            async with s.get(url + "/metrics") as r:
                refused += metric(await r.text(), "fairbatch_router_admit_refusals_total")
    granted = metric(agent_metrics, "fairbatch_agent_reserve_total", 'result="granted"')
    no_budget = metric(agent_metrics, "fairbatch_agent_reserve_total", 'result="no-budget"')
    # a queued request's on-time attempt (the dispatcher's first phase) may be refused "not-on-time"
    late = metric(agent_metrics, "fairbatch_agent_reserve_total", 'result="not-on-time"')
    assert granted == 12  # every request admitted exactly once, by the agent, on arrival
    assert no_budget > 0 and refused == no_budget + late  # the routers did collide; each refusal was re-placed
    assert 0.0 < peak <= H_MS + 1e-6  # prefill was admitted, never more than the horizon holds
    assert metric(agent_metrics, "fairbatch_agent_leases_active") == 0  # every lease freed
