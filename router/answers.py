"""The router's refusals as values (pure): which status, reason and message a decision is answered with.

Every refusal the router itself makes (not the engine's) is one :class:`Answer`; router/server.py
turns it into an OpenAI-format error response (``{"error": {"message", "type", "param", "code"}}``)
with ``Retry-After`` (whole wall seconds, >= 1) and ``x-fairbatch-reason`` = ``code``, and counts it
under ``outcome``. Messages name the tenant and the class, never the prompt.

==================  ======  ====================  ==================================================
code                status  outcome               when
==================  ======  ====================  ==================================================
queue-full          429     queue_full            the admission queue is at its bound
tenant-rate         429     tenant_rate           the tenant's token or request bucket is empty
tenant-concurrency  429     tenant_concurrency    the tenant has ``max_concurrency`` in flight
slo-infeasible      429     slo_infeasible        a sheddable request cannot start in time
work-shed           429     work_shed             under contention, its predicted work is among the costliest
queue-timeout       429     queue_timeout         ``max_queue_ms`` passed while queued
no-replica          503     no_replica            as queue-timeout, but no replica was usable
placement-error     503     placement_error       placing this request raised (never retried)
no-budget           503     upstream_error        agents refused its inline admission too often
queue-cap           429     queue_cap             ``static-queue-cap``: every replica tried was over its cap
flow-control-ttl    503     flow_control_ttl      ``llm-d-flow-control``: its TTL passed while it waited (llm-d EvictedTTL)
flow-control-       429     flow_control_capacity ``llm-d-flow-control``: its band or the queue is full (llm-d
capacity                                          RejectedCapacity)
flow-control-shed   429     flow_control_shed     ``llm-d-flow-control`` with ``reject_sheddable``: sheddable, pool saturated
overloaded          529     overloaded            ``dynamo-kv``: every worker over a busy threshold (Dynamo's 529)
==================  ======  ====================  ==================================================
"""

from __future__ import annotations

import math
from dataclasses import dataclass

RETRY_AFTER_S = 1
"""Retry-After (wall seconds) of a refusal that predicts no better time."""


@dataclass(frozen=True, slots=True)
class Answer:
    """One refusal (module docstring).

    Attributes:
        outcome: the request's outcome label (router/metrics.py ``fairbatch_requests_total``).
        status: HTTP status (429 or 503).
        code: the error code, also sent as ``x-fairbatch-reason``.
        message: human-readable message (no prompt text).
        retry_after_s: ``Retry-After`` in whole wall seconds (>= 1).
        err_type: OpenAI error ``type``.
    """

    outcome: str
    status: int
    code: str
    message: str
    retry_after_s: int = RETRY_AFTER_S
    err_type: str = "rate_limit_error"


def retry_after(wall_s: float) -> int:
    """Whole wall seconds for ``Retry-After``: ``max(1, ceil(wall_s))``.

    Raises:
        OverflowError: ``wall_s`` is infinite.
    """
    return max(1, math.ceil(wall_s))


def queue_full() -> Answer:
    """429 ``queue-full``."""
    return Answer("queue_full", 429, "queue-full", "The router's admission queue is full; retry later.")


def tenant_over(reason: str, tenant: str, retry_after_s: float) -> Answer:
    """429 ``tenant-rate`` or ``tenant-concurrency`` (the ledger's refusal ``reason``); retry after
    ``retry_after_s`` wall seconds (when a token or a slot is expected back)."""
    limit = "rate limit" if reason == "tenant-rate" else "concurrency limit"
    return Answer(reason.replace("-", "_"), 429, reason, f"Tenant {tenant!r} is over its {limit}; retry later.",
                  retry_after(retry_after_s))  # fmt: skip


MAX_INFEASIBLE_RETRY_AFTER_S = 60
"""Largest ``Retry-After`` (wall seconds) of an ``slo-infeasible`` refusal: a prediction further out
says only that the fleet is far behind (a drain rate near 0 on a burst predicts waits of years:
a user's trial got ``Retry-After: 56113674``), and the state it was made on is gone well before."""


def slo_infeasible(slo_class: str, ttft_ms: float, wait_ms: float, retry_after_s: float) -> Answer:
    """429 ``slo-infeasible`` at arrival: the predicted wait ``wait_ms`` (simulated ms) makes the
    class's first-token deadline ``ttft_ms`` unreachable; retry after the wait (``retry_after_s``,
    the same wait in wall seconds), at most :data:`MAX_INFEASIBLE_RETRY_AFTER_S` (a longer wait is
    reported as over that). An infinite wait (no replica can start it in time,
    router/shedding.py ``lump_start_ms``) says so and retries after ``RETRY_AFTER_S``."""
    if math.isfinite(retry_after_s) and retry_after_s > MAX_INFEASIBLE_RETRY_AFTER_S:
        return Answer("slo_infeasible", 429, "slo-infeasible",
                      f"The first-token deadline ({ttft_ms:g} ms) of class {slo_class!r} cannot be met "
                      f"(predicted wait over {MAX_INFEASIBLE_RETRY_AFTER_S} s).", MAX_INFEASIBLE_RETRY_AFTER_S)
    if not math.isfinite(wait_ms) or not math.isfinite(retry_after_s):
        return Answer("slo_infeasible", 429, "slo-infeasible",
                      f"The first-token deadline ({ttft_ms:g} ms) of class {slo_class!r} cannot be met "
                      "(no replica can start it in time).", RETRY_AFTER_S)  # fmt: skip
    return Answer("slo_infeasible", 429, "slo-infeasible",
                  f"The first-token deadline ({ttft_ms:g} ms) of class {slo_class!r} cannot be met "
                  f"(predicted wait {wait_ms:.0f} ms).", retry_after(retry_after_s))  # fmt: skip


def work_shed(slo_class: str) -> Answer:
    """429 ``work-shed``: the router is short of budget for class ``slo_class`` and this request's
    predicted work is among the costliest of recent arrivals (router/work_shed.py); retry after
    ``RETRY_AFTER_S``."""
    return Answer("work_shed", 429, "work-shed",
                  f"Class {slo_class!r} is over capacity and this request's predicted work is among the "
                  "largest of recent requests; a smaller request, or this one later, may be served.")  # fmt: skip


def queue_expired(reason: str, slo_class: str, ttft_ms: float, max_queue_ms: float, any_usable: bool) -> Answer:
    """The request left the queue unserved with ``reason`` (:class:`router.admission_queue.QueueTimeout`):
    ``slo-infeasible`` stays so; a ``queue-timeout`` is 503 ``no-replica`` when no replica is
    usable now (``any_usable``: healthy with a fresh budget), else 429 ``queue-timeout``."""
    if reason == "slo-infeasible":
        return Answer("slo_infeasible", 429, "slo-infeasible",
                      f"The first-token deadline ({ttft_ms:g} ms) of class {slo_class!r} could no longer be met "
                      "while queued.")  # fmt: skip
    if not any_usable:
        return Answer("no_replica", 503,  "no-replica",
                      f"No replica is available (none healthy with a fresh budget) within max_queue_ms "
                      f"({max_queue_ms:g} ms) of class {slo_class!r}.", err_type="service_unavailable")  # fmt: skip
    return Answer("queue_timeout", 429, "queue-timeout",
                  f"No replica could take the request within max_queue_ms ({max_queue_ms:g} ms) of class "
                  f"{slo_class!r}.")  # fmt: skip


def placement_error(reason: str) -> Answer:
    """503 ``placement-error``: placing the request raised ``reason`` (an exception class name)."""
    return Answer("placement_error", 503, "placement-error", f"The request could not be placed ({reason}).",
                  err_type="service_unavailable")  # fmt: skip


def no_budget(refusals: int) -> Answer:
    """503 ``no-budget``: agents refused the request's inline admission ``refusals`` times."""
    return Answer("upstream_error", 503, "no-budget",
                  f"No replica could take the request (its budget was gone on arrival, {refusals} times).",
                  err_type="service_unavailable")  # fmt: skip


def queue_cap() -> Answer:
    """429 ``queue-cap``: every replica the ``static-queue-cap`` profile tried (at most 3) refused the
    request, each over its queued-token cap (router/placement/baselines.py)."""
    return Answer("queue_cap", 429, "queue-cap", "Every replica tried is over its queued-token cap; retry later.")


FLOW_CONTROL_REASONS = frozenset({"flow-control-ttl", "flow-control-capacity", "flow-control-shed"})
"""The refusal reasons of the ``llm-d-flow-control`` profile (router/core.py ``RouterCore.dispatch_held``)."""


def flow_control(reason: str) -> Answer:
    """The ``llm-d-flow-control`` profile's refusal ``reason`` (one of :data:`FLOW_CONTROL_REASONS`),
    with llm-d's status (GIE v1.5.0 pkg/epp/requestcontrol/admission.go ``translateFlowControlOutcome``:
    TTL eviction 503 ServiceUnavailable, capacity 429 ResourceExhausted; a sheddable request dropped
    while saturated 429 ResourceExhausted).

    Raises:
        ValueError: an unknown reason.
    """
    if reason == "flow-control-ttl":
        return Answer("flow_control_ttl", 503, reason, "The request timed out in the flow-control queue.",
                      err_type="service_unavailable")  # fmt: skip
    if reason == "flow-control-capacity":
        return Answer("flow_control_capacity", 429, reason, "The flow-control queue is full; retry later.")
    if reason == "flow-control-shed":
        return Answer("flow_control_shed", 429, reason, "The pool is saturated and the request is sheddable.")
    raise ValueError(f"not a flow-control reason: {reason!r}")


def overloaded() -> Answer:
    """529 ``overloaded``: every replica is over a busy threshold of the ``dynamo-kv`` profile
    (router/placement/filters/dynamo_busy.py), as NVIDIA Dynamo's frontend answers when every
    eligible worker is busy (HTTP 529 by default since v1.3,
    https://docs.nvidia.com/dynamo/v1.3.0/user-guides/fault-tolerance/request-rejection); retry
    after ``RETRY_AFTER_S``."""
    return Answer("overloaded", 529, "overloaded", "All workers are busy; retry later.",
                  err_type="service_unavailable")  # fmt: skip
