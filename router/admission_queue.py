"""Requests that no replica can take right now wait here (docs/design.md section 5, steps 5-6).

:class:`FifoQueue` is the plain bounded FIFO; the router uses the weighted fair queue
(:class:`router.fair_queue.FairQueue`) behind the same :class:`AdmissionQueue` protocol (``push``,
``remove``, ``expire``, ``ordered``), and the :class:`Dispatcher` serves either.

- ``push`` raises :class:`QueueFull` when ``max_requests`` requests or ``max_tokens`` prompt tokens
  already wait (a bounded queue overflows with 429, never with memory growth).
- every entry has a deadline ``enqueued_ms + max_queue_ms`` of its SLO class; past it the entry
  is removed and its future fails with :class:`QueueTimeout` (-> 429 queue-timeout).
- a waiter that goes away (client disconnect) cancels its future and removes its entry at once.

The dispatcher tries the entries in queue order on every budget update and every release, and is
work conserving (issue 18): while some replica can start a queued request, it starts one. A head
that fits nowhere never holds the queue: later entries that fit pass it; after ``max_bypass`` of
them it gets one replica held for it (entries behind it may not use that one), every other replica
keeps serving (:class:`Dispatcher`).

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
        promote_at_ms: router clock from which the entry counts as aged (arrival + ttft_ms of its
            class; :mod:`router.fair_queue`, "Aging"); inf = never.
        sheddable: its class is sheddable: it is only ever placed where it can still meet its TTFT
            (phase 1 of :class:`Dispatcher`), never late; it waits for such a start or is shed.
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
    promote_at_ms: float = float("inf")
    sheddable: bool = False

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
    def ordered(self, now_ms: float | None = None) -> Iterator[WaitingRequest]: ...
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

    def ordered(self, now_ms: float | None = None) -> Iterator[WaitingRequest]:
        """Entries in dispatch order (oldest first; ``now_ms`` unused); safe to remove entries while iterating."""
        return iter(list(self._entries))

    def head(self) -> WaitingRequest | None:
        """The oldest entry, or None."""
        return next(iter(self._entries), None)


@dataclass(frozen=True, slots=True)
class Attempt:
    """How the dispatcher asks ``admit`` to place one entry.

    Attributes:
        on_time_only: place only where the request can still meet its TTFT (first phase of a
            pass); False = the normal fit (pab.py "Work conservation").
        avoid: replica ids held for an entry ahead of this one (:class:`Dispatcher`, "Holds");
            placement must not use them for this entry.
    """

    on_time_only: bool = False
    avoid: frozenset[str] = frozenset()


@dataclass(slots=True)
class DispatchStats:
    """What one dispatch pass did.

    Attributes:
        admitted: entries granted a replica.
        expired: entries removed at their deadline.
        held: a replica is held for a starving head after the pass (see :class:`Dispatcher`).
        truncated: the pass stopped at ``max_scan`` admit calls (another pass is scheduled).
        admit_calls: calls to ``admit`` (entries skipped as dominated are not counted).
        shed_kept: blocked sheddable entries that ``shed`` kept (still feasible): the next pass
            comes within ``Dispatcher.shed_recheck_ms`` to ask again.
    """

    admitted: int = 0
    expired: int = 0
    failed: int = 0
    held: bool = False
    truncated: bool = False
    admit_calls: int = 0
    shed_kept: int = 0



@dataclass(slots=True)
class Dispatcher(Generic[G]):
    """Hands waiting requests to replicas whenever budget may have appeared (issue 18).

    Invariant (work conservation): after a pass that was not truncated, no entry left in the queue
    can be placed on any replica except a replica held for an entry ahead of it, and except a
    sheddable entry that no replica can start in time (step 3). A pass:

    1. expire the entries past their deadline;
    2. phase 1, queue order (``queue.ordered(now_ms)``): each entry is offered the replicas where
       it can still meet its TTFT (``Attempt(on_time_only=True)``);
    3. phase 2, queue order, the entries phase 1 left: the normal fit (``on_time_only=False``).
       A late request thus starts at once wherever a fresh arrival of its size could, behind the
       work that can still meet its deadline in the same pass. Not a sheddable one
       (``WaitingRequest.sheddable``): its class asks to be refused rather than served late, so
       it waits for an on-time start or is shed (``shed``, or its deadline). Serving those late
       took the capacity on-time requests needed: azure-conv, 16 x llama-3-8b-a100 at 130 req/s,
       SLO attainment 0.869 with them placed late, 0.942 without (docs/evaluation.md);
    4. the first entry that phase 1 could not place (the blocked head) counts the entries admitted
       behind it (``passed_by``, +1 each; +``max_bypass`` for a less urgent band). Holds: once
       ``passed_by >= max_bypass``, or before a less urgent band's entry is tried behind it, and
       while no hold exists, ``hold_for(head)`` names one replica (the one where it will fit
       soonest) that entries BEHIND the head in queue order may no longer use until the head
       leaves the queue (placed, also in phase 2 of the same pass, expired or gone). Nothing else
       ever waits for the head: the other replicas keep serving the queue, and entries ahead of
       the head keep the held replica too. At most one hold.

    ``skip_dominated``: with an ``admit`` that is a monotone placement (a prompt that does not fit
    makes every longer prompt of the same class, exclusions and avoid set not fit, and in phase 1
    every such prompt that waited at least as long: pab.fits, pab.on_time and the start window are
    all monotone in P and w), entries dominated by a failure of the same pass are skipped without
    an admit call, so one pass covers a long queue of similar requests in a few calls.

    Args:
        queue: the admission queue.
        clock: router clock (simulated ms).
        admit: async ``(entry, attempt) -> grant | None`` (placement + Reserve; None when nothing fits);
            when it raises, the entry is removed and its future fails with :class:`PlacementFailed`.
        release_orphan: async ``grant -> None`` for a grant whose waiter left meanwhile.
        max_bypass: entries admitted behind a blocked head (same band) before it gets a hold.
        max_scan: admit calls per pass (bounds the work of one wake-up); a pass cut there
            schedules the next at once, which starts at the first entry not tried and wraps
            around, so successive passes reach every entry.
        idle_poll_s: wall seconds between passes when nothing wakes the dispatcher.
        hold_for: ``entry -> replica id | None``: the replica to hold for a starving head (None,
            or a callback answering None: no hold).
        skip_dominated: skip entries dominated by a failure of the same pass (see above).
        max_entries: entries looked at per pass (bounds the queue walk; the rest wait for the next).
        shed: ``(entry, now_ms) -> bool`` asked, at the end of a pass, for each entry left blocked
            whose ``expire_reason`` is ``slo-infeasible`` (a sheddable request): True = it can no
            longer meet its first-token deadline, so it leaves now with ``QueueTimeout("slo-infeasible")``
            instead of waiting to be refused at its deadline.
        shed_recheck_ms: while a pass kept blocked sheddable entries (``DispatchStats.shed_kept``),
            the next pass comes at most this long after it (simulated ms), also when no budget
            push wakes the dispatcher: a prediction goes stale as time passes (a prefill that
            overruns its predicted end), and between changes the agents push only every
            ``push_interval_ms`` (100 ms by default), so such an entry could stay queued that
            long after it turned infeasible (issue 18: refused within 50 ms of arrival).
    """

    queue: AdmissionQueue
    clock: Clock
    admit: Callable[[WaitingRequest, Attempt], Awaitable[G | None]]
    release_orphan: Callable[[G], Awaitable[None]]
    max_bypass: int = 8
    max_scan: int = 64
    idle_poll_s: float = 1.0
    hold_for: Callable[[WaitingRequest], str | None] | None = None
    skip_dominated: bool = False
    max_entries: int = 4096
    shed: Callable[[WaitingRequest, float], bool] | None = None
    shed_recheck_ms: float = 10.0
    _wake: asyncio.Event = field(default_factory=asyncio.Event)
    _hold: tuple[WaitingRequest, str] | None = None
    _resume: WaitingRequest | None = None  # first entry a truncated pass did not try

    @property
    def hold(self) -> tuple[WaitingRequest, str] | None:
        """(entry, replica id) of the current hold, or None."""
        h = self._hold
        if h is not None and h[0].future.done():
            self._hold = h = None
        return h

    def wake(self) -> None:
        """Ask for a dispatch pass soon (budget update, release, new entry)."""
        self._wake.set()

    async def run(self) -> None:
        """Dispatch until cancelled."""
        recheck = False  # the last pass kept blocked sheddable entries
        while True:
            timeout = self.idle_poll_s
            nd = self.queue.next_deadline_ms()
            if nd is not None:
                timeout = min(timeout, max(0.0, self.clock.to_wall_s(nd - self.clock.now_ms())) + 0.001)
            if recheck:
                timeout = min(timeout, self.clock.to_wall_s(self.shed_recheck_ms))
            await wait_event(self._wake, timeout)
            self._wake.clear()
            try:
                stats = await self.dispatch_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # never let one bad pass stop the dispatcher
                log.exception("dispatch pass failed")
                recheck = False
                continue
            recheck = stats.shed_kept > 0
            if stats.truncated:
                self._wake.set()  # the rest of the queue gets its pass at once
                await asyncio.sleep(0)  # but let the event loop serve others first

    async def dispatch_once(self) -> DispatchStats:
        """One pass (see the class docstring): expire, phase 1 (on time), phase 2 (normal fit),
        bypass count and hold."""
        stats = DispatchStats()
        now = self.clock.now_ms()
        for entry in self.queue.expire(now):
            stats.expired += 1
            if not entry.future.done():
                entry.future.set_exception(QueueTimeout(entry.expire_reason))
        entries: list[WaitingRequest] = []
        for entry in self.queue.ordered(now):
            if entry.future.done():  # waiter gone (timeout or disconnect) but not yet removed
                self.queue.remove(entry)
                continue
            entries.append(entry)
            if len(entries) >= self.max_entries:
                break
        resume, self._resume = self._resume, None
        if resume is not None:  # the previous pass was cut: start where it stopped, wrap around
            for i, entry in enumerate(entries):
                if entry is resume:
                    entries = entries[i:] + entries[:i]
                    break
        # entries behind the holder in queue order may not use the held replica; entries ahead of
        # it (or all of them, when it lies beyond the entries looked at) may
        hold = self.hold
        holder_at = len(entries)
        if hold is not None:
            stats.held = True
            for i, entry in enumerate(entries):
                if entry is hold[0]:
                    holder_at = i
                    break
        head_at: int | None = None  # the first entry phase 1 could not place (the blocked head)
        failed: dict[tuple, list[tuple[int, float]]] = {}
        late: list[int] = []
        blocked: list[int] = []

        def not_placed(i: int, entry: WaitingRequest, phase: int) -> None:
            """Entry ``i`` was not placed in this phase: phase 1 leaves it to phase 2 (the normal fit)
            unless it is sheddable; the first one phase 1 could not place is the blocked head."""
            nonlocal head_at
            (late if phase == 1 and not entry.sheddable else blocked).append(i)
            if head_at is None and phase == 1:
                head_at = i

        def take_hold(i: int) -> None:
            nonlocal hold, holder_at
            if hold is None and self.hold_for is not None:
                rid = self.hold_for(entries[i])
                if rid is not None:
                    hold = self._hold = (entries[i], rid)
                    holder_at = i
                    stats.held = True

        for phase, indices in ((1, range(len(entries))), (2, late)):
            failed.clear()
            for i in indices:
                entry = entries[i]
                if hold is not None and hold[0].future.done():  # the holder was placed (or left)
                    hold, self._hold, holder_at = None, None, len(entries)
                if head_at is not None and entries[head_at].future.done():
                    head_at = None
                if (head_at is not None and i > head_at and entry.priority > entries[head_at].priority
                        and hold is None):
                    take_hold(head_at)  # a less urgent band never takes the replica the head waits for
                avoid = frozenset((hold[1],)) if hold is not None and i > holder_at else frozenset()
                key = (entry.slo_class, entry.exclude, avoid)
                waited = entry.waited_ms(now)
                if self.skip_dominated and any(
                    p <= entry.prompt_tokens and (phase == 2 or w <= waited) for p, w in failed.get(key, ())
                ):
                    not_placed(i, entry, phase)
                    continue
                if stats.admit_calls >= self.max_scan:
                    stats.truncated = True
                    self._resume = entry
                    break
                stats.admit_calls += 1
                try:
                    grant = await self.admit(entry, Attempt(on_time_only=phase == 1, avoid=avoid))
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
                    failed.setdefault(key, []).append((entry.prompt_tokens, waited))
                    not_placed(i, entry, phase)
                    continue
                self.queue.remove(entry)
                if entry.future.done():
                    await self.release_orphan(grant)
                else:
                    entry.future.set_result(grant)
                    stats.admitted += 1
                if head_at is not None and i > head_at:
                    head = entries[head_at]
                    head.passed_by += self.max_bypass if entry.priority > head.priority else 1
                    if head.passed_by >= self.max_bypass:
                        take_hold(head_at)
            if stats.truncated:
                break
        if blocked and self.shed is not None:
            for i in blocked:
                entry = entries[i]
                if entry.expire_reason != "slo-infeasible" or entry.future.done():
                    continue
                if self.shed(entry, now):
                    self.queue.remove(entry)
                    entry.future.set_exception(QueueTimeout("slo-infeasible"))
                    stats.expired += 1
                else:
                    stats.shed_kept += 1
        stats.held = self.hold is not None
        return stats
