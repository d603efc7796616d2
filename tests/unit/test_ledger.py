"""router/ledger.py, in-process backend: token buckets, request buckets, concurrency, VTC counters.

Hand-worked: tokens_per_minute 600 refills 600 / 60000 = 0.01 token per simulated ms;
requests_per_minute 2 refills one request every 30,000 ms.
"""

from __future__ import annotations

from dataclasses import dataclass

from router.ledger import Bucket, InProcessLedger, LocalLedger, Refusal, TenantLimits, Ticket, bucket_level


def test_bucket_level_refills_to_capacity() -> None:
    assert bucket_level(None, 600, 0.0) == 600
    assert bucket_level(Bucket(0.0, 0.0), 600, 10_000.0) == 100.0
    assert bucket_level(Bucket(500.0, 0.0), 600, 60_000.0) == 600.0


def test_token_bucket_hand_worked() -> None:
    led = LocalLedger()
    lim = TenantLimits(tokens_per_minute=600)
    assert led.acquire("a", "r1", lim, 400, now_ms=0.0) is None  # 600 -> 200
    refusal = led.acquire("a", "r2", lim, 400, now_ms=0.0)
    assert refusal == Refusal("tenant-rate", 20_000.0)  # needs 200 more at 0.01/ms
    assert led.acquire("a", "r2", lim, 400, now_ms=20_000.0) is None  # 200 + 200 = 400 -> 0
    # one request larger than the bucket is clamped to the bucket size: passes a full bucket
    assert led.acquire("b", "r3", lim, 5000, now_ms=0.0) is None
    assert led.acquire("b", "r4", lim, 1, now_ms=0.0) == Refusal("tenant-rate", 100.0)


def test_request_bucket_and_all_or_nothing() -> None:
    led = LocalLedger()
    lim = TenantLimits(max_concurrency=5, tokens_per_minute=1000, requests_per_minute=2)
    assert led.acquire("a", "r1", lim, 100, 0.0) is None
    assert led.acquire("a", "r2", lim, 100, 0.0) is None
    assert led.acquire("a", "r3", lim, 100, 0.0) == Refusal("tenant-rate", 30_000.0)
    assert led.in_flight("a") == 2  # the refused one took no slot ...
    assert led.acquire("a", "r3", lim, 100, 30_000.0) is None  # ... and no tokens: 800 + 300 - 100


def test_concurrency_slots_release_and_expiry() -> None:
    led = LocalLedger(concurrency_ttl_ms=1000.0)
    lim = TenantLimits(max_concurrency=2, tokens_per_minute=600)
    assert led.acquire("a", "r1", lim, 10, 0.0) is None
    assert led.acquire("a", "r2", lim, 10, 0.0) is None
    assert led.acquire("a", "r3", lim, 10, 0.0) == Refusal("tenant-concurrency", 1000.0)
    assert led.acquire("b", "r1", lim, 10, 0.0) is None  # per tenant
    led.release("a", "r1")
    assert led.acquire("a", "r3", lim, 10, 0.0) is None
    assert led.acquire("a", "r4", lim, 10, 500.0) is not None
    assert led.acquire("a", "r4", lim, 10, 1000.0) is None  # r2, r3 expired at 1000 ms
    # the tokens of the concurrency refusals were not taken: 600 - 4*10 + refill
    led.release("a", "unknown")  # no-op


def test_unlimited_tenant_always_passes() -> None:
    led = LocalLedger()
    for i in range(1000):
        assert led.acquire("a", f"r{i}", TenantLimits(), 10**6, 0.0) is None


def test_vtc_counters() -> None:
    led = LocalLedger()
    assert led.add_service("a", 100.0) == 100.0
    assert led.lift("a", 50.0) == 100.0
    assert led.lift("b", 70.0) == 70.0
    assert led.counters() == {"a": 100.0, "b": 70.0}


@dataclass
class Clk:
    t: float = 0.0
    scale: float = 1.0

    def now_ms(self) -> float:
        return self.t


async def test_in_process_backend_uses_the_clock() -> None:
    clk = Clk()
    led = InProcessLedger(clk)
    lim = TenantLimits(max_concurrency=1, requests_per_minute=1)
    ticket = await led.acquire("a", "r1", lim, 1)
    assert ticket == Ticket("a", "r1", "local")
    assert await led.acquire("a", "r2", lim, 1) == Refusal("tenant-rate", 60_000.0)
    clk.t = 60_000.0
    assert await led.acquire("a", "r2", lim, 1) == Refusal("tenant-concurrency", 1000.0)
    await led.release(ticket)  # type: ignore[arg-type]
    assert isinstance(await led.acquire("a", "r2", lim, 1), Ticket)
    await led.add_service("a", 3.0)
    await led.lift("b", 2.0)
    assert await led.counters() == {"a": 3.0, "b": 2.0}
    assert not led.degraded


def test_at_concurrency_is_a_read_that_counts_live_slots_only() -> None:
    led = LocalLedger(concurrency_ttl_ms=1000.0)
    lim = TenantLimits(max_concurrency=2)
    assert not led.at_concurrency("t", lim, 0.0)  # never seen
    assert led.acquire("t", "a", lim, 1, 0.0) is None
    assert not led.at_concurrency("t", lim, 10.0)
    assert led.acquire("t", "b", lim, 1, 500.0) is None
    assert led.at_concurrency("t", lim, 600.0)  # 2 of 2
    assert led.in_flight("t") == 2  # the peek took nothing
    assert not led.at_concurrency("t", lim, 1000.0)  # "a" expired at 0 + 1000: one live slot
    assert not led.at_concurrency("t", TenantLimits(), 600.0)  # no cap


def test_refund_gives_one_acquire_back_and_never_overfills() -> None:
    # issue 30: tokens_per_minute 600 (0.01 token/ms), requests_per_minute 2 (one per 30,000 ms).
    led = LocalLedger()
    lim = TenantLimits(tokens_per_minute=600, requests_per_minute=2)
    assert led.acquire("a", "r1", lim, 500, 0.0) is None  # tokens 600 -> 100, requests 2 -> 1
    assert led.acquire("a", "r2", lim, 200, 0.0) == Refusal("tenant-rate", 10_000.0)  # 100 < 200
    led.refund("a", lim, 500, 1000.0)  # at 1 s: 100 + 10 refilled + 500 back = 610 -> capped at 600
    assert led.acquire("a", "r2", lim, 600, 1000.0) is None  # a full bucket again: 600 -> 0
    # the request bucket: 1 + 1000 / 30000 refilled + 1 back = 2.03 -> capped at 2, minus r2's 1 = 1,
    # r3 takes the last one, r4 waits a whole request: (1 - 0) * 60000 / 2 = 30,000 ms
    assert led.acquire("a", "r3", lim, 0, 1000.0) is None
    assert led.acquire("a", "r4", lim, 0, 1000.0) == Refusal("tenant-rate", 30_000.0)
    # a tenant never seen, or limits without buckets: nothing to give back, nothing breaks
    led.refund("nobody", lim, 100, 0.0)
    led.refund("a", TenantLimits(), 100, 0.0)


async def test_in_process_ticket_carries_its_tokens_for_the_refund() -> None:
    @dataclass
    class C:
        t: float = 0.0

        def now_ms(self) -> float:
            return self.t

    clock = C()
    led = InProcessLedger(clock)
    lim = TenantLimits(tokens_per_minute=5000)
    ticket = await led.acquire("small", "r1", lim, 4990)  # a request the engine will refuse
    assert isinstance(ticket, Ticket) and ticket.tokens == 4990
    assert isinstance(await led.acquire("small", "r2", lim, 16), Refusal)  # 10 left: the 429
    await led.refund(ticket, lim)
    assert isinstance(await led.acquire("small", "r2", lim, 16), Ticket)


def test_quota_refund_rule() -> None:
    from router.charges import quota_refunded

    assert quota_refunded("upstream_refused", True) and quota_refunded("queue_timeout", False)
    assert quota_refunded("upstream_error", False) and not quota_refunded("upstream_error", True)
    assert not quota_refunded("ok", True) and not quota_refunded("client_disconnect", False)


async def test_settle_now_refunds_and_releases_at_once_in_process() -> None:
    # max_concurrency 1, requests_per_minute 1 (one request back every 60,000 ms): a held ticket
    # blocks the next request both ways; settle_now gives the slot (and, with the limits, the
    # request) back before it returns: no task, no await
    led = InProcessLedger(type("C", (), {"now_ms": lambda self: 0.0})())
    lim = TenantLimits(max_concurrency=1, requests_per_minute=1)
    t1 = await led.acquire("a", "r1", lim, 10)
    assert isinstance(t1, Ticket) and await led.at_concurrency("a", lim)
    assert led.settle_now(t1, lim) is True
    assert not await led.at_concurrency("a", lim)
    t2 = await led.acquire("a", "r2", lim, 10)  # passes: the refund gave the one request back
    assert isinstance(t2, Ticket)
    assert led.settle_now(t2, None) is True  # the slot only
    assert led.local.in_flight("a") == 0
    assert await led.acquire("a", "r3", lim, 10) == Refusal("tenant-rate", 60_000.0)  # r2's request stays spent


def test_quota_refund_rule_on_a_client_disconnect() -> None:
    from router.charges import quota_refunded_on_disconnect

    assert quota_refunded_on_disconnect(sent_to_replica=False)  # left while queued: no engine worked on it
    assert not quota_refunded_on_disconnect(sent_to_replica=True)  # relayed: the engine may have prefilled it
