"""The stall rule both servers share: how long the engine may stay silent on a request of an SLO class.

The agent's proxy gives up a request after that silence (replica_agent/proxy.py ``StallWatch``); the
router uses the same timeout for the requests it relays (router/server.py). A class's own
``stall_timeout_ms`` (fairbatch_common/config_schema.py ``SloClassConfig``) replaces the default.
"""

from __future__ import annotations

STALL_MIN_MS = 1000.0
"""Smallest default stall timeout (simulated ms)."""


def default_stall_ms(ttft_ms: float, tpot_ms: float) -> float:
    """Stall timeout of an SLO class (simulated ms): ``max(1000, 4 * ttft_ms + 20 * tpot_ms)``; for
    TTFT 500 ms / TPOT 50 ms: 3000 ms, four first-token targets plus twenty token gaps of silence."""
    return max(STALL_MIN_MS, 4.0 * ttft_ms + 20.0 * tpot_ms)
