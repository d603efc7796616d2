"""The router with replicas that come and go at run time (router/discovery.py), on loopback.

- A test discovery source (the router's discovery is pluggable) adds and removes in-test agents
  (the gRPC AdmissionService and HTTP doubles of tests/integration/fake_agents.py): subscription,
  placement, drop, and in-flight requests on a removed replica (retried elsewhere before the first
  byte; the clean SSE error event after it).
- KubernetesDiscovery with the official client against an in-test HTTP double of the API server
  (EndpointSlice list + chunked watch stream, real JSON), driving a router whose agents listen on
  distinct loopback addresses (127.0.0.2, 127.0.0.3) with the same ports, as pods would.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from kubernetes import client as k8s

from fake_agents import API_KEY, PROMPT, FakeAdmission, FakeUpstream, LoopbackFleet
from loadgen.procs import free_port
from fairbatch_common.clock import Clock
from router.config import ReplicaConfig, RouterConfig, hash_api_key
from router.discovery import KubernetesDiscovery, KubernetesEndpointSliceApi, Publish
from router.server import Router

pytestmark = pytest.mark.timeout(60)


class CountingAdmission(FakeAdmission):
    """FakeAdmission that counts open WatchBudget streams (subscribed / dropped)."""

    def __init__(self, replica_id: str, pab_ms: float) -> None:
        super().__init__(replica_id, pab_ms)
        self.open_streams = 0

    async def WatchBudget(self, request, context):  # noqa: N802 - gRPC name
        self.open_streams += 1
        try:
            async for snap in super().WatchBudget(request, context):
                yield snap
        finally:
            self.open_streams -= 1


class HoldUpstream(FakeUpstream):
    """Adds mode ``hold``: accept the request, then send nothing (a replica that vanished)."""

    def __init__(self, replica_id: str, mode: str = "ok") -> None:
        super().__init__(replica_id, mode)
        self.holding = asyncio.Event()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if self.mode == "hold":
            self.hits.append(request.headers.copy())  # type: ignore[arg-type]
            await request.read()
            self.holding.set()
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                self.disconnected.set()
                raise
            return web.Response()
        if self.mode == "slow":
            self.holding.set()
        return await super().handle(request)


class TestSource:
    """A discovery source the test drives: ``set(...)`` publishes a new replica set."""

    __test__ = False

    def __init__(self) -> None:
        self.publish: Publish | None = None
        self.started = asyncio.Event()

    async def run(self, publish: Publish) -> None:
        self.publish = publish
        self.started.set()
        await asyncio.Event().wait()

    def set(self, *replicas: ReplicaConfig) -> None:
        assert self.publish is not None
        self.publish({r.id: r for r in replicas})


def router_config(**discovery: Any) -> RouterConfig:
    return RouterConfig.model_validate({
        "model": "sim-model",
        "slo_classes": {"interactive": {"ttft_ms": 500, "tpot_ms": 50, "max_queue_ms": 5000}},
        "tenants": {"acme": {"weight": 1, "slo_class": "interactive"}},
        "api_keys": {hash_api_key(API_KEY): "acme"},
        "discovery": discovery or {"mode": "dns", "dns_name": "agents.test.invalid"},
        "admission": {"bytes_per_token": 4.0, "reserve_timeout_ms": 500},
    })


class Fleet(LoopbackFleet):
    """Agents that the test starts and stops (tests/integration/fake_agents.py), a router fed by a
    discovery source."""

    async def agent(self, rid: str, pab_ms: float = 400.0, mode: str = "ok", host: str = "127.0.0.1",
                    http_port: int = 0, grpc_port: int = 0) -> ReplicaConfig:
        http_url, target = await self.start_replica(CountingAdmission(rid, pab_ms), HoldUpstream(rid, mode), host,
                                                    http_port, grpc_port)  # fmt: skip
        return ReplicaConfig(id=rid, http_url=http_url, grpc_target=target)

    async def start_router(self, config: RouterConfig, source: Any) -> None:
        await self.serve_router(Router(config, Clock(1.0), "test-router", discovery=source))

    async def post(self, stream: bool = False) -> aiohttp.ClientResponse:
        body = {"model": "sim-model", "prompt": PROMPT, "max_tokens": 4, "stream": stream}
        return await self.request(body)


@pytest.fixture
async def fleet():
    f = Fleet()
    try:
        yield f
    finally:
        await f.stop()


async def test_replicas_come_and_go_without_restart(fleet: Fleet) -> None:
    source = TestSource()
    r0 = await fleet.agent("r0")
    await fleet.start_router(router_config(), source)
    await asyncio.wait_for(source.started.wait(), 3)
    router = fleet.router
    assert router is not None and router.replicas == {}

    # a request that arrives before any replica waits in the queue, then flows when one appears
    early = asyncio.create_task(fleet.post())
    await asyncio.sleep(0.1)  # short: the aged request must still fit PAB 400 ms - waited (TTFT 500 ms)
    assert not early.done() and len(router.queue) == 1
    source.set(r0)
    resp = await asyncio.wait_for(early, 5)
    assert resp.status == 200 and resp.headers["x-fairbatch-replica"] == "r0"
    assert fleet.admission["r0"].open_streams == 1

    # a second replica: subscribed, then placeable
    r1 = await fleet.agent("r1", pab_ms=440.0)
    source.set(r0, r1)
    await fleet.wait(lambda: fleet.fresh() == {"r0", "r1"}, "r1 fresh")
    assert fleet.admission["r1"].open_streams == 1
    assert (await fleet.post()).headers["x-fairbatch-replica"] == "r1"  # more headroom

    # r1 vanishes: unsubscribed, dropped from placement and metrics
    source.set(r0)
    await fleet.wait(lambda: fleet.admission["r1"].open_streams == 0, "r1 unsubscribed")
    assert set(router.replicas) == {"r0"} and router.book.replica_ids() == ["r0"]
    resps = [await fleet.post() for _ in range(3)]
    assert all(r.status == 200 and r.headers["x-fairbatch-replica"] == "r0" for r in resps)
    assert len(fleet.upstreams["r1"].hits) == 1
    metrics = await (await fleet.session.get(fleet.url + "/metrics")).text()  # type: ignore[union-attr]
    assert 'fairbatch_router_budget_age_seconds{replica="r1"}' not in metrics
    assert 'fairbatch_router_replica_changes_total{change="removed"} 1.0' in metrics
    assert "fairbatch_router_replicas 1.0" in metrics

    # r1 comes back at another address under the same name: subscribed to the new one
    r1b = await fleet.agent("r1b", pab_ms=440.0)
    moved = ReplicaConfig(id="r1", http_url=r1b.http_url, grpc_target=r1b.grpc_target)
    source.set(r0, moved)
    await fleet.wait(lambda: fleet.admission["r1b"].open_streams == 1, "r1 resubscribed at its new address")
    await fleet.wait(lambda: "r1" in fleet.fresh(), "r1 fresh again")
    resp = await fleet.post()
    assert resp.headers["x-fairbatch-replica"] == "r1" and len(fleet.upstreams["r1b"].hits) == 1


async def test_request_not_started_on_a_removed_replica_is_retried_elsewhere(fleet: Fleet) -> None:
    source = TestSource()
    r0 = await fleet.agent("r0", pab_ms=440.0, mode="hold")  # placed first (more headroom), never answers
    r1 = await fleet.agent("r1", pab_ms=300.0)
    await fleet.start_router(router_config(), source)
    await asyncio.wait_for(source.started.wait(), 3)
    source.set(r0, r1)
    await fleet.wait(lambda: fleet.fresh() == {"r0", "r1"}, "both fresh")
    task = asyncio.create_task(fleet.post())
    await asyncio.wait_for(fleet.upstreams["r0"].holding.wait(), 3)
    source.set(r1)  # r0's pod is gone
    resp = await asyncio.wait_for(task, 5)
    assert resp.status == 200
    assert resp.headers["x-fairbatch-replica"] == "r1"
    assert len(fleet.upstreams["r1"].hits) == 1
    await fleet.wait(lambda: fleet.upstreams["r0"].disconnected.is_set(), "upstream request to r0 closed")
    assert fleet.router is not None
    assert fleet.router.metrics.replica_aborts._value.get() == 1  # noqa: SLF001


async def test_stream_that_already_sent_bytes_ends_with_the_sse_error_event(fleet: Fleet) -> None:
    source = TestSource()
    r0 = await fleet.agent("r0", mode="slow")
    await fleet.start_router(router_config(), source)
    await asyncio.wait_for(source.started.wait(), 3)
    source.set(r0)
    await fleet.wait(lambda: fleet.fresh() == {"r0"}, "r0 fresh")
    resp = await fleet.post(stream=True)
    assert resp.status == 200 and resp.headers["x-fairbatch-replica"] == "r0"
    first = await resp.content.readline()
    assert first.startswith(b"data: ")
    source.set()  # the only replica vanishes mid-stream
    rest = await asyncio.wait_for(resp.content.read(), 5)
    events = [e for e in (first + rest).split(b"\n\n") if e.strip()]
    assert events[-1] == b"data: [DONE]"
    err = json.loads(events[-2][len(b"data: "):])["error"]
    assert err["type"] == "upstream_error" and "replica r0 was removed" in err["message"]
    await fleet.wait(lambda: fleet.upstreams["r0"].disconnected.is_set(), "upstream stream closed")
    await fleet.wait(lambda: fleet.admission["r0"].open_streams == 0, "r0 unsubscribed")
    # and with no replica left a new request waits in the queue (a replica may come back)
    assert fleet.router is not None and fleet.router.replicas == {}


# ---------------------------------------------------------------------- Kubernetes API double over HTTP


class FakeApiServer:
    """The two endpoints KubernetesDiscovery uses, as the API server serves them:
    GET .../endpointslices?labelSelector=... (list) and ...&watch=true (chunked JSON lines)."""

    def __init__(self, namespace: str, service: str) -> None:
        self.namespace = namespace
        self.service = service
        self.slices: dict[str, dict[str, Any]] = {}
        self.rv = 100
        self.requests: list[dict[str, str]] = []
        self.watchers: list[asyncio.Queue[dict[str, Any] | None]] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get(f"/apis/discovery.k8s.io/v1/namespaces/{self.namespace}/endpointslices", self.handle)
        return app

    async def handle(self, request: web.Request) -> web.StreamResponse:
        q = dict(request.query)
        self.requests.append(q)
        assert q["labelSelector"] == f"kubernetes.io/service-name={self.service}"
        if q.get("watch") != "true":
            return web.json_response({"kind": "EndpointSliceList", "apiVersion": "discovery.k8s.io/v1",
                                      "metadata": {"resourceVersion": str(self.rv)},
                                      "items": list(self.slices.values())})
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        events: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        self.watchers.append(events)
        try:
            while (ev := await events.get()) is not None:
                await resp.write(json.dumps(ev).encode() + b"\n")
        finally:
            self.watchers.remove(events)
        await resp.write_eof()
        return resp

    def close(self) -> None:
        """End every open watch (the server side of a watch timeout)."""
        for w in list(self.watchers):
            w.put_nowait(None)

    def change(self, event_type: str, obj: dict[str, Any]) -> None:
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)
        if event_type == "DELETED":
            self.slices.pop(obj["metadata"]["name"], None)
        else:
            self.slices[obj["metadata"]["name"]] = obj
        for w in self.watchers:
            w.put_nowait({"type": event_type, "object": obj})


def endpoint_slice(name: str, pods: Mapping[str, str]) -> dict[str, Any]:
    return {
        "kind": "EndpointSlice", "apiVersion": "discovery.k8s.io/v1",
        "metadata": {"name": name, "namespace": "llm", "labels": {"kubernetes.io/service-name": "fb-agents"}},
        "addressType": "IPv4",
        "endpoints": [{"addresses": [ip], "conditions": {"ready": True, "serving": True, "terminating": False},
                       "targetRef": {"kind": "Pod", "namespace": "llm", "name": pod}} for pod, ip in pods.items()],
        "ports": [{"name": "http", "port": 8001, "protocol": "TCP"}, {"name": "grpc", "port": 9001, "protocol": "TCP"}],
    }


async def test_router_with_kubernetes_discovery_against_an_api_server_double(fleet: Fleet) -> None:
    api_server = FakeApiServer("llm", "fb-agents")
    runner = web.AppRunner(api_server.app(), handler_cancellation=True, shutdown_timeout=1.0)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    fleet._runners.append(runner)  # noqa: SLF001 - cleaned up with the fleet
    api_port = runner.addresses[0][1]

    # two "pods" on distinct loopback addresses with the same agent ports, as in a cluster
    http_port, grpc_port = free_port(), free_port()
    await fleet.agent("vllm-0", host="127.0.0.2", http_port=http_port, grpc_port=grpc_port)
    await fleet.agent("vllm-1", pab_ms=440.0, host="127.0.0.3", http_port=http_port, grpc_port=grpc_port)
    api_server.slices["fb-agents-abc"] = endpoint_slice("fb-agents-abc", {"vllm-0": "127.0.0.2"})

    config = router_config(mode="kubernetes", namespace="llm", service="fb-agents",
                           http_port=http_port, grpc_port=grpc_port, resync_s=30)
    api = KubernetesEndpointSliceApi(
        k8s.ApiClient(k8s.Configuration(host=f"http://127.0.0.1:{api_port}")), "llm", "fb-agents"
    )
    source = KubernetesDiscovery(config.discovery, api=api, use_dns_fallback=False)
    await fleet.start_router(config, source)
    try:
        await _follow_slices(fleet, api_server, grpc_port)
    finally:
        api_server.close()


async def _follow_slices(fleet: Fleet, api_server: FakeApiServer, grpc_port: int) -> None:
    await fleet.wait(lambda: fleet.fresh() == {"vllm-0"}, "vllm-0 discovered")
    assert (await fleet.post()).headers["x-fairbatch-replica"] == "vllm-0"
    await fleet.wait(lambda: api_server.watchers, "watch opened")
    watch_q = next(q for q in api_server.requests if q.get("watch") == "true")
    assert watch_q["resourceVersion"] == "100" and watch_q["timeoutSeconds"] == "30"
    assert watch_q["allowWatchBookmarks"] == "true"

    api_server.change("MODIFIED", endpoint_slice("fb-agents-abc", {"vllm-0": "127.0.0.2", "vllm-1": "127.0.0.3"}))
    await fleet.wait(lambda: fleet.fresh() == {"vllm-0", "vllm-1"}, "vllm-1 discovered")
    resp = await fleet.post()
    assert resp.headers["x-fairbatch-replica"] == "vllm-1"

    api_server.change("MODIFIED", endpoint_slice("fb-agents-abc", {"vllm-1": "127.0.0.3"}))
    await fleet.wait(lambda: fleet.admission["vllm-0"].open_streams == 0, "vllm-0 dropped")
    assert fleet.router is not None and set(fleet.router.replicas) == {"vllm-1"}
    assert fleet.router.replicas["vllm-1"].grpc_target == f"127.0.0.3:{grpc_port}"
