"""Fair-queue charging (VTC) of one request (pure): what is charged when, and the correction.

A request is charged ``(prompt, decode estimate)`` when it gets its lease (the fair queue weighs
them ``w_prefill``, ``w_decode``: router/fair_queue.py), the decode estimate being its
``max_tokens`` or, without one, ``fairness.default_max_tokens``. A request that generated nothing
(refused, failed before its first byte) gets the same charge back. The relay does not parse stream
chunks, so a streamed request keeps the estimate; a non-stream answer is buffered anyway, and its
``usage.completion_tokens`` corrects the decode part (:func:`decode_correction`).
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
