"""The picker mode end to end on a simulated fleet: 2 simulated engines + 2 real agents (gRPC budgets,
HTTP proxies) + ``fairbatch-router --ext-proc-port`` as a process, with this test playing Envoy
(loadgen/envoy_ext_proc.py: ask the picker at the headers, forward to the picked agent, report the
response headers with the served endpoint, then the trailers and the close).

The agents run unchanged: the requests reach them from "the proxy" (this test), not from the router,
with the headers the picker set (``x-fairbatch-admit``: each agent decides the admission on arrival).

Numbers (tests/integration/test_e2e_fleet.py, llama-3-8b-a100 profile): an idle replica's PAB for
class ``interactive`` (TTFT 1000 ms, 10 % margin) is 900 ms, a fresh prompt of at most 12,248
tokens. A body of 16,000 bytes is priced 4,000 tokens (4 bytes per token), so an idle replica takes
3 at once (12,000 <= 12,248 < 16,000) and the fleet 6: 8 sent together make the picker hold 2 in its
queue until a prefill ends.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.request

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from loadgen.envoy_ext_proc import EnvoyStream, gateway_request, parse_pick, upstream_headers
from loadgen.procs import free_port
from loadgen.sim.tokenizer import make_prompt
from tests.timing import LoopLag

pytestmark = pytest.mark.timeout(180)


def body_of(total_bytes: int, max_tokens: int, tag: int) -> bytes:
    """A streamed completion whose JSON body is exactly ``total_bytes`` long."""
    def enc(prompt: str) -> bytes:
        return json.dumps({"model": "llama-3-8b-a100", "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                           "ignore_eos": True}).encode()
    overhead = len(enc(""))
    prompt = (f"{tag:04d} " + make_prompt(total_bytes // 4))[: total_bytes - overhead]
    out = enc(prompt)
    assert len(out) == total_bytes
    return out


def metric(url: str, name: str, **labels: str) -> float:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=5).read().decode()
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def start_picker_fleet(fleet_factory, time_scale: float = 1.0):
    port = free_port()
    fleet = fleet_factory(2, time_scale=time_scale, router_args=["--ext-proc-port", str(port)])
    return fleet, f"127.0.0.1:{port}"


@pytest.fixture
def picker_fleet(fleet_factory):
    return start_picker_fleet(fleet_factory)


async def wait_serving(target: str) -> grpc.aio.Channel:
    channel = grpc.aio.insecure_channel(target)
    stub = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + 15
    while True:
        try:
            got = await stub.Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=1.0)
            if got.status == health_pb2.HealthCheckResponse.SERVING:
                return channel
        except grpc.aio.AioRpcError:
            if time.monotonic() > deadline:
                raise
        await asyncio.sleep(0.1)


def sse_tokens(payload: bytes) -> int:
    events = [ln for ln in payload.split(b"\n") if ln.startswith(b"data: ")]
    assert events[-1] == b"data: [DONE]", events[-3:]
    return sum(1 for e in events[:-1] if b'"text"' in e)


async def test_the_fleet_serves_every_request_the_picker_places_holding_what_does_not_fit(fleet_factory) -> None:
    # 4 wall seconds per simulated second: a prefill holds its budget 4x longer, so the eight overlap at
    # the picker even when a loaded machine spreads their picks over a few hundred ms
    fleet, target = start_picker_fleet(fleet_factory, time_scale=4.0)
    channel = await wait_serving(target)
    key = {"authorization": f"Bearer {fleet.api_keys['acme']}", "content-type": "application/json"}
    endpoints = {u.removeprefix("http://") for u in fleet.agent_urls}
    async with aiohttp.ClientSession() as session, LoopLag() as lag:
        results = await asyncio.gather(*(gateway_request(channel, session, "/v1/completions", key,
                                                         body_of(16_000, 8, i)) for i in range(8)))
    served = [r for r in results if r.status == 200]
    for res in results:
        assert res.pick is not None and res.pick.set_headers["x-fairbatch-admit"] == "4000"
        assert set(res.tried) <= endpoints and res.tried == res.pick.endpoints[: len(res.tried)]
        if res.status == 200:
            assert sse_tokens(res.body) == 8 and res.served in endpoints
        else:
            # the one other answer the protocol allows here: every agent of the list refused the admission
            # on arrival (its budget went between the pick and the arrival) -> the router's 503 no-budget,
            # never the agent's own 409
            assert res.status == 503 and res.headers["x-fairbatch-reason"] == "no-budget", res.body[:300]
            assert res.tried == res.pick.endpoints
    # the idle fleet takes 6 at once (3 per replica); the other 2 waited in the picker's queue
    outcome = [(r.status, r.tried, r.served) for r in results]
    assert len(served) >= 6, outcome
    url = fleet.router_url
    assert metric(url, "fairbatch_router_ext_proc_requests_total", outcome="ok") == len(served)
    # at least the two that did not fit waited, when the eight came together (this loop late by 0.4 s or
    # more could send them so far apart that the first prefills are done before the last arrive)
    waited = metric(url, "fairbatch_router_queue_wait_seconds_count")
    assert waited >= 2 or lag.worst_s >= 0.4, (waited, lag.worst_s)
    assert {r.served for r in served} == endpoints, outcome  # both replicas took some
    assert metric(url, "fairbatch_router_replica_inflight_requests") == 0
    await channel.close()


async def test_a_disconnect_mid_stream_releases_the_pick(picker_fleet) -> None:
    fleet, target = picker_fleet
    channel = await wait_serving(target)
    req = {":method": "POST", ":path": "/v1/completions", "authorization": f"Bearer {fleet.api_keys['acme']}",
           "content-type": "application/json"}
    body = body_of(400, 5000, 1)
    req["content-length"] = str(len(body))
    stream = EnvoyStream.open(channel, 30.0)
    pick = parse_pick(await stream.request_headers(req))
    assert pick is not None
    fwd = upstream_headers(req, pick)
    async with aiohttp.ClientSession() as session:
        async with session.post(f"http://{pick.endpoints[0]}/v1/completions", data=body, headers=fwd) as up:
            assert up.status == 200
            await stream.response_headers(200, {"content-type": "text/event-stream"}, served=pick.endpoints[0])
            assert re.match(rb"data: ", await up.content.readline())
            assert metric(fleet.router_url, "fairbatch_router_replica_inflight_requests") == 1
            stream.cancel()  # Envoy resets the ext_proc stream: the client went away mid-stream
    deadline = time.monotonic() + 15
    while metric(fleet.router_url, "fairbatch_router_replica_inflight_requests") != 0:
        assert time.monotonic() < deadline, "the pick was never released"
        await asyncio.sleep(0.05)
    assert metric(fleet.router_url, "fairbatch_router_ext_proc_requests_total", outcome="ok") == 1
    await channel.close()
