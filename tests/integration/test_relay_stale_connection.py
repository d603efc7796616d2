"""The router re-sends a POST whose kept-alive connection the agent closed before answering
(router/relay.py ``Relay.open``, ``STALE_RESENDS``), over real loopback TCP.

A raw asyncio server plays the agent: on its first connection it answers one request and then
closes the connection as the next request arrives, without a byte of answer (an agent whose idle
timer fired as the request went out; seen with real vLLM after the agent was paused); on any later
connection it answers. Before the fix the router took that drop for the replica's failure and left
the replica out of the request (a stream's continuation then found no replica left).
"""

from __future__ import annotations

import asyncio

import pytest

from fairbatch_common.upstream import UpstreamDisconnected
from router.relay import STALE_RESENDS, Relay

_OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


async def _read_request(reader: asyncio.StreamReader) -> bool:
    """One request (head + Content-Length body); False at the connection's end."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return False
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    await reader.readexactly(length)
    return True


class DroppingAgent:
    """Answers every request, except that a connection numbered in ``drop_on`` is closed, unanswered,
    when its ``(n+1)``-th request arrives (``n`` = ``answer_first``)."""

    def __init__(self, drop_on: set[int], answer_first: int = 1) -> None:
        self.drop_on = drop_on
        self.answer_first = answer_first
        self.connections = 0
        self.answered = 0
        self.dropped = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        number, served = self.connections, 0
        try:
            while await _read_request(reader):
                if number in self.drop_on and served >= self.answer_first:
                    self.dropped += 1
                    return  # closed in finally: no byte of an answer
                writer.write(_OK)
                await writer.drain()
                served += 1
                self.answered += 1
        finally:
            writer.close()


async def _post(relay: Relay, base: str) -> bytes:
    ex = await relay.open(base, "/v1/completions", b'{"prompt": "x"}', {"Content-Type": "application/json"})
    assert ex is not None and ex.status == 200
    body = await ex.read()
    ex.release()
    return body


@pytest.fixture
async def served():
    servers = []

    async def start(agent: DroppingAgent) -> str:
        server = await asyncio.start_server(agent.handle, "127.0.0.1", 0)
        servers.append(server)
        return f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"

    yield start
    for s in servers:
        s.close()
        await s.wait_closed()


async def test_a_dropped_kept_alive_connection_is_resent_on_a_new_one(served) -> None:
    agent = DroppingAgent(drop_on={1})
    base = await served(agent)
    relay = Relay()
    try:
        assert await _post(relay, base) == b"{}"  # connection 1, kept alive
        # the next POST goes out on connection 1, which the agent closes unanswered: sent again on a new one
        assert await _post(relay, base) == b"{}"
        assert (agent.connections, agent.dropped, agent.answered) == (2, 1, 2)
    finally:
        await relay.close()


async def test_the_resends_are_bounded(served) -> None:
    # four connections kept alive (four POSTs at once), each of which then drops the next request: a POST
    # takes an idle one (dropped), is re-sent on the next idle one (dropped), and again (dropped): after
    # 1 + STALE_RESENDS drops it fails as the replica's failure, with the fourth connection left unused
    agent = DroppingAgent(drop_on=set(range(1, 100)))
    base = await served(agent)
    relay = Relay()
    try:
        assert await asyncio.gather(*(_post(relay, base) for _ in range(4))) == [b"{}"] * 4
        assert agent.connections == 4
        with pytest.raises(UpstreamDisconnected) as info:
            await relay.open(base, "/v1/completions", b"{}", {})
        assert info.value.reused and not info.value.answered
        assert (agent.connections, agent.dropped, agent.answered) == (4, 1 + STALE_RESENDS, 4)
    finally:
        await relay.close()


async def test_a_new_connection_closed_unanswered_is_the_replicas_failure(served) -> None:
    # a connection that had served nothing (not a kept-alive race) closed before the answer: raised at
    # once, no re-send (the replica itself failed: the caller retries elsewhere or continues elsewhere)
    agent = DroppingAgent(drop_on={1, 2, 3}, answer_first=0)
    base = await served(agent)
    relay = Relay()
    try:
        with pytest.raises(UpstreamDisconnected) as info:
            await relay.open(base, "/v1/completions", b"{}", {})
        assert not info.value.reused and not info.value.answered
        assert (agent.connections, agent.dropped) == (1, 1)
    finally:
        await relay.close()
