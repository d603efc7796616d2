"""router/openai_surface.py ModelCatalog on the request path: a known catalog is never waited for
(stale: served as it is, refreshed in the background), a missing model waits for one shared fetch.
A real aiohttp /v1/models server on loopback whose delay and list the test sets."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web

import router.openai_surface as surface
from router.openai_surface import ModelCatalog

pytestmark = pytest.mark.timeout(60)


class ModelsServer:
    """``hits``: requests received; ``answered``: answers sent. Each answer waits ``delay_s`` and, while
    ``gate`` is clear, for the test to set it (a replica that does not answer until told: no stopwatch)."""

    def __init__(self) -> None:
        self.models = ["m1"]
        self.delay_s = 0.0
        self.hits = 0
        self.answered = 0
        self.gate = asyncio.Event()
        self.gate.set()

    async def handle(self, request: web.Request) -> web.Response:
        self.hits += 1
        await self.gate.wait()
        await asyncio.sleep(self.delay_s)
        self.answered += 1
        return web.json_response({"object": "list", "data": [{"id": m, "object": "model"} for m in self.models]})


async def _until(cond, timeout_s: float = 10.0) -> None:
    """Poll ``cond`` until true, at most ``timeout_s`` (generous: the assert after it tells)."""
    end = asyncio.get_running_loop().time() + timeout_s
    while not cond() and asyncio.get_running_loop().time() < end:
        await asyncio.sleep(0.005)


async def test_a_known_catalog_is_never_waited_for_and_a_missing_model_waits_for_one_fetch(monkeypatch) -> None:
    monkeypatch.setattr(surface, "MISS_REFRESH_S", 0.05)
    srv = ModelsServer()
    app = web.Application()
    app.router.add_get("/v1/models", srv.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    session = aiohttp.ClientSession()
    catalog = ModelCatalog(lambda: session, lambda: [url], ttl_s=0.1)
    try:
        # nothing known yet: the first request waits for the fetch
        assert await catalog.served_for("m1") == {"m1"} and srv.hits == 1
        # stale (older than ttl_s) and the replica now not answering until the test says so: served from
        # the old catalog while the refresh is held (had either waited for it, wait_for would time out),
        # one background fetch started for both
        await asyncio.sleep(0.15)
        srv.gate.clear()
        assert await asyncio.wait_for(catalog.served_for("m1"), 10.0) == {"m1"}
        assert await asyncio.wait_for(catalog.served_for("m1"), 10.0) == {"m1"}
        await _until(lambda: srv.hits == 2)
        assert srv.hits == 2 and srv.answered == 1  # the refresh is asked and still held
        srv.gate.set()
        background = catalog._background  # the refresh task served_for started
        assert background is not None
        await asyncio.wait_for(asyncio.shield(background), 10.0)
        assert srv.answered == 2
        assert srv.hits == 2  # one background fetch for both
        # a model deployed since: missing from a catalog older than MISS_REFRESH_S -> the callers
        # wait for one shared fetch and see it
        srv.models, srv.delay_s = ["m1", "m2"], 0.1
        await asyncio.sleep(0.06)
        got = await asyncio.gather(*(catalog.served_for("m2") for _ in range(5)))
        assert all(g == {"m1", "m2"} for g in got) and srv.hits == 3
        # a name nobody serves, asked again within MISS_REFRESH_S: no fetch at all
        assert await catalog.served_for("nope") == {"m1", "m2"} and srv.hits == 3
    finally:
        await catalog.close()
        await session.close()
        await runner.cleanup()
