"""The router, started for real on loopback, against test doubles of the agents.

Each fake replica is an in-test grpc.aio AdmissionService (budgets controlled by the test,
Reserve grants when the prompt fits the PAB, Release recorded) plus an in-test aiohttp server
standing in for the agent's HTTP side (records headers, streams SSE, can fail on demand): the
shared doubles of tests/integration/fake_agents.py. The real end-to-end test with real agents and
simulated engines lives elsewhere.

Time model of every fake replica: a = 10 ms, b = 0.1 ms/token, c = 0; horizon 450 ms.
A prompt of 400 ASCII bytes = 100 tokens -> 20 ms of prefill.
"""

from __future__ import annotations

import asyncio
import json
import logging

import aiohttp
import pytest

from fake_agents import API_KEY, PROMPT, FakeAdmission, FakeUpstream, LoopbackFleet
from fairbatch_common.clock import Clock
from router.config import RouterConfig, hash_api_key
from router.server import Router
from tests.timing import LoopLag


class Fleet(LoopbackFleet):
    """Fake replicas (tests/integration/fake_agents.py) + the router on a static replica list."""

    async def add_replica(self, rid: str, pab_ms: float, mode: str = "ok", ttl_ms: int = 300) -> tuple[str, str]:
        return await self.start_replica(FakeAdmission(rid, pab_ms, ttl_ms=ttl_ms), FakeUpstream(rid, mode))

    async def start(self, replicas: dict[str, float], modes: dict[str, str] | None = None,
                    max_queue_ms: float = 3000, queue_max_requests: int = 64, silence_s: float = 10.0,
                    ttft_ms: float = 500, lease_mode: str = "reserve", max_migrations: int = 3,
                    ttl_ms: int = 300) -> None:  # fmt: skip
        modes = modes or {}
        reps = []
        for rid, pab in replicas.items():
            http_url, target = await self.add_replica(rid, pab, modes.get(rid, "ok"), ttl_ms)
            reps.append({"id": rid, "http_url": http_url, "grpc_target": target})
        config = RouterConfig.model_validate({
            "model": "sim-model",
            "slo_classes": {"interactive": {"ttft_ms": ttft_ms, "tpot_ms": 50, "max_queue_ms": max_queue_ms}},
            "tenants": {"acme": {"weight": 1, "slo_class": "interactive"}},
            "api_keys": {hash_api_key(API_KEY): "acme"},
            "replicas": reps,
            "queue": {"max_requests": queue_max_requests, "max_tokens": 1_000_000},
            "admission": {"bytes_per_token": 4.0, "reserve_timeout_ms": 500, "lease_mode": lease_mode},
            "migration": {"max_migrations": max_migrations},
        })
        router = Router(config, Clock(1.0), "test-router")
        router.budgets._silence_s = silence_s
        await self.serve_router(router)
        await self.wait_fresh(set(replicas))

    async def post(self, body: object, key: str | None = API_KEY, path: str = "/v1/completions",
                   raw: bytes | None = None, headers: dict[str, str] | None = None) -> aiohttp.ClientResponse:
        return await self.request(body, key, path, raw, headers)


@pytest.fixture
async def fleet():
    f = Fleet()
    try:
        yield f
    finally:
        await f.stop()


def completion(stream: bool = False) -> dict:
    return {"model": "sim-model", "prompt": PROMPT, "max_tokens": 4, "stream": stream}


async def test_routes_to_most_headroom_with_headers(fleet: Fleet) -> None:
    await fleet.start({"r0": 200.0, "r1": 400.0, "r2": 300.0})
    resp = await fleet.post(completion(), headers={"x-request-id": "req-123"})
    assert resp.status == 200
    assert resp.headers["x-fairbatch-replica"] == "r1"
    assert resp.headers["x-request-id"] == "req-123"
    assert (await resp.json())["replica"] == "r1"
    hit = fleet.upstreams["r1"].hits[0]
    # the agent and the engine get the router's own id (the client's is only echoed back)
    assert hit["x-request-id"] != "req-123" and len(hit["x-request-id"]) == 32
    assert fleet.admission["r1"].reserves[0].request_id == hit["x-request-id"]
    assert hit["x-fairbatch-lease"] == "r1-lease-1"
    assert hit["x-fairbatch-slo-class"] == "interactive"
    assert hit["x-fairbatch-tenant"] == "acme"
    assert float(hit["x-fairbatch-queued-ms"]) >= 0
    assert "traceparent" not in hit  # no exporter configured: the no-op tracer originates no trace context
    assert "Authorization" not in hit
    assert fleet.upstreams["r1"].bodies[0] == json.dumps(completion()).encode()  # bytes unchanged
    assert fleet.admission["r1"].reserves[0].prompt_tokens == 100
    assert not fleet.upstreams["r0"].hits and not fleet.upstreams["r2"].hits


async def test_inline_mode_takes_a_reserve_lease_where_the_agent_is_not_on_the_http_path(fleet: Fleet) -> None:
    # lease_mode inline, but r0's agent says (snapshot inline_admission false: --no-proxy, the router
    # sends to vLLM directly) that nothing on its HTTP path checks x-fairbatch-admit: the router must
    # take a Reserve lease there, or the request would be admitted without any check of the budget
    await fleet.start({"r0": 400.0}, lease_mode="inline")
    fake = fleet.admission["r0"]
    fake.inline_admission = False
    fake.changed.set()
    await fleet.wait(lambda: fleet.router.book.get("r0").seq >= 2 and not fleet.router.book.inline_admission("r0"),
                     "a snapshot without inline admission")  # fmt: skip
    resp = await fleet.post(completion())
    assert resp.status == 200
    hit = fleet.upstreams["r0"].hits[-1]
    assert hit["x-fairbatch-lease"] == "r0-lease-1" and "x-fairbatch-admit" not in hit
    assert [r.request_id for r in fake.reserves] == [hit["x-request-id"]]
    # the agent is on the path again (inline_admission true): admitted inline, no Reserve round trip
    fake.inline_admission = True
    fake.changed.set()
    await fleet.wait(lambda: fleet.router.book.inline_admission("r0"), "a snapshot with inline admission")
    resp = await fleet.post(completion())
    assert resp.status == 200
    hit = fleet.upstreams["r0"].hits[-1]
    assert hit["x-fairbatch-admit"] == "100" and "x-fairbatch-lease" not in hit
    assert len(fake.reserves) == 1


async def test_concurrent_requests_spread(fleet: Fleet) -> None:
    await fleet.start({"r0": 400.0, "r1": 400.0})
    # no request is answered (so none releases its lease) until all 8 are placed: each placement sees
    # the budgets the earlier ones left (400, 380, ... ms on each), so they alternate 4 and 4
    hold = asyncio.Event()
    for up in fleet.upstreams.values():
        up.hold = hold
    posts = [asyncio.ensure_future(fleet.post(completion())) for _ in range(8)]
    await fleet.wait(lambda: sum(len(u.hits) for u in fleet.upstreams.values()) == 8, "8 requests placed")
    hold.set()
    resps = await asyncio.gather(*posts)
    placed = [r.headers["x-fairbatch-replica"] for r in resps]
    assert all(r.status == 200 for r in resps)
    assert placed.count("r0") == placed.count("r1") == 4, placed


async def test_stream_bytes_relayed_unchanged(fleet: Fleet) -> None:
    await fleet.start({"r0": 400.0})
    resp = await fleet.post(completion(stream=True))
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    assert await resp.read() == b"".join(fleet.upstreams["r0"].chunks())


async def test_chat_and_new_request_id(fleet: Fleet) -> None:
    await fleet.start({"r0": 400.0})
    body = {"model": "sim-model", "messages": [{"role": "user", "content": PROMPT}]}
    resp = await fleet.post(body, path="/v1/chat/completions")
    assert resp.status == 200
    rid = resp.headers["x-request-id"]
    assert len(rid) == 32 and int(rid, 16) >= 0
    assert fleet.admission["r0"].reserves[0].prompt_tokens == 104  # 100 + 4 per message


async def test_zero_budget_queues_then_flows(fleet: Fleet) -> None:
    await fleet.start({"r0": 0.0, "r1": 0.0})
    task = asyncio.create_task(fleet.post(completion()))
    # short wait: the aged request fits only while a + bP = 20 <= PAB 400 - waited (TTFT 500 ms)
    await asyncio.sleep(0.15)
    assert not task.done()
    assert fleet.router is not None and len(fleet.router.queue) == 1
    fleet.admission["r1"].set_budget(400.0)
    resp = await asyncio.wait_for(task, 3.0)
    assert resp.status == 200
    assert resp.headers["x-fairbatch-replica"] == "r1"
    assert float(fleet.upstreams["r1"].hits[0]["x-fairbatch-queued-ms"]) >= 100
    # the Reserve that won carried the request's age (arrival at the router -> Reserve)
    assert fleet.admission["r1"].reserves[-1].waited_ms >= 100
    assert len(fleet.router.queue) == 0


async def test_full_queue_429(fleet: Fleet) -> None:
    await fleet.start({"r0": 0.0}, queue_max_requests=1)
    waiting = asyncio.create_task(fleet.post(completion()))
    await asyncio.sleep(0.2)
    resp = await fleet.post(completion())
    assert resp.status == 429
    assert resp.headers["x-fairbatch-reason"] == "queue-full"
    assert int(resp.headers["Retry-After"]) >= 1
    assert "x-request-id" in resp.headers
    err = (await resp.json())["error"]
    assert set(err) == {"message", "type", "param", "code"}
    waiting.cancel()


async def test_queue_timeout_429(fleet: Fleet) -> None:
    await fleet.start({"r0": 0.0}, max_queue_ms=300)
    loop = asyncio.get_running_loop()
    async with LoopLag() as lag:
        t0 = loop.time()
        resp = await fleet.post(completion())
        waited = loop.time() - t0
    assert resp.status == 429
    assert resp.headers["x-fairbatch-reason"] == "queue-timeout"
    assert int(resp.headers["Retry-After"]) >= 1
    assert 0.25 <= waited <= lag.bound_s(0.3)  # at its 300 ms deadline, as late as the loop ran
    assert fleet.router is not None and len(fleet.router.queue) == 0
    metrics = await (await fleet.session.get(fleet.url + "/metrics")).text()  # type: ignore[union-attr]
    assert 'fairbatch_router_requests_total{outcome="queue_timeout",slo_class="interactive",tenant="acme"} 1.0' in metrics


async def test_auth_and_bad_requests(fleet: Fleet) -> None:
    await fleet.start({"r0": 400.0})
    resp = await fleet.post(completion(), key="sk-wrong")
    assert resp.status == 401
    err = (await resp.json())["error"]
    assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error"
    resp = await fleet.post(completion(), key=None)
    assert resp.status == 401
    resp = await fleet.post(None, raw=b"{not json")
    assert resp.status == 400 and "x-request-id" in resp.headers
    resp = await fleet.post({"model": "sim-model"})
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "prompt"
    resp = await fleet.post({"prompt": "hi"})
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "model"
    resp = await fleet.post({"model": "m", "prompt": [1] * 40000})  # token ids: exact, refused at 1x
    err = (await resp.json())["error"]
    assert resp.status == 400 and err["code"] == "context_length_exceeded"
    assert err["message"] == "The prompt (40000 tokens) is longer than every replica's maximum context (32768 tokens)."
    # text: 300,000 bytes ~ 75,000 tokens at 4 bytes per token > 2 x 32,768: refused up front
    resp = await fleet.post({"model": "m", "prompt": "x" * 300_000})
    err = (await resp.json())["error"]
    assert resp.status == 400 and err["code"] == "context_length_exceeded" and "by more than 2x" in err["message"]
    assert not fleet.upstreams["r0"].hits


async def test_text_prompt_estimated_over_the_context_goes_to_the_engine(fleet: Fleet) -> None:
    # "hello " x 30,000 = 180,000 bytes: 45,000 tokens at 4 bytes per token, but about 30,000 for a real
    # BPE tokenizer, so it may fit 32,768; below 2x the router does not refuse it on its estimate. It is
    # placed with the estimate capped at the largest max context (Reserve for 32,768 tokens) and the engine
    # decides.
    await fleet.start({"r0": 4000.0}, ttft_ms=5000, max_queue_ms=5000)
    resp = await fleet.post({"model": "sim-model", "prompt": "hello " * 30_000, "max_tokens": 4})
    assert resp.status == 200 and resp.headers["x-fairbatch-replica"] == "r0"
    assert [r.prompt_tokens for r in fleet.admission["r0"].reserves] == [32768]


async def test_stale_replica_gets_no_work(fleet: Fleet) -> None:
    await fleet.start({"r0": 450.0, "r1": 100.0})
    fleet.admission["r0"].pushing = False  # stream stays open but silent
    await asyncio.sleep(0.45)  # > ttl 300 ms
    for _ in range(3):
        resp = await fleet.post(completion())
        assert resp.status == 200
        assert resp.headers["x-fairbatch-replica"] == "r1"
        fleet.admission["r1"].set_budget(100.0)
    assert not fleet.upstreams["r0"].hits
    assert not fleet.admission["r0"].reserves


async def test_no_usable_replica_is_503_no_replica_and_health_degraded(fleet: Fleet) -> None:
    await fleet.start({"r0": 450.0}, max_queue_ms=300)
    fleet.admission["r0"].pushing = False  # silent stream: stale after the 300 ms TTL
    await asyncio.sleep(0.45)
    health = await (await fleet.session.get(fleet.url + "/health")).json()  # type: ignore[union-attr]
    assert health["status"] == "degraded" and health["replicas_usable"] == []
    resp = await fleet.post(completion())
    assert resp.status == 503  # not a 429: nothing could take it, whatever the client's rate
    assert resp.headers["x-fairbatch-reason"] == "no-replica" and int(resp.headers["Retry-After"]) >= 1
    assert (await resp.json())["error"]["code"] == "no-replica"


async def test_agent_restart_stale_then_reconnects(fleet: Fleet, caplog: pytest.LogCaptureFixture) -> None:
    # TTFT 5 s, PAB 4 s, max queue 5 s: the queued request may wait out the reconnect backoff (up to 2 s) and still
    # fit its aged budget (a + bP <= PAB - waited); with TTFT 500 ms it is shed as slo-infeasible
    caplog.set_level(logging.INFO, logger="router.budget_client")
    await fleet.start({"r0": 4000.0}, ttft_ms=5000, max_queue_ms=5000)
    assert fleet.router is not None
    old = fleet._grpc[0]
    port = int(fleet.router.config.replicas[0].grpc_target.rsplit(":", 1)[1])
    await old.stop(None)
    fleet._grpc.remove(old)
    loop = asyncio.get_running_loop()
    end = loop.time() + 2.0
    while fleet.router.book.views()[0].fresh and loop.time() < end:
        await asyncio.sleep(0.01)
    assert not fleet.router.book.views()[0].fresh  # stale at once on disconnect
    waiting = asyncio.create_task(fleet.post(completion()))  # nothing usable: queued ...
    await asyncio.sleep(0.2)
    assert not waiting.done()
    await fleet.start_grpc(FakeAdmission("r0", 4000.0), port)
    resp = await asyncio.wait_for(waiting, 5.0)  # ... the watch reconnects (backoff <= 2 s) and it flows
    assert resp.status == 200 and resp.headers["x-fairbatch-replica"] == "r0"
    # the outage is logged once when it starts and once when it ends
    msgs = [r.getMessage() for r in caplog.records if r.name == "router.budget_client" and r.levelno >= logging.INFO]
    assert any(m.startswith("replica r0: watch stream error: UNAVAILABLE; reconnecting") or
               m.startswith("replica r0: watch stream ended; reconnecting") for m in msgs), msgs
    assert sum(m.startswith("replica r0: watch stream back after ") for m in msgs) == 1, msgs


async def test_silent_stream_is_reopened(fleet: Fleet) -> None:
    await fleet.start({"r0": 400.0}, silence_s=0.3)
    fleet.admission["r0"].pushing = False
    await asyncio.sleep(0.8)
    assert fleet.admission["r0"].watch_calls >= 2
    fleet.admission["r0"].pushing = True
    await fleet.wait_fresh({"r0"})


async def test_client_disconnect_mid_stream_releases(fleet: Fleet) -> None:
    await fleet.start({"r0": 400.0}, modes={"r0": "slow"})
    assert fleet.session is not None
    resp = await fleet.session.post(
        fleet.url + "/v1/completions", json=completion(stream=True), headers={"Authorization": f"Bearer {API_KEY}"}
    )
    assert resp.status == 200
    first = await resp.content.readany()
    assert first.startswith(b"data: ")
    resp.close()  # client goes away mid-stream
    await asyncio.wait_for(fleet.upstreams["r0"].disconnected.wait(), 3.0)
    loop = asyncio.get_running_loop()
    end = loop.time() + 10.0
    while not fleet.admission["r0"].releases and loop.time() < end:
        await asyncio.sleep(0.02)
    assert [r.lease_id for r in fleet.admission["r0"].releases] == ["r0-lease-1"]
    assert fleet.admission["r0"].releases[0].reason == "client-disconnect"


async def test_client_disconnect_while_queued_leaves_queue(fleet: Fleet) -> None:
    await fleet.start({"r0": 0.0})
    task = asyncio.create_task(fleet.post(completion()))
    await asyncio.sleep(0.2)
    assert fleet.router is not None and len(fleet.router.queue) == 1
    task.cancel()
    loop = asyncio.get_running_loop()
    end = loop.time() + 10.0
    while len(fleet.router.queue) and loop.time() < end:
        await asyncio.sleep(0.02)
    assert len(fleet.router.queue) == 0


@pytest.mark.parametrize("mode", ["fail503", "drop", "error-first"])
async def test_failure_before_first_byte_retried_elsewhere(fleet: Fleet, mode: str) -> None:
    await fleet.start({"r0": 400.0, "r1": 300.0}, modes={"r0": mode})
    resp = await fleet.post(completion(stream=True))
    assert resp.status == 200
    assert resp.headers["x-fairbatch-replica"] == "r1"
    assert await resp.read() == b"".join(fleet.upstreams["r1"].chunks())
    assert len(fleet.upstreams["r0"].hits) == 1
    loop = asyncio.get_running_loop()
    end = loop.time() + 10.0
    while not fleet.admission["r0"].releases and loop.time() < end:
        await asyncio.sleep(0.02)
    assert [r.lease_id for r in fleet.admission["r0"].releases] == ["r0-lease-1"]
    metrics = await (await fleet.session.get(fleet.url + "/metrics")).text()  # type: ignore[union-attr]
    assert 'fairbatch_router_requests_total{outcome="ok",slo_class="interactive",tenant="acme"} 1.0' in metrics


@pytest.mark.parametrize("stream", [False, True])
async def test_engine_refusal_is_relayed_not_retried_and_frees_everything(fleet: Fleet, stream: bool) -> None:
    # a 400 from the engine is the client's error: every replica would answer the same, so no retry; the
    # lease goes back, the tenant is not charged for work that never ran, and the outcome is not "ok"
    await fleet.start({"r0": 400.0, "r1": 300.0}, modes={"r0": "bad-request", "r1": "bad-request"})
    assert fleet.router is not None
    before = fleet.router.queue.counter("acme")
    resp = await fleet.post(completion(stream=stream))
    assert resp.status == 400 and resp.headers["x-fairbatch-replica"] == "r0"
    assert (await resp.json())["error"]["message"] == "max_tokens must be at least 1, got -5."
    assert len(fleet.upstreams["r0"].hits) == 1 and not fleet.upstreams["r1"].hits
    loop = asyncio.get_running_loop()
    end = loop.time() + 10.0
    while not fleet.admission["r0"].releases and loop.time() < end:
        await asyncio.sleep(0.02)
    assert [(r.lease_id, r.reason) for r in fleet.admission["r0"].releases] == [("r0-lease-1", "upstream-refused")]
    assert fleet.admission["r0"].pab_ms == 400.0  # the reservation is back
    assert fleet.router.queue.counter("acme") == before
    metrics = await (await fleet.session.get(fleet.url + "/metrics")).text()  # type: ignore[union-attr]
    assert 'fairbatch_router_requests_total{outcome="upstream_refused",slo_class="interactive",tenant="acme"} 1.0' \
        in metrics
    assert 'outcome="ok"' not in metrics


async def test_failure_mid_stream_ends_with_error_event(fleet: Fleet) -> None:
    await fleet.start({"r0": 400.0, "r1": 300.0}, modes={"r0": "cut"}, max_migrations=0)  # migration off
    resp = await fleet.post(completion(stream=True))
    assert resp.status == 200 and resp.headers["x-fairbatch-replica"] == "r0"
    raw = await resp.read()
    chunks = fleet.upstreams["r0"].chunks()
    assert raw.startswith(chunks[0] + chunks[1])
    events = [e for e in raw.decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    err = json.loads(events[-2][len("data: "):])["error"]
    assert err["type"] == "upstream_error" and err["code"] == 502 and err["message"]
    assert not fleet.upstreams["r1"].hits  # no retry after the first byte


@pytest.mark.parametrize("mode", ["cut", "error-mid", "freeze"])
async def test_failure_mid_stream_is_continued_on_another_replica(fleet: Fleet, mode: str) -> None:
    """Migration on (the default, 3): r0 sends " t0" " t1" then fails (connection cut, the agent's error
    event, or silence); the router continues on r1 with the prompt + " t0 t1" and max_tokens 4 - 2 = 2,
    relays r1's events into the same stream under r0's response id, and releases r0's lease. The fake r1
    streams its canned three events (not a real continuation; the real one is tests/integration/
    test_stream_migration.py)."""
    await fleet.start({"r0": 400.0, "r1": 300.0}, modes={"r0": mode})
    assert fleet.router is not None
    if mode == "freeze":
        fleet.router.silence_s = lambda slo: 0.5  # type: ignore[method-assign]
    resp = await fleet.post(completion(stream=True))
    assert resp.status == 200 and resp.headers["x-fairbatch-replica"] == "r0"
    raw = await asyncio.wait_for(resp.read(), 10.0)
    events = [e for e in raw.decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    texts = [json.loads(e[len("data: "):])["choices"][0]["text"] for e in events[:-1]]
    assert texts == [" t0", " t1", " t0", " t1", " t2"] and "error" not in raw.decode()
    body = json.loads(fleet.upstreams["r1"].bodies[0])
    assert body["prompt"] == PROMPT + " t0 t1" and body["max_tokens"] == 2 and body["stream"] is True
    assert fleet.upstreams["r1"].hits[0]["x-request-id"].endswith("-m1")
    loop = asyncio.get_running_loop()
    end = loop.time() + 10.0
    while not fleet.admission["r0"].releases and loop.time() < end:
        await asyncio.sleep(0.02)
    assert [(r.lease_id, r.reason) for r in fleet.admission["r0"].releases] == [("r0-lease-1", "upstream-error")]
    metrics = await (await fleet.session.get(fleet.url + "/metrics")).text()  # type: ignore[union-attr]
    cause = {"cut": "disconnect", "error-mid": "error_event", "freeze": "silence"}[mode]
    assert f'fairbatch_router_stream_migrations_total{{cause="{cause}",outcome="resumed"}} 1.0' in metrics
    assert 'fairbatch_router_stream_migration_added_seconds_count 1.0' in metrics
    assert 'fairbatch_router_requests_total{outcome="ok",slo_class="interactive",tenant="acme"} 1.0' in metrics


async def test_migration_gives_up_when_no_replica_is_left(fleet: Fleet) -> None:
    """Both replicas fail mid-stream: r0's continuation goes to r1, r1's finds no replica (both excluded):
    the stream ends with the SSE error event and [DONE], outcome upstream_error."""
    await fleet.start({"r0": 400.0, "r1": 300.0}, modes={"r0": "cut", "r1": "cut"}, max_queue_ms=300)
    resp = await fleet.post({**completion(stream=True), "max_tokens": 10})
    raw = await asyncio.wait_for(resp.read(), 10.0)
    events = [e for e in raw.decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][len("data: "):])["error"]["code"] == 502
    texts = [json.loads(e[len("data: "):])["choices"][0]["text"] for e in events[:-2]]
    assert texts == [" t0", " t1", " t0", " t1"]
    assert len(fleet.upstreams["r1"].hits) == 1
    metrics = await (await fleet.session.get(fleet.url + "/metrics")).text()  # type: ignore[union-attr]
    assert 'fairbatch_router_stream_migrations_total{cause="disconnect",outcome="failed"} 1.0' in metrics
    assert 'fairbatch_router_stream_migrations_total{cause="disconnect",outcome="no_replica"} 1.0' in metrics
    assert 'fairbatch_router_requests_total{outcome="upstream_error",slo_class="interactive",tenant="acme"} 1.0' \
        in metrics


async def test_migration_limit_holds(fleet: Fleet) -> None:
    """migration.max_migrations 1: r0 fails mid-stream, its continuation on r1 fails too; the limit
    stops there (r2, healthy, is never asked) and the stream ends with the SSE error event."""
    # budgets fresh for 10 s: on a loaded machine r1's pushes can come later than the usual 300 ms TTL, and a
    # stale r1 (budget 0) sent the continuation to r2, which then served it whole
    await fleet.start({"r0": 400.0, "r1": 350.0, "r2": 300.0}, modes={"r0": "cut", "r1": "cut"}, max_migrations=1,
                      ttl_ms=10_000)
    resp = await fleet.post({**completion(stream=True), "max_tokens": 10})
    raw = await asyncio.wait_for(resp.read(), 10.0)
    events = [e for e in raw.decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]" and json.loads(events[-2][len("data: "):])["error"]["code"] == 502
    assert len(fleet.upstreams["r1"].hits) == 1 and not fleet.upstreams["r2"].hits
    metrics = await (await fleet.session.get(fleet.url + "/metrics")).text()  # type: ignore[union-attr]
    assert 'fairbatch_router_stream_migrations_total{cause="disconnect",outcome="limit"} 1.0' in metrics


async def test_error_event_mid_stream_counts_as_a_failure(fleet: Fleet) -> None:
    """The agent whose engine dies mid-stream sends an error event and [DONE]: the client gets it as
    sent, and the router counts an upstream_error and an SLO miss, not an ok answer (a user's trial:
    a crashed engine's streams were counted ok and attained)."""
    await fleet.start({"r0": 400.0, "r1": 300.0}, modes={"r0": "error-mid"}, max_migrations=0)  # migration off
    resp = await fleet.post(completion(stream=True))
    assert resp.status == 200 and resp.headers["x-fairbatch-replica"] == "r0"
    raw = await resp.read()
    chunks = fleet.upstreams["r0"].chunks()
    assert raw.startswith(chunks[0] + chunks[1]) and raw.endswith(b"data: [DONE]\n\n")
    events = [e for e in raw.decode().split("\n\n") if e]
    assert json.loads(events[-2][len("data: "):])["error"]["code"] == 502  # relayed whole, across the split
    assert not fleet.upstreams["r1"].hits  # tokens went out: no retry
    metrics = await (await fleet.session.get(fleet.url + "/metrics")).text()  # type: ignore[union-attr]
    assert 'fairbatch_router_requests_total{outcome="upstream_error",slo_class="interactive",tenant="acme"} 1.0' \
        in metrics
    assert 'outcome="ok"' not in metrics
    assert 'fairbatch_router_slo_misses_total{kind="failed",slo_class="interactive",tenant="acme"} 1.0' in metrics


async def test_a_frozen_agent_does_not_hold_the_stream(fleet: Fleet) -> None:
    """An agent that stops mid-stream (SIGSTOP) with the socket open: the router gives it up after its
    silence limit (Router.silence_s, here 0.5 s) with an error event, not after the pool's 600 s."""
    await fleet.start({"r0": 400.0, "r1": 300.0}, modes={"r0": "freeze"}, max_migrations=0)  # migration off
    assert fleet.router is not None
    limit = fleet.router.silence_s(fleet.router.config.slo_classes["interactive"])
    assert limit == pytest.approx(2 * 3.0 + 5.0)  # twice the default stall of TTFT 500 / TPOT 50 (3 s), + 5 s
    fleet.router.silence_s = lambda slo: 0.5  # type: ignore[method-assign]
    loop = asyncio.get_running_loop()
    async with LoopLag() as lag:
        t0 = loop.time()
        resp = await fleet.post(completion(stream=True))
        assert resp.status == 200 and resp.headers["x-fairbatch-replica"] == "r0"
        raw = await asyncio.wait_for(resp.read(), 60.0)
        # the 0.5 s silence limit after the chunks before the freeze, not the pool's 600 s
        assert loop.time() - t0 <= lag.bound_s(0.5 + 1.0)
    chunks = fleet.upstreams["r0"].chunks()
    assert raw.startswith(chunks[0] + chunks[1]) and raw.endswith(b"data: [DONE]\n\n")
    events = [e for e in raw.decode().split("\n\n") if e]
    err = json.loads(events[-2][len("data: "):])["error"]
    assert err["type"] == "upstream_error" and "UpstreamTimeout" in err["message"]
    metrics = await (await fleet.session.get(fleet.url + "/metrics")).text()  # type: ignore[union-attr]
    assert 'fairbatch_router_requests_total{outcome="upstream_error",slo_class="interactive",tenant="acme"} 1.0' \
        in metrics


async def test_error_event_first_everywhere_is_relayed(fleet: Fleet) -> None:
    await fleet.start({"r0": 400.0, "r1": 300.0}, modes={"r0": "error-first", "r1": "error-first"})
    resp = await fleet.post(completion(stream=True))
    assert resp.status == 200
    raw = await resp.read()
    assert raw.startswith(b'data: {"error"') and raw.endswith(b"data: [DONE]\n\n")
    assert len(fleet.upstreams["r0"].hits) == len(fleet.upstreams["r1"].hits) == 1


async def test_all_replicas_fail_503(fleet: Fleet) -> None:
    await fleet.start({"r0": 400.0, "r1": 300.0}, modes={"r0": "drop", "r1": "drop"})
    resp = await fleet.post(completion())
    assert resp.status == 503
    assert (await resp.json())["error"]["type"] == "service_unavailable"


async def test_models_health_metrics(fleet: Fleet) -> None:
    await fleet.start({"r0": 400.0})
    assert fleet.session is not None
    models = await (await fleet.session.get(fleet.url + "/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})).json()
    assert models["data"][0]["id"] == "sim-model"
    assert (await fleet.session.get(fleet.url + "/v1/models")).status == 401  # a key, as for every /v1 path
    health = await fleet.session.get(fleet.url + "/health")
    assert health.status == 200 and (await health.json())["replicas_usable"] == ["r0"]
    assert "x-request-id" in health.headers
    await fleet.post(completion())
    text = await (await fleet.session.get(fleet.url + "/metrics")).text()
    for name in ("fairbatch_router_requests_total", "fairbatch_router_queue_depth",
                 "fairbatch_router_queue_wait_seconds", "fairbatch_router_placement_seconds",
                 "fairbatch_router_reserve_seconds", 'fairbatch_router_budget_age_seconds{replica="r0"}',
                 'fairbatch_router_ttft_seconds_count{slo_class="interactive",tenant="acme"}', "process_cpu_seconds_total",
                 'fairbatch_build_info{component="router"'):
        assert name in text, name
    # the fake agent advertises 400 ms of PAB: exported in seconds, per replica and summed over the fleet
    assert "fairbatch_router_inflight_requests 0.0" in text  # the one request ended
    assert "_ms" not in "".join(line.split("{")[0] for line in text.splitlines() if line.startswith("fairbatch_"))


async def test_fleet_spare_capacity_metrics(fleet: Fleet) -> None:
    """The autoscaling signal: PAB per replica in seconds, its sum over the fleet, and the count of
    replicas without PAB (400 ms + 300 ms advertised = 0.7 s; r1 at 0 -> one replica without)."""
    await fleet.start({"r0": 400.0, "r1": 300.0})
    assert fleet.session is not None

    async def sample(name: str) -> float:
        text = await (await fleet.session.get(fleet.url + "/metrics")).text()  # type: ignore[union-attr]
        return next(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " "))

    assert await sample('fairbatch_router_replica_pab_seconds{replica="r0",slo_class="interactive"}') == 0.4
    assert await sample('fairbatch_router_replica_pab_seconds{replica="r1",slo_class="interactive"}') == 0.3
    assert abs(await sample('fairbatch_router_fleet_pab_seconds{slo_class="interactive"}') - 0.7) < 1e-9
    assert await sample('fairbatch_router_fleet_replicas_without_pab{slo_class="interactive"}') == 0.0
    fleet.admission["r1"].set_budget(0.0)
    for _ in range(250):  # the fake agent pushes every 50 ms
        if await sample('fairbatch_router_fleet_replicas_without_pab{slo_class="interactive"}') == 1.0:
            break
        await asyncio.sleep(0.02)
    assert abs(await sample('fairbatch_router_fleet_pab_seconds{slo_class="interactive"}') - 0.4) < 1e-9
    assert await sample('fairbatch_router_fleet_replicas_without_pab{slo_class="interactive"}') == 1.0


async def test_unknown_path_and_wrong_method_answer_openai_errors(fleet: Fleet) -> None:
    await fleet.start({"r0": 400.0})
    assert fleet.session is not None
    async with fleet.session.get(fleet.url + "/v1/nope") as resp:
        assert resp.status == 404 and resp.content_type == "application/json"
        err = (await resp.json())["error"]
        # any unrouted path names what the router serves (router/openai_surface.py), as the README says
        assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", None, "unsupported_endpoint")
        assert err["message"].startswith("GET /v1/nope is not supported by fairbatch-router; supported: ")
        assert "POST /v1/completions" in err["message"]
    async with fleet.session.get(fleet.url + "/v1/completions") as resp:
        assert resp.status == 405 and resp.headers["Allow"] == "POST"
        assert (await resp.json())["error"]["message"] == "Method Not Allowed: GET /v1/completions"
