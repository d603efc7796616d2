"""router/openai_surface.py ModelCatalog on the request path: a known catalog is never waited for
(stale: served as it is, refreshed in the background), a missing model waits for one shared fetch.
A real aiohttp /v1/models server on loopback whose delay and list the test sets."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from aiohttp import web

import router.openai_surface as surface
from router.openai_surface import ModelCatalog

pytestmark = pytest.mark.timeout(60)


class ModelsServer:
    def __init__(self) -> None:
        self.models = ["m1"]
        self.delay_s = 0.0
        self.hits = 0

    async def handle(self, request: web.Request) -> web.Response:
        self.hits += 1
        await asyncio.sleep(self.delay_s)
        return web.json_response({"object": "list", "data": [{"id": m, "object": "model"} for m in self.models]})


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
        # stale (older than ttl_s) and the replica now slow (0.5 s): served at once from the old
        # catalog, one background fetch started
        await asyncio.sleep(0.15)
        srv.delay_s = 0.5
        t0 = time.monotonic()
        assert await catalog.served_for("m1") == {"m1"}
        assert await catalog.served_for("m1") == {"m1"}
        assert time.monotonic() - t0 < 0.25  # neither waited for the 0.5 s fetch
        await asyncio.sleep(0.7)
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
