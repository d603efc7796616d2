"""Issue 30, item 7, over raw sockets (asyncio streams) against real router and agent processes.

(a) Header-read timeout: a client that sends ``POST /v1/completions HTTP/1.1\\r\\nHost: x\\r\\n`` and
nothing more is answered 408 (OpenAI's error JSON, code ``header_timeout``) and its connection closed
once the header timeout passes (1 s here: ``http.header_timeout_s`` of the router,
``--header-timeout-s`` of the agent). Before the fix aiohttp held such a connection for its keep-alive
of 3630 s. A kept-alive connection that finished a request and then sits idle is not cut by it.

Time bounds: a connection is never closed before the timeout (the timer cannot fire early; a loaded
machine only makes it later), and all are closed within the timeout plus a generous 20 s of slack
(500 sockets opened by one Python process on a 2-core machine shared with other test runs).
"""

from __future__ import annotations

import asyncio
import time
from urllib.parse import urlsplit

import pytest

pytestmark = pytest.mark.timeout(120)

HEADER_TIMEOUT_S = 1.0
SOCKETS = 500
SLACK_S = 20.0
PARTIAL_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"


async def _slow_headers(url: str, n: int) -> list[tuple[float, bytes]]:
    """Open ``n`` connections to ``url``, send each the partial head, and return per connection
    (seconds from its send to the server's close, the bytes it answered)."""
    parts = urlsplit(url)
    conns = []
    for _ in range(n):
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
        writer.write(PARTIAL_HEAD)
        conns.append((reader, writer, time.monotonic()))

    async def until_closed(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, sent: float
                           ) -> tuple[float, bytes]:
        data = await reader.read()  # b"" / the 408 then EOF once the server closes
        took = time.monotonic() - sent
        writer.close()
        return took, data

    async with asyncio.timeout(HEADER_TIMEOUT_S + SLACK_S + 30):
        return await asyncio.gather(*(until_closed(r, w, t) for r, w, t in conns))


def _check_closed(results: list[tuple[float, bytes]]) -> None:
    took = [t for t, _ in results]
    assert len(took) == SOCKETS
    assert min(took) >= HEADER_TIMEOUT_S - 0.05, min(took)  # never before the timeout (clock granularity only)
    assert max(took) <= HEADER_TIMEOUT_S + SLACK_S, max(took)
    for _, data in results:
        assert data.startswith(b"HTTP/1.1 408 "), data[:64]
        assert b'"code": "header_timeout"' in data


async def _keepalive_survives(url: str, path: str) -> None:
    """A complete GET on a kept-alive connection, idle for 1.5 times the header timeout, then a second
    GET on the same connection: both answered (the idle wait is not a slow header)."""
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    head = f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode()
    try:
        for i in range(2):
            if i:
                await asyncio.sleep(1.5 * HEADER_TIMEOUT_S)
            writer.write(head)
            status = await asyncio.wait_for(reader.readline(), 10)
            assert status.startswith(b"HTTP/1.1 200"), status
            length = 0
            while (line := await asyncio.wait_for(reader.readline(), 10)) not in (b"\r\n", b""):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            await reader.readexactly(length)
    finally:
        writer.close()


async def test_slow_header_sockets_are_closed_within_the_header_timeout(fleet_factory) -> None:
    fleet = fleet_factory(1, agent_args=["--header-timeout-s", str(HEADER_TIMEOUT_S)],
                          http={"header_timeout_s": HEADER_TIMEOUT_S})
    router, agent, _, _ = await asyncio.gather(_slow_headers(fleet.router_url, SOCKETS),
                                         _slow_headers(fleet.agent_urls[0], SOCKETS),
                                         _keepalive_survives(fleet.router_url, "/health"),
                                         _keepalive_survives(fleet.agent_urls[0], "/metrics"))
    _check_closed(router)
    _check_closed(agent)
