"""router/relay.py ``UpstreamAbort`` on the POST (``Relay.open``), over real loopback HTTP.

A server that holds its answer until the test lets it go. The abort while the POST waits returns
None (retryable) and the server sees its request's connection closed; an abort together with the
caller's own cancellation (the client left at the same instant) propagates the cancellation; a
POST that was answered before the abort keeps its exchange and the later abort fails its body read.
"""

from __future__ import annotations

import asyncio
import socket

import pytest
from aiohttp import web

from loadgen.procs import free_port
from router.relay import Relay, ReplicaGone, UpstreamAbort


class Holding:
    """A server whose POST /hold waits for ``release`` before answering a stream of one chunk."""

    def __init__(self) -> None:
        self.arrived = asyncio.Event()
        self.release = asyncio.Event()
        self.disconnected = asyncio.Event()
        self.nodelay: list[bool] = []  # TCP_NODELAY of each accepted request's socket

    def app(self) -> web.Application:
        async def hold(request: web.Request) -> web.StreamResponse:
            sock = request.transport.get_extra_info("socket") if request.transport else None
            if sock is not None:
                self.nodelay.append(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0)
            self.arrived.set()
            try:
                await self.release.wait()
            except asyncio.CancelledError:
                self.disconnected.set()  # the client closed the connection (handler cancellation)
                raise
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(b"data: {\"x\": 1}\n\n")
            try:
                await asyncio.sleep(30)  # the rest never comes while the test runs
            except asyncio.CancelledError:
                self.disconnected.set()
                raise
            return resp

        app = web.Application()
        app.router.add_post("/hold", hold)
        return app


@pytest.fixture
async def served() -> tuple[Holding, str, Relay]:
    server = Holding()
    runner = web.AppRunner(server.app(), handler_cancellation=True, shutdown_timeout=1.0)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    relay = Relay()
    await relay.start()
    try:
        yield server, f"http://127.0.0.1:{port}", relay
    finally:
        await relay.close()
        await runner.cleanup()


async def test_abort_while_the_post_waits_returns_none_and_closes_the_request(served) -> None:
    server, url, relay = served
    abort = UpstreamAbort()

    async def attempt() -> tuple[object, int]:
        got = await relay.open(url, "/hold", b"{}", {}, abort)
        await asyncio.sleep(0.01)  # raises if a cancellation were left pending on this task
        return got, asyncio.current_task().cancelling()

    post = asyncio.create_task(attempt())
    await asyncio.wait_for(server.arrived.wait(), 5)
    abort.abort("replica removed")
    assert await asyncio.wait_for(post, 5) == (None, 0)
    await asyncio.wait_for(server.disconnected.wait(), 5)


async def test_abort_together_with_the_callers_cancellation_propagates_it(served) -> None:
    server, url, relay = served
    abort = UpstreamAbort()
    post = asyncio.create_task(relay.open(url, "/hold", b"{}", {}, abort))
    await asyncio.wait_for(server.arrived.wait(), 5)
    post.cancel()  # the client left ...
    abort.abort("replica removed")  # ... in the same loop iteration as the replica went
    with pytest.raises(asyncio.CancelledError):
        await post
    await asyncio.wait_for(server.disconnected.wait(), 5)


async def test_abort_after_the_answer_fails_the_pending_body_read(served) -> None:
    server, url, relay = served
    abort = UpstreamAbort()
    server.release.set()
    upstream = await asyncio.wait_for(relay.open(url, "/hold", b"{}", {}, abort), 5)
    assert upstream is not None and upstream.status == 200
    assert await upstream.readany() == b"data: {\"x\": 1}\n\n"
    read = asyncio.create_task(upstream.readany())
    await asyncio.sleep(0)
    abort.abort("replica removed")
    with pytest.raises(ReplicaGone):
        await asyncio.wait_for(read, 5)
    await asyncio.wait_for(server.disconnected.wait(), 5)


async def test_abort_before_the_post_sends_nothing(served) -> None:
    server, url, relay = served
    abort = UpstreamAbort()
    abort.abort("replica removed")
    assert await relay.open(url, "/hold", b"{}", {}, abort) is None
    await asyncio.sleep(0.05)
    assert not server.arrived.is_set()


async def test_both_ends_of_a_relayed_request_send_without_nagle(served) -> None:
    """TCP_NODELAY on the relay's pooled connection and on the server's accepted socket (aiohttp sets it on
    every connection; a small SSE chunk behind an unacknowledged one would otherwise wait for the ACK)."""
    server, url, relay = served
    server.release.set()
    upstream = await asyncio.wait_for(relay.open(url, "/hold", b"{}", {}, UpstreamAbort()), 5)
    try:
        sock = upstream._conn.transport.get_extra_info("socket")
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
        assert server.nodelay == [True]
    finally:
        upstream.close()
