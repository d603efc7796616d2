"""The ext_proc endpoint picker (router/ext_proc.py), started for real on loopback, driven as Envoy drives it.

The client is loadgen/envoy_ext_proc.py (built from xds-protos): request headers, then the response
headers with the served endpoint, then trailers or the end of the stream. The fleet is the loopback
doubles of tests/integration/fake_agents.py (budgets set by the test; each agent's HTTP side
records what reaches it); the picker runs on a real :class:`router.server.Router`'s wiring, so the
same core, placement and ledger as the HTTP router.

Time model of every fake replica: a = 10 ms, b = 0.1 ms/token; a PAB of P ms takes a prompt of
``(P - 10) / 0.1`` tokens. Pricing at 4 bytes per token: ``content-length`` 400 -> 100 tokens (20 ms).
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fake_agents import API_KEY, FakeAdmission, FakeUpstream, LoopbackFleet
from fairbatch_common.clock import Clock
from loadgen.envoy_ext_proc import EnvoyStream, gateway_request, immediate_of, parse_pick, upstream_headers
from router.config import RouterConfig, hash_api_key
from router.epp_protocol import endpoint_of
from router.ext_proc import SERVICE_NAME, start_ext_proc
from router.server import Router
from tests.timing import LoopLag

TOKEN = "agent-secret-token"
BODY = json.dumps({"model": "sim-model", "prompt": "x" * 347, "max_tokens": 4}).encode()
assert len(BODY) == 400  # 100 tokens at 4 bytes per token


def headers(length: int = 400, key: str | None = API_KEY, path: str = "/v1/completions", **extra: str) -> dict:
    h = {":method": "POST", ":path": path, ":authority": "gw", "content-type": "application/json",
         "content-length": str(length)}
    if key is not None:
        h["authorization"] = f"Bearer {key}"
    h.update({k.replace("_", "-"): v for k, v in extra.items()})
    return h


class PickerFleet(LoopbackFleet):
    """Fake replicas + a Router (its wiring) + the picker on 127.0.0.1."""

    async def start(self, replicas: dict[str, float], *, lease_mode: str = "inline", max_queue_ms: float = 3000,
                    sheddable: bool = False, trusted: bool = False, tenants: dict | None = None,
                    inline_admission: bool = True, max_requests: int = 64,
                    placement: dict | None = None) -> None:  # fmt: skip
        reps = []
        for rid, pab in replicas.items():
            http_url, target = await self.start_replica(FakeAdmission(rid, pab, inline_admission=inline_admission),
                                                        FakeUpstream(rid))
            reps.append({"id": rid, "http_url": http_url, "grpc_target": target})
        config = RouterConfig.model_validate({
            "model": "sim-model",
            "slo_classes": {
                "interactive": {"ttft_ms": 500, "tpot_ms": 50, "max_queue_ms": max_queue_ms, "sheddable": sheddable},
                "batch": {"ttft_ms": 20000, "tpot_ms": 200, "priority": 1, "max_queue_ms": max_queue_ms},
            },
            "tenants": tenants or {"acme": {"slo_class": "interactive"}, "beta": {"slo_class": "interactive"}},
            "api_keys": {hash_api_key(API_KEY): "acme"},
            "replicas": reps,
            "queue": {"max_requests": max_requests, "max_tokens": 1_000_000},
            "admission": {"bytes_per_token": 4.0, "reserve_timeout_ms": 500, "lease_mode": lease_mode},
            **({"auth": {"trusted_networks": ["127.0.0.0/8"]}} if trusted else {}),
            **({"placement": placement} if placement else {}),
        })
        router = Router(config, Clock(1.0), "test-picker", agent_token=TOKEN)
        await self.serve_router(router)
        self.server, self.health, port = await start_ext_proc(router, "127.0.0.1", 0)
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        await self.wait_fresh(set(replicas))

    def endpoint(self, rid: str) -> str:
        assert self.router is not None
        return endpoint_of(self.router.replicas[rid].http_url)

    def stream(self) -> EnvoyStream:
        return EnvoyStream.open(self.channel, 30.0)

    def picks(self, outcome: str, tenant: str = "acme", slo_class: str = "interactive") -> float:
        assert self.router is not None
        return self.router.metrics.picks.labels(tenant, slo_class, outcome)._value.get()

    async def stop(self) -> None:
        if getattr(self, "channel", None) is not None:
            await self.channel.close()
        if getattr(self, "server", None) is not None:
            await self.server.stop(0)
        await super().stop()


@pytest.fixture
async def fleet():
    f = PickerFleet()
    try:
        yield f
    finally:
        await f.stop()


# ---------------------------------------------------------------------- picks


async def test_pick_names_the_replica_with_most_budget_then_fallbacks_in_header_and_metadata(fleet) -> None:
    await fleet.start({"r0": 200.0, "r1": 400.0, "r2": 300.0})
    s = fleet.stream()
    resp = await s.request_headers(headers())
    pick = parse_pick(resp)
    assert pick is not None
    # most headroom first (400 > 300 > 200 ms), the same string in the header and the envoy.lb metadata
    want = ",".join(fleet.endpoint(r) for r in ("r1", "r2", "r0"))
    assert pick.header == want and pick.metadata == want
    assert resp.request_headers.response.clear_route_cache
    up = pick.set_headers
    assert up["x-fairbatch-admit"] == "100"  # content-length 400 / 4 bytes per token
    assert up["x-fairbatch-tenant"] == "acme" and up["x-fairbatch-slo-class"] == "interactive"
    assert up["x-fairbatch-token"] == TOKEN and len(up["x-request-id"]) == 32
    assert float(up["x-fairbatch-queued-ms"]) >= 0
    assert set(pick.remove_headers) == {"authorization", "x-fairbatch-lease", "x-fairbatch-on-time", "x-fairbatch-direct",
                                        "x-fairbatch-queue-cap"}  # the client's own admission headers
    assert fleet.router.replica_load("r1") == 1
    await s.close()


async def test_a_request_through_the_gateway_reaches_the_picked_agent_and_settles(fleet) -> None:
    await fleet.start({"r0": 200.0, "r1": 400.0})
    async with aiohttp.ClientSession() as session:
        res = await gateway_request(fleet.channel, session, "/v1/completions",
                                    {"authorization": f"Bearer {API_KEY}", "content-type": "application/json"}, BODY)
    assert res.status == 200 and json.loads(res.body)["replica"] == "r1"
    assert res.served == fleet.endpoint("r1") and res.tried == [fleet.endpoint("r1")]
    assert res.headers["x-fairbatch-replica"] == "r1"
    hit = fleet.upstreams["r1"].hits[0]
    assert hit["x-fairbatch-admit"] == "100" and hit["x-fairbatch-token"] == TOKEN
    assert "Authorization" not in hit and "x-gateway-destination-endpoint" not in hit
    assert res.headers["x-fairbatch-request-id"] == hit["x-request-id"]
    assert fleet.upstreams["r1"].bodies[0] == BODY  # the body went from the client to the agent unchanged
    assert not fleet.upstreams["r0"].hits
    await fleet.wait(lambda: fleet.picks("ok") == 1, "the lease to settle as ok")
    assert fleet.router.replica_load("r1") == 0
    # charged once at the pick: prompt 100 + the default decode estimate 256 * w_decode 2
    assert fleet.router.queue.counter("acme") == pytest.approx(100 + 2 * 256)


async def test_reserve_mode_sends_the_lease_and_lists_no_fallback(fleet) -> None:
    await fleet.start({"r0": 200.0, "r1": 400.0}, lease_mode="reserve")
    s = fleet.stream()
    pick = parse_pick(await s.request_headers(headers()))
    assert pick is not None and pick.endpoints == [fleet.endpoint("r1")]  # a lease id names one agent
    assert pick.set_headers["x-fairbatch-lease"] == "r1-lease-1"
    assert "x-fairbatch-admit" not in pick.set_headers and "x-fairbatch-admit" in pick.remove_headers
    assert fleet.admission["r1"].reserves[0].prompt_tokens == 100
    assert fleet.admission["r1"].pab_ms == pytest.approx(400 - 20)  # 10 + 0.1 * 100 ms reserved
    resp = await s.response_headers(200, {"content-type": "text/event-stream"}, served=fleet.endpoint("r1"))
    assert resp.WhichOneof("response") == "response_headers"
    await s.response_trailers()
    await s.close()
    assert fleet.picks("ok") == 1 and fleet.router.replica_load("r1") == 0
    assert not fleet.admission["r1"].releases  # consumed by the agent, never released


async def test_the_subset_hint_limits_the_pick(fleet) -> None:
    await fleet.start({"r0": 200.0, "r1": 400.0, "r2": 300.0})
    s = fleet.stream()
    pick = parse_pick(await s.request_headers(headers(), subset=[fleet.endpoint("r0"), fleet.endpoint("r2")]))
    assert pick is not None and pick.endpoints == [fleet.endpoint("r2"), fleet.endpoint("r0")]
    await s.close()


async def test_the_token_header_prices_the_prompt_only_from_a_trusted_peer(fleet) -> None:
    await fleet.start({"r0": 400.0}, trusted=True)
    s = fleet.stream()
    pick = parse_pick(await s.request_headers(headers(x_fairbatch_prompt_tokens="1234")))
    assert pick is not None and pick.set_headers["x-fairbatch-admit"] == "1234"
    await s.close()


async def test_untrusted_peer_cannot_set_size_tenant_or_class(fleet) -> None:
    await fleet.start({"r0": 400.0})  # no trusted network: 127.0.0.1 is an ordinary client
    s = fleet.stream()
    pick = parse_pick(await s.request_headers(headers(
        x_fairbatch_prompt_tokens="1", x_gateway_inference_fairness_id="beta", x_gateway_inference_objective="batch")))
    assert pick is not None
    assert pick.set_headers["x-fairbatch-admit"] == "100"  # content-length, not the header
    assert pick.set_headers["x-fairbatch-tenant"] == "acme" and pick.set_headers["x-fairbatch-slo-class"] == "interactive"
    await s.close()
    s = fleet.stream()  # and without a key the fairness id alone is no identity
    im = immediate_of(await s.request_headers(headers(key=None, x_gateway_inference_fairness_id="beta")))
    assert im is not None and im.status == 401 and im.body["error"]["code"] == "invalid_api_key"
    assert im.body["error"]["message"] == "Invalid or missing API key."
    await s.close()


async def test_trusted_gateway_names_tenant_and_objective(fleet) -> None:
    # beta's own class is batch (no budget on the fakes); the gateway's objective names interactive
    await fleet.start({"r0": 400.0}, trusted=True,
                      tenants={"acme": {"slo_class": "interactive"}, "beta": {"slo_class": "batch"}})
    s = fleet.stream()
    resp = await s.request_headers(headers(key=None, x_gateway_inference_fairness_id="beta",
                                           x_gateway_inference_objective="interactive"))
    pick = parse_pick(resp)
    assert pick is not None, resp
    assert pick.set_headers["x-fairbatch-tenant"] == "beta"
    assert pick.set_headers["x-fairbatch-slo-class"] == "interactive"
    await s.close()
    s = fleet.stream()
    im = immediate_of(await s.request_headers(headers(key=None, x_gateway_inference_fairness_id="nobody")))
    assert im is not None and im.status == 401 and "'nobody'" in im.body["error"]["message"]
    await s.close()


async def test_other_paths_go_to_a_usable_replica_without_a_lease(fleet) -> None:
    await fleet.start({"r0": 400.0})
    s = fleet.stream()
    pick = parse_pick(await s.request_headers({":method": "GET", ":path": "/v1/models",
                                               "authorization": f"Bearer {API_KEY}"}, end_of_stream=True))
    assert pick is not None and pick.endpoints == [fleet.endpoint("r0")]
    assert "x-fairbatch-admit" not in pick.set_headers and pick.set_headers["x-fairbatch-token"] == TOKEN
    assert fleet.router.replica_load("r0") == 0
    await s.close()


# ---------------------------------------------------------------------- refusals


async def test_over_budget_waits_in_the_queue_then_429_queue_timeout_with_retry_after(fleet) -> None:
    # 20 ms of PAB takes 100 tokens; a 2000-byte body is 500 tokens (60 ms): it waits, then times out
    await fleet.start({"r0": 20.0}, max_queue_ms=300)
    s = fleet.stream()
    async with LoopLag() as lag:
        t0 = asyncio.get_running_loop().time()
        im = immediate_of(await s.request_headers(headers(length=2000)))
        waited = asyncio.get_running_loop().time() - t0
    assert im is not None and im.status == 429
    assert im.headers["retry-after"] == "1" and im.headers["x-fairbatch-reason"] == "queue-timeout"
    assert im.headers["content-type"] == "application/json"
    assert im.body == {"error": {"message": "No replica could take the request within max_queue_ms (300 ms) of "
                                            "class 'interactive'.", "type": "rate_limit_error", "param": None,
                                 "code": "queue-timeout"}}
    assert 0.28 <= waited <= lag.bound_s(0.3)  # its queue deadline, and no later than the loop allows
    # while it waited, the picker asked Envoy to wait: the queue deadline (300 ms) + 1 s of margin
    assert len(s.extensions) == 1 and s.extensions[0] == pytest.approx(1.3, abs=0.05)
    await s.close()
    assert len(fleet.router.queue) == 0 and fleet.picks("queue_timeout") == 1


async def test_a_held_request_is_picked_when_budget_appears(fleet) -> None:
    await fleet.start({"r0": 20.0}, max_queue_ms=3000)
    s = fleet.stream()
    task = asyncio.create_task(s.request_headers(headers(length=2000)))
    await fleet.wait(lambda: len(fleet.router.queue) == 1, "the request to queue")
    assert not task.done()
    fleet.admission["r0"].set_budget(400.0)
    pick = parse_pick(await asyncio.wait_for(task, 5.0))
    assert pick is not None and pick.endpoints == [fleet.endpoint("r0")] and pick.set_headers["x-fairbatch-admit"] == "500"
    assert float(pick.set_headers["x-fairbatch-queued-ms"]) > 0 and len(s.extensions) == 1
    await s.response_headers(200, served=fleet.endpoint("r0"), end_of_stream=True)
    await s.close()
    assert fleet.picks("ok") == 1 and fleet.router.replica_load("r0") == 0


async def test_sheddable_request_that_cannot_start_in_time_is_429_slo_infeasible(fleet) -> None:
    await fleet.start({"r0": 0.0}, sheddable=True, max_queue_ms=2000)
    s = fleet.stream()
    im = immediate_of(await s.request_headers(headers()))
    assert im is not None and im.status == 429 and im.headers["x-fairbatch-reason"] == "slo-infeasible"
    assert int(im.headers["retry-after"]) >= 1 and im.body["error"]["type"] == "rate_limit_error"
    await s.close()


async def test_tenant_over_quota_is_429_with_the_buckets_retry_after(fleet) -> None:
    await fleet.start({"r0": 400.0}, tenants={"acme": {"slo_class": "interactive", "requests_per_minute": 1}})
    s = fleet.stream()
    assert parse_pick(await s.request_headers(headers())) is not None
    await s.close()
    s = fleet.stream()
    im = immediate_of(await s.request_headers(headers()))
    # one request per (simulated) minute at time scale 1: the next one in 60 s
    assert im is not None and im.status == 429 and im.headers["x-fairbatch-reason"] == "tenant-rate"
    assert im.headers["retry-after"] == "60"
    await s.close()


async def test_subset_without_any_pool_endpoint_is_503(fleet) -> None:
    await fleet.start({"r0": 400.0})
    for subset in ([], ["10.9.9.9:8000"]):
        s = fleet.stream()
        im = immediate_of(await s.request_headers(headers(), subset=subset))
        assert im is not None and im.status == 503 and im.headers["x-fairbatch-reason"] == "no-replica"
        assert im.body["error"]["type"] == "service_unavailable"
        await s.close()


async def test_no_ready_replica_is_503_no_replica(fleet) -> None:
    await fleet.start({"r0": 400.0}, max_queue_ms=200)
    fleet.admission["r0"].healthy = False
    fleet.admission["r0"].set_budget(400.0)
    await fleet.wait(lambda: not fleet.fresh(), "r0 to turn unhealthy")
    s = fleet.stream()
    im = immediate_of(await s.request_headers(headers()))
    assert im is not None and im.status == 503 and im.headers["x-fairbatch-reason"] == "no-replica"
    await s.close()


async def test_client_errors_are_answered_at_the_headers(fleet) -> None:
    await fleet.start({"r0": 400.0})
    cases = [
        (headers(length=5 * 1024 * 1024), 413, "body_too_large"),  # http.max_body_bytes 4 MiB
        (headers(content_encoding="gzip"), 415, "unsupported_content_encoding"),
        # 4 MiB is about 1M tokens, over twice the replica's 32768: refused as the HTTP router refuses it
        (headers(length=4 * 1024 * 1024), 400, "context_length_exceeded"),
    ]
    for h, status, code in cases:
        s = fleet.stream()
        im = immediate_of(await s.request_headers(h))
        assert im is not None and (im.status, im.body["error"]["code"]) == (status, code)
        await s.close()


async def test_agent_refusing_the_inline_admission_becomes_503_no_budget(fleet) -> None:
    await fleet.start({"r0": 400.0})
    s = fleet.stream()
    pick = parse_pick(await s.request_headers(headers()))
    assert pick is not None
    # no periodic snapshot from here on (one would put r0's 400 ms back in the book before the check below)
    fleet.admission["r0"].pushing = False
    resp = await s.response_headers(409, {"x-fairbatch-refused": "no-budget", "x-fairbatch-pab-ms": "5.000",
                                          "x-fairbatch-pab-tokens": "0"}, served=fleet.endpoint("r0"))
    im = immediate_of(resp)
    assert im is not None and im.status == 503 and im.headers["x-fairbatch-reason"] == "no-budget"
    await s.close()
    # the agent's answer updated the router's view of r0 (5 ms left for the class), the charge refunded
    assert fleet.router.book.views()[0].classes["interactive"].pab_ms <= 5.0
    assert fleet.router.queue.counter("acme") == 0
    assert fleet.picks("upstream_error") == 1 and fleet.router.replica_load("r0") == 0


async def test_a_baseline_profile_pick_is_direct_with_its_next_candidates(fleet) -> None:
    # placement.profile round-robin (a baseline router, no budget): the grant is direct, every agent of
    # the list admits it as it is (x-fairbatch-direct), the next candidates are the fallbacks
    await fleet.start({"r0": 400.0, "r1": 400.0}, placement={"profile": "round-robin", "seed": 1})
    s = fleet.stream()
    pick = parse_pick(await s.request_headers(headers()))
    assert pick is not None and len(pick.endpoints) == 2
    assert set(pick.endpoints) == {fleet.endpoint("r0"), fleet.endpoint("r1")}
    assert pick.set_headers["x-fairbatch-direct"] == "1" and "x-fairbatch-admit" not in pick.set_headers
    assert {"x-fairbatch-admit", "x-fairbatch-lease", "x-fairbatch-on-time"} <= set(pick.remove_headers)
    await s.close()


async def test_the_response_headers_end_the_prefill_and_the_stream_end_the_request(fleet) -> None:
    # a direct (baseline-profile) grant counts its prompt in the core's in-prefill load until its first
    # byte, as the HTTP router does (router/core.py prefill_done); through the gateway the first byte is
    # the response headers (the agent sends them with the first chunk): content-length 400 at 4 bytes
    # per token = 100 prompt tokens, no prefix map, so 100 uncached tokens
    await fleet.start({"r0": 400.0}, placement={"profile": "round-robin", "seed": 1})
    load = fleet.router.core.load
    s = fleet.stream()
    assert parse_pick(await s.request_headers(headers())) is not None
    assert load.prefill_tokens.get("r0", 0) == 100 and load.prompt_tokens.get("r0", 0) == 100
    await s.response_headers(200, {"content-type": "text/event-stream"}, served=fleet.endpoint("r0"))
    assert load.prefill_tokens.get("r0", 0) == 0  # prefill over: only the decode is left
    assert load.prompt_tokens.get("r0", 0) == 100 and fleet.router.replica_load("r0") == 1  # still running
    await s.response_trailers()
    await s.close()
    assert load.prompt_tokens.get("r0", 0) == 0 and fleet.router.replica_load("r0") == 0


# ---------------------------------------------------------------------- settlement


async def test_a_request_that_got_nothing_gives_its_rate_quota_back(fleet) -> None:
    # one request per minute: the first fails before any byte (a 503 upstream), so the bucket gets it
    # back and a second request passes; that one is served, and a third is 429 tenant-rate
    await fleet.start({"r0": 400.0}, tenants={"acme": {"slo_class": "interactive", "requests_per_minute": 1}})
    s = fleet.stream()
    assert parse_pick(await s.request_headers(headers())) is not None
    await s.response_headers(503, served=fleet.endpoint("r0"), end_of_stream=True)
    await s.close()
    await asyncio.sleep(0.05)  # the refund runs in the background
    s = fleet.stream()
    assert parse_pick(await s.request_headers(headers())) is not None
    await s.response_headers(200, served=fleet.endpoint("r0"), end_of_stream=True)
    await s.close()
    s = fleet.stream()
    im = immediate_of(await s.request_headers(headers()))
    assert im is not None and im.headers["x-fairbatch-reason"] == "tenant-rate"
    await s.close()


async def test_a_fallback_that_served_releases_the_primary(fleet) -> None:
    await fleet.start({"r0": 200.0, "r1": 400.0})
    s = fleet.stream()
    pick = parse_pick(await s.request_headers(headers()))
    assert pick is not None and pick.endpoints == [fleet.endpoint("r1"), fleet.endpoint("r0")]
    assert fleet.router.replica_load("r1") == 1
    await s.response_headers(200, served=fleet.endpoint("r0"))
    await s.response_trailers()
    await s.close()
    assert fleet.router.replica_load("r1") == 0 and fleet.picks("fallback_served") == 1


async def test_upstream_5xx_refunds_and_releases(fleet) -> None:
    await fleet.start({"r0": 400.0}, lease_mode="reserve")
    s = fleet.stream()
    pick = parse_pick(await s.request_headers(headers()))
    assert pick is not None
    await s.response_headers(503, served=fleet.endpoint("r0"), end_of_stream=True)
    await s.close()
    await fleet.wait(lambda: fleet.admission["r0"].releases, "the Release RPC")
    assert fleet.admission["r0"].releases[0].lease_id == "r0-lease-1"
    assert fleet.router.queue.counter("acme") == 0 and fleet.picks("upstream_error") == 1


async def test_disconnect_after_the_pick_releases_the_lease(fleet) -> None:
    await fleet.start({"r0": 400.0}, lease_mode="reserve")
    s = fleet.stream()
    assert parse_pick(await s.request_headers(headers())) is not None
    assert fleet.admission["r0"].pab_ms == pytest.approx(380.0)
    s.cancel()  # Envoy resets the stream mid-request (the client went away)
    await fleet.wait(lambda: fleet.admission["r0"].releases, "the Release RPC")
    assert fleet.admission["r0"].releases[0].lease_id == "r0-lease-1"
    assert fleet.admission["r0"].pab_ms == pytest.approx(400.0)  # the agent got its budget back
    await fleet.wait(lambda: fleet.picks("client_disconnect") == 1, "the settlement")
    assert fleet.router.replica_load("r0") == 0


async def test_disconnect_while_queued_leaves_nothing_behind(fleet) -> None:
    await fleet.start({"r0": 20.0}, max_queue_ms=5000, lease_mode="reserve")
    s = fleet.stream()
    task = asyncio.create_task(s.request_headers(headers(length=2000)))
    await fleet.wait(lambda: len(fleet.router.queue) == 1, "the request to queue")
    s.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await fleet.wait(lambda: len(fleet.router.queue) == 0, "the queue entry to go")
    fleet.admission["r0"].set_budget(400.0)  # budget appears: nothing may be placed for the gone request
    await asyncio.sleep(0.3)
    assert not fleet.admission["r0"].reserves and fleet.router.replica_load("r0") == 0


async def test_body_chunks_are_passed_through_never_held(fleet) -> None:
    from loadgen.envoy_ext_proc import FULL_DUPLEX_STREAMED

    await fleet.start({"r0": 400.0})
    s = fleet.stream()
    assert parse_pick(await s.request_headers(headers(), body_mode=FULL_DUPLEX_STREAMED)) is not None
    resp = await s.request_body(b'{"model":', False)  # full duplex: the picker returns each chunk as it came
    assert resp.request_body.response.body_mutation.streamed_response.body == b'{"model":'
    await s.close()


# ---------------------------------------------------------------------- health


async def test_grpc_health_serves_liveness_readiness_and_the_ext_proc_service(fleet) -> None:
    await fleet.start({"r0": 400.0})
    stub = health_pb2_grpc.HealthStub(fleet.channel)
    for name in ("liveness", "readiness", SERVICE_NAME, ""):
        got = await stub.Check(health_pb2.HealthCheckRequest(service=name))
        assert got.status == health_pb2.HealthCheckResponse.SERVING, name
    assert SERVICE_NAME == "envoy.service.ext_proc.v3.ExternalProcessor"
    await fleet.health.enter_graceful_shutdown()  # the drain's first step (router/ext_proc.py stop_ext_proc)
    got = await stub.Check(health_pb2.HealthCheckRequest(service="readiness"))
    assert got.status == health_pb2.HealthCheckResponse.NOT_SERVING


def test_upstream_headers_apply_the_mutation_as_envoy_does() -> None:
    from loadgen.envoy_ext_proc import Pick

    pick = Pick("a:1", "a:1", {"x-gateway-destination-endpoint": "a:1", "x-fairbatch-admit": "7"}, ("authorization",))
    got = upstream_headers({":path": "/v1/completions", "Authorization": "Bearer k", "x-fairbatch-admit": "1"}, pick)
    assert got == {"x-gateway-destination-endpoint": "a:1", "x-fairbatch-admit": "7"}
