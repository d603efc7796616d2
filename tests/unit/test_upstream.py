"""fairbatch_common.upstream: the relays' HTTP/1.1 client, against a real aiohttp server on loopback.

Each test's expected bytes, statuses and connection counts follow from what the server handler does
(written out in the handler), not from the client.
"""

from __future__ import annotations

import asyncio
import socket

import pytest
from aiohttp import web

from fairbatch_common.upstream import (
    Http1Pool,
    UpstreamConnectError,
    UpstreamDisconnected,
    UpstreamProtocolError,
    UpstreamTimeout,
)
from tests.timing import LoopLag


class Server:
    """An aiohttp app on a free loopback port; ``peers`` records each request's client port."""

    def __init__(self) -> None:
        self.app = web.Application()
        self.peers: list[int] = []
        self.disconnects = 0
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        self.runner = web.AppRunner(self.app, handler_cancellation=True)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        assert self.runner is not None
        await self.runner.cleanup()


@pytest.fixture
async def server():
    s = Server()

    async def whole(request: web.Request) -> web.Response:
        s.peers.append(request.transport.get_extra_info("peername")[1])
        body = await request.read()
        return web.json_response({"echo": body.decode(), "h": request.headers.get("x-test", "")})

    async def stream(request: web.Request) -> web.StreamResponse:
        s.peers.append(request.transport.get_extra_info("peername")[1])
        n = int(request.query.get("n", "3"))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for i in range(n):
                await resp.write(b"data: %d\n\n" % i)
                await asyncio.sleep(0.002)
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except asyncio.CancelledError:
            s.disconnects += 1
            raise
        return resp

    async def hang(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        await resp.write(b"first")
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            s.disconnects += 1
            raise
        return resp

    async def big(request: web.Request) -> web.Response:
        return web.Response(body=b"x" * 4000)

    s.app.router.add_post("/whole", whole)
    s.app.router.add_post("/stream", stream)
    s.app.router.add_post("/hang", hang)
    s.app.router.add_post("/big", big)
    await s.start()
    yield s
    await s.stop()


async def test_a_whole_answer_is_read_and_its_connection_is_reused(server: Server) -> None:
    pool = Http1Pool()
    for i in range(3):
        ex = pool.exchange("POST", server.url, "/whole", {"Content-Type": "text/plain", "x-test": f"v{i}"}, b"hi")
        await ex.start()
        assert ex.status == 200
        assert ex.headers["content-type"].startswith("application/json")
        assert await ex.read() == b'{"echo": "hi", "h": "v%d"}' % i
        ex.release()
    # one connection served all three (same client port), and it is idle in the pool now
    assert len(set(server.peers)) == 1 and len(server.peers) == 3
    assert pool.idle_connections(server.url) == 1
    await pool.close()


async def test_a_piped_stream_reaches_the_sink_in_order_and_ends_false_at_the_body_end(server: Server) -> None:
    pool = Http1Pool()
    ex = pool.exchange("POST", server.url, "/stream?n=4", {}, b"")
    await ex.start()
    first = await ex.readany()
    got: list[bytes] = [first]
    end = ex.pipe(lambda chunk: got.append(chunk))
    assert await end is False
    assert b"".join(got) == b"data: 0\n\ndata: 1\n\ndata: 2\n\ndata: 3\n\ndata: [DONE]\n\n"
    ex.release()
    assert pool.idle_connections() == 1
    await pool.close()


async def test_a_sink_that_stops_at_done_gets_the_connection_back_when_the_body_ends(server: Server) -> None:
    pool = Http1Pool()
    seen: list[bytes] = []

    def sink(chunk: bytes) -> bool:
        seen.append(chunk)
        return chunk.endswith(b"[DONE]\n\n")

    for _ in range(2):
        ex = pool.exchange("POST", server.url, "/stream?n=2", {}, b"")
        await ex.start()
        assert await ex.pipe(sink) is True
        ex.release()  # the terminating 0-chunk may still be on its way: the pool takes it back then
        for _ in range(100):
            if pool.idle_connections() == 1:
                break
            await asyncio.sleep(0.01)
        assert pool.idle_connections() == 1
    assert len(set(server.peers)) == 1  # the second request reused the first one's connection
    await pool.close()


async def test_close_mid_body_drops_the_connection_and_the_server_sees_the_disconnect(server: Server) -> None:
    pool = Http1Pool()
    ex = pool.exchange("POST", server.url, "/hang", {}, b"")
    await ex.start()
    assert await ex.readany() == b"first"
    ex.close()
    for _ in range(100):
        if server.disconnects:
            break
        await asyncio.sleep(0.01)
    assert server.disconnects == 1
    assert pool.idle_connections() == 0
    with pytest.raises(UpstreamDisconnected):
        await ex.readany()
    await pool.close()


async def test_fail_mid_body_raises_its_exception_in_the_pending_pipe(server: Server) -> None:
    pool = Http1Pool()
    ex = pool.exchange("POST", server.url, "/hang", {}, b"")
    await ex.start()
    end = ex.pipe(lambda chunk: None)

    class Gone(Exception):
        pass

    asyncio.get_running_loop().call_later(0.05, ex.fail, Gone("replica removed"))
    with pytest.raises(Gone):
        await end
    await pool.close()


async def test_fail_before_start_makes_start_raise_without_sending(server: Server) -> None:
    pool = Http1Pool()
    ex = pool.exchange("POST", server.url, "/whole", {}, b"x")
    ex.fail(RuntimeError("aborted"))
    with pytest.raises(RuntimeError, match="aborted"):
        await ex.start()
    assert server.peers == []
    await pool.close()


async def test_a_refused_connection_is_a_connect_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connections are refused
        pool = Http1Pool(connect_timeout_s=1.0)
        ex = pool.exchange("POST", f"http://127.0.0.1:{port}", "/x", {}, b"")
        with pytest.raises(UpstreamConnectError):
            await ex.start()
    await pool.close()


async def test_no_byte_for_the_read_timeout_fails_the_read(server: Server) -> None:
    pool = Http1Pool(read_timeout_s=0.2)
    ex = pool.exchange("POST", server.url, "/hang", {}, b"")
    await ex.start()
    assert await ex.readany() == b"first"
    loop = asyncio.get_running_loop()
    async with LoopLag() as lag:
        t0 = loop.time()
        with pytest.raises(UpstreamTimeout):
            await ex.readany()
        assert 0.15 < loop.time() - t0 <= lag.bound_s(0.2)  # the /hang handler never sends its second chunk
    await pool.close()


async def test_a_kept_alive_connection_the_server_closed_is_not_handed_out() -> None:
    """A raw server that answers once with keep-alive, then closes the socket: the next exchange
    must not get the dead connection (it is dropped from the pool when the close is seen)."""
    accepted = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal accepted
        accepted += 1
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        writer.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}"
    pool = Http1Pool()
    for _ in range(2):
        ex = pool.exchange("POST", url, "/", {}, b"")
        await ex.start()
        assert await ex.read() == b"ok"
        ex.release()
        await asyncio.sleep(0.05)  # the server's close arrives
    assert accepted == 2
    srv.close()
    await pool.close()


async def test_an_answer_that_is_not_http_is_a_protocol_error() -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"SSH-2.0-OpenSSH\r\n\r\n")
        await writer.drain()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    pool = Http1Pool()
    ex = pool.exchange("POST", f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}", "/", {}, b"")
    with pytest.raises(UpstreamProtocolError):
        await ex.start()
    srv.close()
    await pool.close()


async def test_a_body_over_the_limit_fails_the_read(server: Server) -> None:
    pool = Http1Pool(max_body_bytes=1000)
    ex = pool.exchange("POST", server.url, "/big", {}, b"")
    await ex.start()
    with pytest.raises(UpstreamProtocolError, match="over 1000 bytes"):
        await ex.read()
    await pool.close()


def test_headers_with_cr_or_lf_are_refused() -> None:
    pool = Http1Pool()
    with pytest.raises(ValueError):
        pool.exchange("POST", "http://127.0.0.1:1", "/x", {"x-request-id": "a\r\nx-evil: 1"}, b"")
    with pytest.raises(ValueError):
        pool.exchange("POST", "http://127.0.0.1:1", "/x y", {}, b"")
    with pytest.raises(ValueError):
        pool.exchange("POST", "ftp://h", "/x", {}, b"")


async def test_the_request_head_carries_host_length_and_the_given_headers() -> None:
    got: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        got.append(await reader.readuntil(b"\r\n\r\n") + await reader.readexactly(5))
        writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")
        await writer.drain()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    pool = Http1Pool()
    ex = pool.exchange("POST", f"http://127.0.0.1:{port}/base/", "/v1/x", {"X-A": "1", "Host": "ignored", "X-U": "é"},
                       b"hello")
    await ex.start()
    assert ex.status == 204 and await ex.read() == b""
    ex.release()
    assert got == [b"POST /base/v1/x HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Length: 5\r\nX-A: 1\r\n"
                   b"X-U: \xc3\xa9\r\n\r\nhello" % port]  # a forwarded header's own bytes (utf-8)
    srv.close()
    await pool.close()


async def test_client_sink_frames_a_chunked_body_an_http_client_reads() -> None:
    """ClientSink between aiohttp's first write and write_eof: HTTP/1.1 gets chunks (aiohttp's own client
    reads the body whole), HTTP/1.0 the raw bytes up to the close."""
    import aiohttp

    from fairbatch_common.upstream import ClientSink

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        await resp.write(b"a")
        sink = ClientSink(request.transport, None, chunked=request.version >= (1, 1))  # type: ignore[arg-type]
        assert sink.send(b"bc") and sink.send(b"d" * 300)
        sink.flush()
        await resp.write_eof(b"e")
        return resp

    s = Server()
    s.app.router.add_get("/", handler)
    await s.start()
    async with aiohttp.ClientSession() as session, session.get(s.url + "/") as r:  # HTTP/1.1: chunked
        assert r.headers["Transfer-Encoding"] == "chunked"
        assert await r.read() == b"abc" + b"d" * 300 + b"e"
    host, port = s.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))  # HTTP/1.0: raw bytes to the close
    writer.write(b"GET / HTTP/1.0\r\nHost: x\r\n\r\n")
    raw = await asyncio.wait_for(reader.read(), 5.0)
    writer.close()
    assert raw.split(b"\r\n\r\n", 1)[1] == b"abc" + b"d" * 300 + b"e"
    await s.stop()


async def test_connections_per_host_are_bounded_and_a_waiter_gets_a_freed_one(server: Server) -> None:
    pool = Http1Pool(max_per_host=1, connect_timeout_s=0.3)
    ex1 = pool.exchange("POST", server.url, "/hang", {}, b"")
    await ex1.start()
    ex2 = pool.exchange("POST", server.url, "/whole", {}, b"z")
    with pytest.raises(UpstreamConnectError, match="no free connection"):
        await ex2.start()
    ex3 = pool.exchange("POST", server.url, "/whole", {}, b"z")
    asyncio.get_running_loop().call_later(0.1, ex1.close)
    await ex3.start()
    assert await ex3.read() == b'{"echo": "z", "h": ""}'
    ex3.release()
    await pool.close()


class _CountingTransport:
    """A real transport, its writes counted (everything else passes through)."""

    def __init__(self, inner: asyncio.Transport) -> None:
        self.inner = inner
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(data)
        self.inner.write(data)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


async def test_pieces_of_one_socket_read_reach_the_client_in_one_write() -> None:
    """An upstream that sends three chunks in one segment: the sink gets three pieces, the client's
    transport one write (ClientSink.flush), and the client reads the three pieces in order."""
    import aiohttp

    from fairbatch_common.upstream import ClientSink

    async def upstream_handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nab\r\n")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(b"1\r\nc\r\n2\r\nde\r\n3\r\nfgh\r\n0\r\n\r\n")  # three chunks and the end: one segment
        await writer.drain()

    up = await asyncio.start_server(upstream_handle, "127.0.0.1", 0)
    up_url = f"http://127.0.0.1:{up.sockets[0].getsockname()[1]}"
    pool = Http1Pool()
    pieces: list[bytes] = []
    counted: list[_CountingTransport] = []

    async def relay(request: web.Request) -> web.StreamResponse:
        ex = pool.exchange("POST", up_url, "/", {})
        await ex.start()
        resp = web.StreamResponse()
        await resp.prepare(request)
        await resp.write(await ex.readany())
        transport = _CountingTransport(request.transport)
        counted.append(transport)
        sink = ClientSink(transport, ex, chunked=True)

        def on_chunk(chunk: bytes) -> None:
            pieces.append(chunk)
            sink.send(chunk)

        assert await ex.pipe(on_chunk, sink.flush) is False
        ex.release()
        await resp.write_eof()
        return resp

    s = Server()
    s.app.router.add_get("/", relay)
    await s.start()
    async with aiohttp.ClientSession() as session, session.get(s.url + "/") as r:
        assert await r.read() == b"abcdefgh"
    assert pieces == [b"c", b"de", b"fgh"]
    assert counted[0].writes == [b"1\r\nc\r\n2\r\nde\r\n3\r\nfgh\r\n"]
    await s.stop()
    up.close()
    await pool.close()


async def test_fail_while_connecting_drops_the_new_connection_and_frees_the_slot(server: Server) -> None:
    pool = Http1Pool(max_per_host=1, connect_timeout_s=1.0)
    ex = pool.exchange("POST", server.url, "/whole", {}, b"x")
    start = asyncio.create_task(ex.start())
    await asyncio.sleep(0)  # inside the connect
    ex.fail(RuntimeError("replica removed"))
    with pytest.raises(RuntimeError, match="replica removed"):
        await start
    assert pool.idle_connections() == 0 and server.peers == []
    again = pool.exchange("POST", server.url, "/whole", {}, b"y")  # the one slot is free again
    await asyncio.wait_for(again.start(), 2.0)
    assert await again.read() == b'{"echo": "y", "h": ""}'
    again.release()
    await asyncio.sleep(0.05)
    assert server.runner is not None and len(server.runner.server.connections) == 1  # the dropped one is gone
    await pool.close()


async def test_an_origin_whose_connections_all_closed_is_forgotten(server: Server) -> None:
    """A replica that goes away (its server closes the idle connections): the pool keeps no table entry for it."""
    pool = Http1Pool()
    ex = pool.exchange("POST", server.url, "/whole", {}, b"x")
    await ex.start()
    await ex.read()
    ex.release()
    assert pool.idle_connections() == 1 and pool.origins() == 1
    await server.stop()  # the server closes its kept-alive connections
    for _ in range(100):
        if pool.origins() == 0:
            break
        await asyncio.sleep(0.01)
    assert pool.idle_connections() == 0 and pool.origins() == 0
    await pool.close()


async def test_an_https_origin_is_read_over_tls_and_its_connection_is_reused() -> None:
    # a loopback TLS server with a certificate of a test CA (trustme): the pool trusts that CA
    import ssl

    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    cert.configure_cert(server_ctx)
    client_ctx = ssl.create_default_context()
    ca.configure_trust(client_ctx)
    peers: list[int] = []

    async def stream(request: web.Request) -> web.StreamResponse:
        peers.append(request.transport.get_extra_info("peername")[1])
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(3):
            await resp.write(b"data: %d\n\n" % i)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/stream", stream)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=server_ctx)
    await site.start()
    url = f"https://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    pool = Http1Pool(ssl_context=client_ctx)
    try:
        for _ in range(2):
            ex = pool.exchange("POST", url, "/stream", {}, b"")
            await ex.start()
            assert ex.status == 200
            got = [await ex.readany()]
            assert await ex.pipe(got.append) is False
            assert b"".join(got) == b"data: 0\n\ndata: 1\n\ndata: 2\n\ndata: [DONE]\n\n"
            ex.release()
        assert len(peers) == 2 and len(set(peers)) == 1  # one TLS connection served both
        # the system's default trust store does not know the test CA: a connect error, not a hang
        strict = Http1Pool(connect_timeout_s=5.0)
        ex = strict.exchange("POST", url, "/stream", {}, b"")
        with pytest.raises(UpstreamConnectError):
            await ex.start()
        await strict.close()
    finally:
        await pool.close()
        await runner.cleanup()
