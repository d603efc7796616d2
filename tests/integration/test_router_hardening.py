"""The router under hostile or broken input, over real HTTP on loopback (issue 14): every refusal a 4xx in
OpenAI's error JSON, no poisoned queue, no concurrency bypass through a repeated x-request-id, bounded bodies.

Replicas are the test doubles of tests/integration/fake_agents.py (a = 10 ms, b = 0.1 ms/token, horizon 450 ms;
400 ASCII bytes = 100 tokens -> 20 ms of prefill, max context 32,768 tokens).
"""

from __future__ import annotations

import asyncio
import json
from urllib.parse import urlsplit

import pytest
import redis.asyncio

from tests.integration.test_router_fake_agents import Fleet
from tests.integration.test_router_tenants import KEYS, PROMPT, InProcess, fleet  # noqa: F401 - the fixture
from tests.redis_fixture import RedisServer, redis_clean, redis_server  # noqa: F401
from tests.timing import LoopLag

ACME = {"acme": {"weight": 1, "slo_class": "interactive"}}



async def raw_http(url: str, data: bytes, read_timeout_s: float = 3.0, then: bytes | None = None) -> bytes:
    """Send ``data`` as is on a new connection; return what came back before it closed or went quiet.
    ``then``: sent once a ``100 Continue`` has come back (a client that waited for it)."""
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    try:
        writer.write(data)
        await writer.drain()
        out = b""
        loop = asyncio.get_running_loop()
        end = loop.time() + read_timeout_s
        while loop.time() < end:
            try:
                chunk = await asyncio.wait_for(reader.read(65536), max(0.01, end - loop.time()))
            except TimeoutError:
                break
            if not chunk:
                break
            out += chunk
            final = out
            if out.startswith(b"HTTP/1.1 100 Continue\r\n\r\n"):
                final = out[len(b"HTTP/1.1 100 Continue\r\n\r\n"):]
                if then is not None:
                    writer.write(then)
                    await writer.drain()
                    then = None
            if b"\r\n\r\n" in final:
                head, _, rest = final.partition(b"\r\n\r\n")
                length = [int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:")]
                if length and len(rest) >= length[0]:
                    break
        return out
    finally:
        writer.close()


def post_bytes(body: bytes, key: str = KEYS["acme"], extra: bytes = b"", path: bytes = b"/v1/completions") -> bytes:
    return (b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + key.encode() + b"\r\n"
            b"Content-Type: application/json\r\n" + extra + b"Content-Length: " + str(len(body)).encode()
            + b"\r\n\r\n" + body)


def status_and_json(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ")[1])
    return status, json.loads(body)


BAD_BODIES = {
    "deep-nesting": b'{"model": "m", "prompt": "x", "a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "lone-surrogate": b'{"model": "m", "prompt": "abc\\ud800def"}',
    "lone-surrogate-chat": b'{"model": "m", "messages": [{"role": "user", "content": "\\udc00"}]}',
    "max-tokens-10e400": b'{"model": "m", "prompt": "x", "max_tokens": 1' + b"0" * 400 + b"}",
    "max-tokens-2e63": b'{"model": "m", "prompt": "x", "max_tokens": 9223372036854775808}',
    "max-tokens-over-context": b'{"model": "m", "prompt": "x", "max_tokens": 40000}',
    "n-huge": b'{"model": "m", "prompt": "x", "n": 100000}',
    "not-utf8": b'{"model": "m", "prompt": "\xff\xfe"}',
    "nan": b'{"model": "m", "prompt": "x", "temperature": NaN}',
}


async def test_bad_bodies_are_4xx_openai_json_and_nothing_is_held(fleet: InProcess) -> None:
    await fleet.start({"r0": 400.0}, ACME)
    assert fleet.router is not None
    for name, body in BAD_BODIES.items():
        path = b"/v1/chat/completions" if "chat" in name else b"/v1/completions"
        status, doc = status_and_json(await raw_http(fleet.url, post_bytes(body, path=path)))
        assert status == 400, name
        assert set(doc["error"]) == {"message", "type", "param", "code"}, name
    # Content-Encoding: gzip on a plain body: 415, not aiohttp's 500 while inflating it
    status, doc = status_and_json(await raw_http(fleet.url, post_bytes(b'{"model": "m", "prompt": "x"}',
                                                                      extra=b"Content-Encoding: gzip\r\n")))
    assert status == 415 and doc["error"]["code"] == "unsupported_content_encoding"
    assert not fleet.replicas.upstreams["r0"].hits and not fleet.replicas.admission["r0"].reserves
    assert fleet.router.ledger.local.in_flight("acme") == 0  # type: ignore[attr-defined]
    metrics = await (await fleet.session.get(fleet.url + "/metrics")).text()
    assert f'outcome="bad_request",slo_class="interactive",tenant="acme"}} {len(BAD_BODIES) + 1}.0' in metrics


async def test_non_utf8_authorization_is_401(fleet: InProcess) -> None:
    await fleet.start({"r0": 400.0}, ACME)
    body = json.dumps({"model": "m", "prompt": "x"}).encode()
    req = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-\xff\xfe\x80key\r\n"
           b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    status, doc = status_and_json(await raw_http(fleet.url, req))
    assert status == 401 and doc["error"]["code"] == "invalid_api_key"


async def test_body_over_the_limit_is_413_before_it_is_sent(fleet: InProcess) -> None:
    await fleet.start({"r0": 400.0}, ACME, http={"max_body_bytes": 4096, "body_timeout_s": 0.5})
    # the headers announce 50 MB and not one body byte follows: the answer comes from Content-Length alone
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEYS["acme"].encode()
            + b"\r\nContent-Length: 50000000\r\n\r\n")
    status, doc = status_and_json(await raw_http(fleet.url, head))
    assert status == 413 and doc["error"]["code"] == "body_too_large"
    assert "(50000000 bytes) is larger than the limit of 4096 bytes" in doc["error"]["message"]
    # chunked, no length: refused once 4,096 bytes have arrived
    resp = await fleet.session.post(fleet.url + "/v1/completions", data=_chunks(b"x" * 1024, 8),
                                    headers={"Authorization": f"Bearer {KEYS['acme']}"})
    assert resp.status == 413 and (await resp.json())["error"]["code"] == "body_too_large"


async def test_expect_100_continue_only_for_a_body_that_will_be_read(fleet: InProcess) -> None:
    """A client that sends ``Expect: 100-continue`` uploads nothing until the 100; a body the router
    refuses from its headers gets the refusal instead of a 100 (a fresh-user trial: curl got 100
    Continue and then the 413)."""
    await fleet.start({"r0": 400.0}, ACME, http={"max_body_bytes": 4096, "body_timeout_s": 0.5})
    auth = b"Authorization: Bearer " + KEYS["acme"].encode() + b"\r\n"
    big = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + auth + b"Expect: 100-continue\r\nContent-Length: 4800059\r\n\r\n"
    out = await raw_http(fleet.url, big)
    assert out.startswith(b"HTTP/1.1 413 ") and b"100 Continue" not in out
    status, doc = status_and_json(out)
    assert status == 413 and doc["error"]["code"] == "body_too_large"
    gz = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + auth + b"Expect: 100-continue\r\nContent-Encoding: gzip\r\nContent-Length: 10\r\n\r\n"
    out = await raw_http(fleet.url, gz)
    assert out.startswith(b"HTTP/1.1 415 ") and b"100 Continue" not in out
    # a body within the limit: 100 Continue, then the body, then the answer
    body = json.dumps({"model": "m", "prompt": "x" * 40, "max_tokens": 2}).encode()
    small = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + auth + b"Content-Type: application/json\r\n"
             b"Expect: 100-continue\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n")
    out = await raw_http(fleet.url, small, read_timeout_s=1.0, then=body)
    assert out.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 "), out[:200]
    odd = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + auth + b"Expect: 200-ok\r\nContent-Length: 2\r\n\r\n{}"
    status, doc = status_and_json(await raw_http(fleet.url, odd))
    assert status == 417 and doc["error"]["code"] == "expectation_failed"


async def _chunks(piece: bytes, n: int):
    for _ in range(n):
        yield piece


async def test_half_sent_body_times_out_with_408(fleet: InProcess) -> None:
    await fleet.start({"r0": 400.0}, ACME, http={"max_body_bytes": 4096, "body_timeout_s": 0.3})
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEYS["acme"].encode()
            + b"\r\nContent-Length: 100\r\n\r\n{\"model\": ")
    loop = asyncio.get_running_loop()
    async with LoopLag() as lag:
        t0 = loop.time()
        status, doc = status_and_json(await raw_http(fleet.url, head, read_timeout_s=30.0))
        assert status == 408 and doc["error"]["code"] == "body_timeout"
        assert 0.25 <= loop.time() - t0 <= lag.bound_s(0.3)  # at body_timeout_s, as late as the loop ran
    assert fleet.router is not None and fleet.router.ledger.local.in_flight("acme") == 0  # type: ignore[attr-defined]


async def test_a_poison_request_in_the_queue_is_answered_and_the_others_flow() -> None:
    # the replica has no budget: good, poison, good, good queue up. Placement of the poison raises (as building
    # the Reserve of max_tokens 2**63 did before validation); when budget appears the good ones must be served
    # and the poison answered 503 placement-error, not left at the head failing on every pass.
    fleet = Fleet()
    try:
        await fleet.start({"r0": 0.0}, ttft_ms=5000, max_queue_ms=5000)
        router = fleet.router
        assert router is not None
        real_reserve = router.budgets.reserve

        async def reserve(replica_id, slo_class, prompt_tokens, request_id, max_tokens=0, waited_ms=0.0,
                          on_time_only=False):
            if prompt_tokens == 77:
                raise ValueError("Value out of range")
            return await real_reserve(replica_id, slo_class, prompt_tokens, request_id, max_tokens, waited_ms)

        router.budgets.reserve = reserve  # type: ignore[method-assign]
        loop = asyncio.get_running_loop()
        tasks = []
        for prompt in (PROMPT, "y" * 308, PROMPT, PROMPT):  # 308 bytes = 77 tokens: the poison
            body = {"model": "sim-model", "prompt": prompt, "max_tokens": 4}
            tasks.append(asyncio.create_task(fleet.post(body)))
            await asyncio.sleep(0.05)
        assert len(router.queue) == 4
        t0 = loop.time()
        fleet.admission["r0"].set_budget(400.0)
        resps = await asyncio.wait_for(asyncio.gather(*tasks), 5.0)
        served_s = loop.time() - t0
        assert [r.status for r in resps] == [200, 503, 200, 200]
        poison = resps[1]
        assert poison.headers["x-fairbatch-reason"] == "placement-error"
        assert (await poison.json())["error"]["code"] == "placement-error"
        # served, not left behind the poison until their 5 s queue deadline (429 queue-timeout): the statuses
        # above tell, with no wall-clock bound
        assert len(router.queue) == 0 and router.ledger.local.in_flight("acme") == 0  # type: ignore[attr-defined]
        print(f"poison case: 3 good requests served and the poison answered {served_s * 1000:.0f} ms after "
              "budget came")
    finally:
        await fleet.stop()


async def test_a_repeated_request_id_does_not_bypass_max_concurrency(fleet: InProcess) -> None:
    await fleet.start({"r0": 400.0}, {"acme": {"weight": 1, "slo_class": "interactive", "max_concurrency": 4}},
                      modes={"r0": "slow"})
    router = fleet.router
    assert router is not None
    resps = await asyncio.gather(*(fleet.post("acme", stream=True, headers={"x-request-id": "same-id"})
                                   for _ in range(12)))
    statuses = sorted(r.status for r in resps)
    upstream = fleet.replicas.upstreams["r0"]
    try:
        assert statuses == [200] * 4 + [429] * 8
        assert all(r.headers["x-fairbatch-reason"] == "tenant-concurrency" for r in resps if r.status == 429)
        assert all(r.headers["x-request-id"] == "same-id" for r in resps)  # echoed, nothing more
        assert len(upstream.hits) == 4  # at most 4 ran at once
        assert len({h["x-request-id"] for h in upstream.hits}) == 4  # each with its own router-made id
        assert router.ledger.local.in_flight("acme") == 4  # type: ignore[attr-defined]
    finally:
        for r in resps:
            r.close()
    loop = asyncio.get_running_loop()
    end = loop.time() + 10.0
    while loop.time() < end and (router.ledger.local.in_flight("acme") or fleet.replicas.admission["r0"].leases):  # type: ignore[attr-defined]
        await asyncio.sleep(0.02)
    assert router.ledger.local.in_flight("acme") == 0  # type: ignore[attr-defined]
    print(f"repeated-id case: 12 requests with one x-request-id, max_concurrency 4: {statuses.count(200)} ran, "
          f"{statuses.count(429)} got 429 tenant-concurrency")


async def test_full_queue_is_refused_before_the_body_is_read(fleet: InProcess) -> None:
    await fleet.start({"r0": 0.0}, {"acme": {"weight": 1, "slo_class": "batch"}}, queue={"max_requests": 1})
    waiting = asyncio.create_task(fleet.post("acme"))
    await asyncio.sleep(0.1)
    assert fleet.router is not None and len(fleet.router.queue) == 1
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEYS["acme"].encode()
            + b"\r\nContent-Length: 1000\r\n\r\n")  # no body sent: the answer must not wait for it
    status, doc = status_and_json(await raw_http(fleet.url, head, read_timeout_s=2.0))
    assert status == 429 and doc["error"]["code"] == "queue-full"
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)


@pytest.mark.redis
async def test_a_repeated_request_id_does_not_bypass_max_concurrency_in_redis(fleet: InProcess,
                                                                              redis_clean: RedisServer) -> None:
    # the same through the shared ledger (the Lua acquire keys the slot by the router-made id)
    await fleet.start({"r0": 400.0}, {"acme": {"weight": 1, "slo_class": "interactive", "max_concurrency": 4}},
                      modes={"r0": "slow"}, redis_url=redis_clean.url,
                      # the ledger's 200 ms per call is a production setting; on a loaded test machine a
                      # call can take longer and the router then rightly falls back to its local ledger,
                      # which is not what this test checks
                      ledger={"key_prefix": "hard", "timeout_ms": 10_000})
    router = fleet.router
    assert router is not None and not router.ledger.degraded
    client = redis.asyncio.Redis.from_url(redis_clean.url)
    try:
        resps = await asyncio.gather(*(fleet.post("acme", stream=True, headers={"x-request-id": "same-id"})
                                       for _ in range(12)))
        statuses = sorted(r.status for r in resps)
        try:
            assert statuses == [200] * 4 + [429] * 8
            assert len(fleet.replicas.upstreams["r0"].hits) == 4
            assert await client.zcard("hard:conc:acme") == 4
        finally:
            for r in resps:
                r.close()
        loop = asyncio.get_running_loop()
        end = loop.time() + 10.0
        while loop.time() < end and await client.zcard("hard:conc:acme"):
            await asyncio.sleep(0.02)
        assert await client.zcard("hard:conc:acme") == 0  # every slot released
    finally:
        await client.aclose()


async def test_metrics_port_keeps_names_off_the_public_port(fleet: InProcess) -> None:
    await fleet.start({"r0": 400.0}, ACME, http={"metrics_port": 1})  # the port number is the CLI's business
    router = fleet.router
    assert router is not None
    from aiohttp import web

    from fairbatch_common.http_guard import make_runner

    runner = make_runner(router.build_metrics_app())
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    murl = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        assert (await fleet.post("acme")).status == 200
        public = await fleet.session.get(fleet.url + "/metrics")
        assert public.status == 404 and (await public.json())["error"]["code"] == "unsupported_endpoint"
        assert await (await fleet.session.get(fleet.url + "/health")).json() == {"status": "ok"}
        text = await (await fleet.session.get(murl + "/metrics")).text()
        assert 'tenant="acme"' in text and 'replica="r0"' in text
        assert (await (await fleet.session.get(murl + "/health")).json())["replicas_usable"] == ["r0"]
    finally:
        await runner.cleanup()


async def test_a_tenant_at_its_concurrency_cap_is_refused_before_the_body_is_read(fleet: InProcess) -> None:
    await fleet.start({"r0": 400.0}, {"acme": {"weight": 1, "slo_class": "interactive", "max_concurrency": 1}},
                      modes={"r0": "slow"})
    first = await fleet.post("acme", stream=True)
    assert first.status == 200
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEYS["acme"].encode()
            + b"\r\nContent-Length: 1000\r\n\r\n")  # no body follows
    status, doc = status_and_json(await raw_http(fleet.url, head, read_timeout_s=2.0))
    assert status == 429 and doc["error"]["code"] == "tenant-concurrency"
    first.close()
