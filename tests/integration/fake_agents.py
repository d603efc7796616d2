"""Loopback doubles of the agents and the fleet around a real router (one shared helper, issue 16).

Each fake replica is an in-test grpc.aio AdmissionService (budgets controlled by the test, Reserve
grants when the prompt fits the PAB, Release recorded: :class:`FakeAdmission`) plus an in-test
aiohttp server standing in for the agent's HTTP side (records headers, streams SSE, can fail on
demand: :class:`FakeUpstream`). :class:`LoopbackFleet` starts them and a real
:class:`router.server.Router` on 127.0.0.x and stops everything; the tests of
test_router_fake_agents.py and test_router_discovery.py build their fleets on it.

Time model of every fake replica: a = 10 ms, b = 0.1 ms/token, c = 0; horizon 450 ms.
A prompt of 400 ASCII bytes = 100 tokens -> 20 ms of prefill.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
import grpc
from aiohttp import web
from multidict import CIMultiDict

from proto import admission_pb2, admission_pb2_grpc
from fairbatch_common.http_guard import make_runner
from router.server import Router

API_KEY = "sk-test-acme"
A_MS, B_MS, H_MS = 10.0, 0.1, 450.0
PROMPT = "x" * 400  # 100 tokens


class FakeAdmission(admission_pb2_grpc.AdmissionServiceServicer):
    """Controlled budgets: PAB per class is ``pab_ms`` (same for every class). ``inline_admission``:
    what the snapshots say (True: an agent on the HTTP path, as the real proxy-mode agent)."""

    def __init__(self, replica_id: str, pab_ms: float, ttl_ms: int = 300, push_ms: int = 50,
                 inline_admission: bool = True) -> None:  # fmt: skip
        self.replica_id = replica_id
        self.inline_admission = inline_admission
        self.pab_ms = pab_ms
        self.ttl_ms = ttl_ms
        self.push_s = push_ms / 1000
        self.pushing = True
        self.healthy = True
        self.seq = itertools.count(1)
        self.changed = asyncio.Event()
        self.reserves: list[admission_pb2.ReserveRequest] = []
        self.releases: list[admission_pb2.ReleaseRequest] = []
        self.leases: dict[str, float] = {}
        self.watch_calls = 0

    def set_budget(self, pab_ms: float) -> None:
        self.pab_ms = pab_ms
        self.changed.set()

    def _pab_tokens(self) -> int:
        return max(0, int((self.pab_ms - A_MS) / B_MS)) if self.pab_ms > A_MS else 0

    def snapshot(self) -> admission_pb2.BudgetSnapshot:
        cls = admission_pb2.ClassBudget(
            slo_class="interactive", ttft_ms=500, tpot_ms=50, horizon_ms=H_MS, pab_ms=self.pab_ms,
            pab_tokens=self._pab_tokens(), decode_reservation_ms=H_MS - self.pab_ms,
            kv_free_tokens=100_000, kv_limited_tokens=100_000,
        )
        return admission_pb2.BudgetSnapshot(
            replica_id=self.replica_id, seq=next(self.seq), ttl_ms=self.ttl_ms, healthy=self.healthy,
            coefficients=admission_pb2.TimeModelCoefficients(a_ms=A_MS, b_ms_per_new_token=B_MS),
            classes=[cls], max_prompt_tokens=32768, inline_admission=self.inline_admission,
        )

    async def WatchBudget(self, request, context):  # noqa: N802 - gRPC name
        self.watch_calls += 1
        while True:
            if self.pushing:
                yield self.snapshot()
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), self.push_s)
            except TimeoutError:
                pass

    async def Reserve(self, request, context):  # noqa: N802
        self.reserves.append(request)
        need = A_MS + B_MS * request.prompt_tokens
        if not self.healthy or need > self.pab_ms:
            return admission_pb2.ReserveResponse(
                granted=False, reason="no-budget", pab_ms=self.pab_ms, pab_tokens=self._pab_tokens()
            )
        self.pab_ms -= need
        lease = f"{self.replica_id}-lease-{len(self.reserves)}"
        self.leases[lease] = need
        return admission_pb2.ReserveResponse(
            granted=True, lease_id=lease, pab_ms=self.pab_ms, pab_tokens=self._pab_tokens()
        )

    async def Release(self, request, context):  # noqa: N802
        self.releases.append(request)
        need = self.leases.pop(request.lease_id, None)
        if need is not None:
            self.pab_ms += need
            self.changed.set()
        return admission_pb2.ReleaseResponse(released=need is not None)


@dataclass
class FakeUpstream:
    """The agent's HTTP side. ``mode``: ok | fail503 | bad-request | drop (close before any byte) | slow.

    ``hold``: when set, every request waits for it before it is answered (cleared: answered at once).
    """

    replica_id: str
    mode: str = "ok"
    hits: list[CIMultiDict[str]] = field(default_factory=list)
    bodies: list[bytes] = field(default_factory=list)
    disconnected: asyncio.Event = field(default_factory=asyncio.Event)
    hold: asyncio.Event | None = None

    def chunks(self) -> list[bytes]:
        out = []
        for i in range(3):
            out.append(b'data: {"id":"cmpl-1","choices":[{"index":0,"text":" t%d"}]}\n\n' % i)
        out.append(b"data: [DONE]\n\n")
        return out

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.hits.append(CIMultiDict(request.headers))
        body = await request.read()
        self.bodies.append(body)
        if self.hold is not None:
            await self.hold.wait()
        if self.mode == "fail503":
            return web.json_response({"error": {"message": "engine down"}}, status=503)
        if self.mode == "bad-request":  # what vLLM answers to e.g. max_tokens: -5 (JSON, also when stream is set)
            return web.json_response({"error": {"message": "max_tokens must be at least 1, got -5.",
                                                "type": "BadRequestError", "param": None, "code": 400}}, status=400)
        if self.mode == "drop":
            request.transport.close()  # type: ignore[union-attr]
            await asyncio.sleep(0.05)
            return web.Response()
        stream = json.loads(body).get("stream", False)
        if not stream:
            return web.json_response({"id": "cmpl-1", "replica": self.replica_id, "choices": [{"text": "hi"}]},
                                     headers={"x-upstream": self.replica_id})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            if self.mode == "error-first":  # SSE headers early, then only an error event
                await resp.write(b'data: {"error": {"message": "engine stream failed", "type": "upstream_error", '
                                 b'"param": null, "code": 502}}\n\ndata: [DONE]\n\n')
                await resp.write_eof()
                return resp
            if self.mode == "freeze":  # two events, then nothing: a frozen agent (SIGSTOP) keeps the socket open
                for c in self.chunks()[:2]:
                    await resp.write(c)
                await asyncio.sleep(30)
                return resp
            if self.mode == "error-mid":  # two events, then what an agent sends when its engine dies: an
                # error event and [DONE], split inside the event's key so that it straddles two reads
                for c in self.chunks()[:2]:
                    await resp.write(c)
                await asyncio.sleep(0.02)
                await resp.write(b'data: {"er')
                await asyncio.sleep(0.02)
                await resp.write(b'ror": {"message": "engine stream failed: UpstreamDisconnected", '
                                 b'"type": "upstream_error", "param": null, "code": 502}}\n\ndata: [DONE]\n\n')
                await resp.write_eof()
                return resp
            if self.mode == "cut":  # two events, then the replica dies mid-stream
                for c in self.chunks()[:2]:
                    await resp.write(c)
                await asyncio.sleep(0.05)
                request.transport.close()  # type: ignore[union-attr]
                return resp
            if self.mode == "slow":
                for i in range(200):
                    await resp.write(b'data: {"choices":[{"text":" s%d"}]}\n\n' % i)
                    await asyncio.sleep(0.05)
            else:
                for c in self.chunks():
                    await resp.write(c)
            await resp.write_eof()
        except (ConnectionError, asyncio.CancelledError):
            self.disconnected.set()
            raise
        return resp


class LoopbackFleet:
    """Fake replicas and one real router on loopback; :meth:`stop` ends them all.

    Attributes:
        admission, upstreams: each replica's :class:`FakeAdmission` and :class:`FakeUpstream` by id.
        router: the router (after :meth:`serve_router`); url: its base URL; session: a client session.
    """

    def __init__(self) -> None:
        self.admission: dict[str, FakeAdmission] = {}
        self.upstreams: dict[str, FakeUpstream] = {}
        self._grpc: list[grpc.aio.Server] = []
        self._runners: list[web.AppRunner] = []
        self.router: Router | None = None
        self.url = ""
        self.session: aiohttp.ClientSession | None = None

    async def start_grpc(self, servicer: FakeAdmission, port: int = 0,
                         host: str = "127.0.0.1") -> tuple[grpc.aio.Server, int]:  # fmt: skip
        """Serve ``servicer`` on ``host:port`` (0: any free port); returns the server and its port."""
        server = grpc.aio.server()
        admission_pb2_grpc.add_AdmissionServiceServicer_to_server(servicer, server)
        gport = server.add_insecure_port(f"{host}:{port}")
        await server.start()
        self._grpc.append(server)
        return server, gport

    async def start_replica(self, servicer: FakeAdmission, upstream: FakeUpstream, host: str = "127.0.0.1",
                            http_port: int = 0, grpc_port: int = 0) -> tuple[str, str]:  # fmt: skip
        """Start one fake replica (its gRPC side and its HTTP side on ``host``, ports 0 = any free);
        returns its ``(http_url, grpc_target)``."""
        rid = servicer.replica_id
        _, gport = await self.start_grpc(servicer, grpc_port, host)
        app = web.Application()
        app.router.add_post("/v1/completions", upstream.handle)
        app.router.add_post("/v1/chat/completions", upstream.handle)
        runner = web.AppRunner(app, handler_cancellation=True)
        await runner.setup()
        await web.TCPSite(runner, host, http_port).start()
        self._runners.append(runner)
        hport = runner.addresses[0][1]
        self.admission[rid] = servicer
        self.upstreams[rid] = upstream
        return f"http://{host}:{hport}", f"{host}:{gport}"

    async def serve_router(self, router: Router) -> None:
        """Serve ``router``'s application on 127.0.0.1 (any free port) and open the client session."""
        self.router = router
        runner = make_runner(router.build_app())
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        self._runners.insert(0, runner)
        self.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        self.session = aiohttp.ClientSession()

    async def wait(self, pred: Callable[[], object], what: str, timeout_s: float = 5.0) -> None:
        """Poll ``pred`` every 20 ms until true.

        Raises:
            AssertionError: after ``timeout_s`` wall seconds, naming ``what``.
        """
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout_s
        while loop.time() < end:
            if pred():
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"timed out waiting for {what}")

    def fresh(self) -> set[str]:
        """The replicas the router sees healthy with a fresh budget."""
        assert self.router is not None
        return {v.replica_id for v in self.router.book.views() if v.fresh and v.healthy}

    async def wait_fresh(self, rids: set[str], timeout_s: float = 5.0) -> None:
        """Wait until every replica of ``rids`` is fresh and healthy in the router's view."""
        await self.wait(lambda: rids <= self.fresh(), f"replicas {rids} to become fresh", timeout_s)

    async def request(self, body: object, key: str | None = API_KEY, path: str = "/v1/completions",
                      raw: bytes | None = None, headers: dict[str, str] | None = None) -> aiohttp.ClientResponse:
        """POST ``body`` as JSON (or ``raw`` bytes) to the router with the bearer ``key`` (None: no key)."""
        assert self.session is not None
        h = dict(headers or {})
        if key is not None:
            h["Authorization"] = f"Bearer {key}"
        data = raw if raw is not None else json.dumps(body).encode()
        return await self.session.post(self.url + path, data=data, headers=h)

    async def stop(self) -> None:
        """Close the session, the HTTP servers (the router's first) and the gRPC servers."""
        if self.session is not None:
            await self.session.close()
        for r in self._runners:
            await r.cleanup()
        for s in self._grpc:
            await s.stop(None)
