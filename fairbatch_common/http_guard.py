"""What both HTTP servers (router and agent) do the same way at their edge (aiohttp).

- :func:`make_runner`: the ``AppRunner`` settings both use: handler cancellation (a handler is
  cancelled when its client leaves, so an abandoned request frees its reservation and the engine
  aborts it at once), no request-body decompression (a ``Content-Encoding`` body is refused with 415
  instead of being inflated, and a body that is not what its header says cannot make aiohttp raise
  while draining it), no access log, idle keep-alive connections closed after
  :data:`DEFAULT_KEEPALIVE_S`, and a header-read timeout (:class:`HeaderTimeoutHandler`): aiohttp has
  none, so a client that sends ``POST /v1/completions HTTP/1.1\r\nHost: x\r\n`` and nothing more held
  its connection (and a file descriptor) for aiohttp's keep-alive of an hour.
- :func:`read_body`: the body of a request, bounded: 413 from ``Content-Length`` before a byte is
  read, 413 when a chunked body grows past the bound, 408 when it does not arrive within the
  timeout, 415 for a ``Content-Encoding`` other than ``identity``, 400 when the connection breaks.
- :func:`off_loop`: a body's checks (decode, validate, price) run in a worker thread when the body is
  over :data:`OFF_LOOP_BYTES`, so a 200,000-id prompt does not hold the loop while other requests and
  ``/health`` wait (issue 30 item 8).
- :func:`bounded_expect_handler`: ``Expect: 100-continue`` gets ``100 Continue`` only for a body
  :func:`read_body` would read; a body it refuses from its headers alone (413, 415) gets no
  interim answer, so the handler's refusal is the client's final answer before it sends the body.
- :func:`error_middleware`: every error answer is OpenAI's JSON ``{"error": {...}}``: aiohttp's own
  HTTP errors (404, 405, 413) and :class:`~fairbatch_common.api_schema.ApiError`; any other exception is
  our own bug and becomes a 500 in the same JSON with the request id (logged with its traceback,
  which carries no request content).

Request id: a handler stores the id it answers with under :data:`REQUEST_ID` so that the middleware
and the response headers carry it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import re
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from aiohttp import web
from aiohttp.http import HttpVersion11
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler, RequestPayloadError

from fairbatch_common.api_schema import ApiError

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_BODY_TIMEOUT_S = 10.0
DEFAULT_HEADER_TIMEOUT_S = 10.0
"""Wall seconds a client has to send a request's whole head (request line and headers): from the
connection's start for its first request, from the first byte of each later one on a kept-alive
connection (Go's ``http.Server.ReadHeaderTimeout``; nginx's ``client_header_timeout`` is 60 s,
HAProxy's ``timeout http-request`` is commonly 10 s)."""
DEFAULT_KEEPALIVE_S = 75.0
"""Wall seconds an idle kept-alive connection stays open (nginx's ``keepalive_timeout``; aiohttp's own
default is 3630 s). Above the relays' pool keep-alive (router 60 s, agent 4 s), so the client side
closes first."""
REQUEST_ID = web.RequestKey("fairbatch_request_id", str)
_CLIENT_ID = re.compile(r"[\x21-\x7e]{1,128}")


_HEADER_TIMEOUT_BODY = json.dumps({"error": {
    "message": "The request's headers did not arrive in time.", "type": "invalid_request_error", "param": None,
    "code": "header_timeout"}}).encode()
_HEADER_TIMEOUT_ANSWER = (b"HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json\r\nConnection: close\r\n"
                          b"Content-Length: %d\r\n\r\n%b" % (len(_HEADER_TIMEOUT_BODY), _HEADER_TIMEOUT_BODY))
_ABORT_AFTER_S = 1.0  # a closed connection whose 408 cannot be flushed is aborted after this


class HeaderTimeoutHandler(RequestHandler):
    """aiohttp's connection protocol with a header-read timeout (one loop timer per connection).

    The timer runs while the connection waits for a request head: from ``connection_made`` for the
    first request, and from the first byte of each later request on a kept-alive connection; a
    complete head (or one aiohttp's parser refuses, which it answers 400) stops it. An idle kept-alive
    connection between requests is not timed here (aiohttp's ``keepalive_timeout`` closes it), nor is a
    body (:func:`read_body`'s timeout: 408). When the timer fires first, the client gets ``408`` with
    OpenAI's error JSON (code ``header_timeout``) and the connection is closed (aborted when even that
    cannot be flushed within 1 s). Built by :class:`HeaderTimeoutServer`; ``header_timeout_s`` wall s.
    """

    __slots__ = ("_fb_header_s", "_fb_header_timer")

    def __init__(self, *args: Any, header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._fb_header_s = header_timeout_s
        self._fb_header_timer: asyncio.TimerHandle | None = None

    def _fb_arm(self) -> None:
        self._fb_header_timer = self._loop.call_later(self._fb_header_s, self._fb_expire)

    def _fb_disarm(self) -> None:
        if self._fb_header_timer is not None:
            self._fb_header_timer.cancel()
            self._fb_header_timer = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._fb_arm()

    def data_received(self, data: bytes) -> None:
        parsed = self._request_count
        super().data_received(data)
        if self._request_count != parsed:  # a head is complete (or refused by the parser): not slow
            self._fb_disarm()
        elif (data and self._fb_header_timer is None and not self._request_in_progress and not self._messages
              and not self._force_close and not self._close):  # fmt: skip
            self._fb_arm()  # the first bytes of a next request on a kept-alive connection

    def connection_lost(self, exc: BaseException | None) -> None:
        self._fb_disarm()
        super().connection_lost(exc)

    def _fb_expire(self) -> None:
        self._fb_header_timer = None
        transport = self.transport
        if transport is None or self._request_in_progress or self._messages:
            return  # closed already, or a head arrived and is being served
        log.debug("closing a connection whose request head did not arrive within %g s", self._fb_header_s)
        self._force_close = True
        try:
            transport.write(_HEADER_TIMEOUT_ANSWER)  # type: ignore[attr-defined]
        except (ConnectionError, RuntimeError):
            pass
        transport.close()
        self._loop.call_later(_ABORT_AFTER_S, transport.abort)  # type: ignore[attr-defined]  # no-op once closed


class HeaderTimeoutServer(web.Server):
    """aiohttp's low-level ``Server`` (the protocol factory a site listens with) whose connections are
    :class:`HeaderTimeoutHandler` objects; :class:`GuardedRunner` swaps its class in."""

    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S

    def __call__(self) -> RequestHandler:
        return HeaderTimeoutHandler(self, loop=self._loop, header_timeout_s=self.header_timeout_s, **self._kwargs)


class GuardedRunner(web.AppRunner):
    """``web.AppRunner`` whose server is a :class:`HeaderTimeoutServer` with ``header_timeout_s``
    (wall seconds, > 0)."""

    def __init__(self, app: web.Application, *, header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
                 **kwargs: Any) -> None:
        if not header_timeout_s > 0:
            raise ValueError(f"header_timeout_s must be > 0, got {header_timeout_s!r}")
        super().__init__(app, **kwargs)
        self._fb_header_s = header_timeout_s

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        # Application._make_handler builds a plain Server; the subclass adds only __call__ (no state)
        server.__class__ = HeaderTimeoutServer
        server.header_timeout_s = self._fb_header_s  # type: ignore[attr-defined]
        return server


def make_runner(app: web.Application, *, header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
                **kwargs: Any) -> web.AppRunner:
    """A :class:`GuardedRunner` (header-read timeout ``header_timeout_s`` wall s) with
    ``handler_cancellation=True, auto_decompress=False, access_log=None, keepalive_timeout=75``
    unless ``kwargs`` say otherwise."""
    opts: dict[str, Any] = {"handler_cancellation": True, "auto_decompress": False, "access_log": None,
                            "keepalive_timeout": DEFAULT_KEEPALIVE_S}
    opts.update(kwargs)
    return GuardedRunner(app, header_timeout_s=header_timeout_s, **opts)


OFF_LOOP_BYTES = 64 * 1024
"""Bodies at least this large are checked in the worker thread (:func:`off_loop`): about 9,000 token ids,
whose checks take ~1 ms on the loop; below it a thread hop would cost more than it saves."""
_T = TypeVar("_T")
_BODY_POOL: concurrent.futures.ThreadPoolExecutor | None = None


async def off_loop(size: int, fn: Callable[..., _T], *args: Any) -> _T:
    """``fn(*args)``: inline when ``size`` (the body's bytes) is under :data:`OFF_LOOP_BYTES`, else in
    one worker thread of the process (one: the GIL lets only one thread run Python at a time, and the
    loop must get it back between the worker's C-level passes; fairbatch_common/api_schema.py checks
    long lists in slices for this). ``fn`` must be pure (it runs on another thread). Exceptions of
    ``fn`` propagate. A cancelled caller leaves the check to finish in the thread (bounded: the body is
    at most ``http.max_body_bytes``)."""
    if size < OFF_LOOP_BYTES:
        return fn(*args)
    global _BODY_POOL
    if _BODY_POOL is None:
        _BODY_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="fairbatch-body")
    return await asyncio.get_running_loop().run_in_executor(_BODY_POOL, fn, *args)


def client_request_id(value: str | None) -> str | None:
    """The client's ``x-request-id`` when it is 1-128 printable ASCII characters without spaces, else None
    (never echoed into a header or a log line otherwise)."""
    if value and _CLIENT_ID.fullmatch(value):
        return value
    return None


def new_request_id() -> str:
    """A fresh id: 16 random bytes (``os.urandom``) as 32 lower-case hex characters, the length and
    alphabet of a uuid4's hex (without its version bits, at a sixth of its cost)."""
    return os.urandom(16).hex()


async def read_body(request: web.Request, max_bytes: int, timeout_s: float) -> bytes:
    """The whole request body, bounded in size and time.

    Args:
        request: the aiohttp request (its ``client_max_size`` should be >= ``max_bytes``).
        max_bytes: largest body accepted (bytes).
        timeout_s: wall seconds the whole body may take to arrive.

    Raises:
        ApiError: 413 ``body_too_large`` (by ``Content-Length`` before reading, or while reading a
            chunked body), 415 ``unsupported_content_encoding``, 408 ``body_timeout``, 400
            ``body_incomplete`` when the body breaks off.
    """
    encoding = request.headers.get("Content-Encoding", "").strip().lower()
    if encoding not in ("", "identity"):
        raise ApiError(415, "Content-Encoding is not supported; send the JSON body uncompressed.", None,
                       "unsupported_content_encoding")
    length = request.content_length
    if length is not None and length > max_bytes:
        raise ApiError(413, f"The body ({length} bytes) is larger than the limit of {max_bytes} bytes.", None,
                       "body_too_large")
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                chunk = await request.content.readany()
                if not chunk:
                    break
                size += len(chunk)
                if size > max_bytes:
                    raise ApiError(413, f"The body is larger than the limit of {max_bytes} bytes.", None,
                                   "body_too_large")
                chunks.append(chunk)
    except TimeoutError:
        raise ApiError(408, f"The body did not arrive within {timeout_s:g} s.", None, "body_timeout") from None
    except (RequestPayloadError, HttpProcessingError, ConnectionError, OSError) as exc:
        raise ApiError(400, f"The body could not be read ({type(exc).__name__}).", None, "body_incomplete") from None
    return b"".join(chunks)


def json_error(status: int, message: str, err_type: str, code: Any, param: str | None = None,
               headers: dict[str, str] | None = None) -> web.Response:
    """An OpenAI-format error response ``{"error": {"message", "type", "param", "code"}}``."""
    body = json.dumps({"error": {"message": message, "type": err_type, "param": param, "code": code}})
    return web.Response(status=status, text=body, content_type="application/json", headers=headers)


def api_error_response(exc: ApiError, headers: dict[str, str] | None = None) -> web.Response:
    """The response for an :class:`ApiError`."""
    return json_error(exc.status, exc.message, exc.err_type, exc.code, exc.param, headers)


def bounded_expect_handler(max_bytes: Callable[[], int]) -> Callable[[web.Request], Awaitable[web.StreamResponse | None]]:
    """An aiohttp route ``expect_handler`` for a body read by :func:`read_body` with ``max_bytes()``.

    ``Expect: 100-continue`` on HTTP/1.1: ``100 Continue`` (what aiohttp's default sends), except
    when the headers already say the body will be refused (``Content-Length`` over the limit, a
    ``Content-Encoding``): then no interim answer, the handler runs and answers 413 or 415 unread,
    and a client that waits for the 100 never uploads the body (RFC 9110 section 10.1.1: a server
    may send the final status instead). Any other ``Expect`` value: 417 ``expectation_failed`` in
    OpenAI's error JSON. HTTP/1.0: nothing (as aiohttp's default).

    Args:
        max_bytes: returns the body limit now (bytes; a reloaded configuration may change it).
    """

    async def handler(request: web.Request) -> web.StreamResponse | None:
        if request.version != HttpVersion11:
            return None
        expect = request.headers.get("Expect", "")
        if expect.strip().lower() != "100-continue":
            return json_error(417, "Only 'Expect: 100-continue' is supported.", "invalid_request_error",
                              "expectation_failed")
        length = request.content_length
        encoding = request.headers.get("Content-Encoding", "").strip().lower()
        if (length is not None and length > max_bytes()) or encoding not in ("", "identity"):
            return None  # read_body refuses it from the headers: that answer is final, no 100 first
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # the interim answer is not the response's body
        return None

    return handler


def error_middleware(
    name: str, not_found: Callable[[str, str], web.StreamResponse] | None = None
) -> Callable[[web.Request, Any], Awaitable[web.StreamResponse]]:
    """The middleware that makes every error answer OpenAI JSON (see the module docstring).

    Args:
        name: the server's name in the 500 message and log (``router``, ``agent``).
        not_found: the answer to a path no route serves, from (method, path); None: 404 JSON naming
            the path (the router names what it serves instead: router/openai_surface.py ``unsupported``).
    """

    @web.middleware
    async def middleware(request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            if not_found is not None and isinstance(exc, web.HTTPNotFound):
                return not_found(request.method, request.path)
            text = exc.text or ""
            if not text or text.startswith(f"{exc.status}:"):  # aiohttp's default body, e.g. "404: Not Found"
                text = f"{exc.reason}: {request.method} {request.path}"
            headers = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
            return json_error(exc.status, text, "invalid_request_error", exc.status, headers=headers)
        except ApiError as exc:
            return api_error_response(exc)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - our own bug: answer JSON, log it once
            rid = request.get(REQUEST_ID) or new_request_id()
            request[REQUEST_ID] = rid
            log.error("%s: internal error on %s %s (request %s): %s", name, request.method, request.path, rid,
                      type(exc).__name__, exc_info=exc)
            return json_error(500, f"Internal error in the {name} (request id {rid}).", "internal_error", 500,
                              headers={"x-request-id": rid})

    return middleware
