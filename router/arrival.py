"""What the router does with a request when it arrives (pure: state in, decision out).

The steps of :meth:`router.server.Router._acquire` (docs/design.md section 5, steps 4-6) as
decisions, so each is tested by hand and the fleet simulation (loadgen/fleet/sim.py) runs the same
rule as the product; the server and the simulator carry the decision out (Reserve, queue push,
answer).

- :func:`queue_full_before_body`: a new request is refused 429 ``queue-full`` from its headers
  alone when ``max_requests`` requests already wait: whatever its body, it would wait behind them.
- :func:`no_replica_left`: every replica already failed for this request (it is answered with the
  last failure, never queued).
- :func:`place_now_exclude`: placed at once only when nobody waits (a request that arrives behind
  waiting ones must not pass them: the fair queue decides); the replicas left out then are those
  that failed for it, and also, while another replica is left, those whose agent just refused it
  an inline admission (``avoid_now``; the queue entry may use them again once their budget frees).
- :func:`queue_or_refuse`: no replica took it at once. A request whose ``max_queue_ms`` has passed
  already leaves with ``queue-timeout``; a sheddable one whose predicted start misses its
  first-token deadline is refused ``slo-infeasible`` (router/shedding.py ``queue_decision``);
  otherwise it waits until its deadline (``max_queue_ms`` after arrival, or, when sooner and
  sheddable, the last dispatch that can still make its first token). An :class:`Enqueue` whose
  deadline is not after ``now`` expires at once with its ``expire_reason`` (the server's wait times
  out at once; the simulator answers it so).
"""

from __future__ import annotations

from collections.abc import Callable, Set
from dataclasses import dataclass

from router.shedding import queue_decision

Prediction = tuple[float, float] | None
"""(predicted queue wait, predicted prefill) in simulated ms, None without a usable replica."""


def queue_full_before_body(queue_len: int, max_requests: int) -> bool:
    """True when ``queue_len >= max_requests``: refuse 429 ``queue-full`` before reading the body."""
    return queue_len >= max_requests


def no_replica_left(replica_ids: Set[str], exclude: frozenset[str]) -> bool:
    """True when ``exclude`` (the replicas that failed for the request) is non-empty and covers
    every replica in ``replica_ids`` (an empty ``exclude`` never does: a request that failed
    nowhere waits for a replica to appear)."""
    return bool(exclude) and not replica_ids - exclude


def place_now_exclude(
    replica_ids: Set[str], exclude: frozenset[str], avoid_now: frozenset[str], queue_len: int
) -> frozenset[str] | None:
    """The replicas the immediate placement leaves out, or None when the request must queue
    without trying (``queue_len > 0``: someone waits already).

    Args:
        replica_ids: the replicas now.
        exclude: replicas that failed for this request (always left out).
        avoid_now: replicas that just refused it an inline admission: left out too, unless that
            leaves no replica at all (then only ``exclude`` is).
        queue_len: requests waiting in the router's queue.
    """
    if queue_len:
        return None
    if not avoid_now:
        return exclude
    both = exclude | avoid_now
    return both if replica_ids - both else exclude


@dataclass(frozen=True, slots=True)
class Enqueue:
    """Wait in the queue.

    Attributes:
        deadline_ms: when it leaves the queue unserved (simulated ms).
        expire_reason: the reason it then gets (``queue-timeout`` or ``slo-infeasible``).
        first_token_deadline_ms: arrival + the class's ``ttft_ms`` (the EDF key, simulated ms).
        promote_at_ms: from when it counts as aged in the fair queue (the same instant).
    """

    deadline_ms: float
    expire_reason: str
    first_token_deadline_ms: float
    promote_at_ms: float


@dataclass(frozen=True, slots=True)
class Refuse:
    """Refuse it now.

    Attributes:
        reason: ``queue-timeout`` (``max_queue_ms`` passed before it could queue) or
            ``slo-infeasible`` (predicted to miss its first-token deadline).
        wait_ms: the predicted wait (simulated ms; 0 without a prediction), for Retry-After.
    """

    reason: str
    wait_ms: float = 0.0


def queue_or_refuse(
    now_ms: float,
    arrival_ms: float,
    ttft_ms: float,
    max_queue_ms: float,
    sheddable: bool,
    predict: Callable[[], Prediction],
    margin_ms: Callable[[], float],
) -> Enqueue | Refuse:
    """The last rule of the module docstring.

    Args:
        now_ms, arrival_ms: router clock now and at the request's arrival (simulated ms).
        ttft_ms, max_queue_ms, sheddable: the request's SLO class.
        predict: the queue-wait prediction for this request (called only for a sheddable request
            that may still queue: it scans the replica views).
        margin_ms: the agents' safety margin for the class (router/shedding.py
            ``agent_margin_ms``; called only with a prediction).
    """
    if arrival_ms + max_queue_ms <= now_ms:
        return Refuse("queue-timeout")
    prediction = predict() if sheddable else None
    d = queue_decision(now_ms, arrival_ms, ttft_ms, max_queue_ms, sheddable, prediction,
                       margin_ms() if prediction is not None else 0.0)  # fmt: skip
    if d.refuse:
        return Refuse("slo-infeasible", d.wait_ms)
    first_token = arrival_ms + ttft_ms
    return Enqueue(d.deadline_ms, d.expire_reason, first_token, first_token)
