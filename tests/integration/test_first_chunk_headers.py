"""FirstChunkStreamResponse (fairbatch_common/aio.py): the headers leave with the first body write.

A real aiohttp server on loopback and a raw socket client. The handler prepares its response, then
waits for the test; at that point nothing may be readable on the client's socket (loopback delivers
a ``send`` at once, so a header segment would already be there: the control with aiohttp's own
``StreamResponse`` shows it is). After the first write the client reads the status line, the
headers and the first chunk, and the rest of the chunked body parses as written.
"""

from __future__ import annotations

import asyncio
import socket

from aiohttp import web

from fairbatch_common.aio import FirstChunkStreamResponse
from fairbatch_common.http_guard import make_runner


async def _exchange(response_cls: type[web.StreamResponse]) -> tuple[bytes, bytes]:
    """(bytes readable after prepare, the whole response) for one streamed answer of two chunks."""
    prepared, go = asyncio.Event(), asyncio.Event()

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = response_cls(status=200, headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        prepared.set()
        await go.wait()
        await resp.write(b"data: {\"a\":1}\n\n")
        await resp.write_eof(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/s", handler)
    runner = make_runner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    loop = asyncio.get_running_loop()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setblocking(False)
    try:
        await loop.sock_sendall(sock, b"POST /s HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
        await asyncio.wait_for(prepared.wait(), 10)
        await asyncio.sleep(0.05)  # settle: a segment sent by prepare() is in this socket's buffer well before
        try:
            early = sock.recv(65536)  # whatever prepare() sent is in this socket's buffer by now
        except BlockingIOError:
            early = b""
        go.set()
        data = early
        while not data.endswith(b"0\r\n\r\n"):
            got = await asyncio.wait_for(loop.sock_recv(sock, 65536), 10)
            assert got, "server closed before the end of the body"
            data += got
        return early, data
    finally:
        sock.close()
        await runner.cleanup()


async def test_headers_wait_for_the_first_chunk() -> None:
    early, data = await _exchange(FirstChunkStreamResponse)
    assert early == b""
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"Transfer-Encoding: chunked" in head
    # chunk sizes in hex: 15 bytes, 14 bytes, then the terminator
    assert body == b"f\r\ndata: {\"a\":1}\n\n\r\ne\r\ndata: [DONE]\n\n\r\n0\r\n\r\n"


async def test_control_stream_response_sends_its_headers_at_prepare() -> None:
    early, data = await _exchange(web.StreamResponse)
    assert early.startswith(b"HTTP/1.1 200 OK\r\n") and early.endswith(b"\r\n\r\n")
    assert data.endswith(b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")
