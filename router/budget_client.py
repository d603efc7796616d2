"""gRPC client side of the admission contract (proto/admission.proto): I/O shell only.

- one ``WatchBudget`` subscription task per replica feeding the :class:`~router.budgets.BudgetBook`;
  on any stream end or error the replica's budget turns stale at once and the task reconnects with
  bounded exponential backoff (50 ms doubling, capped at 2 s wall); a stream silent for
  ``silence_s`` is cancelled and reopened (half-open connections);
- ``reserve`` with a deadline (``reserve_timeout_ms`` simulated ms); the answer's pab_ms/pab_tokens
  are applied to the book at once, granted or not;
- ``release`` with a deadline; failures are logged, never raised (the lease expires on its own);
- replicas found by discovery are subscribed (:meth:`BudgetClient.add`) and dropped
  (:meth:`BudgetClient.remove`: stream cancelled, channel closed in the background) while running.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from dataclasses import dataclass

import grpc

from proto import admission_pb2, admission_pb2_grpc
from fairbatch_common.clock import Clock
from router.budgets import BudgetBook
from router.config import ReplicaConfig

log = logging.getLogger(__name__)

TOKEN_METADATA = "x-fairbatch-token"  # router <-> agent shared secret (gRPC metadata and HTTP header)

BACKOFF_START_S = 0.05
BACKOFF_CAP_S = 2.0
RELEASE_TIMEOUT_S = 1.0
MAX_TRACKED_LEASES = 65_536

# No client keepalive pings: servers with default settings answer frequent pings with GOAWAY
# (too_many_pings). A half-open stream is caught by the silence watchdog instead.
_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]


@dataclass(frozen=True, slots=True)
class ReserveResult:
    """Answer of one Reserve call.

    Attributes:
        granted: a lease was granted.
        lease_id: the lease ("" when refused).
        reason: refusal reason from the agent, or ``timeout`` / ``unavailable`` / ``unknown-replica``.
        pab_ms: class budget after the decision (simulated ms; -1 when no answer arrived).
        pab_tokens: class budget after the decision (tokens; -1 when no answer arrived).
    """

    granted: bool
    lease_id: str = ""
    reason: str = ""
    pab_ms: float = -1.0
    pab_tokens: int = -1


class BudgetClient:
    """Channels, stubs and watch tasks for every replica's agent.

    Args:
        replicas: the configured replicas.
        book: where snapshots and Reserve answers go.
        clock: router clock (simulated ms -> wall seconds for deadlines).
        router_id: sent in WatchBudget and Reserve (logs only).
        reserve_timeout_ms: Reserve deadline (simulated ms).
        silence_s: wall seconds without any snapshot after which a stream is reopened.
        agent_token: shared secret sent as ``x-fairbatch-token`` gRPC metadata on every call (the agents
            refuse calls without it when they have one); None = none sent.
    """

    def __init__(
        self,
        replicas: Iterable[ReplicaConfig],
        book: BudgetBook,
        clock: Clock,
        router_id: str,
        reserve_timeout_ms: float,
        silence_s: float = 10.0,
        agent_token: str | None = None,
    ) -> None:
        self._metadata = ((TOKEN_METADATA, agent_token),) if agent_token else None
        self._book = book
        self._clock = clock
        self._router_id = router_id
        self._reserve_timeout_s = clock.to_wall_s(reserve_timeout_ms)
        self._silence_s = silence_s
        self._targets = {r.id: r.grpc_target for r in replicas}
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, admission_pb2_grpc.AdmissionServiceStub] = {}
        self._lease_replica: dict[str, str] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._calls: dict[str, grpc.aio.UnaryStreamCall] = {}
        self._closers: set[asyncio.Task[None]] = set()
        self._started = False
        self._closing = False

    async def start(self) -> None:
        """Open one channel and one watch task per replica."""
        self._started = True
        for rid, target in self._targets.items():
            self._open(rid, target)

    def _open(self, rid: str, target: str) -> None:
        channel = grpc.aio.insecure_channel(target, options=_CHANNEL_OPTIONS)
        self._channels[rid] = channel
        self._stubs[rid] = admission_pb2_grpc.AdmissionServiceStub(channel)
        self._tasks[rid] = asyncio.create_task(self._watch(rid), name=f"watch-{rid}")

    def add(self, replica: ReplicaConfig) -> bool:
        """Subscribe to a replica found while running (its WatchBudget stream starts now; before
        :meth:`start` it is only remembered). False when the id is already subscribed."""
        if replica.id in self._targets or self._closing:
            return False
        self._targets[replica.id] = replica.grpc_target
        if self._started:
            self._open(replica.id, replica.grpc_target)
        return True

    def remove(self, replica_id: str) -> bool:
        """Drop a replica: its stub goes at once (Reserve answers ``unknown-replica``), the watch
        stream is cancelled and the channel closed in the background (awaited by :meth:`close`).
        False when unknown."""
        if self._targets.pop(replica_id, None) is None:
            return False
        self._stubs.pop(replica_id, None)
        call = self._calls.pop(replica_id, None)
        if call is not None:
            call.cancel()
        task = self._tasks.pop(replica_id, None)
        channel = self._channels.pop(replica_id, None)
        if task is not None or channel is not None:
            closer = asyncio.create_task(self._close_one(task, channel), name=f"unwatch-{replica_id}")
            self._closers.add(closer)
            closer.add_done_callback(self._closers.discard)
        return True

    @staticmethod
    async def _close_one(task: asyncio.Task[None] | None, channel: grpc.aio.Channel | None) -> None:
        if task is not None:
            task.cancel()
            await asyncio.wait([task], timeout=1.0)
        if channel is not None:
            await channel.close(grace=None)

    async def close(self) -> None:
        """Stop the watch tasks and close the channels (bounded: about 1 s at most)."""
        self._closing = True
        for call in list(self._calls.values()):
            call.cancel()  # gRPC-level cancel first: a task cancelled inside call.read() can linger
        tasks = list(self._tasks.values())
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=1.0)
        self._tasks.clear()
        if self._closers:
            await asyncio.wait(list(self._closers), timeout=2.0)
        for ch in self._channels.values():
            await ch.close(grace=None)
        self._channels.clear()
        self._stubs.clear()

    async def _watch(self, replica_id: str) -> None:
        stub = self._stubs.get(replica_id)
        if stub is None:  # removed before the task first ran
            return
        backoff = BACKOFF_START_S
        request = admission_pb2.WatchBudgetRequest(router_id=self._router_id)
        loop = asyncio.get_running_loop()
        me = asyncio.current_task()
        down_since: float | None = None  # loop time of the first failure of the current outage
        while self._tasks.get(replica_id) is me:  # ends once the replica is removed (or replaced)
            call = stub.WatchBudget(request, metadata=self._metadata)
            self._calls[replica_id] = call
            silent = [False]

            def on_silence(call: grpc.aio.UnaryStreamCall = call, flag: list[bool] = silent) -> None:
                flag[0] = True
                call.cancel()

            watchdog = loop.call_later(self._silence_s, on_silence)
            try:
                async for snapshot in call:
                    watchdog.cancel()
                    watchdog = loop.call_later(self._silence_s, on_silence)
                    self._book.update(replica_id, snapshot)
                    backoff = BACKOFF_START_S
                    if down_since is not None:
                        log.info("replica %s: watch stream back after %.1f s", replica_id, loop.time() - down_since)
                        down_since = None
                detail = "watch stream ended"
            except asyncio.CancelledError:
                if silent[0] and not self._closing:
                    detail = f"watch stream silent for {self._silence_s:.1f} s"
                else:
                    watchdog.cancel()
                    call.cancel()
                    raise
            except grpc.aio.AioRpcError as exc:
                detail = f"watch stream error: {exc.code().name}"
            except Exception as exc:  # pragma: no cover - defensive
                detail = f"watch stream error: {exc!r}"
            finally:
                if self._calls.get(replica_id) is call:
                    del self._calls[replica_id]
            watchdog.cancel()
            call.cancel()
            if self._tasks.get(replica_id) is not me:
                return
            self._book.mark_disconnected(replica_id, detail)
            if down_since is None:
                down_since = loop.time()
            # INFO once per outage (first failure after a good stream), DEBUG while retrying
            level = logging.INFO if backoff == BACKOFF_START_S else logging.DEBUG
            log.log(level, "replica %s: %s; reconnecting in %.2f s", replica_id, detail, backoff)
            await asyncio.sleep(backoff)
            backoff = min(BACKOFF_CAP_S, backoff * 2)

    async def reserve(
        self,
        replica_id: str,
        slo_class: str,
        prompt_tokens: int,
        request_id: str,
        max_tokens: int = 0,
        waited_ms: float = 0.0,
        on_time_only: bool = False,
    ) -> ReserveResult:
        """Take a lease on ``replica_id`` for a prompt of ``prompt_tokens`` tokens.

        ``waited_ms``: ms since the request arrived at the router; the agent plans over the class
        horizon minus it (proto ReserveRequest.waited_ms). ``on_time_only``: grant only a start
        that meets the request's TTFT (proto ReserveRequest.on_time_only). The caller applies the
        answer's budget to the book (router/core.py).

        Never raises for RPC problems: a deadline (``reserve_timeout_ms``) gives ``reason="timeout"``,
        any other RPC error ``reason="unavailable"``.
        """
        stub = self._stubs.get(replica_id)
        if stub is None:
            return ReserveResult(False, reason="unknown-replica")
        req = admission_pb2.ReserveRequest(
            slo_class=slo_class,
            prompt_tokens=int(prompt_tokens),
            request_id=request_id,
            router_id=self._router_id,
            max_tokens=int(max_tokens),
            waited_ms=float(waited_ms),
            on_time_only=bool(on_time_only),
        )
        try:
            resp = await stub.Reserve(req, timeout=self._reserve_timeout_s, metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            reason = "timeout" if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED else "unavailable"
            return ReserveResult(False, reason=reason)
        if resp.granted:
            self._lease_replica[resp.lease_id] = replica_id
            if len(self._lease_replica) > MAX_TRACKED_LEASES:  # bound: forget the oldest (it lapses by TTL)
                self._lease_replica.pop(next(iter(self._lease_replica)))
        return ReserveResult(resp.granted, resp.lease_id, resp.reason, resp.pab_ms, resp.pab_tokens)

    def forget(self, lease_id: str) -> None:
        """Drop the local record of a lease that was used (its request reached the agent and ended)."""
        self._lease_replica.pop(lease_id, None)

    async def release(self, lease_id: str, reason: str) -> bool:
        """Give ``lease_id`` back to its agent; True when the agent released it.

        Never raises: an RPC failure is logged and False returned (the lease lapses by its TTL).
        """
        replica_id = self._lease_replica.pop(lease_id, None)
        stub = self._stubs.get(replica_id) if replica_id is not None else None
        if stub is None:
            return False
        try:
            resp = await stub.Release(
                admission_pb2.ReleaseRequest(lease_id=lease_id, reason=reason), timeout=RELEASE_TIMEOUT_S,
                metadata=self._metadata,
            )
        except grpc.aio.AioRpcError as exc:
            log.warning("release %s on %s failed: %s", lease_id, replica_id, exc.code().name)
            return False
        finally:
            self._book.notify()
        return bool(resp.released)
