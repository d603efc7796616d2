"""Upstream HTTP relay to a replica's agent: pooled connections, bytes passed through unchanged.

Generation requests go over one :class:`~fairbatch_common.upstream.Http1Pool` for the whole router
(keep-alive connections per replica, bounded). The request body is forwarded as the client sent it
(never re-encoded); the answer is relayed as it arrives:

- stream: nothing is sent to the client until the first upstream body chunk arrives, so a replica
  that fails before its first byte can be retried elsewhere (:attr:`RelayOutcome.retryable`).
  After that every chunk is written as is, from the upstream socket's read callback (no task
  wake-up, no per-chunk parsing: fairbatch_common/upstream.py), up to the one that ends with
  ``data: [DONE]``: the answer is complete there, so the relay ends the client stream at
  once instead of waiting for the upstream's end of body (a client that closes on ``[DONE]`` would
  otherwise cancel a finished request). An upstream failure mid-stream ends the client stream
  with one SSE error event and ``data: [DONE]``.
- non-stream: status and body relayed.
- client disconnect (write fails, or the handler is cancelled): the upstream response is closed
  at once, which makes the agent abort the engine request; the caller releases the lease. A client
  that stops reading its stream is one too: once its send buffer stays full for ``client_stall_s``
  (the class's stall timeout) its connection is aborted and the upstream closed
  (fairbatch_common/upstream.py ``ClientSink``; outcome ``client_gone``, never a migration).

Statuses 502/503/504 from the agent, connection errors before the first byte, and a stream whose
first event is an SSE error event (no token was produced) are retryable. A 409 carrying
``x-fairbatch-refused`` is the agent refusing an inline admission (``x-fairbatch-admit``: its
budget is gone): outcome ``lease_refused`` with the class budget it reported, nothing relayed.

An :class:`UpstreamAbort` handle lets the router fail one attempt from outside when its replica
vanishes (discovery): before the first byte the attempt is retryable, after it the client stream
ends with the SSE error event, exactly as for a replica that dies.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import aiohttp
from aiohttp import web
from aiohttp.http import HttpVersion11

from fairbatch_common.aio import FirstChunkStreamResponse
from fairbatch_common.openai_errors import sse_error_event
from fairbatch_common.upstream import (
    ClientSink,
    ClientStalled,
    Exchange,
    Http1Pool,
    UpstreamDisconnected,
    UpstreamError,
    UpstreamTimeout,
    end_stream,
)
from router.migration import HANDOVER_TYPE, StreamResume

log = logging.getLogger(__name__)

RETRYABLE_STATUSES = frozenset({502, 503, 504})
STALE_RESENDS = 2
"""Times :meth:`Relay.open` re-sends a POST whose kept-alive connection closed before any byte of the answer."""
ADMIT_REFUSED_STATUS = 409  # with x-fairbatch-refused: the agent refused an inline admission
_SSE_DONE = b"data: [DONE]\n\n"
# an SSE event whose JSON payload starts with the key "error" (the agent's and vLLM's error event): at a
# line start, so a token-keyed logprobs object ({"error": -0.1} in top_logprobs) is not one
_ERROR_EVENT = re.compile(rb'(?:^|\n)data:[ \t]*\{"error"')


@dataclass(slots=True)
class RelayOutcome:
    """What happened to one forwarding attempt.

    Attributes:
        kind: ``ok`` (answer relayed, stream complete), ``refused`` (the engine answered with an
            error status other than 502/503/504, e.g. 400 for a bad ``max_tokens`` or 404 for an
            unknown model: relayed as is, no token produced, not retried since every replica
            would answer the same), ``retryable`` (failed before any byte reached the client),
            ``upstream_error`` (failed mid-stream: the router sent an error event, or relayed the
            replica's own before ``[DONE]``), ``client_gone`` (client
            disconnected; upstream closed), ``lease_refused`` (the agent refused the inline
            admission: nothing ran, re-place the request; ``detail`` = the agent's reason).
        response: the response to return from the handler (prepared when streamed); None when
            nothing was sent (retryable, or client gone before the first byte).
        status: upstream HTTP status (0 when no answer).
        detail: short reason for logs and error messages.
        error_body: body of a retryable error answer (relayed when no retry is left).
        error_content_type: its content type.
        pab_ms, pab_tokens: the class budget a ``lease_refused`` answer reported (-1: none).
        events: SSE data events relayed to the client, ``[DONE]`` not counted (0 for a non-stream
            answer); counted on line starts, never by parsing an event.
        cause: why a resumable stream's attempt failed (:meth:`Relay.forward_resumable`; one of
            router/migration.py ``CAUSES``), "" otherwise.
    """

    kind: str
    response: web.StreamResponse | None = None
    status: int = 0
    detail: str = ""
    error_body: bytes = b""
    error_content_type: str = "application/json"
    pab_ms: float = -1.0
    pab_tokens: int = -1
    events: int = 0
    cause: str = ""


class ReplicaGone(UpstreamError):
    """Raised into an upstream exchange when :meth:`UpstreamAbort.abort` fails the attempt."""


class UpstreamAbort:
    """Handle to fail one forwarding attempt from outside (its replica vanished).

    :meth:`abort` is idempotent and safe at any point: before the upstream answered, the attempt
    stops waiting and is retryable; after, the exchange fails with :class:`ReplicaGone` and the
    relay's ordinary failure paths apply. Either way the upstream connection is dropped.
    """

    __slots__ = ("reason", "_exchange")

    def __init__(self) -> None:
        self.reason: str | None = None
        self._exchange: Exchange | None = None

    def attach(self, exchange: Exchange) -> None:
        """The attempt's exchange (failed at once when the abort came first)."""
        self._exchange = exchange
        if self.reason is not None:
            exchange.fail(ReplicaGone(self.reason))

    def abort(self, reason: str) -> None:
        """Fail the attempt with ``reason`` (for logs and the client's SSE error event)."""
        if self.reason is not None:
            return
        self.reason = reason
        if self._exchange is not None:
            self._exchange.fail(ReplicaGone(reason))


def _is_error_event(first_chunk: bytes) -> bool:
    """True when a stream's first chunk is an SSE error event (checked once per request, not per chunk;
    the same event pattern as :func:`has_error_event`, at the chunk's start)."""
    return _ERROR_EVENT.match(first_chunk[:64].lstrip()) is not None


async def _admit_refused(upstream: Exchange) -> RelayOutcome:
    """The agent's refusal of an inline admission: reason and budget from its headers (body drained
    so the pooled connection is reused)."""
    h = upstream.headers
    try:
        await upstream.read()
    except UpstreamError:
        pass
    try:
        pab_ms, pab_tokens = float(h.get("x-fairbatch-pab-ms", "-1")), int(h.get("x-fairbatch-pab-tokens", "-1"))
    except ValueError:
        pab_ms, pab_tokens = -1.0, -1
    return RelayOutcome("lease_refused", status=ADMIT_REFUSED_STATUS, detail=h.get("x-fairbatch-refused", ""),
                        pab_ms=pab_ms, pab_tokens=pab_tokens)


def has_error_event(chunk: bytes, tail: bytes) -> bool:
    """Whether an SSE error event (a ``data:`` line whose JSON starts with ``{"error"``) starts in
    ``chunk`` (``tail``: the previous chunk's last 16 bytes, ``b"\\n"`` before the first, so an event
    split between two reads is seen). A JSON string escapes its quotes, so generated text never
    matches. Cheap on a token chunk: two substring searches; the pattern only when one hits."""
    if b'"error' not in chunk and b'"error' not in tail[-6:] + chunk[:6]:
        return False
    return _ERROR_EVENT.search(tail[-16:] + chunk) is not None


def count_events(chunk: bytes, tail: bytes) -> int:
    """SSE ``data:`` lines that end inside ``chunk`` (``tail``: the previous chunk's last 5 bytes, or
    ``b"\\n"`` before the first chunk). A JSON string holds no raw newline, so a line start is an event."""
    return (tail[-5:] + chunk[:5]).count(b"\ndata:") + chunk.count(b"\ndata:")


class _StreamPipe:
    """One relayed stream's SSE accounting and, after its first chunk, its sink (:meth:`Exchange.pipe`).

    :meth:`take` counts a chunk's events, notes an error event (:attr:`error`: the replica failed
    mid-stream and said so in the stream, as the agent does when its engine dies) and says whether
    the chunk completed the answer (``[DONE]``); :meth:`on_chunk` takes each further chunk, writes it
    to the client as it is read (:attr:`client`) and keeps the one that ends with ``[DONE]`` for
    ``write_eof``.
    """

    __slots__ = ("client", "events", "tail", "last", "gone", "error")

    def __init__(self) -> None:
        self.client: ClientSink | None = None  # set once the first chunk went out
        self.events = 0
        self.tail = b"\n"  # the last bytes seen (a line start before the first chunk)
        self.last: bytes | None = None  # the chunk that completed the answer (sent with the end of body)
        self.gone = False  # the client's connection closed
        self.error = False  # an error event was relayed

    def take(self, chunk: bytes) -> bool:
        """Count ``chunk``'s events; True when it ends with ``[DONE]``."""
        self.events += count_events(chunk, self.tail)
        if not self.error and has_error_event(chunk, self.tail):
            self.error = True
        tail = self.tail = chunk[-16:] if len(chunk) >= 16 else (self.tail + chunk)[-16:]
        return tail.rstrip().endswith(b"[DONE]")

    def on_chunk(self, chunk: bytes) -> bool:
        if self.take(chunk):
            self.last = chunk
            return True
        assert self.client is not None
        if not self.client.send(chunk):
            self.gone = True
            return True
        return False


def _stream_end(pipe: _StreamPipe, resp: web.StreamResponse, status: int, events: int) -> RelayOutcome:
    """A stream relayed to its ``[DONE]``: ``ok``, or ``upstream_error`` when it carried an error event
    (the client has the replica's own error event; the request failed, after tokens went out)."""
    if pipe.error:
        return RelayOutcome("upstream_error", resp, status, "upstream error event mid-stream", events=events)
    return RelayOutcome("ok", resp, status, events=events)


def _why(exc: BaseException) -> str:
    """A failure's detail for logs and the client's error event (a removed replica's reason kept)."""
    return f"{exc.__class__.__name__}: {exc}" if isinstance(exc, ReplicaGone) else exc.__class__.__name__


def _cause(exc: BaseException) -> str:
    """The migration cause of an upstream failure (router/migration.py ``CAUSES``)."""
    if isinstance(exc, ReplicaGone):
        return "replica_removed"
    if isinstance(exc, UpstreamTimeout):
        return "silence"
    return "disconnect"


class Relay:
    """Forwards requests to agents over pooled keep-alive connections.

    Generation requests go through an :class:`~fairbatch_common.upstream.Http1Pool` (their streamed
    chunks are written to the client from the upstream socket's read callback); the other upstream
    calls (the model catalog, /tokenize) use :attr:`session`, an ``aiohttp.ClientSession``.

    Args:
        max_connections: connector limit of :attr:`session` over all replicas.
        max_connections_per_host: connection limit per replica (both).
        connect_timeout_s: wall seconds to get a pooled connection or connect.
        read_timeout_s: wall seconds allowed between two upstream reads.
        keepalive_timeout_s: idle keep-alive of pooled connections (wall s).
    """

    def __init__(
        self,
        max_connections: int = 4096,
        max_connections_per_host: int = 1024,
        connect_timeout_s: float = 3.0,
        read_timeout_s: float = 600.0,
        keepalive_timeout_s: float = 60.0,
    ) -> None:
        self._limits = (max_connections, max_connections_per_host, keepalive_timeout_s)
        self._timeout = aiohttp.ClientTimeout(
            total=None, connect=connect_timeout_s, sock_connect=connect_timeout_s, sock_read=read_timeout_s
        )
        self.pool = Http1Pool(max_per_host=max_connections_per_host, keepalive_s=keepalive_timeout_s,
                              connect_timeout_s=connect_timeout_s, read_timeout_s=read_timeout_s)
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        """Create the pooled session (call inside the running loop)."""
        limit, per_host, keepalive = self._limits
        connector = aiohttp.TCPConnector(
            limit=limit, limit_per_host=per_host, keepalive_timeout=keepalive, ttl_dns_cache=300
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=self._timeout,
            auto_decompress=False,
            skip_auto_headers=("User-Agent",),
        )

    async def close(self) -> None:
        """Close the session and the pooled connections."""
        await self.pool.close()
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        """The pooled aiohttp session (for the upstream calls that are not generation requests).

        Raises:
            RuntimeError: before :meth:`start`.
        """
        if self._session is None:
            raise RuntimeError("relay not started")
        return self._session

    async def forward(
        self,
        request: web.Request,
        base_url: str,
        path: str,
        body: bytes,
        upstream_headers: Mapping[str, str],
        response_headers: Mapping[str, str],
        abort: UpstreamAbort | None = None,
        silence_s: float | None = None,
        client_stall_s: float | None = None,
    ) -> RelayOutcome:
        """POST ``body`` to ``base_url + path`` and relay the answer to ``request``'s client.

        Args:
            request: the client's request (its response is written here when streaming).
            base_url: the agent's URL (replica ``http_url``).
            path: the client's path.
            body: the client's body bytes, unchanged.
            upstream_headers: headers for the agent (content-type, x-request-id, lease, ...).
            response_headers: extra headers for the client (x-request-id, x-fairbatch-replica).
            abort: optional handle that fails this attempt from outside (replica removed).
            silence_s: wall seconds the agent may send nothing before the attempt fails as a timeout
                (None: the pool's ``read_timeout_s``); before the first byte a retryable failure,
                after it an ``upstream_error`` with an error event (router/server.py
                ``Router.silence_s``: a frozen agent does not hold the client for ``read_timeout_s``).
            client_stall_s: wall seconds a streaming client may read nothing (its send buffer full)
                before it is cut and the upstream closed (None: no limit).

        Raises:
            asyncio.CancelledError: the handler was cancelled (client gone); upstream is closed first.
        """
        try:
            upstream = await self.open(base_url, path, body, upstream_headers, abort, silence_s)
        except ValueError:  # a header that cannot go on the wire (CR/LF): the client's request, not the replica
            err = {"error": {"message": "a request header cannot be forwarded", "type": "invalid_request_error",
                             "param": None, "code": 400}}
            return RelayOutcome("refused", web.json_response(err, status=400, headers=dict(response_headers)), 400,
                                "request header not forwardable")
        except UpstreamError as exc:
            return RelayOutcome("retryable", detail=f"connect: {exc.__class__.__name__}: {exc}")
        if upstream is None:
            return RelayOutcome("retryable", detail=f"aborted: {abort.reason if abort else ''}")
        try:
            return await self._relay(request, upstream, response_headers, client_stall_s)
        finally:
            upstream.release()  # back to the pool once its body is complete (no-op when closed)

    async def forward_resumable(
        self,
        request: web.Request,
        base_url: str,
        path: str,
        body: bytes,
        upstream_headers: Mapping[str, str],
        response_headers: Mapping[str, str],
        state: StreamResume,
        resp: web.StreamResponse | None,
        abort: UpstreamAbort | None = None,
        silence_s: float | None = None,
        on_first: Callable[[], None] | None = None,
        client_stall_s: float | None = None,
    ) -> RelayOutcome:
        """One attempt of a migratable stream (router/migration.py): like :meth:`forward`, but every
        SSE event goes through ``state.feed`` (the agent's error event held back, a continuation's
        id and usage rewritten), and a failure after the first byte does not end the client stream:
        the caller continues it elsewhere or ends it (:meth:`end_with_error`).

        Args:
            state: the stream's state across attempts (updated in place).
            resp: the client's response once prepared (a continuation), else None (the first
                attempt: prepared with this attempt's first relayed event).
            on_first: called once, when this attempt relays its first event.
            others: as :meth:`forward`.

        Returns:
            ``ok`` (``[DONE]`` relayed, stream ended), ``retryable`` (this attempt relayed nothing:
            ``response`` is ``resp``, None on a first attempt), ``upstream_error`` (it failed after
            relaying events; the client stream is open, ``cause`` set), ``client_gone``, or the
            outcomes of a non-stream answer as :meth:`forward` (``refused``, ``lease_refused``, ...).

        Raises:
            asyncio.CancelledError: the handler was cancelled (client gone); upstream is closed first.
        """
        state.new_attempt()
        try:
            upstream = await self.open(base_url, path, body, upstream_headers, abort, silence_s)
        except ValueError:
            err = {"error": {"message": "a request header cannot be forwarded", "type": "invalid_request_error",
                             "param": None, "code": 400}}
            return RelayOutcome("refused", web.json_response(err, status=400, headers=dict(response_headers)), 400,
                                "request header not forwardable")
        except UpstreamError as exc:
            return RelayOutcome("retryable", resp, detail=f"connect: {exc.__class__.__name__}: {exc}",
                                cause=_cause(exc))
        if upstream is None:
            return RelayOutcome("retryable", resp, detail=f"aborted: {abort.reason if abort else ''}",
                                cause="replica_removed")
        try:
            ctype = upstream.headers.get("content-type", "application/json")
            if not ctype.startswith("text/event-stream") or upstream.status >= 400:
                out = await self._relay(request, upstream, response_headers)
                if resp is not None and out.kind != "lease_refused":  # a continuation answered, but not a stream:
                    # the engine's refusal (4xx) stays one (every replica would refuse it), the rest is a failure
                    kind = "refused" if out.kind == "refused" else "retryable"
                    return RelayOutcome(kind, resp, out.status, out.detail or "continuation not streamed",
                                        cause="error_event")
                return out
            return await self._resume_stream(request, upstream, ctype, response_headers, state, resp, on_first,
                                             client_stall_s)
        finally:
            upstream.release()

    async def _resume_stream(
        self, request: web.Request, upstream: Exchange, ctype: str, response_headers: Mapping[str, str],
        state: StreamResume, resp: web.StreamResponse | None, on_first: Callable[[], None] | None,
        client_stall_s: float | None = None,
    ) -> RelayOutcome:
        """Read until this attempt relays its first event (the client's response prepared then on a
        first attempt), then pipe the rest from the upstream socket's read callback
        (:meth:`Exchange.pipe`, :class:`ClientSink`: no task wake-up per chunk), each chunk through
        ``state.feed``, up to ``[DONE]`` (sent with the end of the body), an error event or a failure."""
        status = upstream.status
        before = b""  # a first attempt's bytes before anything was relayed (its error answer)
        cause = ""
        why = ""
        try:
            while True:  # up to this attempt's first relayed event
                try:
                    chunk = await upstream.readany()
                except UpstreamError as exc:
                    upstream.close()
                    cause, why = _cause(exc), _why(exc)
                    break
                if not chunk:
                    cause = "disconnect"
                    break
                out = state.feed(chunk)
                if not out:
                    if resp is None:
                        before = (before + chunk)[-4096:]
                    if state.error:
                        upstream.close()
                        cause = "error_event"
                        break
                    continue
                if on_first is not None:
                    on_first()
                if resp is None:
                    resp = FirstChunkStreamResponse(status=status, headers=response_headers)
                    resp.content_type = ctype.split(";", 1)[0]
                    resp.headers["Cache-Control"] = "no-cache"
                    await resp.prepare(request)
                if state.done:
                    if state.cut:  # the router ended the stream at a stop across the cut: the engine stops too
                        upstream.close()
                    await resp.write_eof(out)
                    return RelayOutcome("ok", resp, status, events=state.events)
                await resp.write(out)
                if state.error:
                    upstream.close()
                    cause = "error_event"
                    break
                cause, why = await self._pipe_resumable(request, upstream, state, client_stall_s)
                if cause == "ok":
                    if state.cut:
                        upstream.close()
                    try:
                        await end_stream(resp, request.transport, state.last_out, client_stall_s)
                    except ClientStalled:
                        return RelayOutcome("client_gone", resp, status, "client stopped reading",
                                            events=state.events)
                    return RelayOutcome("ok", resp, status, events=state.events)
                if cause == "client_gone":
                    upstream.close()
                    return RelayOutcome("client_gone", resp, status, "client disconnected", events=state.events)
                break
        except asyncio.CancelledError:
            upstream.close()
            raise
        except (ConnectionError, aiohttp.ClientConnectionResetError, RuntimeError):
            upstream.close()
            return RelayOutcome("client_gone", resp, status, "client disconnected", events=state.events)
        except Exception:  # noqa: BLE001 - a bug in the event accounting: end the attempt, never continue it
            upstream.close()
            log.exception("resumable relay failed")
            state.opaque = True  # router/migration.py decide: not-continuable -> the SSE error event
            cause, why = "disconnect", "relay error"
        if cause == "error_event" and state.error_type == HANDOVER_TYPE:
            cause = "drain"  # a draining agent handed the stream over (replica_agent/drainer.py)
        if cause in ("error_event", "drain") and state.error_message:
            why = state.error_message  # the agent's own words (engine stalled, engine stream failed, ...)
        detail = f"upstream failed mid-stream: {why or cause}"
        if resp is None or state.attempt_events == 0:
            body = before if before.rstrip().endswith(b"[DONE]") else before + _SSE_DONE
            return RelayOutcome("retryable", resp, status, detail, error_body=body if before else b"",
                                error_content_type=ctype, events=state.events, cause=cause)
        return RelayOutcome("upstream_error", resp, status, detail, events=state.events, cause=cause)

    @staticmethod
    async def _pipe_resumable(request: web.Request, upstream: Exchange, state: StreamResume,
                              client_stall_s: float | None = None) -> tuple[str, str]:
        """The rest of an attempt after its first relayed event, from the read callback: returns
        (``ok`` | ``client_gone`` | a migration cause, detail). On ``ok`` the output that ends with
        ``[DONE]`` is left in ``state.last_out`` for ``write_eof``; the upstream is closed on failures."""
        transport = request.transport
        if transport is None or transport.is_closing():
            return "client_gone", ""
        client = ClientSink(transport, upstream, request.version >= HttpVersion11, max_pause_s=client_stall_s)
        gone = False

        def on_chunk(chunk: bytes) -> bool:
            nonlocal gone
            out = state.feed(chunk)
            if state.done:
                state.last_out = out
                return True
            if out and not client.send(out):
                gone = True
                return True
            return state.error

        try:
            await upstream.pipe(on_chunk, client.flush)
        except ClientStalled:  # the client stopped reading: cut (not a failure of the replica)
            upstream.close()
            return "client_gone", ""
        except UpstreamError as exc:
            upstream.close()
            return _cause(exc), _why(exc)
        except asyncio.CancelledError:
            upstream.close()
            raise
        except Exception:  # noqa: BLE001 - a bug in the event accounting (raised in the sink)
            upstream.close()
            log.exception("resumable relay pipe failed")
            state.opaque = True
            return "disconnect", "relay error"
        client.flush()
        if gone:
            return "client_gone", ""
        if state.done:
            return "ok", ""
        upstream.close()
        return ("error_event", "") if state.error else ("disconnect", "")

    @staticmethod
    async def end_with_error(resp: web.StreamResponse, detail: str) -> bool:
        """End an open client stream with the SSE error event and ``[DONE]``; False when the client
        was gone."""
        try:
            await resp.write(sse_error_event(detail))
            await resp.write_eof()
        except (ConnectionError, RuntimeError, aiohttp.ClientConnectionResetError):
            return False
        return True

    async def open(
        self, base_url: str, path: str, body: bytes, headers: Mapping[str, str], abort: UpstreamAbort | None = None,
        silence_s: float | None = None,
    ) -> Exchange | None:
        """POST to the agent and wait for the answer's head: the exchange, or None when ``abort`` fired
        first (nothing relayed; the connection was dropped, so the agent sees the request abandoned).

        A POST whose kept-alive connection closed before any byte of the answer (the agent closed an
        idle connection just as the request went out: e.g. its idle timers fired late, after the agent
        was paused) is sent again on a new connection, at most :data:`STALE_RESENDS` times, as the agent
        does towards its engine (replica_agent/proxy.py ``stale_retries``): such a drop says nothing of
        the replica, and counted as its failure it excluded the replica from the request (a
        continuation then found no replica left: a real-vLLM CI run).

        Raises:
            ValueError: a header or the path cannot be sent (CR/LF).
            UpstreamError: the POST failed (connect, disconnect, timeout, not HTTP).
            asyncio.CancelledError: the caller was cancelled (the connection is dropped first).
        """
        resent = 0
        while True:
            upstream = self.pool.exchange("POST", base_url, path, headers, body, silence_s)
            if abort is not None:
                abort.attach(upstream)
            try:
                await upstream.start()
            except ReplicaGone:
                return None
            except UpstreamDisconnected as exc:
                if not exc.reused or exc.answered or resent >= STALE_RESENDS:
                    raise
                resent += 1
                log.info("agent %s dropped a kept-alive connection before answering; re-sending", base_url)
                continue
            return upstream

    async def _relay(
        self, request: web.Request, upstream: Exchange, response_headers: Mapping[str, str],
        client_stall_s: float | None = None,
    ) -> RelayOutcome:
        status = upstream.status
        ctype = upstream.headers.get("content-type", "application/json")
        if status == ADMIT_REFUSED_STATUS and "x-fairbatch-refused" in upstream.headers:
            return await _admit_refused(upstream)
        if status in RETRYABLE_STATUSES:
            try:
                err = await upstream.read()
            except UpstreamError:
                err = b""
            return RelayOutcome(
                "retryable", status=status, detail=f"upstream status {status}", error_body=err, error_content_type=ctype
            )
        if not ctype.startswith("text/event-stream"):
            try:
                payload = await upstream.read()
            except asyncio.CancelledError:
                upstream.close()
                raise
            except UpstreamError as exc:
                upstream.close()
                return RelayOutcome("retryable", status=status, detail=f"read: {exc.__class__.__name__}")
            headers = dict(response_headers)
            headers["Content-Type"] = ctype
            kind = "refused" if status >= 400 else "ok"
            detail = f"upstream status {status}" if status >= 400 else ""
            return RelayOutcome(kind, web.Response(status=status, body=payload, headers=headers), status, detail)
        return await self._relay_stream(request, upstream, ctype, response_headers, client_stall_s)

    async def _relay_stream(
        self,
        request: web.Request,
        upstream: Exchange,
        ctype: str,
        response_headers: Mapping[str, str],
        client_stall_s: float | None = None,
    ) -> RelayOutcome:
        status = upstream.status
        try:
            first = await upstream.readany()
        except asyncio.CancelledError:
            upstream.close()
            raise
        except UpstreamError as exc:
            upstream.close()
            return RelayOutcome("retryable", status=status, detail=f"first read: {exc.__class__.__name__}")
        if not first:
            upstream.close()
            return RelayOutcome("retryable", status=status, detail="upstream closed before the first byte")
        if _is_error_event(first):
            # The replica failed before producing anything (the agent, or vLLM, sent its SSE
            # headers early and then only an error event): nothing reached the client yet, retry.
            upstream.close()
            body = first if first.rstrip().endswith(b"[DONE]") else first + _SSE_DONE
            return RelayOutcome(
                "retryable", status=status, detail="upstream error event before the first token",
                error_body=body, error_content_type=ctype,
            )
        resp = FirstChunkStreamResponse(status=status, headers=response_headers)  # headers + first chunk: one send
        resp.content_type = ctype.split(";", 1)[0]
        resp.headers["Cache-Control"] = "no-cache"
        pipe = _StreamPipe()
        complete = pipe.take(first)
        try:
            await resp.prepare(request)
            # the chunk that ends the answer goes out with the end of the body, in one write
            await (resp.write_eof(first) if complete else resp.write(first))
        except asyncio.CancelledError:
            upstream.close()
            raise
        except (ConnectionError, aiohttp.ClientConnectionResetError, RuntimeError):
            upstream.close()
            return RelayOutcome("client_gone", None, status, "client disconnected")
        if complete:
            return _stream_end(pipe, resp, status, pipe.events - 1)
        transport = request.transport
        if transport is None or transport.is_closing():
            upstream.close()
            return RelayOutcome("client_gone", resp, status, "client disconnected")
        # every further chunk is written from the upstream socket's read callback, up to [DONE]
        client = pipe.client = ClientSink(transport, upstream, request.version >= HttpVersion11,
                                          max_pause_s=client_stall_s)
        try:
            await upstream.pipe(pipe.on_chunk, client.flush)
        except asyncio.CancelledError:
            upstream.close()
            raise
        except ClientStalled:  # the client stopped reading: its connection is aborted, the upstream closed
            upstream.close()
            log.info("client of a stream read nothing for %g s: cut", client_stall_s)
            return RelayOutcome("client_gone", resp, status, "client stopped reading")
        except Exception as exc:  # noqa: BLE001 - an upstream failure (or a bug in the pipe): end the stream
            upstream.close()
            if not isinstance(exc, UpstreamError):
                log.exception("relay pipe failed")
            detail = f"upstream failed mid-stream: {exc.__class__.__name__}"
            if isinstance(exc, ReplicaGone):
                detail += f": {exc}"
            try:
                await resp.write(sse_error_event(detail))
                await resp.write_eof()
            except (ConnectionError, RuntimeError):
                return RelayOutcome("client_gone", resp, status, "client disconnected")
            return RelayOutcome("upstream_error", resp, status, detail)
        if pipe.gone:
            upstream.close()
            return RelayOutcome("client_gone", resp, status, "client disconnected")
        try:
            # the stream is complete at [DONE]: a client that closes now is done, not gone
            await end_stream(resp, transport, pipe.last or b"", client_stall_s)
        except (ConnectionError, RuntimeError, ClientStalled):
            upstream.close()
            return RelayOutcome("client_gone", resp, status, "client disconnected")
        return _stream_end(pipe, resp, status, pipe.events - (pipe.last is not None))
