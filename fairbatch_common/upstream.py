"""Pooled HTTP/1.1 client for the relays' generation requests: the answer's body handed to a callback.

Both relays (router -> agent, agent -> engine) forward every token event of a streamed answer. Through
aiohttp's client, each event cost a future and a task wake-up in the reader, a re-armed read timer,
and a write through aiohttp's ``StreamWriter`` coroutine: 51-53 us per relayed chunk in the router
against 21-25 us in vllm-router (Rust) on the same machine (docs/bench/router_overhead.md). Here the
upstream socket's protocol parses the answer with httptools (llhttp, the parser uvicorn uses) and hands
each body piece, in the same loop callback that read it, to a synchronous callback (:meth:`Exchange.pipe`)
that writes it to the client's transport (:class:`ClientSink`). Per chunk: one ``recv``, one parse, one
``send``; no future, no task switch, no timer.

One :class:`Exchange` is one request/answer on one pooled keep-alive connection:

1. :meth:`Http1Pool.exchange` builds it (nothing sent; :meth:`Exchange.fail` already works, so an
   abort handle can hold it before it starts);
2. :meth:`Exchange.start` takes an idle connection (or connects, within ``connect_timeout_s``), writes
   the request in one ``send`` and returns when the status line and headers are in;
3. the body: :meth:`Exchange.readany` (what has arrived, waiting for the first piece),
   :meth:`Exchange.read` (the whole body), or :meth:`Exchange.pipe` (every further piece to a callback);
4. :meth:`Exchange.release` returns the connection to the pool once the body is complete (at once, or
   when its end arrives, within :data:`EOF_WAIT_S`); :meth:`Exchange.close` drops it, which is how the
   upstream learns that the request is abandoned (vLLM aborts a request whose connection closes).

Errors are :class:`UpstreamError` subclasses, raised by the awaits above: :class:`UpstreamConnectError`
(nothing was sent), :class:`UpstreamDisconnected` (the connection closed before the answer ended;
``reused`` and ``answered`` say whether it was a kept-alive connection and whether a byte of the answer
came), :class:`UpstreamTimeout` (no byte for ``read_timeout_s``), :class:`UpstreamProtocolError` (not
HTTP/1.x), or the exception given to :meth:`Exchange.fail`.

Limits: ``max_per_host`` connections per upstream (an exchange waits up to ``connect_timeout_s`` for
one), ``max_body_bytes`` per buffered body, idle connections closed after ``keepalive_s``. Request
header names and values with CR or LF are refused (``ValueError``): no header injection.
"""

from __future__ import annotations

import asyncio
import collections
import socket
import ssl as ssl_module
import struct
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

import httptools

MAX_DRAIN_POLL_S = 0.05  # longest interval between two checks of a paused client's send buffer (wall s)
EOF_WAIT_S = 1.0  # how long a released exchange waits for its body's end before dropping the connection
DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024


class UpstreamError(Exception):
    """An upstream exchange failed (base class)."""


class UpstreamConnectError(UpstreamError):
    """No connection could be made (or none freed up within the connect timeout): nothing was sent."""


class UpstreamDisconnected(UpstreamError):
    """The connection closed before the answer ended.

    Attributes:
        reused: the connection had served an earlier exchange (a kept-alive connection the peer may
            have closed just as this request went out).
        answered: a byte of this exchange's answer had arrived.
    """

    def __init__(self, message: str, reused: bool, answered: bool) -> None:
        super().__init__(message)
        self.reused = reused
        self.answered = answered


class UpstreamTimeout(UpstreamError):
    """No byte of the answer for ``read_timeout_s`` wall seconds."""


class UpstreamProtocolError(UpstreamError):
    """The answer was not valid HTTP/1.x, or its body exceeded ``max_body_bytes``."""


class ClientStalled(Exception):
    """The client of a relayed stream read nothing for ``max_pause_s`` (its send buffer stayed full):
    :class:`ClientSink` aborted its connection and failed the upstream exchange with this, so the
    upstream sees its request abandoned. Not an :class:`UpstreamError`: the upstream did nothing wrong."""


def reset(transport: asyncio.BaseTransport) -> None:
    """Make the next close of ``transport``'s TCP socket a reset (``SO_LINGER`` 0): the kernel drops
    the bytes it still holds for the peer instead of trickling them to a client that does not read
    (a loopback socket buffers up to ``net.ipv4.tcp_wmem``'s 4 MiB). No-op for other transports."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except (OSError, AttributeError, TypeError):
        pass


async def end_stream(resp: Any, transport: asyncio.BaseTransport | None, data: bytes, limit_s: float | None) -> None:
    """``await resp.write_eof(data)`` (an aiohttp stream response), waiting at most ``limit_s`` wall
    seconds for a client that reads nothing to take it (aiohttp's drain waits for ever); then the
    client's connection is reset and :class:`ClientStalled` raised. ``limit_s`` None: no bound.

    Raises:
        ClientStalled: the end of the body did not go out within ``limit_s``.
    """
    if limit_s is None:
        await resp.write_eof(data)
        return
    try:
        async with asyncio.timeout(limit_s):
            await resp.write_eof(data)
    except TimeoutError:
        if transport is not None:
            reset(transport)
            transport.abort()  # type: ignore[attr-defined]
        raise ClientStalled(f"the client read nothing for {limit_s:g} s") from None


def frame_chunk(chunk: bytes, chunked: bool = True) -> bytes:
    """``chunk`` as it goes on the wire of a response body: one HTTP/1.1 chunk (``chunked``: aiohttp's
    choice for an HTTP/1.1 stream without a Content-Length), else as is (an HTTP/1.0 client gets raw
    bytes and a closed connection). The first piece of a relayed stream (with the headers) and the last
    (``write_eof``) still go through aiohttp, which frames the end of the body. ``chunk`` must not be
    empty (an empty chunk ends a chunked body)."""
    return b"%x\r\n%b\r\n" % (len(chunk), chunk) if chunked else chunk


class ClientSink:
    """Writes body pieces to a prepared aiohttp stream response's client, from an upstream read callback.

    :meth:`send` queues one piece; :meth:`flush` (the pipe's ``flush``, called once per socket read)
    writes what is queued in one ``send`` call, so several of a stream's chunks that arrived in one
    read cost one system call. While the client's send buffer holds more than
    ``high_water`` bytes, the upstream exchange stops reading (:meth:`Exchange.pause_reading`) and a
    timer checks for it to drain below ``low_water``, every ``poll_s`` wall seconds at first, the
    interval doubling up to :data:`MAX_DRAIN_POLL_S` (a slow client slows its upstream down instead of
    growing the relay's memory: the relay buffers at most ``high_water`` plus one read per stream).
    A client that stays above ``low_water`` for ``max_pause_s`` wall seconds has stopped reading: its
    connection is aborted and the exchange failed with :class:`ClientStalled` (the upstream request is
    dropped, so the engine aborts it and frees its slot; issue 30: 50 such clients held both engines
    of a fleet for 125 s).

    Args:
        transport: the client's transport (``request.transport``).
        exchange: the upstream exchange whose body is relayed.
        chunked: the response uses chunked transfer coding (``request.version >= HttpVersion11``).
        max_pause_s: wall seconds a full send buffer may stay full; None = no limit.
    """

    __slots__ = ("transport", "exchange", "chunked", "high_water", "low_water", "poll_s", "max_pause_s", "_paused",
                 "_out", "_paused_at", "_poll")

    def __init__(self, transport: asyncio.BaseTransport, exchange: Exchange, chunked: bool,
                 high_water: int = 256 * 1024, low_water: int = 64 * 1024, poll_s: float = 0.005,
                 max_pause_s: float | None = None) -> None:
        self.transport = transport
        self.exchange = exchange
        self.chunked = chunked
        self.high_water = high_water
        self.low_water = low_water
        self.poll_s = poll_s
        self.max_pause_s = max_pause_s
        self._paused = False
        self._out: list[bytes] = []
        self._paused_at = 0.0
        self._poll = poll_s

    def send(self, chunk: bytes) -> bool:
        """Queue ``chunk`` (not empty) for :meth:`flush`; False when the client's connection is closed."""
        if self.transport.is_closing():
            return False
        self._out.append(frame_chunk(chunk, self.chunked))
        return True

    def flush(self) -> None:
        """Write the queued pieces (one ``write``); a closed client is seen by the next :meth:`send`."""
        out = self._out
        if not out:
            return
        data = out[0] if len(out) == 1 else b"".join(out)
        out.clear()
        transport = self.transport
        try:
            transport.write(data)  # type: ignore[attr-defined]
        except (ConnectionError, RuntimeError):
            return
        if not self._paused and transport.get_write_buffer_size() > self.high_water:  # type: ignore[attr-defined]
            self._paused = True
            self.exchange.pause_reading()
            loop = asyncio.get_running_loop()
            self._paused_at = loop.time()
            self._poll = self.poll_s
            loop.call_later(self._poll, self._check_drain)

    @property
    def paused(self) -> bool:
        """The client's send buffer is full: the upstream is not being read."""
        return self._paused

    def _check_drain(self) -> None:
        transport = self.transport
        if transport.is_closing() or transport.get_write_buffer_size() <= self.low_water:  # type: ignore[attr-defined]
            self._paused = False  # drained (or the client left: the next send sees it)
            self.exchange.resume_reading()
            return
        loop = asyncio.get_running_loop()
        if self.max_pause_s is not None and loop.time() - self._paused_at >= self.max_pause_s:
            self._paused = False
            reset(transport)
            transport.abort()  # type: ignore[attr-defined]  # its unsent bytes are dropped: it was not reading them
            self.exchange.fail(ClientStalled(f"the client read nothing for {self.max_pause_s:g} s"))
            return
        self._poll = min(2.0 * self._poll, MAX_DRAIN_POLL_S)
        loop.call_later(self._poll, self._check_drain)


class _Origin:
    __slots__ = ("key", "host", "port", "ssl", "prefix", "host_header")

    def __init__(self, base_url: str) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self.ssl = parts.scheme == "https"
        default = 443 if self.ssl else 80
        self.host = parts.hostname
        self.port = parts.port or default
        self.prefix = parts.path.rstrip("/")
        self.key = (parts.scheme, self.host, self.port)
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.host_header = (host if self.port == default else f"{host}:{self.port}").encode("idna")


class _Conn(asyncio.Protocol):
    """One pooled connection; forwards the bytes it reads to its current exchange's parser."""

    __slots__ = ("transport", "exchange", "lost", "served", "idle_since", "key", "pool")

    def __init__(self, key: tuple[str, str, int], pool: Http1Pool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.exchange: Exchange | None = None
        self.lost = False
        self.served = 0
        self.idle_since = 0.0
        self.key = key

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        ex = self.exchange
        if ex is None:  # bytes on an idle connection: not an answer to anything, so it cannot be reused
            self.close()
            return
        ex._data(data)

    def eof_received(self) -> bool:
        return False  # close the transport; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        ex = self.exchange
        if ex is not None:
            ex._conn_lost(exc)
        else:
            self.pool._forget(self)  # an idle one (the peer closed it): out of the idle list

    def pause_writing(self) -> None:  # a request body larger than the socket buffer: the kernel catches up
        pass

    def resume_writing(self) -> None:
        pass

    def close(self) -> None:
        self.lost = True
        if self.transport is not None:
            self.transport.close()


class Exchange:
    """One request and its answer on a pooled connection (see the module docstring for the sequence).

    Attributes:
        status: the answer's HTTP status (0 before :meth:`start` returned).
        headers: its headers, names lower-cased (a repeated header keeps the last value).
    """

    __slots__ = (
        "status", "headers", "_pool", "_origin", "_head", "_conn", "_parser", "_loop", "_head_fut", "_end_fut",
        "_wait", "_chunks", "_size", "_sink", "_complete", "_failed", "_answered", "_released", "_last_read",
        "_timer", "_framed", "_slot", "_max_body", "read_timeout_s", "_paused", "_piped", "_was_reused",
        "_keep_alive", "_flush", "_delivered",
    )

    def __init__(self, pool: Http1Pool, origin: _Origin, head: bytes, read_timeout_s: float | None = None) -> None:
        self.status = 0
        # wall seconds allowed without a byte of the answer: this exchange's, else the pool's
        self.read_timeout_s = pool.read_timeout_s if read_timeout_s is None else read_timeout_s
        self.headers: dict[str, str] = {}
        self._pool = pool
        self._origin = origin
        self._head = head
        self._conn: _Conn | None = None
        self._parser: httptools.HttpResponseParser | None = None
        self._loop = pool._loop or asyncio.get_running_loop()
        self._head_fut: asyncio.Future[None] | None = None
        self._end_fut: asyncio.Future[bool] | None = None  # pipe(): True = stopped by the callback
        self._wait: asyncio.Future[None] | None = None  # readany()/read() waiting for body bytes
        self._chunks: collections.deque[bytes] = collections.deque()
        self._size = 0
        self._sink: Callable[[bytes], bool | None] | None = None
        self._complete = False  # the body's end was parsed
        self._failed: BaseException | None = None
        self._answered = False
        self._released = False
        self._last_read = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._framed = False  # Content-Length or chunked: the end is in the bytes, not the connection's close
        self._slot = False  # holds one of the origin's connection slots
        self._max_body = pool.max_body_bytes
        self._paused = False
        self._piped = False  # pipe() was called: bytes after the sink stopped are discarded
        self._was_reused = False  # the connection served an earlier exchange
        self._keep_alive = False  # the answer's head allows reusing the connection (read at its end)
        self._flush: Callable[[], None] | None = None  # pipe(): called after a read that fed the sink
        self._delivered = False  # the sink got a piece since the last flush

    # ---- the sequence --------------------------------------------------------------------------
    async def start(self) -> None:
        """Send the request and wait for the answer's status line and headers.

        Raises:
            UpstreamConnectError, UpstreamDisconnected, UpstreamTimeout, UpstreamProtocolError: as named.
            The exception given to :meth:`fail`, when it was called first.
            asyncio.CancelledError: the caller was cancelled (the connection is dropped first).
        """
        if self._failed is not None:
            raise self._failed
        pool = self._pool
        try:
            conn = await pool._checkout(self)
            if self._failed is not None:  # failed while it connected: the new connection is not used
                conn.close()
                raise self._failed
            self._conn = conn
            conn.exchange = self
            self._parser = httptools.HttpResponseParser(self)
            self._head_fut = self._loop.create_future()
            self._last_read = self._loop.time()
            if self.read_timeout_s is not None:
                self._timer = self._loop.call_at(self._last_read + self.read_timeout_s, self._check_timeout)
            assert conn.transport is not None
            conn.transport.write(self._head)
            await self._head_fut
        except BaseException:  # a failure, or the caller's cancellation: the connection is dropped
            self.close()
            raise

    def readany_nowait(self) -> bytes:
        """The body bytes buffered now (b"" when none)."""
        if not self._chunks:
            return b""
        data = b"".join(self._chunks) if len(self._chunks) > 1 else self._chunks[0]
        self._chunks.clear()
        self._size = 0
        self.resume_reading()
        return data

    async def readany(self) -> bytes:
        """The body bytes that have arrived, waiting for at least one; b"" at the body's end.

        Raises:
            the exchange's failure (see :meth:`start`).
        """
        while not self._chunks:
            if self._failed is not None:
                raise self._failed
            if self._complete:
                return b""
            self._wait = self._loop.create_future()
            try:
                await self._wait
            finally:
                self._wait = None
        return self.readany_nowait()

    async def read(self) -> bytes:
        """The whole body (up to the pool's ``max_body_bytes``).

        Raises:
            the exchange's failure (see :meth:`start`); UpstreamProtocolError past ``max_body_bytes``.
        """
        parts: list[bytes] = []
        while True:
            piece = await self.readany()
            if not piece:
                return b"".join(parts)
            parts.append(piece)

    def pipe(self, sink: Callable[[bytes], bool | None], flush: Callable[[], None] | None = None) -> asyncio.Future[bool]:
        """Hand every body piece from now on to ``sink``, synchronously, as it is read.

        Bytes already buffered go to ``sink`` first, in this call. ``sink`` returns True to stop the
        pipe (the answer is complete for the caller, or its client left): further bytes are then
        discarded until :meth:`release` or :meth:`close`. An exception in ``sink`` fails the exchange.
        ``flush``, when given, is called after each socket read (and after this call) that gave ``sink``
        at least one piece: a sink that queues its writes sends them there, once per read.

        Returns:
            a future: True when ``sink`` stopped the pipe, False at the body's end; its exception is the
            exchange's failure (see :meth:`start`).
        """
        fut: asyncio.Future[bool] = self._loop.create_future()
        self._end_fut = fut
        self._piped = True
        if self._failed is not None:
            fut.set_exception(self._failed)
            return fut
        pending = self.readany_nowait()
        self._sink = sink
        self._flush = flush
        if pending:
            stopped = self._feed_sink(pending)
            self._flush_sink()
            if stopped:
                return fut
        if self._complete and not fut.done():
            self._sink = None
            fut.set_result(False)
        return fut

    @property
    def paused(self) -> bool:
        """Reading is paused (:meth:`pause_reading`): the consumer is slow, not the upstream."""
        return self._paused

    def pause_reading(self) -> None:
        """Stop reading the upstream socket (the consumer's buffer is full)."""
        if not self._paused and self._conn is not None and self._conn.transport is not None:
            self._paused = True
            self._conn.transport.pause_reading()

    def resume_reading(self) -> None:
        """Read the upstream socket again after :meth:`pause_reading`."""
        if self._paused:
            self._paused = False
            conn = self._conn
            if conn is not None and conn.transport is not None and not conn.lost:
                conn.transport.resume_reading()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def fail(self, exc: BaseException) -> None:
        """Fail the exchange with ``exc`` from outside (an abort, a stall), in any state; idempotent.

        The connection is dropped; a pending :meth:`start`, :meth:`readany`, :meth:`read` or pipe raises
        ``exc``.
        """
        if self._failed is not None or self._complete:
            return  # failed already, or the answer is complete: nothing left to fail
        self._failed = exc
        self._wake_all(exc)
        self.close()

    def close(self) -> None:
        """Drop the connection (the upstream sees its request abandoned); idempotent. A read still
        waiting raises :class:`UpstreamDisconnected`."""
        if not self._complete and self._failed is None:
            self._failed = UpstreamDisconnected("closed by the caller", reused=self._was_reused,
                                                answered=self._answered)
            self._wake_all(self._failed)
        conn, self._conn = self._conn, None
        self._cancel_timer()
        self._sink = None
        if conn is not None:
            conn.exchange = None
            conn.close()
        self._pool._done(self, None)

    def release(self) -> None:
        """Hand the connection back to the pool: at once when the body's end has been parsed, else when it
        arrives (the rest of the body is discarded), within the pool's ``eof_wait_s`` wall seconds, after which it
        is dropped; a connection the upstream will not keep alive is closed."""
        if self._released:
            return
        self._released = True
        self._sink = None
        self._chunks.clear()
        self._size = 0
        self.resume_reading()
        if self._conn is None:
            self._pool._done(self, None)
            return
        if self._complete:
            self._give_back()
            return
        self._cancel_timer()
        self._timer = self._loop.call_later(self._pool.eof_wait_s, self.close)

    # ---- httptools callbacks -----------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        key = name.decode("latin-1").lower()
        self.headers[key] = value.decode("latin-1")
        if key == "content-length" or key == "transfer-encoding":
            self._framed = True

    def on_headers_complete(self) -> None:
        assert self._parser is not None
        self.status = self._parser.get_status_code()
        if 100 <= self.status < 200 and self.status != 101:  # an interim answer: the real one follows
            self.headers = {}
            self._framed = False
            return
        self._keep_alive = self._parser.should_keep_alive()  # llhttp forgets it once the message is complete
        fut = self._head_fut
        if fut is not None and not fut.done():
            fut.set_result(None)

    def on_body(self, body: bytes) -> None:
        sink = self._sink
        if sink is not None:
            self._feed_sink(body)
            return
        if self._released or self._piped or self._failed is not None:
            return  # discarded
        self._chunks.append(body)
        self._size += len(body)
        if self._size > self._max_body:
            self.fail(UpstreamProtocolError(f"answer body over {self._max_body} bytes"))
            return
        if self._size > self._pool.high_water:
            self.pause_reading()
        wait = self._wait
        if wait is not None and not wait.done():
            wait.set_result(None)

    def on_message_complete(self) -> None:
        if 100 <= self.status < 200 and self.status != 101:
            return  # an interim answer ended: the same parser reads the final one
        self._complete = True
        if not self._released:  # a released exchange's timer is its end-of-body wait, ended by _give_back
            self._cancel_timer()
        self._finish_body()

    # ---- internals -------------------------------------------------------------------------------
    def _data(self, data: bytes) -> None:
        self._answered = True
        self._last_read = self._loop.time()
        parser = self._parser
        if parser is None:
            return
        try:
            parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:  # a sink raised
            cause = exc.__context__ or exc
            self.fail(cause if isinstance(cause, Exception) else exc)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            self.fail(UpstreamProtocolError(f"invalid HTTP answer: {exc.__class__.__name__}: {exc}"))
        if self._delivered:
            self._flush_sink()

    def _flush_sink(self) -> None:
        self._delivered = False
        flush = self._flush
        if flush is not None:
            try:
                flush()
            except Exception as exc:  # noqa: BLE001 - the consumer's bug ends this exchange, not the loop
                self.fail(exc)

    def _feed_sink(self, body: bytes) -> bool:
        sink = self._sink
        assert sink is not None
        self._delivered = True
        try:
            stop = sink(body)
        except Exception as exc:  # noqa: BLE001 - the consumer's bug ends this exchange, not the loop
            self.fail(exc)
            return True
        if stop:
            self._sink = None
            fut = self._end_fut
            if fut is not None and not fut.done():
                fut.set_result(True)
            return True
        return False

    def _finish_body(self) -> None:
        wait = self._wait
        if wait is not None and not wait.done():
            wait.set_result(None)
        fut = self._end_fut
        if self._sink is not None:
            self._sink = None
            if fut is not None and not fut.done():
                fut.set_result(False)
        if self._released:
            self._give_back()

    def _give_back(self) -> None:
        self._cancel_timer()
        self.resume_reading()
        conn, self._conn = self._conn, None
        if conn is None:
            self._pool._done(self, None)
            return
        conn.exchange = None
        keep = self._keep_alive and self._framed and not conn.lost
        if not keep:
            conn.close()
            conn = None
        self._pool._done(self, conn)

    def _conn_lost(self, exc: Exception | None) -> None:
        self._conn = None
        self._cancel_timer()
        if self._complete or self._failed is not None:
            self._pool._done(self, None)
            return
        if self.status and not self._framed and exc is None:  # a body delimited by the connection's close
            self._complete = True
            self._finish_body()
            self._pool._done(self, None)
            return
        err = UpstreamDisconnected(
            "upstream closed the connection" + (f": {exc}" if exc else ""), reused=self._was_reused,
            answered=self._answered,
        )
        self._failed = err
        self._wake_all(err)
        self._pool._done(self, None)

    def _wake_all(self, exc: BaseException) -> None:
        for fut in (self._head_fut, self._wait, self._end_fut):
            if fut is not None and not fut.done():
                fut.set_exception(exc)
                fut.exception()  # retrieved: no "never retrieved" warning when nobody awaits it any more

    def _check_timeout(self) -> None:
        self._timer = None
        timeout = self.read_timeout_s
        if timeout is None or self._complete or self._failed is not None or self._conn is None:
            return
        if self._paused:  # the consumer is slow, not the upstream
            self._timer = self._loop.call_later(timeout, self._check_timeout)
            return
        due = self._last_read + timeout
        now = self._loop.time()
        if now < due:
            self._timer = self._loop.call_at(due, self._check_timeout)
            return
        self.fail(UpstreamTimeout(f"no byte from upstream for {timeout:g} s"))


class Http1Pool:
    """Keep-alive HTTP/1.1 connections per upstream origin, for :class:`Exchange` objects.

    Args:
        max_per_host: connections per origin (idle and busy); an exchange waits for a free one up to
            ``connect_timeout_s``.
        keepalive_s: idle wall seconds after which a pooled connection is closed.
        connect_timeout_s: wall seconds to get a connection (waiting for a slot and connecting).
        read_timeout_s: wall seconds allowed without a byte of the answer (None: no limit).
        max_body_bytes: limit of a buffered (not piped) body.
        high_water: buffered bytes at which reading the socket pauses until the body is consumed.
        ssl_context: for ``https`` origins (default: the system's default context).
        eof_wait_s: wall seconds a released exchange waits for its body's end (:meth:`Exchange.release`).
    """

    def __init__(
        self,
        max_per_host: int = 1024,
        keepalive_s: float = 60.0,
        connect_timeout_s: float = 3.0,
        read_timeout_s: float | None = 600.0,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        high_water: int = 256 * 1024,
        ssl_context: ssl_module.SSLContext | None = None,
        eof_wait_s: float = EOF_WAIT_S,
    ) -> None:
        self.eof_wait_s = eof_wait_s
        self.max_per_host = max(1, max_per_host)
        self.keepalive_s = keepalive_s
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.max_body_bytes = max_body_bytes
        self.high_water = high_water
        self._ssl = ssl_context
        self._loop: asyncio.AbstractEventLoop | None = None
        self._origins: dict[str, _Origin] = {}
        self._idle: dict[tuple[str, str, int], list[_Conn]] = {}
        self._slots: dict[tuple[str, str, int], asyncio.Semaphore] = {}
        self._busy: dict[tuple[str, str, int], int] = {}  # exchanges holding a slot, per origin
        self._closed = False

    def exchange(self, method: str, base_url: str, path: str, headers: Mapping[str, str], body: bytes = b"",
                 read_timeout_s: float | None = None) -> Exchange:
        """A new exchange (nothing sent yet): ``method`` ``base_url`` + ``path`` with ``headers`` and ``body``.

        ``Host`` and ``Content-Length`` are set here; other headers are sent as given.
        ``read_timeout_s``: wall seconds without a byte of the answer for this exchange (None: the
        pool's ``read_timeout_s``).

        Raises:
            ValueError: ``base_url`` is not an http(s) URL, or a header name or value holds CR or LF.
            RuntimeError: the pool is closed.
        """
        if self._closed:
            raise RuntimeError("pool closed")
        origin = self._origins.get(base_url)
        if origin is None:
            origin = _Origin(base_url)
            if len(self._origins) >= 4096:
                self._origins.clear()
            self._origins[base_url] = origin
        if " " in path or "\r" in path or "\n" in path or not path.startswith("/"):
            raise ValueError(f"path {path!r}: not absolute, or a blank, CR or LF in it")
        lines = [b"%s %s%s HTTP/1.1\r\nHost: %s\r\nContent-Length: %d\r\n" % (
            method.encode("ascii"), origin.prefix.encode("ascii"), path.encode("ascii"), origin.host_header,
            len(body))]
        for name, value in headers.items():
            if "\r" in name or "\n" in name or "\r" in value or "\n" in value or ":" in name:
                raise ValueError(f"header {name!r}: CR, LF or ':' in a name or value")
            if name.lower() in ("host", "content-length", "transfer-encoding"):
                continue
            # the bytes aiohttp's server decoded a forwarded header from (utf-8, surrogateescape)
            lines.append(b"%s: %s\r\n" % (name.encode("utf-8", "surrogateescape"),
                                            value.encode("utf-8", "surrogateescape")))
        lines.append(b"\r\n")
        lines.append(body)
        return Exchange(self, origin, b"".join(lines), read_timeout_s)

    async def _checkout(self, ex: Exchange) -> _Conn:
        """A connection for ``ex``: an idle one of its origin, else a new one (holding one of its slots)."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        origin = ex._origin
        key = origin.key
        sem = self._slots.get(key)
        if sem is None:
            sem = self._slots[key] = asyncio.Semaphore(self.max_per_host)
        try:
            if sem.locked():
                async with asyncio.timeout(self.connect_timeout_s):
                    await sem.acquire()
            else:
                await sem.acquire()
        except TimeoutError as exc:
            raise UpstreamConnectError(f"no free connection to {origin.host}:{origin.port} "
                                       f"within {self.connect_timeout_s:g} s") from exc
        ex._slot = True
        self._busy[key] = self._busy.get(key, 0) + 1
        idle = self._idle.get(key)
        now = self._loop.time()
        while idle:
            conn = idle.pop()
            if conn.lost or conn.transport is None or conn.transport.is_closing():
                continue
            if now - conn.idle_since > self.keepalive_s:
                conn.close()
                continue
            ex._was_reused = True
            conn.served += 1
            return conn
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await self._loop.create_connection(
                    lambda: _Conn(key, self), origin.host, origin.port,
                    ssl=(self._ssl or ssl_module.create_default_context()) if origin.ssl else None,
                )
        except (OSError, TimeoutError) as exc:
            raise UpstreamConnectError(f"connect {origin.host}:{origin.port}: {exc.__class__.__name__}: {exc}") from exc
        sock = conn.transport.get_extra_info("socket") if conn.transport is not None else None
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a token event is a small write
        conn.served = 1
        return conn

    def _done(self, ex: Exchange, conn: _Conn | None) -> None:
        """``ex`` ended: its connection (None when dropped) back to the idle list, its slot freed."""
        if conn is not None and not conn.lost and not self._closed:
            conn.idle_since = self._loop.time() if self._loop is not None else 0.0
            self._idle.setdefault(conn.key, []).append(conn)
        elif conn is not None:
            conn.close()
        if ex._slot:
            ex._slot = False
            key = ex._origin.key
            sem = self._slots.get(key)
            if sem is not None:
                sem.release()
            busy = self._busy[key] = self._busy.get(key, 1) - 1
            if busy <= 0 and not self._idle.get(key):
                self._drop_origin(key)

    def _forget(self, conn: _Conn) -> None:
        """An idle connection closed: out of its idle list (and its origin dropped when nothing is left)."""
        idle = self._idle.get(conn.key)
        if idle is not None and conn in idle:
            idle.remove(conn)
        if not self._idle.get(conn.key) and self._busy.get(conn.key, 0) <= 0:
            self._drop_origin(conn.key)

    def _drop_origin(self, key: tuple[str, str, int]) -> None:
        """Forget an origin nothing uses now (no exchange holds a slot, so none waits for one either):
        a fleet whose replicas come and go does not grow the pool's tables."""
        self._slots.pop(key, None)
        self._busy.pop(key, None)
        self._idle.pop(key, None)

    def origins(self) -> int:
        """Origins the pool holds state for (a connection slot in use or an idle connection)."""
        return len(self._slots)

    def idle_connections(self, base_url: str | None = None) -> int:
        """Idle pooled connections (of ``base_url``'s origin, or all)."""
        if base_url is None:
            return sum(len(v) for v in self._idle.values())
        return len(self._idle.get(_Origin(base_url).key, []))

    async def close(self) -> None:
        """Close every idle connection; exchanges still running keep theirs until they end."""
        self._closed = True
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()
        await asyncio.sleep(0)
