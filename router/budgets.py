"""The router's view of every replica's Prefill Admission Budget (PAB).

Holds the latest ``BudgetSnapshot`` per replica with the router-clock time it arrived. A budget is
usable only while the agent reports healthy and the snapshot is younger than its ``ttl_ms``
(simulated ms, router clock: no trust in the agent's wall clock); otherwise it counts as zero.
A granted or refused Reserve carries the class's new ``pab_ms``/``pab_tokens``; they are applied at
once so the next placement does not spend the same budget twice.

Every change wakes the waiters of :meth:`BudgetBook.wait_changed` (the queue's dispatcher).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields, replace

from fairbatch_common.aio import wait_event
from fairbatch_common.clock import Clock
from replica_agent.policy.time_model import TimeModel
from replica_agent.policy.pab import ClassBudget
from router.drain import DrainEstimator
from router.placement import ReplicaView

DEFAULT_TTL_MS = 1000.0

_CLASS_FIELDS = ("slo_class", "horizon_ms", "pab_ms", "pab_tokens", "kv_limited_tokens", "ttft_ms", "tpot_ms",
                 "decode_reservation_ms", "inflight_reservation_ms", "kv_free_tokens", "decode_iterations",
                 "slot_wait_ms")
"""ClassBudget's fields in order, as :func:`_deducted` passes them (a new field must be added there)."""
if tuple(f.name for f in fields(ClassBudget)) != _CLASS_FIELDS:  # pragma: no cover - fails at import
    raise ImportError("replica_agent.policy.pab.ClassBudget changed its fields: update router/budgets.py _deducted")


@dataclass(slots=True)
class ReplicaBudget:
    """Latest budget of one replica.

    Attributes:
        replica_id: replica id.
        received_ms: router clock (simulated ms) when the latest snapshot arrived; None = never.
        ttl_ms: the snapshot's TTL (simulated ms).
        seq: the snapshot's sequence number.
        healthy: agent-reported health.
        connected: the WatchBudget stream is up.
        time_model: a, b, c from the snapshot.
        classes: PAB per SLO class (updated by snapshots and Reserve answers).
        max_prompt_tokens: engine max model length (0 = unknown).
        status_detail: agent's reason when unhealthy.
        num_running, num_waiting, kv_usage: the engine's requests running and waiting and its KV cache
            usage (0..1) from the agent's latest scrape of the engine's ``/metrics``, as the snapshot
            carries them (proto ``BudgetSnapshot`` fields 8-10; read by the baseline placement
            profiles through router/core.py ``RouterCore.refresh_load``).
        inflight_prefill_ms: the snapshot's in-flight reservation per prefill in engine order (ms),
            then the prompts this router placed since (:meth:`take_local`).
        inflight_prefill_done_at_ms: when each of those ends (router clock, ms): the agent's
            prediction, and for the router's own placements the end of the one before plus the
            placement's ``b * P`` (empty when the agent sends no prediction).
        prefix_queries_tokens, prefix_hits_tokens: the engine's prefix cache over the agent's
            recent window (prompt tokens looked up, found cached; 0, 0 = unknown).
        inline_admission: the agent is on the request's HTTP path and decides
            ``x-fairbatch-admit`` on arrival (the snapshot's field; False for an agent run with
            ``--no-proxy`` or one that does not send it: router/admission.py ``use_inline``).
        draining: the agent is draining (its snapshot's ``draining``): then ``healthy`` is False and
            ``status_detail`` is ``draining``, so no placement policy picks it.
        view: the placement view last built from this state (:meth:`BudgetBook.views`), dropped on
            every change so that a decision never sees old figures.
    """

    replica_id: str
    received_ms: float | None = None
    ttl_ms: float = DEFAULT_TTL_MS
    seq: int = 0
    healthy: bool = False
    connected: bool = False
    time_model: TimeModel | None = None
    classes: dict[str, ClassBudget] | None = None
    max_prompt_tokens: int = 0
    status_detail: str = ""
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    inflight_prefill_ms: tuple[float, ...] = ()
    inflight_prefill_done_at_ms: tuple[float, ...] = ()
    prefix_queries_tokens: int = 0
    prefix_hits_tokens: int = 0
    inline_admission: bool = False
    draining: bool = False
    view: ReplicaView | None = None  # cached placement view; None after any change
    awaiting: dict[str, AwaitingTake] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class AwaitingTake:
    """A local take (:meth:`BudgetBook.take_local`) whose Reserve answer has not come back yet.

    Attributes:
        cost_ms: PAB (ms) it took per SLO class (the request's class a + b*P, the others b*P).
        tokens: P, the prompt tokens it took from ``pab_tokens`` and ``kv_limited_tokens``.
    """

    cost_ms: dict[str, float]
    tokens: int


def _deducted(cur: ClassBudget, cost_ms: float, tokens: int) -> ClassBudget:
    """``cur`` less a prompt of ``tokens`` whose prefill takes ``cost_ms`` of its PAB: ``pab_ms``,
    ``pab_tokens`` and ``kv_limited_tokens`` lowered (never below 0), ``inflight_reservation_ms`` raised.
    Built field by field (``dataclasses.replace`` costs 5x on the placement path: :data:`_CLASS_FIELDS`)."""
    return ClassBudget(
        cur.slo_class, cur.horizon_ms, max(0.0, cur.pab_ms - cost_ms), max(0, cur.pab_tokens - tokens),
        max(0, cur.kv_limited_tokens - tokens), cur.ttft_ms, cur.tpot_ms, cur.decode_reservation_ms,
        cur.inflight_reservation_ms + cost_ms, cur.kv_free_tokens, cur.decode_iterations, cur.slot_wait_ms)


MAX_LOCAL_LUMPS = 16
"""Entries of a replica's ``inflight_prefill_ms`` the router keeps (its own placements included)."""


def snapshot_time_model(coef: object) -> TimeModel | None:
    """The replica's prompt pricing from a snapshot's ``TimeModelCoefficients`` (proto): a, b' (the agent's
    model linearized, replica_agent/policy/time_model.py ``TimeModel.linearized``), c, e and K (an agent that
    sends no e or K, 0 in proto3, prices prompts linearly). None when the coefficients are invalid."""
    values = (coef.a_ms, coef.b_ms_per_new_token, coef.c_ms_per_context_token,  # type: ignore[attr-defined]
              getattr(coef, "e_ms_per_chunk_prefix", 0.0), getattr(coef, "chunk_tokens", 0.0))
    if not all(math.isfinite(v) for v in values):  # a faulty agent: no model rather than NaN prices
        return None
    try:
        return TimeModel(*values[:4], chunk_tokens=values[4])
    except ValueError:
        return None


class BudgetBook:
    """Latest budget per replica, freshness, and a broadcast wake-up on every change.

    Args:
        clock: router clock (simulated ms).
        replica_ids: the replicas of the config (others are ignored).
    """

    def __init__(self, clock: Clock, replica_ids: Iterable[str]) -> None:
        self._clock = clock
        self._budgets: dict[str, ReplicaBudget] = {rid: ReplicaBudget(rid) for rid in replica_ids}
        self._changed: asyncio.Event | None = None  # made by the first waiter of wait_changed
        self._listeners: list[Callable[[], None]] = []
        self.version = 0
        self.drain = DrainEstimator()

    def add_listener(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` (synchronously, must not block) on every change."""
        self._listeners.append(callback)

    # -------------------------------------------------------------- updates

    def update(self, replica_id: str, snapshot: object) -> bool:
        """Store a ``BudgetSnapshot`` (proto) received now; False when unknown replica or older seq.

        A lower ``seq`` than the stored one is accepted only after a reconnect (agent restart).
        """
        budget = self._budgets.get(replica_id)
        if budget is None:
            return False
        seq = int(snapshot.seq)  # type: ignore[attr-defined]
        if budget.connected and budget.received_ms is not None and seq <= budget.seq and seq != 0:
            return False
        budget.time_model = snapshot_time_model(snapshot.coefficients)  # type: ignore[attr-defined]
        budget.classes = {
            c.slo_class: ClassBudget(
                slo_class=c.slo_class,
                ttft_ms=c.ttft_ms,
                tpot_ms=c.tpot_ms,
                horizon_ms=c.horizon_ms,
                pab_ms=max(0.0, c.pab_ms),
                pab_tokens=max(0, int(c.pab_tokens)),
                decode_reservation_ms=c.decode_reservation_ms,
                inflight_reservation_ms=c.inflight_reservation_ms,
                kv_free_tokens=int(c.kv_free_tokens),
                kv_limited_tokens=max(0, int(c.kv_limited_tokens)),
                decode_iterations=int(c.decode_iterations),
                slot_wait_ms=max(0.0, c.slot_wait_ms),
            )
            for c in snapshot.classes  # type: ignore[attr-defined]
        }
        if budget.awaiting:  # the agent may not have seen them yet: counted until their answers come
            self._deduct_awaiting(budget)
        budget.seq = seq
        ttl = float(snapshot.ttl_ms)  # type: ignore[attr-defined]
        budget.ttl_ms = ttl if ttl > 0 else DEFAULT_TTL_MS
        budget.draining = bool(getattr(snapshot, "draining", False))
        # a draining replica is not placeable (issue 29): to every placement policy it is unhealthy
        budget.healthy = bool(snapshot.healthy) and not budget.draining  # type: ignore[attr-defined]
        budget.max_prompt_tokens = max(0, int(snapshot.max_prompt_tokens))  # type: ignore[attr-defined]
        budget.status_detail = "draining" if budget.draining else snapshot.status_detail  # type: ignore[attr-defined]
        budget.num_running = max(0, int(getattr(snapshot, "num_running", 0)))
        budget.num_waiting = max(0, int(getattr(snapshot, "num_waiting", 0)))
        kv_usage = float(getattr(snapshot, "kv_usage", 0.0))
        budget.kv_usage = min(1.0, max(0.0, kv_usage)) if kv_usage == kv_usage else 1.0  # NaN: as unknown, full
        budget.received_ms = now = self._clock.now_ms()
        lumps = tuple(getattr(snapshot, "inflight_prefill_ms", ()))
        done = getattr(snapshot, "inflight_prefill_done_ms", ())
        budget.inflight_prefill_ms = lumps
        budget.inflight_prefill_done_at_ms = tuple(now + d for d in done) if len(done) == len(lumps) else ()
        budget.prefix_queries_tokens = max(0, int(getattr(snapshot, "prefix_queries_tokens", 0)))
        budget.prefix_hits_tokens = max(0, int(getattr(snapshot, "prefix_hits_tokens", 0)))
        budget.inline_admission = bool(getattr(snapshot, "inline_admission", False))
        self.drain.observe(
            replica_id, budget.received_ms,
            {n: c.decode_reservation_ms + c.inflight_reservation_ms for n, c in budget.classes.items()},
        )
        budget.connected = True
        budget.view = None
        self.notify()
        return True

    def apply_reserve(self, replica_id: str, slo_class: str, pab_ms: float, pab_tokens: int) -> None:
        """Apply the class budget a Reserve answer reported (granted or refused) at once.

        The answered take has left the awaiting ones (:meth:`forget_take`, as the answer came); the
        takes on this replica still awaiting their answers are deducted from the answer's figures:
        the agent answered this Reserve before (or without) seeing them, and overwriting the book
        with the answer alone would hand their budget out a second time (a replica whose answers
        come back first would look richer than it is)."""
        budget = self._budgets.get(replica_id)
        if budget is None or budget.classes is None:
            return
        cur = budget.classes.get(slo_class)
        if cur is None:
            return
        new_ms = max(0.0, float(pab_ms))
        new_tokens = max(0, int(pab_tokens))
        for take in budget.awaiting.values():
            new_ms = max(0.0, new_ms - take.cost_ms.get(slo_class, 0.0))
            new_tokens = max(0, new_tokens - take.tokens)
        # The budget a lease took counts as in-flight reservation until the next snapshot, so the
        # "nothing reserved" test of the fit rule (oversize prompts) sees it too.
        taken_ms = max(0.0, cur.pab_ms - new_ms)
        budget.classes[slo_class] = replace(
            cur,
            pab_ms=new_ms,
            pab_tokens=new_tokens,
            inflight_reservation_ms=cur.inflight_reservation_ms + taken_ms,
        )
        budget.view = None
        self.notify()

    def forget_take(self, replica_id: str, awaiting_key: str) -> None:
        """The Reserve of a take awaiting its answer ended: answered (then :meth:`apply_reserve`), or
        without an answer (error, cancellation)."""
        budget = self._budgets.get(replica_id)
        if budget is not None:
            budget.awaiting.pop(awaiting_key, None)

    @staticmethod
    def _deduct_awaiting(budget: ReplicaBudget) -> None:
        """Deduct every awaiting take from the book's class figures (after a snapshot: one the agent
        computed after granting some of them counts those twice until their answers arrive, erring
        towards less budget for at most a Reserve round trip)."""
        assert budget.classes is not None
        for take in budget.awaiting.values():
            for name, cur in list(budget.classes.items()):
                budget.classes[name] = _deducted(cur, take.cost_ms.get(name, 0.0), take.tokens)

    def take_local(self, replica_id: str, slo_class: str, prompt_tokens: int,
                   awaiting_key: str | None = None) -> None:
        """Deduct a prompt from the local view at once, before its Reserve answer arrives, so that
        concurrent placements spread instead of all choosing the same replica: the request's class
        loses its predicted prefill ``prefill_ms(P)`` = a + b*P + e*cross(P) ms, every other class that
        less a (the in-flight reservation's own term, pab.py), and every class P tokens of PAB_tokens and of
        kv_limited_tokens (the prompt's KV). The Reserve answer (:meth:`apply_reserve`) or the
        next snapshot then sets the agent's figures. With ``awaiting_key`` (a placement about to
        send its Reserve) the take stays deducted from every snapshot and from other placements'
        answers until :meth:`forget_take` with the same key ends it."""
        budget = self._budgets.get(replica_id)
        if budget is None or budget.classes is None or budget.time_model is None:
            return
        tm = budget.time_model
        p = max(0, int(prompt_tokens))
        costs: dict[str, float] = {}
        body = tm.prompt_body_ms(p)  # without a: it rides in steps that pay a (pab.py, item 2)
        for name, cur in list(budget.classes.items()):
            cost = costs[name] = tm.prefill_ms(p) if name == slo_class else body
            budget.classes[name] = _deducted(cur, cost, p)
        if awaiting_key is not None:
            budget.awaiting[awaiting_key] = AwaitingTake(costs, p)
        self.drain.note_added(replica_id, body)
        lump = body
        lumps, done = budget.inflight_prefill_ms, budget.inflight_prefill_done_at_ms
        timed = len(done) == len(lumps)
        end = max(self._clock.now_ms(), done[-1] if timed and done else 0.0) + lump
        if len(lumps) < MAX_LOCAL_LUMPS:
            budget.inflight_prefill_ms = (*lumps, lump)
            budget.inflight_prefill_done_at_ms = (*done, end) if timed else ()
        else:  # bounded: later placements join the last lump (it frees when they all have)
            budget.inflight_prefill_ms = (*lumps[:-1], lumps[-1] + lump)
            budget.inflight_prefill_done_at_ms = (*done[:-1], end) if timed else ()
        budget.view = None

    def add_replica(self, replica_id: str) -> bool:
        """Start tracking a discovered replica (no budget until its first snapshot); False when known."""
        if replica_id in self._budgets:
            return False
        self._budgets[replica_id] = ReplicaBudget(replica_id)
        self.notify()
        return True

    def remove_replica(self, replica_id: str) -> bool:
        """Forget a replica that vanished (placement no longer sees it); False when unknown."""
        if self._budgets.pop(replica_id, None) is None:
            return False
        self.drain.forget(replica_id)
        self.notify()
        return True

    def mark_disconnected(self, replica_id: str, detail: str = "watch stream down") -> None:
        """The WatchBudget stream broke: the budget is stale (zero) until the next snapshot."""
        budget = self._budgets.get(replica_id)
        if budget is None:
            return
        budget.connected = False
        budget.received_ms = None
        budget.status_detail = detail
        budget.view = None
        self.notify()

    def notify(self) -> None:
        """Wake every waiter of :meth:`wait_changed` (also called on lease releases)."""
        self.version += 1
        changed = self._changed
        if changed is not None:  # made by the first waiter: a release with nobody waiting makes none
            self._changed = None
            changed.set()
        for callback in self._listeners:
            callback()

    async def wait_changed(self, timeout_s: float | None = None) -> bool:
        """Wait for the next change (wall seconds timeout); True when woken by a change."""
        if self._changed is None:
            self._changed = asyncio.Event()
        return await wait_event(self._changed, timeout_s)

    # -------------------------------------------------------------- reads

    def get(self, replica_id: str) -> ReplicaBudget | None:
        """The stored budget of a replica (mutable; read only)."""
        return self._budgets.get(replica_id)

    def inline_admission(self, replica_id: str) -> bool:
        """Whether the replica's agent decides inline admissions on the HTTP path, from its latest
        snapshot (False when unknown: no snapshot yet, or an agent that does not say)."""
        b = self._budgets.get(replica_id)
        return b is not None and b.inline_admission

    def prefix_measured(self, replica_id: str) -> tuple[int, int]:
        """(queried, hit) prompt tokens of the replica's prefix cache over its agent's recent window,
        from its latest snapshot; (0, 0) when unknown or not fresh (router/prefix_correction.py)."""
        b = self._budgets.get(replica_id)
        if b is None or not self.is_fresh(b, self._clock.now_ms()):
            return 0, 0
        return b.prefix_queries_tokens, b.prefix_hits_tokens

    def is_fresh(self, budget: ReplicaBudget, now_ms: float) -> bool:
        """True when the latest snapshot arrived less than ``ttl_ms`` ago (simulated ms)."""
        return budget.received_ms is not None and budget.connected and now_ms - budget.received_ms <= budget.ttl_ms

    def age_ms(self, replica_id: str, now_ms: float | None = None) -> float | None:
        """Simulated ms since the latest snapshot of ``replica_id`` (None: never received / disconnected)."""
        budget = self._budgets.get(replica_id)
        if budget is None or budget.received_ms is None:
            return None
        return (self._clock.now_ms() if now_ms is None else now_ms) - budget.received_ms

    def views(self, now_ms: float | None = None) -> list[ReplicaView]:
        """Placement input: one :class:`ReplicaView` per replica, stale or unhealthy ones marked so.

        Views are cached per replica and rebuilt only after a change or when freshness flips, so a
        decision costs one freshness test per replica rather than one new object. Each view holds
        its own copy of the class budgets (Reserve answers and local takes change the book's dict
        in place), so a view never changes after it is built.
        """
        now = self._clock.now_ms() if now_ms is None else now_ms
        out = []
        for b in self._budgets.values():
            received = b.received_ms
            fresh = received is not None and b.connected and now - received <= b.ttl_ms
            view = b.view
            if view is None or view.fresh is not fresh:
                view = b.view = ReplicaView(
                    replica_id=b.replica_id,
                    healthy=b.healthy,
                    fresh=fresh,
                    time_model=b.time_model,
                    classes=dict(b.classes) if b.classes else {},  # a snapshot: the view precomputes from it
                    max_prompt_tokens=b.max_prompt_tokens,
                    inflight_prefill_ms=b.inflight_prefill_ms,
                    inflight_prefill_done_at_ms=b.inflight_prefill_done_at_ms,
                )
            out.append(view)
        return out

    def usable(self, replica_id: str, slo_class: str, now_ms: float | None = None) -> ClassBudget | None:
        """The class budget when healthy and fresh, else None (zero budget)."""
        b = self._budgets.get(replica_id)
        if b is None or not b.healthy or b.classes is None:
            return None
        now = self._clock.now_ms() if now_ms is None else now_ms
        if not self.is_fresh(b, now):
            return None
        return b.classes.get(slo_class)

    def replica_ids(self) -> list[str]:
        """Ids of the known replicas in config order."""
        return list(self._budgets)
