"""The router's shedding rule (pure): predicted start of a new prompt, and what to do with it.

One module for the router (router/server.py) and the fleet simulation's routers
(loadgen/fleet/sim.py), so the simulation sheds as the product does.

:func:`predict_start`, per usable replica r (healthy, fresh, with a budget for the class):
``prefill_r = a + b*P``; the budget it lacks, ``deficit_r = prefill_r - (H - decode_reservation -
inflight_reservation)`` (unclamped: a replica deep in debt lacks more than its PAB_ms of 0 shows),
frees at the replica's measured drain rate (:class:`router.drain.DrainEstimator` over its budget
stream, at most ``max_drain_rate`` = 1 ms/ms: a burst of finished decodes must not make a replica
look faster than time; 1 ms/ms before it has two snapshots), so ``wait_r = deficit_r / rate_r``
(inf at rate 0), and no longer than the replica takes to finish its admitted prefills when they
alone cover the deficit: ``deficit_r <= inflight_reservation`` bounds ``wait_r`` by
``inflight_reservation / (1 - decode_reservation / H)`` (prefill work runs in the share of each
step that decodes leave; an in-flight prefill holds its whole reservation until its first token,
so the drain the budget stream shows is lumpy and reads 0 while one runs). wait = min_r wait_r
plus the prefill of the prompt tokens already waiting in
bands as urgent or more, drained at the fleet's summed rate (``b * tokens / sum_r rate_r``);
prefill = min_r prefill_r.

:func:`queue_decision`: a sheddable request whose ``now + wait + prefill`` passes its first-token
deadline less the agents' margin (``ttft - horizon``, :func:`agent_margin_ms`: the prediction
plans, as PAB does, to start the prefill by arrival + horizon) is refused at arrival
(``slo-infeasible``); otherwise it may wait until ``max_queue`` or, when sooner and sheddable,
until ``first-token deadline - prefill`` (the last dispatch that can still make it).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from router.drain import DrainEstimator, wait_for_budget_ms
from router.placement import ReplicaView

MAX_DRAIN_RATE = 1.0
"""ms of budget per ms: prefill work ends at most as fast as time passes."""


def predict_start(
    views: Iterable[ReplicaView], drain: DrainEstimator, slo_class: str, prompt_tokens: int, tokens_ahead: int,
    max_drain_rate: float = MAX_DRAIN_RATE,
) -> tuple[float, float] | None:
    """(predicted queue wait, predicted prefill) in simulated ms (module docstring), None without a
    usable replica.

    Args:
        views: the router's replica views now.
        drain: the per-replica drain estimator of the router's budget book.
        slo_class: the request's class; prompt_tokens: P.
        tokens_ahead: prompt tokens queued ahead of the request (bands as urgent or more).
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
        if cb.pab_ms >= p_ms:
            avail = cb.pab_ms
        else:
            avail = min(cb.pab_ms, cb.horizon_ms - cb.decode_reservation_ms - cb.inflight_reservation_ms)
        deficit = p_ms - avail
        wait_r = wait_for_budget_ms(deficit, rate)
        if 0.0 < deficit <= cb.inflight_reservation_ms and cb.horizon_ms > 0:
            prefill_share = 1.0 - cb.decode_reservation_ms / cb.horizon_ms
            if prefill_share > 0.0:
                wait_r = min(wait_r, cb.inflight_reservation_ms / prefill_share)
        budget_wait = min(budget_wait, wait_r)
    if not seen:
        return None
    tokens = max(0, tokens_ahead)
    ahead = 0.0 if tokens == 0 else (b * tokens / total_rate if total_rate > 0 else math.inf)
    return budget_wait + ahead, prefill


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
