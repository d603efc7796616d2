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
    (seconds from the start of its connect to the server's close, the bytes it answered)."""
    parts = urlsplit(url)
    conns = []
    for _ in range(n):
        began = time.monotonic()  # before the connect: the server's timer starts at its accept, later
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
        writer.write(PARTIAL_HEAD)
        conns.append((reader, writer, began))

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


STALL_MS = 5000.0  # the class's stall timeout (simulated ms); 1 s wall at time scale 0.2


def _engine_running(engine_url: str) -> float:
    import urllib.request

    with urllib.request.urlopen(engine_url + "/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("vllm:num_requests_running"):
                return float(line.split()[-1])
    raise AssertionError("no vllm:num_requests_running")


async def _stalled_reader(url: str, body: bytes, api_key: str
                          ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A raw-socket client whose receive buffer is 4 KB: it sends a streamed request and then reads
    nothing (its TCP window closes, the router's send buffer fills)."""
    import socket

    parts = urlsplit(url)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (parts.hostname, parts.port))
    reader, writer = await asyncio.open_connection(sock=sock)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Authorization: Bearer " + api_key.encode() + b"\r\n"
                 b"Content-Length: %d\r\n\r\n%b" % (len(body), body))
    await writer.drain()
    return reader, writer  # the writer must stay referenced: a collected StreamWriter closes its socket


async def test_clients_that_stop_reading_are_cut_and_free_the_engine(fleet_factory) -> None:
    """(b) Six streams whose clients read nothing: each needs far more than the relay and socket
    buffers hold (n 8 x 2,000 tokens with 20 logprobs: ~20 MB; the kernel holds up to 4 MiB, the
    relay 256 KiB), so the router's send buffer stays full; after the class's stall timeout (1 s wall)
    the router resets the client connection and drops the upstream request, the agent drops the
    engine's, the engine runs nothing any more, the agent is not marked unhealthy (its stall timer does
    not count the pause), and another tenant is served. Before the fix the engine kept the six
    requests until they finished (16,000 tokens each)."""
    fleet = fleet_factory(1, time_scale=0.2, slo_classes={
        "interactive": {"ttft_ms": 1000, "tpot_ms": 100, "priority": 0, "sheddable": False, "max_queue_ms": 8000,
                        "stall_timeout_ms": STALL_MS}})
    import json

    import aiohttp

    body = json.dumps({"model": "llama-3-8b-a100", "prompt": "tell me a long story", "max_tokens": 2000, "n": 8,
                       "logprobs": 20, "stream": True}).encode()
    clients = [await _stalled_reader(fleet.router_url, body, fleet.api_keys["acme"]) for _ in range(6)]
    started = time.monotonic()
    while _engine_running(fleet.engine_urls[0]) < 1:  # the streams run on the engine
        assert time.monotonic() - started < 20, "the streams never started"
        await asyncio.sleep(0.05)
    while _engine_running(fleet.engine_urls[0]) > 0:  # ... until the router cuts them
        assert time.monotonic() - started < 30, "the engine still runs the stalled streams"
        await asyncio.sleep(0.05)
    # each stalled client's connection was aborted by the router: reading drains what its small buffer
    # held, then ends (EOF or reset), never blocks
    for reader, writer in clients:
        with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
            async with asyncio.timeout(10):
                while await reader.read(65536):
                    pass
                raise asyncio.IncompleteReadError(b"", None)  # EOF: closed by the router
        writer.close()
    async with aiohttp.ClientSession() as s:
        async with s.get(fleet.agent_urls[0] + "/metrics") as r:
            page = await r.text()
        # the router cut the six (the agent saw its client go); the agent never took the pause for an engine
        # stall (before: "engine stalled: no byte for 1 s", outcome upstream_error, the agent unhealthy)
        assert 'fairbatch_agent_requests_finished_total{outcome="client_disconnect"} 6.0' in page
        assert 'outcome="upstream_error"' not in page
        async with s.get(fleet.router_url + "/health") as r:
            assert "r0" in (await r.json())["replicas_usable"]
        async with s.post(fleet.router_url + "/v1/completions",
                          json={"model": "llama-3-8b-a100", "prompt": "hi", "max_tokens": 8},
                          headers={"Authorization": f"Bearer {fleet.api_keys['beta']}"}) as r:
            assert r.status == 200, await r.text()


async def test_a_60k_token_prompt_is_not_ended_by_the_stall_timer_during_its_prefill(fleet_factory) -> None:
    """(c) The class's stall timeout is 1,000 simulated ms; a 60,000-token prompt's prefill on the
    engine takes ~4,700 ms (30 steps of 2,048 tokens at a = 9.86 ms, b = 0.0727 ms/token: 30 x 9.86 +
    60,000 x 0.0727), during which the engine sends nothing. The agent starts the stall timer at the
    predicted end of the prefill (its time model, the same profile), so the stream completes: 16
    tokens, finish_reason ``length``, no error event, the agent healthy and its outcome ``ok``. Before
    the fix the stream ended with ``engine stalled: no byte for 0.2 s`` (1,000 ms at time scale 0.2)."""
    import json

    import aiohttp

    from loadgen.sim.tokenizer import make_prompt

    fleet = fleet_factory(1, time_scale=0.2, engine_args=["--max-model-len", "65536"], slo_classes={
        "interactive": {"ttft_ms": 1000, "tpot_ms": 100, "priority": 0, "sheddable": False, "max_queue_ms": 8000,
                        "stall_timeout_ms": 1000}})
    body = {"model": "llama-3-8b-a100", "prompt": make_prompt(60_000), "max_tokens": 16, "stream": True}
    events = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        async with s.post(fleet.router_url + "/v1/completions", json=body,
                          headers={"Authorization": f"Bearer {fleet.api_keys['acme']}"}) as r:
            assert r.status == 200, await r.text()
            async for line in r.content:
                if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                    events.append(json.loads(line[6:]))
        async with s.get(fleet.agent_urls[0] + "/metrics") as r:
            page = await r.text()
    assert not [e for e in events if "error" in e], events[-1:]
    assert len(events) == 16 and events[-1]["choices"][0]["finish_reason"] == "length"
    assert 'fairbatch_agent_requests_finished_total{outcome="ok"} 1.0' in page
    assert "fairbatch_agent_healthy 1.0" in page
