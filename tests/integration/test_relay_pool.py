"""A stream answered at ``[DONE]`` gives its pooled connection back (fairbatch_common/upstream.py
``Exchange.release``): over real loopback HTTP, against a server that sends the end of its chunked
body 50 ms after ``[DONE]``, as an engine or an agent that writes them apart does."""

from __future__ import annotations

import asyncio

from aiohttp import web

from loadgen.procs import free_port
from fairbatch_common.upstream import Exchange, Http1Pool
from tests.timing import LoopLag

_TAIL_DELAY_S = 0.05


def _app(peers: list[object], tail_delay_s: float) -> web.Application:
    async def stream(request: web.Request) -> web.StreamResponse:
        peers.append(request.transport.get_extra_info("peername") if request.transport else None)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: {\"x\": 1}\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await asyncio.sleep(tail_delay_s)  # the end of the chunked body comes later
        await resp.write_eof()
        return resp

    async def plain(request: web.Request) -> web.Response:
        peers.append(request.transport.get_extra_info("peername") if request.transport else None)
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/stream", stream)
    app.router.add_post("/plain", plain)
    return app


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, shutdown_timeout=1.0)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


async def _read_to_done(ex: Exchange) -> bytes:
    """The body up to and including ``[DONE]``, as the relays read it (not waiting for the end)."""
    got = b""
    while not got.rstrip().endswith(b"[DONE]"):
        chunk = await ex.readany()
        assert chunk, "the body ended before [DONE]"
        got += chunk
    return got


async def _two_streams(base: str, release: str) -> None:
    pool = Http1Pool(max_per_host=1)
    for _ in range(2):
        ex = pool.exchange("POST", base, "/stream", {})
        await ex.start()
        assert ex.status == 200
        assert (await _read_to_done(ex)).endswith(b"data: [DONE]\n\n")
        if release == "release":
            ex.release()
        else:
            ex.close()
    await asyncio.sleep(2 * _TAIL_DELAY_S)
    await pool.close()


async def test_the_connection_is_reused_after_done() -> None:
    peers: list[object] = []
    runner, base = await _serve(_app(peers, _TAIL_DELAY_S))
    try:
        await asyncio.wait_for(_two_streams(base, "release"), 10.0)
        assert len(peers) == 2 and peers[0] == peers[1]  # one connection (same client port) for both
        # control: closed at [DONE] instead, the connection is dropped each time
        peers.clear()
        await asyncio.wait_for(_two_streams(base, "close"), 10.0)
        assert len(peers) == 2 and peers[0] != peers[1]
    finally:
        await runner.cleanup()


async def test_a_body_that_never_ends_frees_the_connection_after_the_bound() -> None:
    peers: list[object] = []
    runner, base = await _serve(_app(peers, 30.0))  # the end of body never comes within the test
    try:
        pool = Http1Pool(max_per_host=1, connect_timeout_s=5.0, eof_wait_s=0.2)
        ex = pool.exchange("POST", base, "/stream", {})
        await ex.start()
        await _read_to_done(ex)
        ex.release()
        assert pool.idle_connections() == 0  # not back yet: its body has not ended
        # max_per_host=1: this request can only go once the bound dropped the stream's connection
        loop = asyncio.get_running_loop()
        async with LoopLag() as lag:
            t0 = loop.time()
            plain = pool.exchange("POST", base, "/plain", {})
            await asyncio.wait_for(plain.start(), 10.0)
            assert await plain.read() == b"ok"
            # after the 0.2 s bound (eof_wait_s), long before the body's own end (30 s)
            assert 0.15 < loop.time() - t0 <= lag.bound_s(0.2)
        assert peers[0] != peers[1]  # a new connection: the old one was dropped, not reused mid-body
        plain.release()
        await pool.close()
    finally:
        await runner.cleanup()
