"""Issue 30, item 8, over loopback: large token-id prompts are checked without holding the router's loop.

A 200,000-id prompt is over the simulated engine's 32,768-token context: the router counts it exactly
and refuses it (400 ``context_length_exceeded``, ``param: "prompt"``); in a 30,000-id prompt (within
the context) an id out of range is named (400 ``invalid_value``). Meanwhile a prober asks ``/health`` back to back.

Bound: before the fix the router checked such a body on its loop (274-460 ms each on an idle 2-core
machine; 1.2-1.8 s under load), so five of them sent together held ``/health`` for over a second. Now
the checks run in a worker thread that gives the GIL back between its passes; ``/health`` is held at
most for one pass (a few ms idle). The test allows 400 ms, far above that and below the old stall even
on an idle machine (5 x 274 ms). Measured on the loaded 2-core machine: main's router held /health up to
2,354 ms here (the test fails there), this one 100 ms.
"""

from __future__ import annotations

import asyncio
import json
import random
import time

import aiohttp
import pytest

pytestmark = pytest.mark.timeout(120)

HEALTH_BOUND_MS = 400.0


async def test_a_200k_token_id_prompt_is_refused_while_health_answers(fleet_factory) -> None:
    fleet = fleet_factory(1, time_scale=0.2)
    rng = random.Random(3)
    ids = [rng.randrange(0, 128_000) for _ in range(200_000)]
    raw = json.dumps({"model": "llama-3-8b-a100", "prompt": ids, "max_tokens": 8}).encode()
    bad_ids = ids[:30_000]  # within the context: every id is checked
    bad_ids[25_000] = 2**32
    bad = json.dumps({"model": "llama-3-8b-a100", "prompt": bad_ids, "max_tokens": 8}).encode()
    headers = {"Authorization": f"Bearer {fleet.api_keys['acme']}", "Content-Type": "application/json"}
    url = fleet.router_url
    health: list[float] = []
    stop = asyncio.Event()

    async def probe(s: aiohttp.ClientSession) -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            async with s.get(url + "/health") as r:
                assert r.status == 200
                await r.read()
            health.append((time.perf_counter() - t0) * 1000)

    async def send(s: aiohttp.ClientSession, body: bytes) -> tuple[int, dict]:
        async with s.post(url + "/v1/completions", data=body, headers=headers) as r:
            return r.status, await r.json()

    async with aiohttp.ClientSession() as ps, aiohttp.ClientSession() as rs:
        prober = asyncio.create_task(probe(ps))
        await asyncio.sleep(0.2)
        answers = await asyncio.gather(*(send(rs, raw) for _ in range(5)), send(rs, bad))
        stop.set()
        await prober
    for status, body in answers[:5]:
        assert status == 400, body
        err = body["error"]
        assert (err["code"], err["param"]) == ("context_length_exceeded", "prompt")
        assert "The prompt (200000 tokens) is longer than every replica's maximum context" in err["message"]
    status, body = answers[5]
    assert status == 400 and body["error"]["code"] == "invalid_value"
    assert "token id prompt[25000] is outside [0, 4294967295]" in body["error"]["message"]
    assert len(health) >= 5
    assert max(health) < HEALTH_BOUND_MS, sorted(health)[-5:]
