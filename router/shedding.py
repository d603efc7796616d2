"""The router's shedding rule (pure): predicted start of a new prompt, and what to do with it.

One module for the router (router/server.py) and the fleet simulation's routers
(loadgen/fleet/sim.py), so the simulation sheds as the product does.

:func:`predict_start`, per usable replica r (healthy, fresh, with a budget for the class):
``prefill_r = a + b*P`` (plus the prompt's own cross-chunk term where the snapshot carries ``e`` and the
chunk length: ``TimeModel.prefill_ms``, replica_agent/policy/time_model.py); the budget it lacks, ``deficit_r = prefill_r - (H - decode_reservation -
inflight_reservation)`` (unclamped: a replica deep in debt lacks more than its PAB_ms of 0 shows).
When the snapshot lists its in-flight prefills with the agent's prediction of when each ends
(``inflight_prefill_ms`` and ``inflight_prefill_done_ms``, replica_agent/policy/prefill_eta.py), the
budget frees in their lumps, and ``wait_r`` is the first lump end at which the prompt fits what is
left of its horizon by the router's aged rule (:func:`lump_start_ms`; inf when none: it cannot
start in time there). Otherwise (an agent that does not send them) the deficit frees at the
replica's measured drain rate (:class:`router.drain.DrainEstimator` over its budget
stream, at most ``max_drain_rate`` = 1 ms/ms: a burst of finished decodes must not make a replica
look faster than time; 1 ms/ms before it has two snapshots), so ``wait_r = deficit_r / rate_r``
(inf at rate 0), and no longer than the replica takes to finish its admitted prefills when they
alone cover the deficit: ``deficit_r <= inflight_reservation`` bounds ``wait_r`` by
``inflight_reservation / (1 - decode_reservation / H)`` (prefill work runs in the share of each
step that decodes leave; an in-flight prefill holds its whole reservation until its first token,
so the drain the budget stream shows is lumpy and reads 0 while one runs). A replica whose engine is
at ``max_num_seqs`` (``slot_wait_ms`` s > 0: nothing starts there before a running request finishes;
replica_agent/policy/pab.py "Sequence slots") has s taken off its ``pab_ms`` by the agent; s passes
with time, not with the drain, so there the deficit is taken against ``H - decode_reservation -
inflight_reservation`` and ``wait_r = max(s, that deficit's wait)``. wait = min_r wait_r plus
the prefill of the prompt tokens already waiting in
bands as urgent or more, drained at the fleet's summed rate (``b * tokens / sum_r rate_r``: linear,
since only their sum is known here; the queued prompts' own cross-chunk terms are left out, so
this part of the wait is a lower estimate on engines with ``e > 0``);
prefill = min_r prefill_r.

:func:`queue_decision`: a sheddable request whose ``now + wait + prefill`` passes its first-token
deadline less the agents' margin (``ttft - horizon``, :func:`agent_margin_ms`: the prediction
plans, as PAB does, to start the prefill by arrival + horizon) is refused at arrival
(``slo-infeasible``); otherwise it may wait until ``max_queue`` or, when sooner and sheddable,
until ``first-token deadline - prefill`` (the last dispatch that can still make it).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from router.drain import DrainEstimator, wait_for_budget_ms
from router.placement import ReplicaView

MAX_DRAIN_RATE = 1.0
"""ms of budget per ms: prefill work ends at most as fast as time passes."""

LUMP_SEEN_MS = 5.0
"""ms from now before the router can count an in-flight prefill's lump as freed (:func:`lump_start_ms`).

A lump frees in the router's book only when a snapshot without it arrives: the agent pushes a change
at most every ``min_push_interval_ms`` (5 ms by default, the agent's ``--min-push-interval-ms``), so a lump the
agent predicted to end sooner than that, or one already past its predicted end and still listed,
is taken to free that long from now. Counting an overdue lump as freed at once made the
``infeasible`` scenario of scripts/bench_backlog.py queue requests with a 2.6 ms slack that were
shed 5-100 ms later, when the lump was seen to end (or the next periodic snapshot came)."""


def predict_start(
    views: Iterable[ReplicaView], drain: DrainEstimator, slo_class: str, prompt_tokens: int, tokens_ahead: int,
    max_drain_rate: float = MAX_DRAIN_RATE, now_ms: float | None = None, waited_ms: float = 0.0,
) -> tuple[float, float] | None:
    """(predicted queue wait, predicted prefill) in simulated ms (module docstring), None without a
    usable replica.

    Args:
        views: the router's replica views now.
        drain: the per-replica drain estimator of the router's budget book.
        slo_class: the request's class; prompt_tokens: P.
        tokens_ahead: prompt tokens queued ahead of the request (bands as urgent or more).
        max_drain_rate: cap of the measured drain rate (ms/ms).
        now_ms: router clock now; without it the views' in-flight lumps are not used.
        waited_ms: ms the request has waited since its arrival (its horizon is that much shorter;
            used with the lumps).
    """
    prefill = math.inf
    budget_wait = math.inf
    total_rate = 0.0
    b = math.inf
    seen = False
    for v in views:
        if not (v.healthy and v.fresh and v.time_model is not None and slo_class in v.classes):
            continue
        seen = True
        tm = v.time_model
        cb = v.classes[slo_class]
        p_ms = tm.prefill_ms(prompt_tokens)
        prefill = min(prefill, p_ms)
        b = min(b, tm.b_ms_per_new_token)
        rate = drain.rate(v.replica_id, slo_class)
        if rate is not None:
            rate = min(rate, max_drain_rate)
        total_rate += 1.0 if rate is None else rate
        slot = cb.slot_wait_ms
        if slot > 0.0:  # the agent took the slot wait off pab_ms; it passes with time, not with the drain
            avail = cb.horizon_ms - cb.decode_reservation_ms - cb.inflight_reservation_ms
        elif cb.pab_ms >= p_ms:
            avail = cb.pab_ms
        else:
            avail = min(cb.pab_ms, cb.horizon_ms - cb.decode_reservation_ms - cb.inflight_reservation_ms)
        deficit = p_ms - avail
        lumps = v.inflight_prefill_ms
        if lumps and now_ms is not None and len(v.inflight_prefill_done_at_ms) == len(lumps):
            reserved = cb.decode_reservation_ms + cb.inflight_reservation_ms
            horizon_w = cb.horizon_ms - waited_ms
            if p_ms + reserved <= horizon_w + 1e-9 or (not waited_ms and deficit <= 0.0):
                wait_r = 0.0
            else:
                wait_r = lump_start_ms(p_ms, reserved, horizon_w, lumps, v.inflight_prefill_done_at_ms, now_ms)
        else:
            wait_r = wait_for_budget_ms(deficit, rate)
            if 0.0 < deficit <= cb.inflight_reservation_ms and cb.horizon_ms > 0:
                prefill_share = 1.0 - cb.decode_reservation_ms / cb.horizon_ms
                if prefill_share > 0.0:
                    wait_r = min(wait_r, cb.inflight_reservation_ms / prefill_share)
        if slot > wait_r:  # the engine is at max_num_seqs: nothing starts before a slot frees
            wait_r = slot
        budget_wait = min(budget_wait, wait_r)
    if not seen:
        return None
    tokens = max(0, tokens_ahead)
    ahead = 0.0 if tokens == 0 else (b * tokens / total_rate if total_rate > 0 else math.inf)
    return budget_wait + ahead, prefill


def lump_start_ms(prefill_ms: float, reserved_ms: float, horizon_ms: float, lumps_ms: Sequence[float],
                  done_at_ms: Sequence[float], now_ms: float, seen_ms: float = LUMP_SEEN_MS) -> float:  # fmt: skip
    """ms from now until a prompt can be placed here and still meet its TTFT, when the in-flight
    prefills free their budget in lumps (inf: not before its deadline).

    A prefill holds its whole reservation until its first token, so lump ``i`` (ms of budget,
    engine order) frees at ``done_at_ms[i]`` (router clock; the agent's prediction,
    replica_agent/policy/prefill_eta.py). Placed at ``s``, the prompt must fit what is then left of
    its horizon (pab.py ``on_time``, the router's aged rule): with the first ``i`` lumps freed,
    ``prefill + reserved - (lumps_0 + ... + lumps_i) <= horizon - (s - now)``, where lump ``i``
    frees at ``s = max(done_at_ms[i], now + seen_ms)``: the router sees it free only with the next
    snapshot (:data:`LUMP_SEEN_MS`), also when its predicted end has passed. The answer is the
    first such ``s - now`` that satisfies this. Decode reservations are taken as they are now (a
    decode's reservation frees as fast as the horizon shrinks, at most), so after the last lump
    nothing new becomes feasible: inf.

    Args:
        prefill_ms: the prompt's predicted prefill ``TimeModel.prefill_ms(P)`` (ms).
        reserved_ms: ``decode_reservation + inflight_reservation`` now (ms).
        horizon_ms: what is left of the request's horizon now, ``H - waited`` (ms).
        lumps_ms: the replica's ``inflight_prefill_ms`` (ms, engine order).
        done_at_ms: when each lump frees (router clock, ms; same length).
        now_ms: router clock now.
        seen_ms: the earliest a lump can be seen to free, ms from now (>= 0).

    Example: prefill 155, reserved 581.4 in lumps 290.7 + 290.7 ending in 150 and 460 ms, horizon
    448: now 736.4 > 448; after the first, 445.7 > 448 - 150 = 298: no; after the second 155 >
    448 - 460 < 0: no -> inf. The first ending in 2 ms instead, or 1 ms ago (still listed): it
    frees at 5 ms, 445.7 > 448 - 5 = 443: inf; with horizon 451: 445.7 <= 446 -> 5 ms.
    """
    cum = 0.0
    for lump, done in zip(lumps_ms, done_at_ms, strict=False):
        cum += lump
        s = max(seen_ms, done - now_ms)
        if prefill_ms + reserved_ms - cum <= horizon_ms - s + 1e-9:
            return s
    return math.inf


def priced_tokens(prompt_tokens: int, cached: Mapping[str, int] | None) -> int:
    """The prompt tokens the shedding rule prices: what is left to compute on the replica that the
    router's prefix map says holds most of the prompt (its best case: a request is refused only
    when even that replica cannot start it in time), the whole prompt without a map.

    Args:
        prompt_tokens: P (>= 0).
        cached: replica id -> tokens estimated cached there (router/prefix_index.py
            ``cached_tokens``, discounted by router/prefix_correction.py where the router measures
            its engines' hits), or None / empty.
    """
    if not cached:
        return prompt_tokens
    return max(0, prompt_tokens - max(cached.values()))


def agent_margin_ms(views: Iterable[ReplicaView], slo_class: str) -> float:
    """The agents' safety margin for the class, ``ttft_ms - horizon_ms`` (the largest over the usable
    views; 0 without one)."""
    margin = 0.0
    for v in views:
        cb = v.classes.get(slo_class)
        if v.healthy and v.fresh and cb is not None and cb.ttft_ms > 0:
            margin = max(margin, cb.ttft_ms - cb.horizon_ms)
    return margin


def infeasible(now_ms: float, first_token_deadline_ms: float, prediction: tuple[float, float] | None,
               margin_ms: float) -> bool:  # fmt: skip
    """Whether the request can no longer start in time: ``now + wait + prefill > deadline - margin``
    (False without a prediction)."""
    if prediction is None:
        return False
    wait_ms, prefill_ms = prediction
    return now_ms + wait_ms + prefill_ms > first_token_deadline_ms - margin_ms


@dataclass(frozen=True, slots=True)
class QueueDecision:
    """What to do with a request no replica takes now.

    Attributes:
        refuse: refuse it at once (``slo-infeasible``).
        deadline_ms: when it leaves the queue unserved (simulated ms).
        expire_reason: the reason it then gets (``queue-timeout`` or ``slo-infeasible``).
        wait_ms: the predicted wait (ms; 0 without a prediction), for Retry-After.
    """

    refuse: bool
    deadline_ms: float
    expire_reason: str
    wait_ms: float = 0.0


def queue_decision(now_ms: float, arrival_ms: float, ttft_ms: float, max_queue_ms: float, sheddable: bool,
                   prediction: tuple[float, float] | None, margin_ms: float) -> QueueDecision:  # fmt: skip
    """The rule of the module docstring for a request that arrived at ``arrival_ms``."""
    deadline, reason = arrival_ms + max_queue_ms, "queue-timeout"
    if not sheddable or prediction is None:
        return QueueDecision(False, deadline, reason)
    wait_ms, prefill_ms = prediction
    first_token_deadline = arrival_ms + ttft_ms
    if infeasible(now_ms, first_token_deadline, prediction, margin_ms):
        return QueueDecision(True, deadline, "slo-infeasible", wait_ms)
    shed_at = first_token_deadline - prefill_ms
    if shed_at < deadline:
        deadline, reason = shed_at, "slo-infeasible"
    return QueueDecision(False, deadline, reason, wait_ms)
