"""grpc.aio AdmissionService (proto/admission.proto): WatchBudget, Reserve, Release.

WatchBudget sends one BudgetSnapshot at once, then one on every change the :class:`Agent`
signals and at least every ``push_interval_ms`` (simulated ms), so a silent stream means a dead
or stuck agent. Changes coalesce: after a snapshot, the next one on change waits until
``min_push_interval_ms`` have passed since it (every change in between is in it), so the pushes
follow the request rate only up to ``1 / min_push_interval`` per replica and router. After its
first snapshot a stream takes the agent's shared feed (:class:`SnapshotFeed`): each snapshot is
computed once and sent to every subscribed router, not once per stream.
Reserve grants a lease only when the prompt fits the class's PAB over the class horizon minus the
request's ``waited_ms`` (``pab.admits``, policy/pab.py "Aged requests"); the answer's
pab_ms/pab_tokens are the fresh-arrival budget (full horizon) and already include the new lease,
and a push follows at once.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc

from proto import admission_pb2, admission_pb2_grpc
from replica_agent.agent import Agent, BudgetView
from fairbatch_common.aio import wait_event
from replica_agent.policy.pab import ClassBudget

log = logging.getLogger(__name__)


def class_budget_pb(b: ClassBudget) -> admission_pb2.ClassBudget:
    """Proto message of one class's budget (same field names and units)."""
    return admission_pb2.ClassBudget(
        slo_class=b.slo_class,
        ttft_ms=b.ttft_ms,
        tpot_ms=b.tpot_ms,
        horizon_ms=b.horizon_ms,
        pab_ms=b.pab_ms,
        pab_tokens=b.pab_tokens,
        decode_reservation_ms=b.decode_reservation_ms,
        inflight_reservation_ms=b.inflight_reservation_ms,
        kv_free_tokens=b.kv_free_tokens,
        kv_limited_tokens=b.kv_limited_tokens,
        decode_iterations=b.decode_iterations,
        slot_wait_ms=b.slot_wait_ms,
    )


def snapshot_pb(agent: Agent, view: BudgetView) -> admission_pb2.BudgetSnapshot:
    """BudgetSnapshot of ``view`` with the next sequence number and the unix timestamp."""
    tm = agent.time_model().linearized()  # a, b' = b + f*K, c, e, K: the router prices prompts as PAB does (time_model.py)
    return admission_pb2.BudgetSnapshot(
        replica_id=agent.config.replica_id,
        seq=agent.next_seq(),
        timestamp_ms=agent.clock.unix_ms(),
        ttl_ms=int(agent.config.ttl_ms),
        coefficients=admission_pb2.TimeModelCoefficients(
            a_ms=tm.a_ms, b_ms_per_new_token=tm.b_ms_per_new_token, c_ms_per_context_token=tm.c_ms_per_context_token,
            e_ms_per_chunk_prefix=tm.e_ms_per_chunk_prefix, chunk_tokens=tm.chunk_tokens,
        ),
        classes=[class_budget_pb(b) for b in view.classes.values()],
        healthy=view.healthy,
        num_running=view.num_running,
        num_waiting=view.num_waiting,
        kv_usage=view.kv_usage,
        kv_capacity_tokens=view.kv_capacity_tokens,
        active_leases=view.active_leases,
        max_prompt_tokens=view.max_prompt_tokens,
        status_detail=view.status_detail,
        inflight_prefill_ms=view.inflight_prefill_ms,
        inflight_prefill_done_ms=view.inflight_prefill_done_ms,
        prefix_queries_tokens=view.prefix_queries_tokens,
        prefix_hits_tokens=view.prefix_hits_tokens,
        inline_admission=agent.config.proxy_tracking,
        draining=view.draining,
    )


class _Subscriber:
    """One WatchBudget stream's mailbox: the newest snapshot it has not sent yet (an older unsent one
    is replaced: a slow stream skips to the newest), or the error that ended the feed."""

    __slots__ = ("latest", "error", "ready")

    def __init__(self) -> None:
        self.latest: admission_pb2.BudgetSnapshot | None = None
        self.error: BaseException | None = None
        self.ready = asyncio.Event()

    def put(self, snap: admission_pb2.BudgetSnapshot) -> None:
        self.latest = snap
        self.ready.set()

    async def next(self) -> admission_pb2.BudgetSnapshot:
        while self.latest is None:
            if self.error is not None:
                raise self.error
            self.ready.clear()
            await self.ready.wait()
        snap, self.latest = self.latest, None
        return snap


class SnapshotFeed:
    """The agent's snapshots after each stream's first, computed once for every subscribed stream.

    One task, while any stream is subscribed, runs the push rule of the module docstring: a snapshot
    on change, the next change-triggered one not sooner than ``min_push_interval_ms`` after the last
    (every change in between is in it) and at least one loop pass after the change, and one at least
    every ``push_interval_ms``; each goes to every subscriber. With R routers the agent computes the
    budget and builds the message once per push instead of R times; each router gets the same
    snapshot (same ``seq`` and timestamp). A stream's own first snapshot is computed when it
    subscribes, so its next one may come sooner than a full interval after it.

    Args:
        agent: the agent whose budget is pushed.
    """

    def __init__(self, agent: Agent) -> None:
        self._agent = agent
        self._subs: list[_Subscriber] = []
        self._task: asyncio.Task[None] | None = None
        self.computed = 0  # snapshots computed by the feed (tests)

    @property
    def running(self) -> bool:
        """Whether the feed's task runs (some stream is subscribed)."""
        return self._task is not None and not self._task.done()

    def subscribe(self, changed: asyncio.Event) -> _Subscriber:
        """Register a stream that just computed its first snapshot; ``changed``: the agent's change event
        taken before that computation (a change since then is pushed, to this stream and any other)."""
        sub = _Subscriber()
        self._subs.append(sub)
        if not self.running:
            self._task = asyncio.get_running_loop().create_task(self._run(changed))
        return sub

    def unsubscribe(self, sub: _Subscriber) -> None:
        """The stream ended; the feed's task stops with its last subscriber."""
        if sub in self._subs:
            self._subs.remove(sub)
        if not self._subs and self._task is not None:
            self._task.cancel()
            self._task = None

    async def _run(self, changed: asyncio.Event) -> None:
        agent = self._agent
        period_s = agent.clock.to_wall_s(agent.config.push_interval_ms)
        min_s = agent.clock.to_wall_s(agent.config.min_push_interval_ms)
        loop = asyncio.get_running_loop()
        snapshots = agent.metrics.budget_snapshots
        sent = loop.time()
        try:
            while True:
                if await wait_event(changed, period_s) and min_s > 0:
                    rest = min_s - (loop.time() - sent)
                    # coalesce: the changes of the rest of the interval go in one snapshot; and at least one
                    # loop pass, so the request whose arrival or token woke this goes on first (its upstream
                    # write is a task of its own, scheduled after this wake-up)
                    await asyncio.sleep(max(0.0, rest))
                changed = agent.change_event
                snap = snapshot_pb(agent, agent.compute_budget(agent.clock.now_ms()))
                self.computed += 1
                snapshots.inc()
                sent = loop.time()
                for sub in self._subs:
                    sub.put(snap)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # every stream ends with it, as a stream computing its own would
            log.exception("budget snapshot failed")
            for sub in self._subs:
                sub.error = e
                sub.ready.set()
            self._subs.clear()
            self._task = None


class AdmissionService(admission_pb2_grpc.AdmissionServiceServicer):
    """The agent's gRPC face. All state lives in ``agent``; nothing here blocks."""

    def __init__(self, agent: Agent) -> None:
        self._agent = agent
        self.feed = SnapshotFeed(agent)

    async def WatchBudget(  # noqa: N802 - gRPC method name
        self, request: admission_pb2.WatchBudgetRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[admission_pb2.BudgetSnapshot]:
        """Stream snapshots: one now, then on change and at least every push interval (the shared
        :class:`SnapshotFeed`)."""
        agent = self._agent
        log.info("WatchBudget from router %r", request.router_id)
        changed = agent.change_event
        first = snapshot_pb(agent, agent.compute_budget(agent.clock.now_ms()))
        agent.metrics.budget_snapshots.inc()
        sub = self.feed.subscribe(changed)
        try:
            yield first
            while True:
                yield await sub.next()
        finally:
            self.feed.unsubscribe(sub)

    async def Reserve(  # noqa: N802
        self, request: admission_pb2.ReserveRequest, context: grpc.aio.ServicerContext
    ) -> admission_pb2.ReserveResponse:
        """Grant a lease or refuse with a reason (unhealthy, unknown-class, no-budget, kv-full, ...)."""
        agent = self._agent
        res = agent.reserve(
            request.slo_class,
            int(request.prompt_tokens),
            int(request.max_tokens) or None,
            request.request_id,
            agent.clock.now_ms(),
            request.waited_ms,
            on_time_only=request.on_time_only,
        )
        b = res.budget
        return admission_pb2.ReserveResponse(
            granted=res.granted,
            lease_id=res.lease_id,
            reason=res.reason,
            pab_ms=b.pab_ms if b else 0.0,
            pab_tokens=b.pab_tokens if b else 0,
            expires_ms=res.expires_unix_ms,
            seq=agent.next_seq(),
        )

    async def Release(  # noqa: N802
        self, request: admission_pb2.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> admission_pb2.ReleaseResponse:
        """Give a lease back; released=false when it was unknown (used, expired or released)."""
        released = self._agent.release(request.lease_id)
        log.debug("release %s (%s): %s", request.lease_id, request.reason, released)
        return admission_pb2.ReleaseResponse(released=released)


async def expire_leases_loop(agent: Agent) -> None:
    """Drop lapsed leases every min(lease_ttl / 4, push_interval) simulated ms, until cancelled."""
    period_ms = min(agent.config.lease_ttl_ms / 4.0, agent.config.push_interval_ms)
    while True:
        await agent.clock.sleep_ms(period_ms)
        agent.expire_leases(agent.clock.now_ms())


TOKEN_METADATA = "x-fairbatch-token"


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call whose ``x-fairbatch-token`` metadata is not the shared token (UNAUTHENTICATED).

    Args:
        token: the shared secret (compared in constant time).
    """

    def __init__(self, token: str) -> None:
        self._token = token.encode()

        async def deny_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong x-fairbatch-token")

        async def deny_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong x-fairbatch-token")
            yield  # pragma: no cover - a generator: the stream handler's shape

        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny_unary)
        self._deny_stream = grpc.unary_stream_rpc_method_handler(deny_stream)

    async def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        presented = ""
        for key, value in details.invocation_metadata or ():
            if key == TOKEN_METADATA:
                presented = value if isinstance(value, str) else value.decode("utf-8", "replace")
        if hmac.compare_digest(presented.encode("utf-8", "surrogatepass"), self._token):
            return await continuation(details)
        log.warning("gRPC %s refused: missing or wrong x-fairbatch-token", details.method)
        return self._deny_stream if details.method.endswith("/WatchBudget") else self._deny_unary


async def start_grpc_server(
    agent: Agent, host: str, port: int, token: str | None = None
) -> tuple[grpc.aio.Server, int]:
    """Start a grpc.aio server with :class:`AdmissionService` on ``host:port`` (0 = any free port).

    ``token``: when set, every call must carry it as ``x-fairbatch-token`` metadata (:class:`TokenInterceptor`).

    Returns:
        (server, bound port).

    Raises:
        RuntimeError: if the port cannot be bound.
    """
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)],
                             interceptors=[TokenInterceptor(token)] if token else None)
    admission_pb2_grpc.add_AdmissionServiceServicer_to_server(AdmissionService(agent), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise RuntimeError(f"cannot bind gRPC server to {host}:{port}")
    await server.start()
    return server, bound
