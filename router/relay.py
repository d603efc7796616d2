"""Upstream HTTP relay to a replica's agent: pooled connections, bytes passed through unchanged.

One ``aiohttp.ClientSession`` for the whole router (bounded connector, keep-alive). The request
body is forwarded as the client sent it (never re-encoded); the answer is relayed as it arrives:

- stream: nothing is sent to the client until the first upstream body chunk arrives, so a replica
  that fails before its first byte can be retried elsewhere (:attr:`RelayOutcome.retryable`).
  After that every chunk is written as is (``readany``, no per-chunk parsing) up to the one that
  ends with ``data: [DONE]``: the answer is complete there, so the relay ends the client stream at
  once instead of waiting for the upstream's end of body (a client that closes on ``[DONE]`` would
  otherwise cancel a finished request). An upstream failure mid-stream ends the client stream
  with one SSE error event and ``data: [DONE]``.
- non-stream: status and body relayed.
- client disconnect (write fails, or the handler is cancelled): the upstream response is closed
  at once, which makes the agent abort the engine request; the caller releases the lease.

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
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from replica_agent.aio import FirstChunkStreamResponse, release_at_eof

log = logging.getLogger(__name__)

RETRYABLE_STATUSES = frozenset({502, 503, 504})
ADMIT_REFUSED_STATUS = 409  # with x-fairbatch-refused: the agent refused an inline admission
_SSE_DONE = b"data: [DONE]\n\n"


@dataclass(slots=True)
class RelayOutcome:
    """What happened to one forwarding attempt.

    Attributes:
        kind: ``ok`` (answer relayed, stream complete), ``refused`` (the engine answered with an
            error status other than 502/503/504, e.g. 400 for a bad ``max_tokens`` or 404 for an
            unknown model: relayed as is, no token produced, not retried since every replica
            would answer the same), ``retryable`` (failed before any byte reached the client),
            ``upstream_error`` (failed mid-stream; error event sent), ``client_gone`` (client
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


class ReplicaGone(aiohttp.ClientConnectionError):
    """Raised into an upstream read when :meth:`UpstreamAbort.abort` fails the attempt."""


class UpstreamAbort:
    """Handle to fail one forwarding attempt from outside (its replica vanished).

    :meth:`abort` is idempotent and safe at any point: before the upstream answered, the attempt
    stops waiting and is retryable; after, the pending upstream read raises :class:`ReplicaGone`
    and the relay's ordinary failure paths apply.
    """

    __slots__ = ("reason", "_waiting", "_cancelled", "_upstream")

    def __init__(self) -> None:
        self.reason: str | None = None
        self._waiting: asyncio.Task[object] | None = None  # the task awaiting the POST's answer, while it waits
        self._cancelled = False  # abort() cancelled that task
        self._upstream: aiohttp.ClientResponse | None = None

    def abort(self, reason: str) -> None:
        """Fail the attempt with ``reason`` (for logs and the client's SSE error event)."""
        if self.reason is not None:
            return
        self.reason = reason
        waiting, self._waiting = self._waiting, None
        if waiting is not None:
            self._cancelled = True
            waiting.cancel()
        up = self._upstream
        if up is not None and not up.closed:
            up.content.set_exception(ReplicaGone(reason))
            up.close()


def _is_error_event(first_chunk: bytes) -> bool:
    """True when a stream's first chunk is an SSE error event (checked once per request, not per chunk)."""
    head = first_chunk[:64].lstrip()
    if not head.startswith(b"data:"):
        return False
    return head[5:].lstrip().startswith(b'{"error"')


async def _admit_refused(upstream: aiohttp.ClientResponse) -> RelayOutcome:
    """The agent's refusal of an inline admission: reason and budget from its headers (body drained
    so the pooled connection is reused)."""
    h = upstream.headers
    try:
        await upstream.read()
    except (aiohttp.ClientError, TimeoutError, OSError):
        pass
    try:
        pab_ms, pab_tokens = float(h.get("x-fairbatch-pab-ms", "-1")), int(h.get("x-fairbatch-pab-tokens", "-1"))
    except ValueError:
        pab_ms, pab_tokens = -1.0, -1
    return RelayOutcome("lease_refused", status=ADMIT_REFUSED_STATUS, detail=h.get("x-fairbatch-refused", ""),
                        pab_ms=pab_ms, pab_tokens=pab_tokens)


def count_events(chunk: bytes, tail: bytes) -> int:
    """SSE ``data:`` lines that end inside ``chunk`` (``tail``: the previous chunk's last 5 bytes, or
    ``b"\\n"`` before the first chunk). A JSON string holds no raw newline, so a line start is an event."""
    return (tail[-5:] + chunk[:5]).count(b"\ndata:") + chunk.count(b"\ndata:")


def sse_error_event(message: str, code: int = 502) -> bytes:
    """The SSE error event sent when the upstream fails mid-stream (followed by ``[DONE]``)."""
    payload = {"error": {"message": message, "type": "upstream_error", "code": code}}
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n" + _SSE_DONE


class Relay:
    """Forwards requests to agents over one pooled client session.

    Args:
        max_connections: connector limit over all replicas.
        max_connections_per_host: connector limit per replica.
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
        """Close the session and its pooled connections."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        """The pooled session.

        Raises:
            RuntimeError: before :meth:`start`.
        """
        if self._session is None:
            raise RuntimeError("relay not started")
        return self._session

    async def forward(
        self,
        request: web.Request,
        url: str,
        body: bytes,
        upstream_headers: Mapping[str, str],
        response_headers: Mapping[str, str],
        abort: UpstreamAbort | None = None,
    ) -> RelayOutcome:
        """POST ``body`` to ``url`` and relay the answer to ``request``'s client.

        Args:
            request: the client's request (its response is written here when streaming).
            url: agent URL (replica http_url + the client's path).
            body: the client's body bytes, unchanged.
            upstream_headers: headers for the agent (content-type, x-request-id, lease, ...).
            response_headers: extra headers for the client (x-request-id, x-fairbatch-replica).
            abort: optional handle that fails this attempt from outside (replica removed).

        Raises:
            asyncio.CancelledError: the handler was cancelled (client gone); upstream is closed first.
        """
        try:
            if abort is None:
                upstream = await self.session.post(url, data=body, headers=upstream_headers)
            else:
                got = await self._post_abortable(url, body, upstream_headers, abort)
                if got is None:
                    return RelayOutcome("retryable", detail=f"aborted: {abort.reason}")
                upstream = got
        except asyncio.CancelledError:
            raise
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            return RelayOutcome("retryable", detail=f"connect: {exc.__class__.__name__}: {exc}")
        outcome: RelayOutcome | None = None
        try:
            outcome = await self._relay(request, upstream, response_headers)
            return outcome
        finally:
            if outcome is not None and outcome.kind == "ok":
                release_at_eof(upstream)  # answered at [DONE]: the end of body may still be on its way
            elif not upstream.closed:
                upstream.release()

    async def _post_abortable(
        self, url: str, body: bytes, headers: Mapping[str, str], abort: UpstreamAbort
    ) -> aiohttp.ClientResponse | None:
        """The upstream response, or None when ``abort`` fired first.

        The POST runs in the caller's task (no task of its own per request): :meth:`UpstreamAbort.abort`
        cancels that task while it waits for the answer. The cancellation lands inside aiohttp's own
        await, which closes the request's connection (as when the client goes away); a response that
        was complete at that instant is closed the same way, before it is handed back, so none is left
        open. A cancellation that is not only the abort's (the client left too) propagates.

        Raises:
            aiohttp.ClientError, TimeoutError, OSError: the POST failed.
            asyncio.CancelledError: the caller was cancelled.
        """
        if abort.reason is not None:
            return None
        task = asyncio.current_task()
        abort._waiting = task
        try:
            upstream = await self.session.post(url, data=body, headers=headers)
        except asyncio.CancelledError:
            if abort._cancelled and task is not None and task.uncancel() == 0:
                return None  # the abort's cancellation alone: the attempt is retryable
            raise
        finally:
            abort._waiting = None
        if abort.reason is not None:  # the cancellation was swallowed on the way (not seen with aiohttp 3.14)
            upstream.close()
            if abort._cancelled and task is not None:
                task.uncancel()
            return None
        abort._upstream = upstream
        return upstream

    async def _relay(
        self, request: web.Request, upstream: aiohttp.ClientResponse, response_headers: Mapping[str, str]
    ) -> RelayOutcome:
        status = upstream.status
        ctype = upstream.headers.get("Content-Type", "application/json")
        if status == ADMIT_REFUSED_STATUS and "x-fairbatch-refused" in upstream.headers:
            return await _admit_refused(upstream)
        if status in RETRYABLE_STATUSES:
            try:
                err = await upstream.read()
            except (aiohttp.ClientError, TimeoutError, OSError):
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
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                upstream.close()
                return RelayOutcome("retryable", status=status, detail=f"read: {exc.__class__.__name__}")
            headers = dict(response_headers)
            headers["Content-Type"] = ctype
            kind = "refused" if status >= 400 else "ok"
            detail = f"upstream status {status}" if status >= 400 else ""
            return RelayOutcome(kind, web.Response(status=status, body=payload, headers=headers), status, detail)
        return await self._relay_stream(request, upstream, ctype, response_headers)

    async def _relay_stream(
        self,
        request: web.Request,
        upstream: aiohttp.ClientResponse,
        ctype: str,
        response_headers: Mapping[str, str],
    ) -> RelayOutcome:
        content = upstream.content
        status = upstream.status
        try:
            first = await content.readany()
        except asyncio.CancelledError:
            upstream.close()
            raise
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
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
        events, tail = count_events(first, b"\n"), first[-16:]
        complete = tail.rstrip().endswith(b"[DONE]")
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
        while not complete:
            try:
                chunk = await content.readany()
            except asyncio.CancelledError:
                upstream.close()
                raise
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                upstream.close()
                detail = f"upstream failed mid-stream: {exc.__class__.__name__}"
                if isinstance(exc, ReplicaGone):
                    detail += f": {exc}"
                try:
                    await resp.write(sse_error_event(detail))
                    await resp.write_eof()
                except (ConnectionError, RuntimeError):
                    return RelayOutcome("client_gone", resp, status, "client disconnected")
                return RelayOutcome("upstream_error", resp, status, detail)
            if not chunk:
                break
            events += count_events(chunk, tail)
            tail = chunk[-16:] if len(chunk) >= 16 else (tail + chunk)[-16:]
            # the stream is complete at [DONE]: a client that closes now is done, not gone
            complete = tail.rstrip().endswith(b"[DONE]")
            try:
                await (resp.write_eof(chunk) if complete else resp.write(chunk))
            except asyncio.CancelledError:
                upstream.close()
                raise
            except (ConnectionError, RuntimeError):
                upstream.close()
                return RelayOutcome("client_gone", resp, status, "client disconnected")
        try:
            await resp.write_eof()
        except (ConnectionError, RuntimeError):
            return RelayOutcome("client_gone", resp, status, "client disconnected")
        return RelayOutcome("ok", resp, status, events=events - complete)
