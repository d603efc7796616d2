"""aiohttp reverse proxy in front of the engine (proxy mode of the replica agent).

Relays ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``POST /tokenize`` and ``POST /detokenize`` to the engine (error bodies in fairbatch's vocabulary,
fairbatch_common/openai_errors.py); serves ``GET /health`` (200 when the engine's /health answers
200, else 503) and ``GET /metrics`` (the agent's own registry, ``fairbatch_agent_*``).

Stream requests: the engine's bytes go to the client unchanged as they arrive; each SSE event is
read on the side to timestamp tokens: the plain one-choice token chunk is counted from its bytes
(``openai_stream.fast_event_tokens``), every other event (first chat chunk, finish, usage, errors,
logprobs, tools, ``n > 1``) is parsed with orjson and counted field by field
(fairbatch_common/openai_stream.py; the final ``usage`` corrects the counts). Non-stream
requests go upstream unchanged (still non-stream) and the engine's answer goes back byte for byte;
the agent tracks them in prefill until the answer arrives and reads ``usage`` from it
(docs/architecture.md "Non-stream requests" says why, with the measured cost). Headers honoured
(docs/architecture.md "Agent"): ``x-request-id`` (forwarded),
``x-fairbatch-lease`` (consumed), ``x-fairbatch-admit`` (inline admission: the Reserve decision
made on arrival, 409 ``x-fairbatch-refused`` when the budget is gone), ``x-fairbatch-direct`` (a
baseline placement profile's request: admitted as it is, like any request without a lease; the
span says so), ``x-fairbatch-queue-cap`` (``static-queue-cap``: 409 ``x-fairbatch-refused: queue-cap``
while the agent has work and its queued prompt tokens plus this prompt exceed the cap,
replica_agent/policy/queue_cap.py), ``x-fairbatch-slo-class``, ``x-fairbatch-queued-ms`` (arrival =
now - queued), ``x-fairbatch-tenant`` (logs/spans only), ``traceparent``/``tracestate`` (a child
span is created and injected upstream). Upstream, the agent adds ``x-fairbatch-ttft-ms`` and
``x-fairbatch-tpot-ms``: the SLO of the request's class, for deadline-aware engine policies.

Failure handling: client disconnect (the server runs with handler cancellation,
:func:`fairbatch_common.http_guard.make_runner`) -> the handler is cancelled wherever it waits, the upstream
request or response closed (the engine aborts, also before its first byte) and the request dropped
from the tracker; engine failure mid-stream -> ``data: {"error": {...}}`` then
``data: [DONE]`` and the request dropped; upstream 4xx/5xx before streaming -> status and body
relayed.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from aiohttp.http import HttpVersion11
from opentelemetry import trace
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from replica_agent.agent import Agent
from replica_agent.drainer import Drainer
from fairbatch_common.aio import FirstChunkStreamResponse
from fairbatch_common.api_schema import ApiError, is_token_ids, validate_request
from fairbatch_common.http_guard import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_MAX_BODY_BYTES,
    REQUEST_ID,
    api_error_response,
    client_request_id,
    error_middleware,
    new_request_id,
    off_loop,
    read_body,
)
from fairbatch_common.openai_errors import map_engine_error, sse_error_event
from fairbatch_common.openai_stream import (
    fast_event_tokens,
    finish_reasons,
    generated_tokens,
    requested_choices,
    usage_counts,
)
from fairbatch_common.stall import default_stall_ms
from fairbatch_common.telemetry import extract_context, genai_request_attributes, inject_context, set_http_status
from replica_agent.policy.queue_cap import QUEUE_CAP_REASON, over_queue_cap, queued_prompt_tokens
from replica_agent.tracker import TrackerFull
from fairbatch_common.upstream import (
    ClientSink,
    ClientStalled,
    Exchange,
    Http1Pool,
    UpstreamDisconnected,
    UpstreamError,
    end_stream,
)

log = logging.getLogger(__name__)

BYTES_PER_TOKEN = 4
CHAT_TOKENS_PER_MESSAGE = 4
_DISCONNECT_POLL_S = 0.05
_FORWARDED_HEADERS = ("authorization", "accept")


def _ceil_bytes_tokens(text: str) -> int:
    return math.ceil(len(text.encode("utf-8", "surrogatepass")) / BYTES_PER_TOKEN)


def with_slo_xargs(body: Mapping[str, Any], ttft_ms: float, tpot_ms: float) -> dict[str, Any]:
    """A copy of an OpenAI request body whose ``vllm_xargs`` also carries the request's SLO (ms).

    vLLM (0.32.0) copies ``vllm_xargs`` into ``SamplingParams.extra_args``, where the FairBatching
    scheduler plugin reads ``fairbatch_ttft_ms`` and ``fairbatch_tpot_ms``; other keys the client
    put in ``vllm_xargs`` are kept.
    """
    xargs = body.get("vllm_xargs")
    merged = {**(xargs if isinstance(xargs, dict) else {}), "fairbatch_ttft_ms": ttft_ms, "fairbatch_tpot_ms": tpot_ms}
    return {**body, "vllm_xargs": merged}


def estimate_prompt_tokens(body: Mapping[str, Any], chat: bool) -> int:
    """Prompt tokens of an OpenAI request body, for requests that arrive without a lease.

    Completions: exact for token-id lists (``[1, 2]`` or ``[[1, 2]]``), else ceil(utf-8 bytes / 4)
    of the prompt text(s). Chat: ceil(utf-8 bytes / 4) of the concatenated message contents (text
    parts of list contents), plus 4 per message. Unrecognised shapes count 0 (the engine rejects
    them; ``usage`` corrects any estimate).
    """
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list):
            return 0
        texts: list[str] = []
        for m in messages:
            content = m.get("content") if isinstance(m, Mapping) else None
            if isinstance(content, str):
                texts.append(content)
            elif isinstance(content, list):
                texts.extend(p["text"] for p in content if isinstance(p, Mapping) and isinstance(p.get("text"), str))
        return _ceil_bytes_tokens("".join(texts)) + CHAT_TOKENS_PER_MESSAGE * len(messages)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return _ceil_bytes_tokens(prompt)
    if isinstance(prompt, list) and prompt:
        if is_token_ids(prompt):
            return len(prompt)
        total = 0
        for p in prompt:
            if isinstance(p, str):
                total += _ceil_bytes_tokens(p)
            elif isinstance(p, list):
                total += len(p)
        return total
    return 0


@dataclass(slots=True)
class SseParser:
    """Incremental parser of an OpenAI SSE stream (``data: {json}\\n\\n`` ... ``data: [DONE]``).

    :meth:`feed_raw` takes raw bytes as they arrive (events may straddle chunks) and returns the
    ``data:`` payloads (bytes, JSON not parsed) of the events completed by them; :meth:`feed` the
    parsed JSON objects. ``done`` turns True at ``[DONE]``.
    """

    done: bool = False
    _buf: bytearray = field(default_factory=bytearray)

    def feed_raw(self, chunk: bytes) -> list[bytes]:
        """The payloads of the events completed by ``chunk`` (one per ``data:`` line, ``[DONE]`` left out)."""
        if not self._buf and chunk.startswith(b"data:") and chunk.find(b"\n") == len(chunk) - 2 \
                and chunk.endswith(b"\n\n"):
            # one whole one-line event, nothing pending: what an engine writes per token (the split below
            # gives the same answer)
            payload = chunk[5:-2].strip()
            if payload == b"[DONE]":
                self.done = True
                return []
            return [payload] if payload else []
        if self._buf:
            self._buf += chunk
            data = bytes(self._buf)
            self._buf.clear()
        else:
            data = chunk
        events = data.split(b"\n\n")
        rest = events.pop()  # b"" when the chunk ended on an event boundary
        if rest:
            self._buf += rest
        out: list[bytes] = []
        for event in events:
            for line in event.split(b"\n") if b"\n" in event else (event,):
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()  # also drops a trailing \r
                if payload == b"[DONE]":
                    self.done = True
                elif payload:
                    out.append(payload)
        return out

    def feed(self, chunk: bytes) -> list[dict[str, Any]]:
        """Parse the events completed by ``chunk``; malformed JSON events are skipped."""
        out: list[dict[str, Any]] = []
        for payload in self.feed_raw(chunk):
            try:
                obj = orjson.loads(payload)
            except orjson.JSONDecodeError:
                continue
            if isinstance(obj, dict):
                out.append(obj)
        return out


def content_tokens(event: Mapping[str, Any]) -> int:
    """Generated tokens in one parsed SSE chunk, every choice and field counted
    (:func:`fairbatch_common.openai_stream.generated_tokens`; kept under its old name)."""
    return generated_tokens(event)


def error_json(status: int, message: str, err_type: str = "upstream_error") -> web.Response:
    """OpenAI-style error response ``{"error": {"message", "type", "param", "code"}}``."""
    return web.json_response(
        {"error": {"message": message, "type": err_type, "param": None, "code": status}}, status=status
    )


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    """Proxy settings.

    Attributes:
        engine_url: base URL of the engine, e.g. ``http://127.0.0.1:8000``.
        max_connections: bound of the pooled upstream connector.
        connect_timeout_s: wall seconds to open an upstream connection.
        read_timeout_s: wall seconds of silence tolerated between upstream chunks.
        health_timeout_s: wall seconds for the engine's /health.
        keepalive_timeout_s: wall seconds an idle pooled connection is kept; below the engine's own
            keep-alive (vLLM's uvicorn closes idle connections after 5 s), so the agent does not
            pick a connection the engine is closing.
        stale_retries: times a request is re-sent on another connection when the engine dropped a
            kept-alive one before answering (aiohttp ``ServerDisconnectedError`` or ``ClientOSError``
            "Can not write request body"; never for a refused connection). Real vLLM does this under
            load: 13 of 62 requests of 32 topped-up streams on one CPU replica failed so.
        max_body_bytes: bound on request bodies (bytes): a larger ``Content-Length`` is refused with 413
            before reading.
        body_timeout_s: wall seconds a request body may take to arrive (else 408).
        stall_timeout_s: wall seconds without a byte from the engine (response headers, then between
            chunks) after which the request is given up as stalled; None = from the request's SLO class,
            :func:`default_stall_ms` (converted with the agent's clock). A stall ends a stream with the SSE
            error event, answers a non-stream request 502 (the router retries it elsewhere: nothing was
            sent), and marks the agent unhealthy until the engine's /metrics answers again.
        class_stall_ms: ``(class, stall timeout in simulated ms)`` pairs from the classes'
            ``stall_timeout_ms`` in the router YAML; used when ``stall_timeout_s`` is None.
        agent_token: shared secret of router and agent: when set, ``POST /v1/*`` and ``GET /v1/models``
            need the header ``x-fairbatch-token`` with it (else 401); /health and /metrics stay open.
        engine_api_key: sent to the engine as ``Authorization: Bearer <key>`` (vLLM ``--api-key``),
            replacing any the client sent; None = the client's Authorization is forwarded.
        slo_in_body: also pass the request's SLO in the body as vLLM's ``vllm_xargs``
            (``{"fairbatch_ttft_ms", "fairbatch_tpot_ms"}``), which vLLM hands to the scheduler as
            ``SamplingParams.extra_args``: needed by the FairBatching scheduler plugin
            (replica_agent/vllm_plugin.py), since HTTP headers do not reach vLLM's scheduler. The
            body is then re-encoded; off by default, so the bytes go upstream unchanged.
        drain_grace_s: wall seconds in-flight requests may run on after a drain began before they
            are handed over (replica_agent/policy/drain.py).
        drain_handover_s: wall seconds after the hand-over before a drain ends anyway.
    """

    engine_url: str
    max_connections: int = 1024
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 600.0
    health_timeout_s: float = 2.0
    keepalive_timeout_s: float = 4.0
    stale_retries: int = 2
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    slo_in_body: bool = False
    stall_timeout_s: float | None = None
    class_stall_ms: tuple[tuple[str, float], ...] = ()
    agent_token: str | None = field(default=None, repr=False)
    engine_api_key: str | None = field(default=None, repr=False)
    drain_grace_s: float = 30.0
    drain_handover_s: float = 5.0


HANDOVER_TYPE = "replica_draining"
"""The ``error.type`` of the event that ends a stream a draining agent hands over (and of its 503
answers): router/migration.py continues such a stream elsewhere, cause ``drain``."""
HANDOVER_MESSAGE = "replica draining: stream handed over"
DRAIN_RETRY_AFTER_S = 1
"""``Retry-After`` of a draining agent's 503 (wall s): its replacement, or another replica, will answer."""


class HandedOver(Exception):
    """Raised into an open engine exchange when the draining agent hands its requests over."""


def draining_response(request_id: str) -> web.Response:
    """503 ``replica_draining`` with ``Retry-After``: a draining agent takes no new work, and a non-stream
    request it hands over is answered so (the router re-issues it on another replica)."""
    return web.json_response(
        {"error": {"message": "replica draining: not taking new requests", "type": HANDOVER_TYPE, "param": None,
                   "code": 503}},
        status=503, headers={"Retry-After": str(DRAIN_RETRY_AFTER_S), "x-request-id": request_id},
    )


def engine_wide_stall(silent_s: float | None, stall_s: float) -> bool:
    """Whether a request's stall (``stall_s`` wall seconds without a byte) says the engine itself stopped:
    its /metrics has not answered for ``silent_s`` wall seconds (None: never answered yet) >= half the
    stall timeout. A live engine answers the scrape every 50 ms, so a request silent that long while the
    scrapes answer is that request's problem (a prefill longer than predicted, a stuck sequence), not
    the replica's; marking the replica unhealthy for it turned one long prompt into a replica outage.
    A SIGSTOPped or hung engine stops answering both, and is marked."""
    return silent_s is None or silent_s >= 0.5 * stall_s


class EngineStalled(Exception):
    """No byte from the engine within the stall timeout.

    Attributes:
        timeout_s: the timeout that passed (wall seconds).
    """

    def __init__(self, timeout_s: float) -> None:
        super().__init__(f"engine sent nothing for {timeout_s:g} s")
        self.timeout_s = timeout_s


class StallWatch:
    """The stall rule of one engine stream, on one loop timer for the whole stream (not a timer per chunk).

    The silence since the last chunk is measured in slices of ``stall_s / 4``; a slice that lasted
    more than twice its length counts as two: the agent itself did not run then (SIGSTOP, a blocked
    loop, a starved machine), which says nothing about the engine. Without this, an agent resumed
    after 12 s paused ended its healthy streams as stalled before reading the bytes waiting on their
    sockets (seen in the real-vLLM kill test). The reader calls :meth:`saw_chunk` per chunk (one
    clock read); the timer, when it fires, restarts its slice from the last chunk, or adds the slice
    to the silence, and calls ``on_stall(EngineStalled(stall_s))`` once the silence reaches
    ``stall_s`` (the proxy fails the pending upstream read with it). :meth:`close` stops it.

    Two things are not the engine's silence: the ``grace_s`` before the first chunk (the predicted
    rest of the request's prefill: a long prompt sends nothing until its prefill ends, issue 30), and
    any time while ``held()`` is True. The proxy's ``held`` is True while the client is not reading
    (the relay stopped reading the engine: the engine is waiting on us) and while requests wait in the
    engine's queue and it produces tokens for others (``Agent.engine_queue_moving``): this request may
    then be one of the waiting (a full KV cache, a preemption), bounded by the upstream read timeout;
    a request silent while nothing waits is stuck and still ends at the stall timeout. Before
    that rule, requests re-routed to a survivor busy with continued streams were ended as stalled
    after 12 s in its queue (a real-vLLM CI failure).

    Args:
        stall_s: wall seconds of silence, while the agent runs, that make a stall.
        on_stall: called once, from the loop, with the :class:`EngineStalled` to raise.
        grace_s: wall seconds from now before silence starts counting (>= 0), ended early by a chunk.
        held: returns True while the silence is not the engine's (None: never).
    """

    __slots__ = ("_loop", "_slice", "_stall_s", "_on_stall", "_silent", "_mark", "_last", "_handle", "_held",
                 "_grace")

    def __init__(self, stall_s: float, on_stall: Callable[[EngineStalled], None], grace_s: float = 0.0,
                 held: Callable[[], bool] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        self._slice = stall_s / 4.0
        self._stall_s = stall_s
        self._on_stall = on_stall
        self._held = held
        self._silent = 0.0
        now = self._loop.time()
        self._grace = grace_s > 0
        self._mark = now + max(0.0, grace_s)  # start of the slice being timed
        self._last = now  # last chunk seen
        self._handle: asyncio.TimerHandle | None = self._loop.call_at(self._mark + self._slice, self._check)

    def saw_chunk(self) -> None:
        """A chunk arrived: the silence restarts now (a grace still running ends)."""
        now = self._last = self._loop.time()
        if self._grace:
            self._grace = False
            if self._mark > now and self._handle is not None:
                self._handle.cancel()
                self._mark = now
                self._handle = self._loop.call_at(now + self._slice, self._check)

    def close(self) -> None:
        """Stop watching (the stream ended, either way)."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _check(self) -> None:
        now = self._loop.time()
        self._grace = False
        if self._held is not None and self._held():  # the relay holds the engine back: not its silence
            self._silent, self._mark = 0.0, now
        elif self._last > self._mark:  # a chunk within this slice: time a new slice from it
            self._silent, self._mark = 0.0, self._last
        else:
            self._silent += min(now - self._mark, 2.0 * self._slice)
            if self._silent >= self._stall_s - 1e-9:
                self._handle = None
                self._on_stall(EngineStalled(self._stall_s))
                return
            self._mark = now
        self._handle = self._loop.call_at(self._mark + self._slice, self._check)


class _EnginePipe:
    """One engine stream's token accounting, and its relay to the router after the first chunk.

    :meth:`feed` splits a chunk into its SSE payloads (JSON not parsed); :meth:`count` then feeds the
    tracker: nearly every token event is counted from its bytes (``fast_event_tokens``), the first,
    finish, usage and error events are parsed. :meth:`on_chunk` is the :meth:`Exchange.pipe` sink:
    it writes the chunk to the router first (:class:`ClientSink`), then counts it; the chunk that ends
    with ``[DONE]`` is kept in :attr:`last` for ``write_eof``.
    """

    __slots__ = ("agent", "key", "finished", "watch", "parser", "client", "last", "gone", "error")

    def __init__(self, agent: Agent, key: str, finished: list[str] | None, watch: StallWatch) -> None:
        self.agent = agent
        self.key = key
        self.finished = finished
        self.watch = watch
        self.parser = SseParser()
        self.client: ClientSink | None = None
        self.last: bytes | None = None
        self.gone = False  # the router's connection closed
        self.error = ""  # why the stream failed, when it did (an error event, a stall, a broken read)

    @property
    def done(self) -> bool:
        """The engine sent ``[DONE]``."""
        return self.parser.done

    def feed(self, chunk: bytes) -> list[bytes]:
        """The payloads of the events ``chunk`` completes (the stall watch sees the chunk)."""
        self.watch.saw_chunk()
        return self.parser.feed_raw(chunk)

    def count(self, payloads: list[bytes], now_ms: float) -> None:
        """Feed the payloads' tokens, finish reasons, usage and errors to the tracker (at ``now_ms``)."""
        agent = self.agent
        for payload in payloads:
            n = fast_event_tokens(payload)  # nearly every token chunk: counted from its bytes
            if n is None:  # first, finish, usage, error, logprobs, tools: parsed
                try:
                    event = orjson.loads(payload)
                except orjson.JSONDecodeError:
                    continue
                if not isinstance(event, dict):
                    continue
                n = generated_tokens(event)
                if self.finished is not None:
                    self.finished.extend(finish_reasons(event))
                counts = usage_counts(event)
                if counts is not None:
                    agent.request_usage(self.key, *counts)
                if "error" in event and not self.error:
                    self.error = "engine sent an error event"
            if n:
                agent.request_tokens(self.key, now_ms, n)

    def on_chunk(self, chunk: bytes) -> bool:
        now = self.agent.clock.now_ms()
        payloads = self.feed(chunk)  # splits the bytes only; parsed after the write
        if self.parser.done:
            self.last = chunk
            self.count(payloads, now)
            return True
        assert self.client is not None
        if not self.client.send(chunk):
            self.gone = True
            return True
        self.count(payloads, now)
        return False


def make_session(config: ProxyConfig) -> aiohttp.ClientSession:
    """The one pooled upstream session (bounded connector, timeouts, bytes not decompressed)."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(
            limit=config.max_connections, limit_per_host=config.max_connections,
            keepalive_timeout=config.keepalive_timeout_s,
        ),
        timeout=aiohttp.ClientTimeout(
            total=None, sock_connect=config.connect_timeout_s, sock_read=config.read_timeout_s
        ),
        auto_decompress=False,
    )


class Proxy:
    """Request handlers; ``session`` is owned by the caller (created inside the running loop).

    Args:
        agent: the agent whose tracker the requests feed.
        config: proxy settings.
        session: pooled upstream session (:func:`make_session`).
        tracer: OpenTelemetry tracer (``make_tracer("fairbatch-agent")``).
    """

    def set_class_stall_ms(self, pairs: tuple[tuple[str, float], ...]) -> None:
        """New per-class stall timeouts (simulated ms) after a config reload; requests already relaying
        keep theirs."""
        self._cfg = replace(self._cfg, class_stall_ms=tuple(pairs))

    def __init__(self, agent: Agent, config: ProxyConfig, session: aiohttp.ClientSession, tracer: trace.Tracer) -> None:
        self._agent = agent
        self._cfg = config
        self._session = session
        # generation requests: their streamed chunks are relayed from the engine socket's read callback
        self._pool = Http1Pool(max_per_host=config.max_connections, keepalive_s=config.keepalive_timeout_s,
                               connect_timeout_s=config.connect_timeout_s, read_timeout_s=config.read_timeout_s)
        self._tracer = tracer
        self._base = config.engine_url.rstrip("/")
        self._key_counter = 0
        self._open: dict[str, Exchange] = {}  # tracker key -> its engine exchange (the drain's hand-over)
        self._handed_over = False  # the hand-over ran: an exchange opened later is ended at once
        self.drainer = Drainer(agent, self.hand_over, config.drain_grace_s, config.drain_handover_s)

    @property
    def pool(self) -> Http1Pool:
        """The keep-alive HTTP/1.1 pool to the engine (generation requests; the /metrics scrape too)."""
        return self._pool

    def app(self) -> web.Application:
        """The aiohttp application with all routes."""
        app = web.Application(client_max_size=self._cfg.max_body_bytes + 1, middlewares=[error_middleware("agent")])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/tokenize", self.utility)
        app.router.add_post("/detokenize", self.utility)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        self.add_drain_routes(app)
        app.on_cleanup.append(self._close_pool)
        return app

    async def _close_pool(self, app: web.Application) -> None:
        await self._pool.close()

    # ---- drain (replica_agent/drainer.py) --------------------------------------------------
    def add_drain_routes(self, app: web.Application) -> None:
        """``POST /drain`` and ``GET /drain`` on ``app`` (also the ``--no-proxy`` app)."""
        app.router.add_post("/drain", self.drain)
        app.router.add_get("/drain", self.drain_status)

    def _drain_state(self) -> dict[str, Any]:
        return {"state": self.drainer.state, "in_flight": self.drainer.in_flight()}

    async def drain(self, request: web.Request) -> web.Response:
        """POST /drain: begin the drain (agent token required when one is set); 202 with the state, or
        with ``?wait=1`` (a preStop hook), 200 once the drain is done."""
        refused = self._token_refusal(request)
        if refused is not None:
            return refused
        self.drainer.start()
        if request.query.get("wait") not in (None, "", "0", "false"):
            await self.drainer.done.wait()
            return web.json_response(self._drain_state(), status=200)
        return web.json_response(self._drain_state(), status=202)

    async def drain_status(self, request: web.Request) -> web.Response:
        """GET /drain: ``{"state": "serving" | "draining" | "drained", "in_flight": n}`` (open, like /health)."""
        return web.json_response(self._drain_state())

    def hand_over(self) -> int:
        """End every open engine exchange now (the drain's hand-over): a stream ends with the hand-over
        event (``replica_draining``), a request not answered yet with 503 ``replica_draining``; the engine
        sees its connection closed and aborts. Returns how many were open."""
        self._handed_over = True
        open_now = list(self._open.values())
        for ex in open_now:
            ex.fail(HandedOver())
        return len(open_now)

    # ---- simple endpoints ----------------------------------------------------------------
    def _token_refusal(self, request: web.Request) -> web.Response | None:
        """401 when an agent token is configured and the request does not carry it, else None."""
        token = self._cfg.agent_token
        if not token:
            return None
        presented = request.headers.get("x-fairbatch-token", "")
        if hmac.compare_digest(presented.encode("utf-8", "surrogateescape"), token.encode()):
            return None
        return web.json_response({"error": {"message": "Missing or wrong x-fairbatch-token (this agent takes "
                                                       "requests from its routers only).",
                                            "type": "invalid_request_error", "param": None, "code": "invalid_token"}},
                                 status=401)

    async def models(self, request: web.Request) -> web.Response:
        """Relay GET /v1/models (status and body unchanged)."""
        refused = self._token_refusal(request)
        if refused is not None:
            return refused
        try:
            async with self._session.get(self._base + "/v1/models", headers=self._fwd_headers(request)) as up:
                body = await up.read()
                return web.Response(
                    status=up.status, body=body, headers={"Content-Type": up.headers.get("Content-Type", "application/json")}
                )
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            return self._unreachable(e)

    async def utility(self, request: web.Request) -> web.Response:
        """Relay POST /tokenize and /detokenize (no forward pass, so not tracked): status kept,
        error bodies in fairbatch's vocabulary."""
        refused = self._token_refusal(request)
        if refused is not None:
            return refused
        raw = await read_body(request, self._cfg.max_body_bytes, self._cfg.body_timeout_s)
        headers = {**self._fwd_headers(request), "Content-Type": "application/json"}
        try:
            async with self._session.post(self._base + request.path, data=raw, headers=headers) as up:
                body = await up.read()
                if up.status >= 400:
                    body = map_engine_error(up.status, body)
                return web.Response(
                    status=up.status, body=body, headers={"Content-Type": up.headers.get("Content-Type", "application/json")}
                )
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            return self._unreachable(e)

    async def health(self, request: web.Request) -> web.Response:
        """200 when the engine's /health answers 200 (bounded wait), else 503."""
        try:
            async with self._session.get(
                self._base + "/health", timeout=aiohttp.ClientTimeout(total=self._cfg.health_timeout_s)
            ) as up:
                await up.read()
                ok = up.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            ok = False
        return web.Response(status=200 if ok else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        """The agent's own Prometheus metrics (gauges refreshed now)."""
        self._agent.refresh_gauges(self._agent.clock.now_ms())
        return web.Response(body=generate_latest(self._agent.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    # ---- generation endpoints ------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/completions."""
        return await self._generate(request, "/v1/completions", chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/chat/completions."""
        return await self._generate(request, "/v1/chat/completions", chat=True)

    def _fwd_headers(self, request: web.Request) -> dict[str, str]:
        headers = {h: request.headers[h] for h in _FORWARDED_HEADERS if h in request.headers}
        if self._cfg.engine_api_key:
            headers.pop("authorization", None)
            headers["Authorization"] = f"Bearer {self._cfg.engine_api_key}"
        rid = request.headers.get("x-request-id")
        if rid:
            headers["x-request-id"] = rid
        return headers

    def _tracker_key(self, request_id: str) -> str:
        if request_id not in self._agent.tracker:
            return request_id
        self._key_counter += 1
        return f"{request_id}#{self._key_counter}"

    async def _generate(self, request: web.Request, path: str, chat: bool) -> web.StreamResponse:
        hdrs = request.headers
        request_id = client_request_id(hdrs.get("x-request-id")) or new_request_id()
        request[REQUEST_ID] = request_id
        refused = self._token_refusal(request)
        if refused is not None:
            return refused
        try:
            raw = await read_body(request, self._cfg.max_body_bytes, self._cfg.body_timeout_s)
            # in a worker thread when large: a 200,000-id prompt must not hold the loop (issue 30 item 8)
            valid = await off_loop(len(raw), validate_request, raw, chat, self._agent.max_prompt_tokens)
        except ApiError as exc:
            return api_error_response(exc, {"x-request-id": request_id})
        body = valid.body
        if self._agent.draining:
            return self._draining_refusal(hdrs, request_id)
        try:
            queued_ms = max(0.0, float(hdrs.get("x-fairbatch-queued-ms", "0")))
        except ValueError:
            queued_ms = 0.0
        if not math.isfinite(queued_ms):
            queued_ms = 0.0
        max_tokens = valid.max_tokens  # max_completion_tokens wins over max_tokens (vLLM; api_schema.py)
        if max_tokens is not None:
            max_tokens *= requested_choices(body)  # n sequences, each up to max_tokens
        stream = valid.stream
        agent = self._agent
        key = self._tracker_key(request_id)
        up_headers = self._fwd_headers(request)
        up_headers["x-request-id"] = request_id
        up_headers["Content-Type"] = "application/json"
        with self._tracer.start_as_current_span(
            "agent.relay", context=extract_context(hdrs) if "traceparent" in hdrs else None, kind=trace.SpanKind.SERVER
        ) as span:
            inject_context(up_headers)
            lease_id = hdrs.get("x-fairbatch-lease", "")
            admit = hdrs.get("x-fairbatch-admit")
            prompt_estimate = valid.prompt_ids if valid.prompt_ids is not None else estimate_prompt_tokens(body, chat)
            cap = hdrs.get("x-fairbatch-queue-cap")
            if cap is not None and (capped := self._queue_cap_refusal(cap, prompt_estimate, request_id)) is not None:
                return capped
            if admit is not None:  # inline admission: Reserve now; granted and consumed below, no await between
                got = self._admit_inline(admit, hdrs.get("x-fairbatch-slo-class"), max_tokens, request_id, queued_ms,
                                         hdrs.get("x-fairbatch-on-time") == "1")
                if isinstance(got, web.Response):
                    return got
                lease_id = got
            try:
                tracked = agent.request_arrived(
                    key,
                    hdrs.get("x-fairbatch-slo-class"),
                    prompt_estimate,
                    max_tokens,
                    agent.clock.now_ms(),
                    queued_ms,
                    lease_id,
                )
            except TrackerFull:
                if admit is not None:
                    agent.release(lease_id)
                return error_json(503, "agent is tracking too many requests", "server_overloaded")
            # The engine's deadline-aware policy (sim --policy fairbatching, plugin) reads the class's SLO.
            up_headers["x-fairbatch-ttft-ms"] = f"{tracked.envelope.ttft_ms:g}"
            up_headers["x-fairbatch-tpot-ms"] = f"{tracked.envelope.tpot_ms:g}"
            span.set_attribute("http.request.method", request.method)
            span.set_attribute("url.path", path)
            genai_request_attributes(span, chat, body, valid.max_tokens)
            span.set_attribute("fairbatch.request_id", request_id)
            span.set_attribute("fairbatch.slo_class", tracked.slo_class)
            span.set_attribute("fairbatch.stream", stream)
            span.set_attribute("fairbatch.admission", "inline" if admit is not None else "lease" if lease_id else
                               "direct" if "x-fairbatch-direct" in hdrs else "none")  # fmt: skip
            if "x-fairbatch-tenant" in hdrs:
                span.set_attribute("fairbatch.tenant", hdrs["x-fairbatch-tenant"])
            if self._cfg.slo_in_body:
                body = with_slo_xargs(body, tracked.envelope.ttft_ms, tracked.envelope.tpot_ms)
                try:
                    raw = orjson.dumps(body)  # a 200,000-id prompt: ~2 ms, json.dumps ~20 ms
                except (orjson.JSONEncodeError, TypeError):  # an integer beyond 64 bits (decoded by json.loads)
                    raw = json.dumps(body).encode()
            stall_s = self._cfg.stall_timeout_s or agent.clock.to_wall_s(
                dict(self._cfg.class_stall_ms).get(tracked.slo_class)
                or default_stall_ms(tracked.envelope.ttft_ms, tracked.envelope.tpot_ms))
            outcome = "aborted"
            finished: list[str] = []  # finish_reason of each choice, as the engine reported them
            try:
                if stream:
                    # the stall timer starts where this request's prefill is predicted to end (issue 30: a
                    # 60,000-token prompt was ended by the 3 s timer during its prefill)
                    prefill_s = agent.clock.to_wall_s(agent.predicted_prefill_ms(key, agent.clock.now_ms()))
                    resp, outcome = await self._relay_stream(request, path, raw, up_headers, key, request_id, stall_s,
                                                             finished, prefill_s)
                else:
                    resp, outcome = await self._relay_whole(request, path, raw, up_headers, key, request_id, stall_s,
                                                            finished)
                span.set_attribute("fairbatch.outcome", outcome)
                if finished:
                    span.set_attribute("gen_ai.response.finish_reasons", finished)
                broke = resp.status == 200 and outcome not in ("ok", "client_disconnect")  # failed after its 200
                set_http_status(span, resp.status, outcome if broke else None)
                return resp
            except asyncio.CancelledError:
                # the client left (aiohttp cancelled the handler): the upstream request was closed on the
                # way out, so the engine aborts it, in prefill as well as in decode
                outcome = "client_disconnect"
                raise
            finally:
                self._open.pop(key, None)
                done = agent.request_done(key, agent.clock.now_ms(), outcome)
                if done is not None:  # the engine's usage when it reported one, else the relayed tokens
                    span.set_attribute("gen_ai.usage.input_tokens", done.request.prompt_tokens)
                    span.set_attribute("gen_ai.usage.output_tokens", done.request.tokens_out)
                if done is not None and outcome != "ok":
                    log.info("request %s ended: %s", request_id, outcome)

    @staticmethod
    def _draining_refusal(hdrs: Mapping[str, str], request_id: str) -> web.Response:
        """A request that arrives while the agent drains: with ``x-fairbatch-admit`` the inline
        admission's 409 ``x-fairbatch-refused: draining`` with a zero budget (the router re-places it at
        once), else 503 ``replica_draining`` with ``Retry-After``."""
        if "x-fairbatch-admit" not in hdrs:
            return draining_response(request_id)
        return web.json_response(
            {"error": {"message": "replica draining; place elsewhere", "type": "admission_refused", "param": None,
                       "code": "draining"}},
            status=409, headers={"x-fairbatch-refused": "draining", "x-request-id": request_id,
                                 "x-fairbatch-pab-ms": "0", "x-fairbatch-pab-tokens": "0"},
        )

    def _queue_cap_refusal(self, cap: str, prompt_tokens: int, request_id: str) -> web.Response | None:
        """``x-fairbatch-queue-cap: <tokens>`` (module docstring): None when the request is taken, else
        the 409 refusal with ``x-fairbatch-refused: queue-cap``, which the router answers by trying
        its next candidate. A malformed header is 400."""
        try:
            cap_tokens = int(cap)
        except ValueError:
            cap_tokens = -1
        if cap_tokens < 0:
            return error_json(400, "x-fairbatch-queue-cap must be a non-negative token count", "invalid_request_error")
        tracker = self._agent.tracker
        if not over_queue_cap(queued_prompt_tokens(tracker.prefills()), prompt_tokens, cap_tokens, len(tracker) > 0):
            return None
        return web.json_response(
            {"error": {"message": f"replica queue over its cap ({cap_tokens} prompt tokens); place elsewhere",
                       "type": "admission_refused", "param": None, "code": QUEUE_CAP_REASON}},
            status=409, headers={"x-fairbatch-refused": QUEUE_CAP_REASON, "x-request-id": request_id},
        )

    def _admit_inline(
        self, admit: str, slo_class: str | None, max_tokens: int | None, request_id: str, queued_ms: float,
        on_time_only: bool = False,
    ) -> str | web.Response:
        """The Reserve decision for a request that arrived with ``x-fairbatch-admit: <prompt tokens>``
        (docs/architecture.md "Leases on the request path"): the granted lease id (the caller consumes
        it at once), or the refusal: 409 with ``x-fairbatch-refused: <reason>`` and the class budget
        after the decision (``x-fairbatch-pab-ms``, ``x-fairbatch-pab-tokens``), which the router
        treats as a refused Reserve (it re-places the request). A malformed header is 400.
        ``x-fairbatch-on-time: 1`` asks for a start that meets the TTFT (``on_time_only``)."""
        agent = self._agent
        try:
            prompt_tokens = int(admit)
        except ValueError:
            prompt_tokens = -1
        if prompt_tokens < 0:
            return error_json(400, "x-fairbatch-admit must be a non-negative token count", "invalid_request_error")
        name = slo_class if slo_class in agent.classes else agent.config.default_slo_class
        res = agent.reserve(name, prompt_tokens, max_tokens, request_id, agent.clock.now_ms(), queued_ms,
                            answer_budget=False, on_time_only=on_time_only)
        if res.granted:
            return res.lease_id
        b = res.budget
        return web.json_response(
            {"error": {"message": f"replica budget gone on arrival ({res.reason}); place elsewhere",
                       "type": "admission_refused", "param": None, "code": res.reason}},
            status=409,
            headers={"x-fairbatch-refused": res.reason or "refused", "x-request-id": request_id,
                     "x-fairbatch-pab-ms": f"{b.pab_ms:.3f}" if b else "-1",
                     "x-fairbatch-pab-tokens": str(b.pab_tokens) if b else "-1"},
        )

    async def _open_upstream(
        self, path: str, data: bytes, headers: dict[str, str], stall_s: float | None = None, key: str | None = None,
        grace_s: float = 0.0,
    ) -> Exchange | web.Response:
        """POST to the engine and wait for its answer's head (at most ``grace_s + stall_s`` wall seconds:
        the request's predicted prefill, then the stall timeout): the exchange, or the 502 to answer with. A request whose connection closed before any byte of the
        answer came (the engine closed a kept-alive connection as the request went out) is sent again,
        at most ``stale_retries`` times."""
        resent = 0
        while True:
            try:
                ex = self._pool.exchange("POST", self._base, path, headers, data)
            except ValueError:  # a forwarded header that cannot go on the wire (CR/LF): the client's
                return error_json(400, "a request header cannot be forwarded", "invalid_request_error")
            if key is not None:
                self._open[key] = ex  # the drain's hand-over fails it (until the request ends)
                if self._handed_over:
                    ex.fail(HandedOver())
            try:
                if stall_s is None:
                    await ex.start()
                    return ex
                try:
                    async with asyncio.timeout(grace_s + stall_s):  # in this task: no task of its own per request
                        await ex.start()
                    return ex
                except TimeoutError:
                    self._stalled(EngineStalled(grace_s + stall_s))
                    after = f" after its predicted prefill of {grace_s:.3g} s" if grace_s >= 0.001 else ""
                    return error_json(502, f"engine stalled: no response within {stall_s:g} s{after}")
            except HandedOver:
                ex.close()
                return draining_response(headers.get("x-request-id", ""))
            except UpstreamDisconnected as e:
                if e.answered or resent >= self._cfg.stale_retries:
                    return self._unreachable(e)
                resent += 1
                log.info("engine %s dropped a kept-alive connection (%s: %s); re-sending", self._base,
                         type(e).__name__, e)
            except UpstreamError as e:
                return self._unreachable(e)

    def _stalled(self, e: EngineStalled) -> None:
        """Log a request's stall; mark the engine unhealthy (until its /metrics answers again) only when
        the engine itself stopped answering (:func:`engine_wide_stall`): one request's silence while the
        engine answers its scrapes ends that request alone (issue 30)."""
        silent_ms = self._agent.engine_silent_ms()
        silent_s = None if silent_ms is None else self._agent.clock.to_wall_s(silent_ms)
        if not engine_wide_stall(silent_s, e.timeout_s):
            log.warning("engine %s: a request stalled (%s) while the engine answers; request ended", self._base, e)
            return
        log.warning("engine %s stalled: %s; agent unhealthy until the engine answers again", self._base, e)
        self._agent.engine_stalled(str(e))

    def _unreachable(self, e: BaseException) -> web.Response:
        """502 ``engine unreachable: <exception type>``, and the exception in the log."""
        log.warning("engine %s unreachable: %s: %s", self._base, type(e).__name__, e)
        return error_json(502, f"engine unreachable: {type(e).__name__}")

    @staticmethod
    async def _relay_error_status(up: Exchange, request_id: str) -> web.Response:
        """The engine's error answer, its body in fairbatch's error vocabulary (fairbatch_common/openai_errors.py)."""
        try:
            raw = await up.read()
        except UpstreamError:
            raw = b""
        return web.Response(
            status=up.status,
            body=map_engine_error(up.status, raw),
            headers={"Content-Type": up.headers.get("content-type", "application/json"), "x-request-id": request_id},
        )

    async def _relay_stream(
        self, request: web.Request, path: str, raw: bytes, headers: dict[str, str], key: str, request_id: str,
        stall_s: float, finished: list[str] | None = None, prefill_s: float = 0.0,
    ) -> tuple[web.StreamResponse, str]:
        """Relay a streamed request (module docstring). The engine may stay silent for ``prefill_s``
        (the predicted rest of this request's prefill, wall s) plus ``stall_s`` before its first byte,
        then ``stall_s`` between chunks; a client (the router) that reads nothing for twice
        ``stall_s`` is cut (its own limit, the class's stall timeout, comes first)."""
        up = await self._open_upstream(path, raw, headers, stall_s, key, prefill_s)
        if isinstance(up, web.Response):
            return up, "handed_over" if up.status == 503 else "upstream_unreachable"
        clean = False
        handed = False
        watch: StallWatch | None = None
        try:
            if up.status != 200:
                clean = True
                return await self._relay_error_status(up, request_id), "upstream_error"
            resp = FirstChunkStreamResponse(  # the headers go with the first token: one send, one wake-up
                status=200,
                headers={
                    "Content-Type": up.headers.get("content-type", "text/event-stream"),
                    "Cache-Control": "no-cache",
                    "x-request-id": request_id,
                },
            )
            await resp.prepare(request)
            # a stall fails the exchange with EngineStalled; the prefill's predicted time is not silence, nor is
            # a pause while the router does not read (the engine waits on us then), nor a wait in the engine's
            # queue while it produces tokens for others (this one is queued or preempted there)
            agent = self._agent
            busy_ms = agent.clock.to_sim_ms(stall_s / 4.0) + 2.0 * agent.config.metrics_interval_ms
            watch = StallWatch(stall_s, up.fail, prefill_s, lambda: up.paused or agent.engine_queue_moving(busy_ms))
            pipe = _EnginePipe(self._agent, key, finished, watch)
            try:
                first = await up.readany()  # the first token: the headers go out with it
                if not first:
                    pipe.error = "engine stream ended without [DONE]"
                else:
                    now = self._agent.clock.now_ms()
                    payloads = pipe.feed(first)
                    await (resp.write_eof(first) if pipe.done else resp.write(first))
                    pipe.count(payloads, now)
                if first and not pipe.done:
                    transport = request.transport
                    if transport is None or transport.is_closing():
                        return resp, "client_disconnect"
                    pipe.client = ClientSink(transport, up, request.version >= HttpVersion11, max_pause_s=2.0 * stall_s)
                    await up.pipe(pipe.on_chunk, pipe.client.flush)  # every further chunk written from the engine socket's read
                    if pipe.gone:
                        return resp, "client_disconnect"
                    if pipe.last is not None:  # the last event and the end of the body: one write
                        await end_stream(resp, transport, pipe.last, 2.0 * stall_s)
            except ClientStalled:  # the router read nothing for 2 x stall_s: cut; the engine's request is dropped
                log.info("request %s: the router read nothing for %g s; stream cut", request_id, 2.0 * stall_s)
                return resp, "client_disconnect"
            except EngineStalled as e:
                self._stalled(e)
                pipe.error = pipe.error or f"engine stalled: no byte for {e.timeout_s:g} s"
            except HandedOver:
                handed = True
                pipe.error = HANDOVER_MESSAGE
            except UpstreamError as e:
                pipe.error = pipe.error or f"engine stream failed: {type(e).__name__}"
            except (ConnectionError, aiohttp.ClientConnectionResetError, OSError):
                return resp, "client_disconnect"
            except Exception as e:  # noqa: BLE001 - a bug in the pipe: end this stream, not the agent
                log.exception("engine stream relay failed")
                pipe.error = pipe.error or f"engine stream failed: {type(e).__name__}"
            if pipe.done and not pipe.error:
                clean = True
                return resp, "ok"
            if handed:  # the drain's hand-over (module docstring of replica_agent/drainer.py): the router migrates it
                try:
                    await resp.write(sse_error_event(HANDOVER_MESSAGE, 503, HANDOVER_TYPE))
                    await resp.write_eof()
                except (ConnectionError, aiohttp.ClientConnectionResetError, OSError, RuntimeError):
                    pass
                return resp, "handed_over"
            if not pipe.done:
                upstream_error = pipe.error or "engine stream ended without [DONE]"
                try:
                    await resp.write(sse_error_event(upstream_error))
                    await resp.write_eof()
                except (ConnectionError, aiohttp.ClientConnectionResetError, OSError, RuntimeError):
                    pass
            return resp, "upstream_error"
        finally:
            if watch is not None:
                watch.close()
            if clean:
                up.release()  # back to the pool; the engine's end of body may still be on its way after [DONE]
            else:
                up.close()  # drops the connection: the engine sees the disconnect and aborts

    async def _relay_whole(
        self, request: web.Request, path: str, raw: bytes, headers: dict[str, str], key: str, request_id: str,
        stall_s: float | None = None, finished: list[str] | None = None,
    ) -> tuple[web.StreamResponse, str]:
        """Relay a non-stream request unchanged and the engine's answer byte for byte.

        The request stays in prefill in the tracker until the answer arrives (the engine sends
        nothing, not even its headers, before it is done); then ``usage`` from the answer corrects
        its counts and the caller finishes it. While waiting, the client's connection is checked
        every ``_DISCONNECT_POLL_S`` wall seconds: a client gone cancels the upstream exchange,
        which closes its connection, so the engine aborts the request; outcome ``client_disconnect``.
        A whole answer sends no byte until it is done, so a stall is read from the engine itself: its
        /metrics unanswered for ``stall_s`` wall seconds (the scraper's last success) ends the wait
        with 502 ``engine stalled`` before anything reached the client, and the router retries the
        request on another replica.
        """
        exchange = asyncio.ensure_future(self._whole_exchange(path, raw, headers, key))
        try:
            while True:
                done, _ = await asyncio.wait({exchange}, timeout=_DISCONNECT_POLL_S)
                if done:
                    break
                transport = request.transport
                if transport is None or transport.is_closing():
                    return web.Response(status=499), "client_disconnect"
                silent_ms = self._agent.engine_silent_ms()
                if stall_s is not None and silent_ms is not None and self._agent.clock.to_wall_s(silent_ms) > stall_s:
                    self._stalled(EngineStalled(stall_s))
                    return error_json(502, f"engine stalled: no answer to /metrics for {stall_s:g} s"), "upstream_stalled"
        finally:
            if not exchange.done():
                exchange.cancel()
                await asyncio.gather(exchange, return_exceptions=True)
        result = exchange.result()
        if isinstance(result[0], web.Response):
            return result  # type: ignore[return-value]
        status, content_type, body = result
        resp_headers = {"Content-Type": content_type, "x-request-id": request_id}
        if status != 200:
            body = map_engine_error(status, body)  # one error vocabulary (fairbatch_common/openai_errors.py)
            return web.Response(status=status, body=body, headers=resp_headers), "upstream_error"
        try:
            answer = orjson.loads(body)
        except orjson.JSONDecodeError:
            answer = None
        if isinstance(answer, dict):
            if finished is not None:
                finished.extend(finish_reasons(answer))
            counts = usage_counts(answer)
            if counts is not None:
                self._agent.request_usage(key, *counts)
        return web.Response(status=200, body=body, headers=resp_headers), "ok"

    async def _whole_exchange(
        self, path: str, raw: bytes, headers: dict[str, str], key: str | None = None,
    ) -> tuple[int, str, bytes] | tuple[web.Response, str]:
        """POST upstream and read the whole answer: (status, content type, body), or (a 502
        response, outcome; 503 ``replica_draining`` when the drain handed it over). Cancelled, it
        closes the upstream connection (the engine aborts)."""
        up = await self._open_upstream(path, raw, headers, None, key)
        if isinstance(up, web.Response):
            return up, "handed_over" if up.status == 503 else "upstream_unreachable"
        clean = False
        try:
            body = await up.read()
            clean = True
            return up.status, up.headers.get("content-type", "application/json"), body
        except HandedOver:
            return draining_response(headers.get("x-request-id", "")), "handed_over"
        except UpstreamError as e:
            log.warning("engine %s answer failed: %s: %s", self._base, type(e).__name__, e)
            return error_json(502, f"engine answer failed: {type(e).__name__}"), "upstream_error"
        finally:
            if clean:
                up.release()
            else:
                up.close()  # drops the connection: the engine sees the disconnect and aborts
