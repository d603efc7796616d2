"""Tenant quotas and fairness counters: in-process (default) or shared by router copies through Redis.

What the ledger holds per tenant (docs/design.md section 5, step 3):

- a request bucket (``requests_per_minute``) and a token bucket (``tokens_per_minute``; a request
  costs ``prompt_tokens + max_tokens``, clamped to the bucket size so that one large request can
  still pass a full bucket). Each bucket holds one simulated minute of rate and refills
  continuously: ``level = min(rate, level + elapsed_ms * rate / 60000)``.
- a concurrency set: ids of the tenant's requests in flight, at most ``max_concurrency``; a slot
  older than ``concurrency_ttl_ms`` is dropped (a crashed router cannot hold slots for ever).
- the VTC counters of the fair queue (arXiv 2401.00588), so several routers order by the same
  service history: ``add_service`` adds, ``lift`` raises to a floor, ``counters`` reads them.

An acquire is all-or-nothing: rate buckets and the concurrency slot are checked first and taken
together only when all pass (one Lua script in Redis, so it is atomic across routers).

:class:`LocalLedger` is the pure core (``now_ms`` passed in). :class:`InProcessLedger` and
:class:`RedisLedger` are the async shells the router uses. :class:`RedisLedger` falls back to a
local ledger when Redis does not answer within ``timeout_ms``, reports it through ``on_degraded``
(the router logs and exports ``fairbatch_router_ledger_degraded``), and retries with exponential
backoff (``retry_initial_ms`` doubling to ``retry_max_ms``) until Redis answers, then rejoins.
Rate and concurrency state taken locally while degraded is not copied into Redis.
"""

from __future__ import annotations

import asyncio
import logging
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from fairbatch_common.aio import stop_task, within

log = logging.getLogger(__name__)

MINUTE_MS = 60_000.0
CONCURRENCY_RETRY_MS = 1000.0


@dataclass(frozen=True, slots=True)
class TenantLimits:
    """A tenant's quotas (None = unlimited).

    Attributes:
        max_concurrency: requests in flight.
        tokens_per_minute: prompt + max_tokens per simulated minute.
        requests_per_minute: requests per simulated minute.
    """

    max_concurrency: int | None = None
    tokens_per_minute: int | None = None
    requests_per_minute: int | None = None


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why an acquire was refused.

    Attributes:
        reason: ``tenant-rate`` or ``tenant-concurrency`` (the ``x-fairbatch-reason``).
        retry_after_ms: when the same request would pass (simulated ms; an estimate for concurrency).
    """

    reason: str
    retry_after_ms: float


@dataclass(frozen=True, slots=True)
class Ticket:
    """A granted acquire; give it back to :meth:`Ledger.release`.

    Attributes:
        tenant: tenant name.
        request_id: the router-made request id (the concurrency slot's member, locally and in Redis);
            never the client's x-request-id, so a repeated client id cannot share one slot.
        backend: ``local`` or ``redis`` (where the slot was taken).
        tokens: the tokens the acquire asked for (what :meth:`Ledger.refund` gives back to the
            token bucket, at most its size; the request bucket gets its one request back).
    """

    tenant: str
    request_id: str
    backend: str = "local"
    tokens: int = field(default=0, compare=False)


@dataclass(slots=True)
class Bucket:
    """A token bucket's state: ``level`` units at ``updated_ms`` (simulated ms)."""

    level: float
    updated_ms: float


def bucket_level(bucket: Bucket | None, per_minute: float, now_ms: float) -> float:
    """Level of a bucket of size ``per_minute`` refilled at ``per_minute / 60000`` per ms, at ``now_ms``.

    A bucket never seen is full.
    """
    if bucket is None:
        return per_minute
    return min(per_minute, bucket.level + max(0.0, now_ms - bucket.updated_ms) * per_minute / MINUTE_MS)


@dataclass(slots=True)
class _TenantState:
    tokens: Bucket | None = None
    requests: Bucket | None = None
    in_flight: dict[str, float] = field(default_factory=dict)  # request id -> expiry (simulated ms)


class LocalLedger:
    """The in-process ledger. PURE: every call takes ``now_ms`` (simulated ms).

    Args:
        concurrency_ttl_ms: a slot older than this is dropped (simulated ms).
    """

    __slots__ = ("concurrency_ttl_ms", "_tenants", "_counters")

    def __init__(self, concurrency_ttl_ms: float = 600_000.0) -> None:
        self.concurrency_ttl_ms = concurrency_ttl_ms
        self._tenants: dict[str, _TenantState] = {}
        self._counters: dict[str, float] = {}

    def acquire(self, tenant: str, request_id: str, limits: TenantLimits, tokens: int, now_ms: float) -> Refusal | None:
        """Take one request of ``tokens`` tokens for ``tenant``; None when granted, else why not.

        Checks, in order: request bucket, token bucket, concurrency; takes all or nothing.
        """
        st = self._tenants.setdefault(tenant, _TenantState())
        rl = tl = 0.0
        rpm, tpm = limits.requests_per_minute, limits.tokens_per_minute
        if rpm:
            rl = bucket_level(st.requests, rpm, now_ms)
            if rl < 1.0:
                return Refusal("tenant-rate", (1.0 - rl) * MINUTE_MS / rpm)
        need = min(tokens, tpm) if tpm else 0
        if tpm:
            tl = bucket_level(st.tokens, tpm, now_ms)
            if tl < need:
                return Refusal("tenant-rate", (need - tl) * MINUTE_MS / tpm)
        if limits.max_concurrency:
            for rid in [r for r, exp in st.in_flight.items() if exp <= now_ms]:
                del st.in_flight[rid]
            if len(st.in_flight) >= limits.max_concurrency:
                return Refusal("tenant-concurrency", CONCURRENCY_RETRY_MS)
        st.in_flight[request_id] = now_ms + self.concurrency_ttl_ms
        if rpm:
            st.requests = Bucket(rl - 1.0, now_ms)
        if tpm:
            st.tokens = Bucket(tl - need, now_ms)
        return None

    def refund(self, tenant: str, limits: TenantLimits, tokens: int, now_ms: float) -> None:
        """Give back what one granted acquire took from the buckets (one request and ``tokens``
        tokens, at most the bucket's size; each bucket stays at most full): the request was
        refused or failed before anything was generated (issue 30)."""
        st = self._tenants.get(tenant)
        if st is None:
            return
        rpm, tpm = limits.requests_per_minute, limits.tokens_per_minute
        if rpm and st.requests is not None:
            st.requests = Bucket(min(float(rpm), bucket_level(st.requests, rpm, now_ms) + 1.0), now_ms)
        if tpm and st.tokens is not None:
            back = min(max(0, tokens), tpm)
            st.tokens = Bucket(min(float(tpm), bucket_level(st.tokens, tpm, now_ms) + back), now_ms)

    def release(self, tenant: str, request_id: str) -> None:
        """Free the concurrency slot of ``request_id`` (no-op when not held)."""
        st = self._tenants.get(tenant)
        if st is not None:
            st.in_flight.pop(request_id, None)

    def at_concurrency(self, tenant: str, limits: TenantLimits, now_ms: float) -> bool:
        """True when an acquire now would be refused ``tenant-concurrency`` (a read: nothing taken or dropped)."""
        if not limits.max_concurrency:
            return False
        st = self._tenants.get(tenant)
        if st is None:
            return False
        return sum(1 for exp in st.in_flight.values() if exp > now_ms) >= limits.max_concurrency

    def in_flight(self, tenant: str) -> int:
        """Slots held by ``tenant`` (expired ones included until the next acquire)."""
        st = self._tenants.get(tenant)
        return len(st.in_flight) if st else 0

    def add_service(self, tenant: str, delta: float) -> float:
        """Add ``delta`` (weighted tokens / weight) to the tenant's VTC counter; returns the new value."""
        value = self._counters.get(tenant, 0.0) + delta
        self._counters[tenant] = value
        return value

    def lift(self, tenant: str, floor: float) -> float:
        """Raise the tenant's counter to at least ``floor``; returns the new value."""
        value = max(self._counters.get(tenant, 0.0), floor)
        self._counters[tenant] = value
        return value

    def counters(self) -> dict[str, float]:
        """Every tenant's VTC counter."""
        return dict(self._counters)


class Ledger(Protocol):
    """What the router needs from a ledger (both backends)."""

    degraded: bool

    async def start(self) -> None: ...
    async def close(self) -> None: ...
    async def acquire(self, tenant: str, request_id: str, limits: TenantLimits, tokens: int) -> Ticket | Refusal: ...
    async def release(self, ticket: Ticket) -> None: ...
    async def refund(self, ticket: Ticket, limits: TenantLimits) -> None: ...
    def settle_now(self, ticket: Ticket, limits: TenantLimits | None) -> bool: ...
    async def at_concurrency(self, tenant: str, limits: TenantLimits) -> bool: ...
    async def add_service(self, tenant: str, delta: float) -> None: ...
    async def lift(self, tenant: str, floor: float) -> None: ...
    async def counters(self) -> dict[str, float]: ...


class _NowMs(Protocol):
    def now_ms(self) -> float: ...


class InProcessLedger:
    """The default backend: a :class:`LocalLedger` read with the router clock.

    Args:
        clock: anything with ``now_ms()`` (simulated ms).
        concurrency_ttl_ms: see :class:`LocalLedger`.
    """

    def __init__(self, clock: _NowMs, concurrency_ttl_ms: float = 600_000.0) -> None:
        self.clock = clock
        self.local = LocalLedger(concurrency_ttl_ms)
        self.degraded = False

    async def start(self) -> None:
        """Nothing to open."""

    async def close(self) -> None:
        """Nothing to close."""

    async def acquire(self, tenant: str, request_id: str, limits: TenantLimits, tokens: int) -> Ticket | Refusal:
        """A :class:`Ticket`, or the :class:`Refusal`."""
        refusal = self.local.acquire(tenant, request_id, limits, tokens, self.clock.now_ms())
        return refusal if refusal is not None else Ticket(tenant, request_id, "local", max(0, int(tokens)))

    async def release(self, ticket: Ticket) -> None:
        """Free the ticket's concurrency slot."""
        self.local.release(ticket.tenant, ticket.request_id)

    async def refund(self, ticket: Ticket, limits: TenantLimits) -> None:
        """Give the ticket's request and tokens back to the buckets (:meth:`LocalLedger.refund`)."""
        self.local.refund(ticket.tenant, limits, ticket.tokens, self.clock.now_ms())

    def settle_now(self, ticket: Ticket, limits: TenantLimits | None) -> bool:
        """:meth:`refund` (when ``limits`` is given) then :meth:`release`, done here and now (no I/O);
        always True. A caller that is not a coroutine (the ext_proc picker's settlement) saves a task."""
        if limits is not None:
            self.local.refund(ticket.tenant, limits, ticket.tokens, self.clock.now_ms())
        self.local.release(ticket.tenant, ticket.request_id)
        return True

    async def at_concurrency(self, tenant: str, limits: TenantLimits) -> bool:
        """True when the tenant holds ``max_concurrency`` slots now (a peek, before the body is read)."""
        return self.local.at_concurrency(tenant, limits, self.clock.now_ms())

    async def add_service(self, tenant: str, delta: float) -> None:
        """VTC counter += delta."""
        self.local.add_service(tenant, delta)

    async def lift(self, tenant: str, floor: float) -> None:
        """VTC counter = max(counter, floor)."""
        self.local.lift(tenant, floor)

    async def counters(self) -> dict[str, float]:
        """VTC counters."""
        return self.local.counters()


# One script for the whole acquire, so that concurrent routers cannot both take the last unit.
# Time is Redis's own (TIME), scaled to simulated ms, so routers with different clocks agree.
ACQUIRE_LUA = """
local t = redis.call('TIME')
local scale = tonumber(ARGV[1])
local now = (tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000) / scale
local tpm = tonumber(ARGV[2])
local tokens = tonumber(ARGV[3])
local rpm = tonumber(ARGV[4])
local maxc = tonumber(ARGV[5])
local ttl = tonumber(ARGV[7])
local keep_ms = math.ceil(60000 * scale) + 1000
local function level(key, per_min)
  local v = redis.call('HMGET', key, 'level', 'ts')
  local lvl = tonumber(v[1])
  local ts = tonumber(v[2])
  if lvl == nil or ts == nil then return per_min end
  local dt = now - ts
  if dt < 0 then dt = 0 end
  local l = lvl + dt * per_min / 60000
  if l > per_min then l = per_min end
  return l
end
local rl = 0
local tl = 0
if rpm > 0 then
  rl = level(KEYS[2], rpm)
  if rl < 1 then return {'tenant-rate', tostring((1 - rl) * 60000 / rpm)} end
end
if tpm > 0 then
  if tokens > tpm then tokens = tpm end
  tl = level(KEYS[1], tpm)
  if tl < tokens then return {'tenant-rate', tostring((tokens - tl) * 60000 / tpm)} end
end
if maxc > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
  if redis.call('ZCARD', KEYS[3]) >= maxc then return {'tenant-concurrency', ARGV[8]} end
  redis.call('ZADD', KEYS[3], now + ttl, ARGV[6])
  redis.call('PEXPIRE', KEYS[3], math.ceil(ttl * scale) + 1000)
end
if rpm > 0 then
  redis.call('HSET', KEYS[2], 'level', rl - 1, 'ts', now)
  redis.call('PEXPIRE', KEYS[2], keep_ms)
end
if tpm > 0 then
  redis.call('HSET', KEYS[1], 'level', tl - tokens, 'ts', now)
  redis.call('PEXPIRE', KEYS[1], keep_ms)
end
return {'ok', '0'}
"""

# Give one acquire's request and tokens back (each bucket at most full), on Redis's clock as ACQUIRE_LUA.
REFUND_LUA = """
local t = redis.call('TIME')
local scale = tonumber(ARGV[1])
local now = (tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000) / scale
local keep_ms = math.ceil(60000 * scale) + 1000
local function give(key, per_min, amount)
  local v = redis.call('HMGET', key, 'level', 'ts')
  local lvl = tonumber(v[1])
  local ts = tonumber(v[2])
  if lvl == nil or ts == nil then return end
  local dt = now - ts
  if dt < 0 then dt = 0 end
  local l = lvl + dt * per_min / 60000 + amount
  if l > per_min then l = per_min end
  redis.call('HSET', key, 'level', l, 'ts', now)
  redis.call('PEXPIRE', key, keep_ms)
end
local tpm = tonumber(ARGV[2])
local tokens = tonumber(ARGV[3])
local rpm = tonumber(ARGV[4])
if rpm > 0 then give(KEYS[2], rpm, 1) end
if tpm > 0 then
  if tokens > tpm then tokens = tpm end
  give(KEYS[1], tpm, tokens)
end
return 'ok'
"""

LIFT_LUA = """
local cur = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0')
local floor = tonumber(ARGV[2])
if floor > cur then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
  return ARGV[2]
end
return tostring(cur)
"""


class RedisLedger:
    """Quotas and VTC counters in Redis (shared by router copies), with a local fallback.

    Args:
        url: ``redis://host:port/db``.
        clock: router clock (``now_ms()`` for the local fallback; ``scale`` for Redis time).
        key_prefix: prefix of every key (``<prefix>:tpm:<tenant>``, ``:rpm:``, ``:conc:``, ``:vtc``).
        timeout_ms: wall ms per Redis call before falling back.
        retry_initial_ms, retry_max_ms: reconnect backoff (wall ms, doubling).
        concurrency_ttl_ms: slot lifetime (simulated ms).
        on_degraded: called with True when falling back to local, False on rejoin.
        client: a ready ``redis.asyncio.Redis`` (tests); built from ``url`` when None.
        password: Redis ``AUTH`` password (``requirepass``; the router CLI reads ``FAIRBATCH_REDIS_PASSWORD``);
            None = the URL's own, if any. Never logged: log lines name the URL without its password.
    """

    def __init__(
        self,
        url: str,
        clock: Any,
        key_prefix: str = "fairbatch",
        timeout_ms: float = 200.0,
        retry_initial_ms: float = 100.0,
        retry_max_ms: float = 5000.0,
        concurrency_ttl_ms: float = 600_000.0,
        on_degraded: Callable[[bool], None] | None = None,
        client: Any = None,
        password: str | None = None,
    ) -> None:
        import redis.asyncio as aioredis

        self.url = redact_url(url)
        self._password_given = bool(password) or urllib.parse.urlsplit(url).password is not None
        self.clock = clock
        self.prefix = key_prefix
        self.timeout_s = timeout_ms / 1000.0
        self.retry_initial_s = retry_initial_ms / 1000.0
        self.retry_max_s = max(retry_max_ms, retry_initial_ms) / 1000.0
        self.concurrency_ttl_ms = concurrency_ttl_ms
        self.on_degraded = on_degraded
        self.local = InProcessLedger(clock, concurrency_ttl_ms)
        self.degraded = False
        self.failures = 0
        self._client = client or aioredis.Redis.from_url(
            url, socket_timeout=self.timeout_s, socket_connect_timeout=self.timeout_s, retry=None,
            decode_responses=True, health_check_interval=0, **({"password": password} if password else {}),
        )
        self._acquire = self._client.register_script(ACQUIRE_LUA)
        self._lift = self._client.register_script(LIFT_LUA)
        self._refund = self._client.register_script(REFUND_LUA)
        self._rejoin: asyncio.Task[None] | None = None
        self._errors: tuple[type[BaseException], ...] = (aioredis.RedisError, OSError, TimeoutError)

    def _key(self, kind: str, tenant: str) -> str:
        return f"{self.prefix}:{kind}:{tenant}"

    @property
    def _vtc_key(self) -> str:
        return f"{self.prefix}:vtc"

    async def start(self) -> None:
        """Check Redis once; degraded (local) at once when it does not answer."""
        try:
            await within(self._client.ping(), self.timeout_s)
            log.info("ledger: using Redis at %s (prefix %s)", self.url, self.prefix)
        except self._errors as exc:
            self._fail(exc)

    async def close(self) -> None:
        """Stop the reconnect loop and close the client."""
        if self._rejoin is not None:
            await stop_task(self._rejoin)
            self._rejoin = None
        try:
            await self._client.aclose()
        except Exception:  # noqa: BLE001 - closing a broken connection
            pass

    def _fail(self, exc: BaseException) -> None:
        self.failures += 1
        if self.degraded:
            return
        self.degraded = True
        from redis.exceptions import AuthenticationError

        if isinstance(exc, AuthenticationError):  # NOAUTH (no password given) or WRONGPASS
            log.warning("ledger: Redis at %s %s (%s: %s): give Redis's requirepass as FAIRBATCH_REDIS_PASSWORD "
                        "(or a file named by FAIRBATCH_REDIS_PASSWORD_FILE) "
                        "or in redis_url; serving on the local ledger", self.url,
                        "refused the password given" if self._password_given else "requires a password, none given",
                        exc.__class__.__name__, exc)
        else:
            log.warning("ledger: Redis at %s unreachable (%s: %s); serving on the local ledger",
                        self.url, exc.__class__.__name__, exc)
        if self.on_degraded is not None:
            self.on_degraded(True)
        if self._rejoin is None or self._rejoin.done():
            self._rejoin = asyncio.create_task(self._rejoin_loop(), name="ledger-rejoin")

    async def _rejoin_loop(self) -> None:
        delay = self.retry_initial_s
        while True:
            await asyncio.sleep(delay)
            try:
                # the pool's connections of before the outage are dead (a restarted Redis closed them):
                # drop the idle ones, so that the ping and every later call open fresh ones; otherwise the
                # next calls meet them one by one and each falls back to the local ledger for a moment.
                # Not the ones in use: a call still in flight from before the fall-back (a slow Redis,
                # not a dead one) had its writer torn away and raised AttributeError from redis-py, a 500
                # to its client (seen with 12 concurrent acquires on a loaded machine); it ends by itself
                await within(self._client.connection_pool.disconnect(inuse_connections=False), self.timeout_s)
                await within(self._client.ping(), self.timeout_s)
            except self._errors:
                delay = min(self.retry_max_s, delay * 2)
                continue
            self.degraded = False
            log.warning("ledger: Redis at %s answers again; rejoined the shared ledger", self.url)
            if self.on_degraded is not None:
                self.on_degraded(False)
            return

    async def _call(self, coro: Any) -> Any:
        return await within(coro, self.timeout_s)

    async def acquire(self, tenant: str, request_id: str, limits: TenantLimits, tokens: int) -> Ticket | Refusal:
        """Atomic acquire in Redis (local ledger while degraded)."""
        if not self.degraded:
            keys = [self._key("tpm", tenant), self._key("rpm", tenant), self._key("conc", tenant)]
            args = [
                self.clock.scale, limits.tokens_per_minute or 0, max(0, int(tokens)),
                limits.requests_per_minute or 0, limits.max_concurrency or 0, request_id,
                self.concurrency_ttl_ms, CONCURRENCY_RETRY_MS,
            ]
            try:
                reason, retry = await self._call(self._acquire(keys=keys, args=args))
            except self._errors as exc:
                self._fail(exc)
            else:
                if reason == "ok":
                    return Ticket(tenant, request_id, "redis", max(0, int(tokens)))
                return Refusal(str(reason), float(retry))
        return await self.local.acquire(tenant, request_id, limits, tokens)

    async def release(self, ticket: Ticket) -> None:
        """Free the slot where it was taken (a Redis slot left behind expires after its TTL)."""
        if ticket.backend == "local":
            await self.local.release(ticket)
            return
        if self.degraded:
            return
        try:
            await self._call(self._client.zrem(self._key("conc", ticket.tenant), ticket.request_id))
        except self._errors as exc:
            self._fail(exc)

    def settle_now(self, ticket: Ticket, limits: TenantLimits | None) -> bool:
        """:meth:`refund` (when ``limits`` is given) and :meth:`release` without I/O where they need
        none (a ticket of the local fallback, or nothing to do while degraded): True when done; False
        when Redis must be called (the caller awaits :meth:`refund` and :meth:`release`)."""
        if ticket.backend == "local":
            return self.local.settle_now(ticket, limits)
        return self.degraded

    async def refund(self, ticket: Ticket, limits: TenantLimits) -> None:
        """Give the ticket's request and tokens back where they were taken (a refund lost to a
        Redis failure is not retried: the bucket refills within a minute anyway)."""
        if ticket.backend == "local":
            await self.local.refund(ticket, limits)
            return
        if self.degraded:
            return
        keys = [self._key("tpm", ticket.tenant), self._key("rpm", ticket.tenant)]
        args = [self.clock.scale, limits.tokens_per_minute or 0, ticket.tokens, limits.requests_per_minute or 0]
        try:
            await self._call(self._refund(keys=keys, args=args))
        except self._errors as exc:
            self._fail(exc)

    async def at_concurrency(self, tenant: str, limits: TenantLimits) -> bool:
        """The local peek while degraded; False otherwise (the shared count is decided by the acquire
        script, one round trip later, once the body is read)."""
        if self.degraded:
            return await self.local.at_concurrency(tenant, limits)
        return False

    async def add_service(self, tenant: str, delta: float) -> None:
        """Shared VTC counter += delta (local while degraded)."""
        await self.local.add_service(tenant, delta)
        if self.degraded:
            return
        try:
            await self._call(self._client.hincrbyfloat(self._vtc_key, tenant, delta))
        except self._errors as exc:
            self._fail(exc)

    async def lift(self, tenant: str, floor: float) -> None:
        """Shared VTC counter = max(counter, floor)."""
        await self.local.lift(tenant, floor)
        if self.degraded:
            return
        try:
            await self._call(self._lift(keys=[self._vtc_key], args=[tenant, repr(float(floor))]))
        except self._errors as exc:
            self._fail(exc)

    async def counters(self) -> dict[str, float]:
        """Shared VTC counters (the local ones while degraded)."""
        if not self.degraded:
            try:
                raw = await self._call(self._client.hgetall(self._vtc_key))
            except self._errors as exc:
                self._fail(exc)
            else:
                return {str(k): float(v) for k, v in raw.items()}
        return await self.local.counters()


def redact_url(url: str) -> str:
    """``url`` with the password of its user-info replaced by ``***`` (for log lines):
    ``redis://:pw@host:6379/0`` -> ``redis://:***@host:6379/0``; a URL without one is unchanged."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rpartition("@")[2]
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def build_ledger(
    config: Any, clock: Any, on_degraded: Callable[[bool], None] | None = None, password: str | None = None,
) -> Ledger:
    """The ledger the config asks for: Redis when ``redis_url`` is set (authenticated with ``password``
    when given), else in-process."""
    lc = config.ledger
    if config.redis_url:
        return RedisLedger(
            config.redis_url, clock, lc.key_prefix, lc.timeout_ms, lc.retry_initial_ms, lc.retry_max_ms,
            lc.concurrency_ttl_ms, on_degraded, password=password,
        )
    return InProcessLedger(clock, lc.concurrency_ttl_ms)
