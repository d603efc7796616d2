"""A rolling restart loses nothing (issue 29 item 3): 2 simulated engines + 2 real agents + the router,
all real processes on loopback, under a steady load of streams; one replica at a time is drained
(the first by ``fairbatch-agent drain --wait``, the chart's preStop hook, the others by SIGTERM), its
engine stopped, and both started again on the same ports.

Sizes: time scale 1 (a decode step of llama-3-8b-a100 is ~10 ms), streams of 150 tokens (~1.5 s), a
drain grace of 0.8 s: the streams a drained agent holds that are younger than ~0.7 s are still open
when its grace ends and are handed over (the router continues them elsewhere, cause ``drain``);
the older ones finish there. The simulated engine decodes greedily without a seed (every token is
``" tok"``), so each stream must carry exactly ``max_tokens`` tokens of it and finish ``length``.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time

import aiohttp
import pytest

from loadgen.procs import script
from loadgen.sim.tokenizer import make_prompt
from tests.integration.conftest import wait_all_replicas_usable

pytestmark = pytest.mark.timeout(150)

MODEL = "llama-3-8b-a100"
MAX_TOKENS = 150
GRACE_S = 0.8
RATE = 5.0  # streams per second over the whole restart
N = 2  # replicas


def prompt(i: int) -> str:
    return f"{i:04d}" + make_prompt(64)[4:]


async def read_sse(resp: aiohttp.ClientResponse) -> dict:
    out = {"texts": [], "ids": set(), "finish": [], "usage": None, "error": None, "done": False}
    async for line in resp.content:
        if not line.startswith(b"data: "):
            continue
        payload = line[6:].strip()
        if payload == b"[DONE]":
            out["done"] = True
            continue
        ev = json.loads(payload)
        if "error" in ev:
            out["error"] = ev["error"]
            continue
        out["ids"].add(ev["id"])
        for ch in ev.get("choices") or ():
            if ch.get("text"):
                out["texts"].append(ch["text"])
            if ch.get("finish_reason") is not None:
                out["finish"].append(ch["finish_reason"])
        if ev.get("usage"):
            out["usage"] = ev["usage"]
    return out


async def one_stream(s: aiohttp.ClientSession, fleet, i: int) -> dict:
    body = {"model": MODEL, "prompt": prompt(i), "max_tokens": MAX_TOKENS, "stream": True,
            "stream_options": {"include_usage": True}}
    headers = {"Authorization": f"Bearer {fleet.api_keys['acme']}"}
    async with s.post(f"{fleet.router_url}/v1/completions", json=body, headers=headers) as resp:
        if resp.status != 200:
            return {"status": resp.status, "body": await resp.text()}
        out = await read_sse(resp)
        out["status"] = 200
        return out


async def wait_exit(popen: subprocess.Popen, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while popen.poll() is None:
        assert time.monotonic() < deadline, "the drained agent did not exit"
        await asyncio.sleep(0.05)
    return popen.returncode


async def check_draining(s: aiohttp.ClientSession, fleet, i: int) -> None:
    """While agent ``i`` drains (a direct stream holds it past its grace): GET /drain says so, a new
    direct request is refused 503 with Retry-After, and the router stops listing it as usable."""
    url = fleet.agent_urls[i]
    deadline = time.monotonic() + 30.0  # the hook's interpreter starts (imports) on a busy machine
    while True:
        async with s.get(f"{url}/drain") as r:
            state = (await r.json())["state"]
        if state == "draining":
            break
        assert state == "serving" and time.monotonic() < deadline, state
        await asyncio.sleep(0.02)
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
    async with s.post(f"{url}/v1/completions", json=body) as r:
        assert r.status == 503 and r.headers["Retry-After"] == "1"
        assert (await r.json())["error"]["type"] == "replica_draining"
    while True:  # the draining snapshot reaches the router within a push (5 ms) plus the loop's lag
        async with s.get(f"{fleet.router_url}/health") as r:
            usable = (await r.json()).get("replicas_usable", [])
        if f"r{i}" not in usable:
            break
        assert time.monotonic() < deadline, usable
        await asyncio.sleep(0.02)


async def test_rolling_restart_under_load_loses_no_stream(fleet_factory) -> None:
    fleet = fleet_factory(N, time_scale=1.0, agent_args=["--drain-grace-s", str(GRACE_S)])
    results: list[asyncio.Task] = []
    stop_load = asyncio.Event()
    exit_codes: list[int] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:

        async def load() -> None:
            i = 0
            t0 = time.monotonic()
            while not stop_load.is_set():
                results.append(asyncio.create_task(one_stream(s, fleet, i)))
                i += 1
                await asyncio.sleep(max(0.0, t0 + i / RATE - time.monotonic()))

        loader = asyncio.create_task(load())
        await asyncio.sleep(2.0)  # streams open on every replica
        held = None
        for i in range(N):
            agent = fleet.children[f"agent{i}"]
            if i == 0:  # the preStop path, with a direct stream that outlives the grace period
                direct = {"model": MODEL, "prompt": prompt(9999), "max_tokens": 3000, "stream": True}
                held_resp = await s.post(f"{fleet.agent_urls[0]}/v1/completions", json=direct)
                assert held_resp.status == 200
                held = asyncio.create_task(read_sse(held_resp))
                hook = subprocess.Popen(script("fairbatch-agent") + ["drain", "--url", fleet.agent_urls[0], "--wait"],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                await check_draining(s, fleet, 0)
                assert await wait_exit(hook, 30.0) == 0, hook.stderr.read() if hook.stderr else ""
            else:
                os.kill(agent.popen.pid, signal.SIGTERM)
            exit_codes.append(await wait_exit(agent.popen, 30.0))
            engine = fleet.children[f"engine{i}"]
            engine.popen.terminate()
            await wait_exit(engine.popen, 10.0)
            await asyncio.to_thread(fleet.restart, [(f"engine{i}", f"{fleet.engine_urls[i]}/health"),
                                                    (f"agent{i}", f"{fleet.agent_urls[i]}/health")])
            await asyncio.to_thread(wait_all_replicas_usable, fleet.router_url, N, 60.0)
        await asyncio.sleep(1.0)  # the restarted replicas take work too
        stop_load.set()
        await loader
        done = await asyncio.gather(*results)
        held_out = await held
        async with s.get(f"{fleet.router_url}/metrics") as r:
            metrics = await r.text()

    assert exit_codes == [0] * N
    # a direct client of the agent (no router) sees the hand-over event: that is the signal the router migrates on
    assert held_out["error"] is not None and held_out["error"]["type"] == "replica_draining", held_out
    assert held_out["done"]
    assert 0 < len(held_out["texts"]) < 3000
    failed = [r for r in done if r["status"] != 200 or r["error"] is not None or not r["done"]]
    assert not failed, failed[:3]
    for r in done:
        assert r["texts"] == [" tok"] * MAX_TOKENS and r["finish"] == ["length"] and len(r["ids"]) == 1
        assert r["usage"]["completion_tokens"] == MAX_TOKENS and r["usage"]["prompt_tokens"] == 64
    assert len(done) >= 4 * RATE  # the load ran through the whole restart (>= 4 s of it)
    handed = [line for line in metrics.splitlines() if line.startswith("fairbatch_router_stream_migrations_total")
              and 'cause="drain"' in line and 'outcome="resumed"' in line]
    assert handed and float(handed[0].rsplit(" ", 1)[1]) >= 1, handed
    assert 'outcome="upstream_error"' not in metrics and 'outcome="failed"' not in metrics
