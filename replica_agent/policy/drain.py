"""Drain of a replica agent (issue 29 item 3): what to do next while draining. PURE (times passed in).

An agent told to drain (SIGTERM, SIGINT, or ``POST /drain`` from a Kubernetes preStop hook) stops
taking new work at once (its budget stream says ``draining`` with zero PAB, so routers stop placing
there; a new request is refused: 409 ``x-fairbatch-refused: draining`` for an inline admission, which
the router re-places, else 503 with ``Retry-After``), and then, in phases:

1. ``wait``: the requests in flight finish on their own, for at most ``grace_ms`` after the drain began;
2. ``hand_over`` (once, at the end of the grace period, when requests are still in flight): each
   stream still open is ended with the hand-over event (``replica_draining``, replica_agent/proxy.py
   ``HANDOVER_TYPE``), which the router continues on another replica by its token-resume migration
   (router/migration.py), and each non-stream request is answered 503 (the router re-issues it whole);
3. ``exit``: nothing in flight any more, or ``handover_ms`` after the hand-over (a request whose
   handler did not end by then is dropped with the process).

Worked (grace 30 000 ms, hand-over bound 5 000 ms, poll 50 ms): drain at t = 1000 with 3 in flight ->
``wait`` 50; at t = 20 000 with 0 in flight -> ``exit``; at t = 31 000 with 2 in flight, not handed
over -> ``hand_over``; at t = 32 000, handed over at 31 000, 1 in flight -> ``wait`` 50; at t = 36 000
-> ``exit`` (5000 ms after the hand-over).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class DrainStep:
    """:func:`drain_step`'s answer.

    Attributes:
        action: ``wait`` (check again after ``wait_ms``), ``hand_over`` (end the open requests now,
            then check again after ``wait_ms``), ``exit`` (the drain is complete: stop the process).
        wait_ms: ms until the next check (0 for ``exit``).
    """

    action: str
    wait_ms: float


def drain_step(started_ms: float, now_ms: float, in_flight: int, grace_ms: float,
               handed_over_ms: float | None = None, handover_ms: float = 5000.0,
               poll_ms: float = 50.0) -> DrainStep:
    """The next step of a drain that began at ``started_ms`` (module docstring).

    Args:
        started_ms: when the drain began (ms, any clock; ``now_ms`` on the same one).
        now_ms: now.
        in_flight: generation requests the agent still relays (>= 0).
        grace_ms: how long in-flight requests may run on before they are handed over (>= 0).
        handed_over_ms: when the hand-over was done, None before.
        handover_ms: how long after the hand-over the agent waits for its handlers to end (>= 0).
        poll_ms: the longest wait between two checks (> 0).

    Returns:
        ``exit`` when nothing is in flight or the hand-over bound passed; ``hand_over`` once the grace
        period is over; else ``wait`` for ``min(poll_ms, time left in the current phase)`` (at least 1 ms).

    Raises:
        ValueError: a negative ``in_flight``, ``grace_ms`` or ``handover_ms``, or ``poll_ms`` <= 0.
    """
    if in_flight < 0 or grace_ms < 0 or handover_ms < 0 or poll_ms <= 0:
        raise ValueError("in_flight, grace_ms and handover_ms must be >= 0 and poll_ms > 0")
    if in_flight == 0:
        return DrainStep("exit", 0.0)
    if handed_over_ms is not None:
        left = handed_over_ms + handover_ms - now_ms
        if left <= 0:
            return DrainStep("exit", 0.0)
        return DrainStep("wait", max(1.0, min(poll_ms, left)))
    left = started_ms + grace_ms - now_ms
    if left <= 0:
        return DrainStep("hand_over", poll_ms)
    return DrainStep("wait", max(1.0, min(poll_ms, left)))
