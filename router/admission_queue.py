"""Requests that no replica can take right now wait here (DESIGN.md section 5, steps 5-6).

:class:`FifoQueue` is the plain bounded FIFO; the router uses the weighted fair queue
(:class:`router.fair_queue.FairQueue`) behind the same :class:`AdmissionQueue` protocol (``push``,
``remove``, ``expire``, ``ordered``), and the :class:`Dispatcher` serves either.

- ``push`` raises :class:`QueueFull` when ``max_requests`` requests or ``max_tokens`` prompt tokens
  already wait (a bounded queue overflows with 429, never with memory growth).
- every entry has a deadline ``enqueued_ms + max_queue_ms`` of its SLO class; past it the entry
  is removed and its future fails with :class:`QueueTimeout` (-> 429 queue-timeout).
- a waiter that goes away (client disconnect) cancels its future and removes its entry at once.

The dispatcher tries the entries in queue order on every budget update and every release. A head
that fits nowhere does not block the requests behind it for ever: later entries that fit may pass
it, at most ``max_bypass`` times per head, then the dispatcher holds until the head fits.

No entry can block the dispatcher: an entry whose ``admit`` raises (a bug, or a request the
placement or the Reserve cannot represent) is removed at once and its future fails with
:class:`PlacementFailed` (the router answers 503 ``placement-error``); the pass goes on with the
entries behind it.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
from collections.abc import Awaitable, Callable, Container, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from replica_agent.aio import wait_event
from replica_agent.clock import Clock

log = logging.getLogger(__name__)

G = TypeVar("G")


class QueueFull(Exception):
    """The queue holds ``max_requests`` requests or ``max_tokens`` tokens already.

    Attributes:
        limit: ``"max_requests"`` or ``"max_tokens"``.
    """

    def __init__(self, limit: str) -> None:
        super().__init__(f"admission queue full ({limit})")
        self.limit = limit


class QueueTimeout(Exception):
    """The request left the queue unserved at its ``deadline_ms``.

    Attributes:
        reason: ``"queue-timeout"`` (waited its class's ``max_queue_ms``) or ``"slo-infeasible"``
            (a sheddable request whose first-token deadline could no longer be met).
    """

    def __init__(self, reason: str = "queue-timeout") -> None:
        super().__init__(reason)
        self.reason = reason


class PlacementFailed(Exception):
    """Placing this request raised; it was removed from the queue and is answered, never retried.

    Attributes:
        reason: the exception class name (no request content).
    """

    def __init__(self, reason: str) -> None:
        super().__init__(f"placement failed: {reason}")
        self.reason = reason


@dataclass(slots=True, eq=False)
class WaitingRequest:
    """One queued request (compared and hashed by identity).

    Attributes:
        request_id: the router-made request id (never the client's x-request-id).
        tenant: tenant name.
        slo_class: SLO class name.
        prompt_tokens: estimated prompt tokens.
        max_tokens: requested output tokens (0 = unknown).
        enqueued_ms: router clock at push (simulated ms).
        deadline_ms: enqueued_ms + the class's max_queue_ms (simulated ms).
        future: resolved by the dispatcher with a grant, or failed with :class:`QueueTimeout`.
        exclude: replica ids not to use (already failed for this request).
        passed_by: how many later entries were admitted while this one waited at the head.
        priority: priority band (0 = most urgent) of its SLO class.
        first_token_deadline_ms: arrival + ttft_ms (simulated ms): the EDF key within a tenant.
        expire_reason: reason given when ``deadline_ms`` passes (``queue-timeout`` or
            ``slo-infeasible`` when the deadline was set by the fast-fail prediction).
        seq: arrival order in the queue (set by the queue).
        arrival_ms: router clock when the request arrived at the router (simulated ms; before
            ``enqueued_ms`` when it was tried or retried first); None = ``enqueued_ms``.
    """

    request_id: str
    tenant: str
    slo_class: str
    prompt_tokens: int
    max_tokens: int
    enqueued_ms: float
    deadline_ms: float
    future: asyncio.Future[Any]
    exclude: frozenset[str] = frozenset()
    passed_by: int = 0
    priority: int = 0
    first_token_deadline_ms: float = float("inf")
    expire_reason: str = "queue-timeout"
    seq: int = 0
    arrival_ms: float | None = None

    @property
    def arrived_ms(self) -> float:
        """Router clock at the request's arrival at the router (``arrival_ms``, else ``enqueued_ms``)."""
        return self.enqueued_ms if self.arrival_ms is None else self.arrival_ms

    def waited_ms(self, now_ms: float) -> float:
        """ms since the request's arrival at the router (>= 0): its TTFT has that much less left."""
        return max(0.0, now_ms - self.arrived_ms)


class AdmissionQueue(Protocol):
    """What the dispatcher and the request path need from a queue (FIFO now, WFQ later)."""

    def push(self, entry: WaitingRequest) -> object: ...
    def remove(self, entry: WaitingRequest) -> bool: ...
    def expire(self, now_ms: float) -> list[WaitingRequest]: ...
    def ordered(self) -> Iterator[WaitingRequest]: ...
    def next_deadline_ms(self) -> float | None: ...
    def __len__(self) -> int: ...
    @property
    def tokens(self) -> int: ...


class DeadlineIndex:
    """Queue deadlines in a min-heap with lazy deletion, shared by the queue implementations.

    Entries removed from their queue stay in the heap until they reach its top; callers pass the
    set of live entries (``live``) so that removed ones are skipped. Times are simulated ms.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, WaitingRequest]] = []
        self._seq = itertools.count()

    def add(self, entry: WaitingRequest) -> None:
        """Index ``entry`` by its ``deadline_ms`` (ties in insertion order)."""
        heapq.heappush(self._heap, (entry.deadline_ms, next(self._seq), entry))

    def clear(self) -> None:
        """Forget everything (the queue became empty)."""
        self._heap.clear()

    def pop_due(self, now_ms: float) -> list[WaitingRequest]:
        """Pop every indexed entry whose deadline <= ``now_ms`` (live or already removed)."""
        due = []
        while self._heap and self._heap[0][0] <= now_ms:
            due.append(heapq.heappop(self._heap)[2])
        return due

    def earliest_ms(self, live: Container[WaitingRequest]) -> float | None:
        """Earliest deadline among entries still in ``live``, None when there is none."""
        while self._heap and self._heap[0][2] not in live:
            heapq.heappop(self._heap)
        return self._heap[0][0] if self._heap else None


class FifoQueue:
    """Bounded FIFO: O(1) push and remove, expiry by a deadline heap (lazy deletion).

    Args:
        max_requests: most waiting requests (>= 1).
        max_tokens: most waiting prompt tokens in total (>= 1).
    """

    def __init__(self, max_requests: int, max_tokens: int) -> None:
        if max_requests < 1 or max_tokens < 1:
            raise ValueError("max_requests and max_tokens must be >= 1")
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self._entries: dict[WaitingRequest, None] = {}
        self._tokens = 0
        self._deadlines = DeadlineIndex()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def tokens(self) -> int:
        """Prompt tokens waiting in total."""
        return self._tokens

    def push(self, entry: WaitingRequest) -> None:
        """Append ``entry``.

        Raises:
            QueueFull: ``max_requests`` reached, or the prompt would take the total over
                ``max_tokens`` (a single prompt larger than ``max_tokens`` is still accepted into
                an empty queue so that it can wait for an idle replica).
        """
        if len(self._entries) >= self.max_requests:
            raise QueueFull("max_requests")
        if self._entries and self._tokens + entry.prompt_tokens > self.max_tokens:
            raise QueueFull("max_tokens")
        self._entries[entry] = None
        self._tokens += entry.prompt_tokens
        self._deadlines.add(entry)

    def remove(self, entry: WaitingRequest) -> bool:
        """Take ``entry`` out (False when it was not queued)."""
        if entry not in self._entries:
            return False
        del self._entries[entry]
        self._tokens -= entry.prompt_tokens
        if not self._entries:
            self._deadlines.clear()
        return True

    def expire(self, now_ms: float) -> list[WaitingRequest]:
        """Remove and return the entries whose ``deadline_ms`` <= ``now_ms`` (simulated ms)."""
        return [e for e in self._deadlines.pop_due(now_ms) if self.remove(e)]

    def next_deadline_ms(self) -> float | None:
        """Earliest deadline among queued entries (simulated ms), None when empty."""
        return self._deadlines.earliest_ms(self._entries)

    def ordered(self) -> Iterator[WaitingRequest]:
        """Entries in dispatch order (oldest first); safe to remove entries while iterating."""
        return iter(list(self._entries))

    def head(self) -> WaitingRequest | None:
        """The oldest entry, or None."""
        return next(iter(self._entries), None)


@dataclass(slots=True)
class DispatchStats:
    """What one dispatch pass did."""

    admitted: int = 0
    expired: int = 0
    failed: int = 0
    held: bool = False


@dataclass(slots=True)
class Dispatcher(Generic[G]):
    """Hands waiting requests to replicas whenever budget may have appeared.

    Args:
        queue: the admission queue.
        clock: router clock (simulated ms).
        admit: async ``entry -> grant | None`` (placement + Reserve; None when nothing fits); when it
            raises, the entry is removed and its future fails with :class:`PlacementFailed`.
        release_orphan: async ``grant -> None`` for a grant whose waiter left meanwhile.
        max_bypass: later entries admitted past a head that fits nowhere, per head, before holding.
        max_scan: entries tried per pass (bounds the work of one wake-up).
        idle_poll_s: wall seconds between passes when nothing wakes the dispatcher.
    """

    queue: AdmissionQueue
    clock: Clock
    admit: Callable[[WaitingRequest], Awaitable[G | None]]
    release_orphan: Callable[[G], Awaitable[None]]
    max_bypass: int = 8
    max_scan: int = 64
    idle_poll_s: float = 1.0
    _wake: asyncio.Event = field(default_factory=asyncio.Event)

    def wake(self) -> None:
        """Ask for a dispatch pass soon (budget update, release, new entry)."""
        self._wake.set()

    async def run(self) -> None:
        """Dispatch until cancelled."""
        while True:
            timeout = self.idle_poll_s
            nd = self.queue.next_deadline_ms()
            if nd is not None:
                timeout = min(timeout, max(0.0, self.clock.to_wall_s(nd - self.clock.now_ms())) + 0.001)
            await wait_event(self._wake, timeout)
            self._wake.clear()
            try:
                await self.dispatch_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # never let one bad pass stop the dispatcher
                log.exception("dispatch pass failed")

    async def dispatch_once(self) -> DispatchStats:
        """One pass: expire, then try entries in order with the bounded head-of-line bypass."""
        stats = DispatchStats()
        for entry in self.queue.expire(self.clock.now_ms()):
            stats.expired += 1
            if not entry.future.done():
                entry.future.set_exception(QueueTimeout(entry.expire_reason))
        blocked_head: WaitingRequest | None = None
        scanned = 0
        for entry in self.queue.ordered():
            if entry.future.done():  # waiter gone (timeout or disconnect) but not yet removed
                self.queue.remove(entry)
                continue
            if blocked_head is not None and blocked_head.passed_by >= self.max_bypass:
                stats.held = True
                break
            if blocked_head is not None and entry.priority > blocked_head.priority:
                # A less urgent band never takes the budget a blocked, more urgent head waits for:
                # its longer TTFT horizon makes it fit where the urgent one does not, and admitting
                # it would push the urgent band further out. Lower bands still get their min_share,
                # because the fair queue then orders them first (they are the head themselves).
                continue
            scanned += 1
            if scanned > self.max_scan:
                break
            try:
                grant = await self.admit(entry)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - this entry only: answer it, drop it, go on
                log.error("dispatch: placing request %s raised %s; answered and removed from the queue",
                          entry.request_id, type(exc).__name__, exc_info=exc)
                self.queue.remove(entry)
                if not entry.future.done():
                    entry.future.set_exception(PlacementFailed(type(exc).__name__))
                stats.failed += 1
                continue
            if grant is None:
                if blocked_head is None:
                    blocked_head = entry
                continue
            self.queue.remove(entry)
            if blocked_head is not None:
                blocked_head.passed_by += 1
            if entry.future.done():
                await self.release_orphan(grant)
            else:
                entry.future.set_result(grant)
                stats.admitted += 1
        return stats
