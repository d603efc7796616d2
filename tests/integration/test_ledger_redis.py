"""router/ledger.py, Redis backend, against a real redis-server started by the suite.

Two ledgers on one Redis stand for two router processes: they share token buckets, concurrency
slots and VTC counters. Killing Redis mid-run degrades both to their local ledgers (reported
through ``on_degraded``); restarting it makes them rejoin.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import pytest

from router.ledger import RedisLedger, Refusal, TenantLimits, Ticket
from tests.redis_fixture import RedisServer, redis_clean, redis_server  # noqa: F401

pytestmark = pytest.mark.redis


@dataclass
class Clk:
    scale: float = 1.0
    t: float = 0.0

    def now_ms(self) -> float:
        return self.t


def make(server: RedisServer, states: list[bool] | None = None, prefix: str = "t") -> RedisLedger:
    return RedisLedger(server.url, Clk(), key_prefix=prefix, timeout_ms=300, retry_initial_ms=50,
                       retry_max_ms=200, on_degraded=(states.append if states is not None else None))


async def test_two_ledgers_share_one_token_bucket(redis_clean: RedisServer) -> None:
    a, b = make(redis_clean), make(redis_clean)
    await a.start()
    await b.start()
    try:
        lim = TenantLimits(tokens_per_minute=600)
        t0 = time.monotonic()
        assert await a.acquire("acme", "r1", lim, 400) == Ticket("acme", "r1", "redis")
        refusal = await b.acquire("acme", "r2", lim, 400)  # the other router sees 200 left
        elapsed_ms = (time.monotonic() - t0) * 1000.0
        assert isinstance(refusal, Refusal) and refusal.reason == "tenant-rate"
        # 200 tokens short at 0.01 / ms = 20,000 ms, less what Redis's clock refilled between the two calls
        # (0.01 token per ms that passed: at most elapsed_ms of the wait), however slow the machine was
        assert 20_000 - elapsed_ms - 1.0 <= refusal.retry_after_ms <= 20_000
        assert isinstance(await b.acquire("acme", "r3", lim, 150), Ticket)
        assert isinstance(await a.acquire("acme", "r4", lim, 100), Refusal)  # 50 left (+ refill)
        assert isinstance(await a.acquire("other", "r5", lim, 400), Ticket)  # per tenant
    finally:
        await a.close()
        await b.close()


async def test_two_ledgers_share_concurrency_and_requests(redis_clean: RedisServer) -> None:
    a, b = make(redis_clean), make(redis_clean)
    await a.start()
    await b.start()
    try:
        lim = TenantLimits(max_concurrency=2, requests_per_minute=1000)
        t1 = await a.acquire("acme", "r1", lim, 1)
        t2 = await b.acquire("acme", "r2", lim, 1)
        assert isinstance(t1, Ticket) and isinstance(t2, Ticket)
        assert await a.acquire("acme", "r3", lim, 1) == Refusal("tenant-concurrency", 1000.0)
        await b.release(t1)  # any router can free a shared slot
        assert isinstance(await b.acquire("acme", "r3", lim, 1), Ticket)
        rpm = TenantLimits(requests_per_minute=2)
        assert isinstance(await a.acquire("beta", "q1", rpm, 1), Ticket)
        assert isinstance(await b.acquire("beta", "q2", rpm, 1), Ticket)
        assert (await a.acquire("beta", "q3", rpm, 1)).reason == "tenant-rate"  # type: ignore[union-attr]
    finally:
        await a.close()
        await b.close()


async def test_shared_vtc_counters(redis_clean: RedisServer) -> None:
    a, b = make(redis_clean), make(redis_clean)
    await a.start()
    await b.start()
    try:
        await a.add_service("acme", 100.0)
        await b.add_service("acme", 50.5)
        await b.lift("beta", 120.0)
        await a.lift("beta", 80.0)  # never lowers
        assert await a.counters() == {"acme": 150.5, "beta": 120.0}
        assert await b.counters() == {"acme": 150.5, "beta": 120.0}
    finally:
        await a.close()
        await b.close()


async def restart_and_rejoin(redis: RedisServer, led: RedisLedger, timeout_s: float = 5.0) -> None:
    """Start Redis again and wait (at most ``timeout_s``) until ``led`` has rejoined it."""
    redis.start()
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout_s
    while led.degraded and loop.time() < end:
        await asyncio.sleep(0.05)
    assert not led.degraded


async def test_redis_killed_degrades_to_local_then_rejoins(redis_clean: RedisServer) -> None:
    states: list[bool] = []
    led = make(redis_clean, states)
    await led.start()
    try:
        lim = TenantLimits(max_concurrency=1)
        first = await led.acquire("acme", "r1", lim, 1)
        assert first == Ticket("acme", "r1", "redis")
        redis_clean.stop()
        # Redis gone: served on the local ledger at once (its own, fresh limits), degraded reported
        t = await led.acquire("acme", "r2", lim, 1)
        assert t == Ticket("acme", "r2", "local")
        assert led.degraded and states == [True]
        assert await led.acquire("acme", "r3", lim, 1) == Refusal("tenant-concurrency", 1000.0)
        await led.release(t)  # type: ignore[arg-type]
        await led.add_service("acme", 5.0)
        assert (await led.counters())["acme"] == 5.0
        await restart_and_rejoin(redis_clean, led)
        assert states == [True, False]
        # rejoined: shared state again (Redis restarted empty: no keys survived)
        assert (await led.acquire("acme", "r4", lim, 1)) == Ticket("acme", "r4", "redis")
        assert await led.counters() == {}
    finally:
        redis_clean.start()
        await led.close()


async def test_rejoin_leaves_no_dead_pooled_connection(redis_clean: RedisServer) -> None:
    """After Redis restarts, the pooled connections of before are dead; rejoining must not hand them
    out (a user's trial: the next burst met them one by one, each fell back to the local ledger for a
    moment, and max_concurrency 4 let 9 of 10 through across two routers)."""
    states: list[bool] = []
    led = make(redis_clean, states)
    await led.start()
    try:
        lim = TenantLimits(max_concurrency=2)
        tickets = await asyncio.gather(*(led.acquire("acme", f"w{i}", lim, 1) for i in range(6)))  # several connections
        for t in tickets:
            if isinstance(t, Ticket):
                await led.release(t)
        redis_clean.stop()
        assert isinstance(await led.acquire("acme", "x", lim, 1), Ticket) and states == [True]
        await restart_and_rejoin(redis_clean, led)
        assert states == [True, False]
        burst = await asyncio.gather(*(led.acquire("acme", f"b{i}", lim, 1) for i in range(6)))
        assert sum(isinstance(t, Ticket) and t.backend == "redis" for t in burst) == 2, burst
        assert sum(isinstance(t, Refusal) for t in burst) == 4
        assert states == [True, False] and not led.degraded  # no spurious fallback
    finally:
        redis_clean.start()
        await led.close()


async def test_unreachable_at_start_is_degraded(redis_clean: RedisServer) -> None:
    states: list[bool] = []
    led = RedisLedger("redis://127.0.0.1:1/0", Clk(), timeout_ms=200, retry_initial_ms=50, retry_max_ms=100,
                      on_degraded=states.append)
    await led.start()
    try:
        assert led.degraded and states == [True]
        assert isinstance(await led.acquire("acme", "r1", TenantLimits(max_concurrency=1), 1), Ticket)
    finally:
        await led.close()


async def test_a_refund_gives_the_shared_buckets_back(redis_clean: RedisServer) -> None:
    # issue 30: tenant small, 5,000 tokens per minute; a 4,990-token request the engine refuses
    # leaves 10 tokens for every router copy; refunded, the other copy's 16-token request passes
    a, b = make(redis_clean), make(redis_clean)
    await a.start()
    await b.start()
    try:
        lim = TenantLimits(tokens_per_minute=5000, requests_per_minute=600)
        ticket = await a.acquire("small", "r1", lim, 4990)
        assert isinstance(ticket, Ticket) and ticket.tokens == 4990
        assert isinstance(await b.acquire("small", "r2", lim, 16), Refusal)
        await a.refund(ticket, lim)
        await a.refund(ticket, lim)  # a refund given twice cannot overfill: the bucket holds 5,000 at most
        assert isinstance(await b.acquire("small", "r2", lim, 16), Ticket)  # 5,000 -> 4,984
        assert isinstance(await b.acquire("small", "r3", lim, 4990), Refusal)  # 4,984 + refill < 4,990
    finally:
        await a.close()
        await b.close()


async def test_settle_now_is_done_only_where_no_redis_call_is_needed(redis_clean: RedisServer) -> None:
    # a Redis ticket needs the ZREM (False: the caller awaits release); degraded, release and refund
    # do nothing for it and a fallback ticket is released locally (True)
    led = make(redis_clean)
    await led.start()
    try:
        lim = TenantLimits(max_concurrency=1)
        ticket = await led.acquire("acme", "r1", lim, 1)
        assert isinstance(ticket, Ticket) and ticket.backend != "local"
        assert led.settle_now(ticket, lim) is False
        refused = await led.acquire("acme", "r1b", lim, 1)  # nothing was released: the one slot is taken
        assert isinstance(refused, Refusal) and refused.reason == "tenant-concurrency"
        await led.release(ticket)
        assert isinstance(await led.acquire("acme", "r1c", lim, 1), Ticket)
    finally:
        await led.close()
    down = RedisLedger("redis://127.0.0.1:1/0", Clk(), timeout_ms=200, retry_initial_ms=50, retry_max_ms=100)
    await down.start()
    try:
        assert down.degraded
        local = await down.acquire("acme", "r2", TenantLimits(max_concurrency=1), 1)
        assert isinstance(local, Ticket) and local.backend == "local"
        assert await down.at_concurrency("acme", TenantLimits(max_concurrency=1))
        assert down.settle_now(local, None) is True
        assert not await down.at_concurrency("acme", TenantLimits(max_concurrency=1))
    finally:
        await down.close()
