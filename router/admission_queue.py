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

from fairbatch_common.aio import wait_event
from fairbatch_common.clock import Clock

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
        stalled: the chain (:meth:`Dispatcher.dispatch_chain`) covered the queue, admitted nothing,
            and ``probe`` says the head of some band could be placed now: the dispatcher failed its
            work conservation (:meth:`Dispatcher.stalled_ms`, the watchdog).
        covered: entries (in the pass's order from its first) that got both phases, placed or not:
            all of them unless the pass was truncated.
    """

    admitted: int = 0
    expired: int = 0
    failed: int = 0
    held: bool = False
    truncated: bool = False
    admit_calls: int = 0
    shed_kept: int = 0
    stalled: bool = False
    covered: int = 0



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
    an admit call, so one pass covers a long queue of similar requests in a few calls. Phase 1
    also skips, without a call, an entry already past its first-token deadline
    (``now >= first_token_deadline_ms``): it cannot be on time anywhere (pab.on_time needs
    ``a + b*P <= H - w`` with ``H = ttft - margin <= ttft <= w``).

    Scan budget (issue 25): one pass makes at most ``max_scan`` admit calls, and phase 1 never
    takes the calls phase 2 needs: once phase 1 has left entries to phase 2, it stops at
    ``max_scan - min(len(late), max_scan // 2)`` calls (the pass is truncated there), so phase 2
    always gets at least one call per pass. Before, a queue of 64 or more entries that all failed
    phase 1 spent every pass's calls in phase 1, each truncated pass resumed in phase 1 again, and
    phase 2 never ran: 128 late requests waited in front of two idle replicas until their queue
    timeout. A truncated pass resumes at the first entry of its order that did not get both of
    its phases (the phase-1 cut, or the phase-2 cut when that comes first), so successive passes
    move through the whole queue with both phases.

    Args:
        queue: the admission queue.
        clock: router clock (simulated ms).
        admit: async ``(entry, attempt) -> grant | None`` (placement + Reserve; None when nothing fits);
            when it raises, the entry is removed and its future fails with :class:`PlacementFailed`.
        release_orphan: async ``grant -> None`` for a grant whose waiter left meanwhile.
        max_bypass: entries admitted behind a blocked head (same band) before it gets a hold.
        max_scan: admit calls per pass (>= 2; bounds the work of one wake-up); a pass cut there
            schedules the next at once, which starts at the first entry not fully tried and wraps
            around, so successive passes reach every entry in both phases (see "Scan budget").
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
        probe: ``(entry, attempt) -> bool``, side-effect free: would ``admit`` place ``entry`` with
            ``attempt`` now (the placement alone, no Reserve)? Asked only after a chain of passes
            (:meth:`dispatch_chain`) that covered the queue and admitted nothing, for the head of each band (the attempt it may use: on time only
            for a sheddable one, the held replica avoided behind the holder). True for any of
            them = the queue is stalled while budget is free (:meth:`stalled_ms`; issue 25).
            None: no watchdog.
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
    probe: Callable[[WaitingRequest, Attempt], bool] | None = None
    _resume: WaitingRequest | None = None  # first entry a truncated pass did not try
    _resume_head: WaitingRequest | None = None  # the blocked head of that pass (the next one keeps it)
    _stalled_since_ms: float | None = None  # end of the first chain of the current stall (watchdog)

    def __post_init__(self) -> None:
        if self.max_scan < 2:
            raise ValueError(f"max_scan must be >= 2 (one call for each phase), got {self.max_scan}")

    @property
    def hold(self) -> tuple[WaitingRequest, str] | None:
        """(entry, replica id) of the current hold, or None."""
        h = self._hold
        if h is not None and h[0].future.done():
            self._hold = h = None
        return h

    def stalled_ms(self, now_ms: float) -> float:
        """How long the queue has not moved while the head of a band could be placed (simulated
        ms; 0 when not stalled). It starts at the end of the first chain (:meth:`dispatch_chain`)
        that covered the queue, admitted nothing and in which ``probe`` found a placeable band
        head, and ends at the next chain that admits or finds the queue empty or no head
        placeable. A working dispatcher reads 0 (or one push period while an agent refuses a
        Reserve its stale view promised); the router exports it as
        ``fairbatch_router_dispatch_stalled_seconds``."""
        since = self._stalled_since_ms
        return 0.0 if since is None else max(0.0, now_ms - since)

    def _placeable_head(self, now_ms: float) -> bool:
        """``probe`` on the head of each band in queue order (see ``probe``)."""
        if self.probe is None:
            return False
        hold = self.hold
        behind_holder = False
        seen: set[int] = set()
        for n, entry in enumerate(self.queue.ordered(now_ms)):
            if n >= self.max_entries:
                break
            if entry.future.done():
                continue
            if entry.priority not in seen:
                seen.add(entry.priority)
                avoid = frozenset((hold[1],)) if hold is not None and behind_holder else frozenset()
                if self.probe(entry, Attempt(on_time_only=entry.sheddable, avoid=avoid)):
                    return True
            if hold is not None and entry is hold[0]:
                behind_holder = True
        return False

    def _watch(self, stats: DispatchStats, streak: int, now_ms: float) -> None:
        """Update the stall watchdog after a chain whose passes since the last admission covered
        ``streak`` entries (a stall needs a chain that admitted nothing in its last full cycle)."""
        if streak < len(self.queue) or stats.admitted or not len(self.queue) or not self._placeable_head(now_ms):
            self._stalled_since_ms = None
            return
        stats.stalled = True
        if self._stalled_since_ms is None:
            self._stalled_since_ms = now_ms

    def wake(self) -> None:
        """Ask for a dispatch pass soon (budget update, release, new entry)."""
        self._wake.set()

    def wake_if_waiting(self) -> None:
        """:meth:`wake` when a pass could change anything: an entry waits, or a hold or a stall is
        still recorded (a pass clears them). A budget update or a lease release with an empty queue
        needs no pass (the ext_proc picker's and the front door's every release notified one)."""
        if len(self.queue) or self._hold is not None or self._stalled_since_ms is not None:
            self._wake.set()

    async def run(self) -> None:
        """Dispatch until cancelled: after every wake-up (or ``idle_poll_s``, or the next queue
        deadline, or ``shed_recheck_ms`` after a pass that kept sheddable entries), one
        :meth:`dispatch_chain`."""
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
                stats = await self.dispatch_chain(_yield)
            except asyncio.CancelledError:
                raise
            except Exception:  # never let one bad pass stop the dispatcher
                log.exception("dispatch pass failed")
                recheck = False
                continue
            recheck = stats.shed_kept > 0

    async def dispatch_chain(self, pause: Callable[[], Awaitable[None]] | None = None) -> DispatchStats:
        """What one wake-up does: :meth:`dispatch_once`, and again at once while the pass was
        truncated and the passes since the last admission have not yet given every queued entry
        both phases (``DispatchStats.covered`` summed), so that a wake-up places whatever some
        replica can take now however long the queue is, and a long queue that fits nowhere costs
        one cycle over it per wake-up, not a busy loop. ``pause`` is awaited between passes (the
        router yields to its event loop; the fleet simulation passes None). Then the stall
        watchdog (:meth:`stalled_ms`) is updated when the chain covered the queue.

        Returns:
            the passes' stats added up (``truncated``, ``held``, ``shed_kept`` of the last pass).
        """
        total = DispatchStats()
        streak = 0  # entries covered since the last pass that admitted
        while True:
            stats = await self.dispatch_once()
            total.admitted += stats.admitted
            total.expired += stats.expired
            total.failed += stats.failed
            total.admit_calls += stats.admit_calls
            total.covered += stats.covered
            total.truncated, total.held, total.shed_kept = stats.truncated, stats.held, stats.shed_kept
            streak = 0 if stats.admitted else streak + stats.covered
            complete = not stats.truncated or streak >= len(self.queue)
            if complete:
                self._watch(total, streak, self.clock.now_ms())
                return total
            if pause is not None:
                await pause()

    async def dispatch_once(self) -> DispatchStats:
        """One pass (see the class docstring): expire, phase 1 (on time), phase 2 (normal fit),
        bypass count and hold. Positions (holder, head, "behind") are in queue order, also when a
        pass starts where a truncated one stopped."""
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
        n = len(entries)
        start = 0
        resume, self._resume = self._resume, None
        resume_head, self._resume_head = self._resume_head, None
        head_at: int | None = None  # first in queue order of the entries phase 1 could not place
        if resume is not None:  # the previous pass was cut: start where it stopped, wrap around
            for i, entry in enumerate(entries):
                if entry is resume:
                    start = i
                if entry is resume_head:  # its blocked head stays the head (tried before this pass's start)
                    head_at = i
        order = [*range(start, n), *range(start)]  # queue indices in this pass's order
        # entries behind the holder in queue order may not use the held replica; entries ahead of
        # it (or all of them, when it lies beyond the entries looked at) may
        hold = self.hold
        holder_at = n
        if hold is not None:
            stats.held = True
            for i, entry in enumerate(entries):
                if entry is hold[0]:
                    holder_at = i
                    break
        failed: dict[tuple, list[tuple[int, float]]] = {}
        late: list[int] = []
        blocked: list[int] = []

        def not_placed(i: int, entry: WaitingRequest, phase: int) -> None:
            """Entry ``i`` was not placed in this phase: phase 1 leaves it to phase 2 (the normal fit)
            unless it is sheddable; the first one (queue order) phase 1 could not place is the blocked head."""
            nonlocal head_at
            (late if phase == 1 and not entry.sheddable else blocked).append(i)
            if phase == 1 and (head_at is None or i < head_at):
                head_at = i

        def take_hold(i: int) -> None:
            nonlocal hold, holder_at
            if hold is None and self.hold_for is not None:
                rid = self.hold_for(entries[i])
                if rid is not None:
                    hold = self._hold = (entries[i], rid)
                    holder_at = i
                    stats.held = True

        cut_rank: int | None = None  # pass position of the first entry this pass did not give both phases
        phase2_reserve = self.max_scan // 2  # calls phase 1 leaves to phase 2 once it has late entries
        for phase, indices in ((1, order), (2, late)):
            failed.clear()
            for i in indices:
                entry = entries[i]
                if hold is not None and hold[0].future.done():  # the holder was placed (or left)
                    hold, self._hold, holder_at = None, None, n
                if head_at is not None and entries[head_at].future.done():
                    head_at = None
                if (head_at is not None and i > head_at and entry.priority > entries[head_at].priority
                        and hold is None):
                    take_hold(head_at)  # a less urgent band never takes the replica the head waits for
                avoid = frozenset((hold[1],)) if hold is not None and i > holder_at else frozenset()
                key = (entry.slo_class, entry.exclude, avoid)
                waited = entry.waited_ms(now)
                if self.skip_dominated and (
                    (phase == 1 and now >= entry.first_token_deadline_ms)  # cannot be on time anywhere
                    or any(p <= entry.prompt_tokens and (phase == 2 or w <= waited) for p, w in failed.get(key, ()))
                ):
                    not_placed(i, entry, phase)
                    continue
                rank = (i - start) % n
                if phase == 1 and late and stats.admit_calls >= self.max_scan - min(len(late), phase2_reserve):
                    stats.truncated = True  # the rest of phase 1 waits for the next pass; phase 2 runs now
                    cut_rank = rank
                    break
                if stats.admit_calls >= self.max_scan:
                    stats.truncated = True
                    cut_rank = rank if cut_rank is None else min(cut_rank, rank)
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
        stats.covered = n if cut_rank is None else cut_rank
        if cut_rank is not None:
            self._resume = entries[order[cut_rank]]
            if head_at is not None and not entries[head_at].future.done():
                self._resume_head = entries[head_at]
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


async def _yield() -> None:
    """Let the event loop serve others between the passes of one chain."""
    await asyncio.sleep(0)
