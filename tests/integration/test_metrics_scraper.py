"""The agent's engine /metrics scrape (replica_agent/engine_metrics.py MetricsScraper) over the relays'
keep-alive pool, against real loopback servers: a vLLM-shaped page, an error status, an engine that
does not answer, and a closed port."""

from __future__ import annotations

import asyncio
import socket
import sys
from pathlib import Path

from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))

from test_engine_metrics import VLLM_032  # noqa: E402

from fairbatch_common.clock import Clock  # noqa: E402
from replica_agent.engine_metrics import EngineMetrics, MetricsScraper  # noqa: E402
from fairbatch_common.upstream import Http1Pool  # noqa: E402


async def serve(handler) -> tuple[web.AppRunner, str]:  # noqa: ANN001
    app = web.Application()
    app.router.add_get("/metrics", handler)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]


def collector() -> tuple[list[tuple[EngineMetrics | None, list[str], str]], object]:
    got: list[tuple[EngineMetrics | None, list[str], str]] = []
    return got, lambda m, missing, err: got.append((m, missing, err))


async def test_the_page_is_parsed_and_one_kept_alive_connection_serves_every_scrape() -> None:
    peers: list[int] = []

    async def page(request: web.Request) -> web.Response:
        peers.append(request.transport.get_extra_info("peername")[1])  # type: ignore[union-attr]
        return web.Response(text=VLLM_032, content_type="text/plain")

    runner, url = await serve(page)
    pool = Http1Pool()
    got, on_result = collector()
    scraper = MetricsScraper(pool, url + "/", Clock(1.0), 10.0, on_result)  # type: ignore[arg-type]
    try:
        for _ in range(3):
            await scraper.scrape_once()
    finally:
        await pool.close()
        await runner.cleanup()
    # the page's own figures (tests/unit/test_engine_metrics.py test_new_names): 3 running, 2 waiting
    assert [(m.num_running, m.num_waiting, m.kv_usage, missing, err) for m, missing, err in got] == \
        [(3, 2, 0.4375, [], "")] * 3  # type: ignore[union-attr]
    assert len(peers) == 3 and len(set(peers)) == 1


async def test_an_error_status_a_silent_engine_and_a_closed_port_are_reported() -> None:
    async def fail(request: web.Request) -> web.Response:
        return web.Response(status=503, text="down")

    async def silent(request: web.Request) -> web.Response:
        await asyncio.sleep(30)
        return web.Response(text="late")

    failing, failing_url = await serve(fail)
    frozen, frozen_url = await serve(silent)
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed_url = f"http://127.0.0.1:{s.getsockname()[1]}"
    pool = Http1Pool()
    got, on_result = collector()
    try:
        for url in (failing_url, frozen_url, closed_url):
            await MetricsScraper(pool, url, Clock(1.0), 10.0, on_result, timeout_s=0.3).scrape_once()  # type: ignore[arg-type]
    finally:
        await pool.close()
        await failing.cleanup()
        await frozen.cleanup()
    assert got == [
        (None, [], "engine /metrics answered 503"),
        (None, [], "engine /metrics unreachable: TimeoutError"),
        (None, [], "engine /metrics unreachable: UpstreamConnectError"),
    ]
