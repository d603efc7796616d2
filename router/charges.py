"""Fair-queue charging (VTC) of one request (pure): what is charged when, and the correction.

A request is charged ``(prompt, decode estimate)`` when it gets its lease (the fair queue weighs
them ``w_prefill``, ``w_decode``: router/fair_queue.py), the decode estimate being its
``max_tokens`` or, without one, ``fairness.default_max_tokens``. A request that generated nothing
(refused, failed before its first byte) gets the same charge back. The relay does not parse stream
chunks, so a streamed request keeps the estimate; a non-stream answer is buffered anyway, and its
``usage.completion_tokens`` corrects the decode part (:func:`decode_correction`).

The tenant's rate buckets (router/ledger.py: requests and tokens per minute) are given back for a
request that got nothing: refused by the router after its quota was taken, refused by the engine
(4xx), or failed before its first byte was sent (:func:`quota_refunded`; issue 30: a tenant of
5,000 tokens per minute got 429 on its next 8-token request after the engine refused one), and for
one whose client left before it was sent to any replica (queued: :func:`quota_refunded_on_disconnect`).
"""

from __future__ import annotations

import orjson


def decode_estimate(max_tokens: int, default_max_tokens: int) -> int:
    """Decode tokens charged at dispatch: ``max_tokens`` when > 0, else ``default_max_tokens``."""
    return max_tokens if max_tokens > 0 else default_max_tokens


def decode_correction(body: object, estimate: int) -> int:
    """Decode tokens to add to a charge of ``estimate``: ``usage.completion_tokens - estimate`` of a
    non-stream answer ``body`` (JSON bytes); 0 when the body is not bytes, has no usable usage or
    the count equals the estimate (no charge to send)."""
    if not isinstance(body, bytes) or b'"usage"' not in body:
        return 0
    try:
        usage = orjson.loads(body).get("usage") or {}
        actual = int(usage["completion_tokens"])
    except (ValueError, KeyError, TypeError, AttributeError):
        return 0
    return actual - estimate


REFUNDED_OUTCOMES = frozenset({"queue_full", "slo_infeasible", "queue_timeout", "no_replica", "placement_error",
                               "upstream_refused"})  # fmt: skip
"""Outcomes (router/metrics.py labels) of a request that never started once its quota was taken."""


def quota_refunded(outcome: str, response_started: bool) -> bool:
    """Whether an answered request's rate-bucket charge goes back: its outcome is one of
    :data:`REFUNDED_OUTCOMES`, or ``upstream_error`` before any byte of the answer went out (every
    replica failed before its first byte, or agents refused its admission too often)."""
    return outcome in REFUNDED_OUTCOMES or (outcome == "upstream_error" and not response_started)


def quota_refunded_on_disconnect(sent_to_replica: bool) -> bool:
    """Whether the rate-bucket charge of a request whose client disconnected goes back: yes when the
    request was never sent to a replica (it left while queued, or before its placement), since no
    engine did any work for it; no once an attempt was relayed (the engine may have prefilled it)."""
    return not sent_to_replica
