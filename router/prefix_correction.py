"""The router's prefix map discounted by what the engines measure (pure).

The map (router/prefix_index.py) guesses which replica holds which prompt prefix from the router's
own placements; an engine may have evicted those blocks since (its KV cache filled), so the map can
promise cache hits that are gone. The agent publishes its engine's prefix-cache counters over a
recent window (``BudgetSnapshot.prefix_queries_tokens`` / ``prefix_hits_tokens``, from vLLM's
``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits``), and this module compares them with
what the map predicted:

- predicted ratio of replica r: ``p_r = P_r / Q_r`` with ``P_r``, ``Q_r`` the map's predicted cached
  tokens and the prompt tokens of this router's placements on r, each sum exponentially weighted
  (every new placement multiplies the old sums by ``1 - 1/horizon``: about the last ``horizon``
  placements count);
- measured ratio: ``m_r = hits / queries`` of r's latest snapshot;
- factor ``f_r = min(1, m_r / p_r)``; 1 while either is unknown (no placement predicted a hit, no
  query measured). A map right on average keeps its estimates (``m_r >= p_r``); one that promises
  twice what the engine finds is halved. Never above 1: hits that other routers' traffic brought
  are not this map's to promise.

The discounted estimate for r is ``floor(f_r * cached_r)``. The two ratios cover different spans
(this router's recent placements; every router's traffic over the agent's window), so the factor
is a correction of the map's average error, not of each prompt.
"""

from __future__ import annotations

import math
from collections.abc import Callable

Measured = Callable[[str], tuple[int, int]]
"""replica id -> (queried tokens, hit tokens) of its latest snapshot; (0, 0) = unknown."""


class PrefixCorrection:
    """Per-replica discount of the prefix map (module docstring).

    Args:
        horizon: placements the predicted ratio spans, about (>= 1).
    """

    __slots__ = ("_decay", "_sums")

    def __init__(self, horizon: int = 64) -> None:
        if horizon < 1:
            raise ValueError(f"horizon must be >= 1, got {horizon}")
        self._decay = 1.0 - 1.0 / horizon
        self._sums: dict[str, list[float]] = {}  # replica -> [predicted cached, prompt] (weighted)

    def record(self, replica_id: str, predicted_cached: int, prompt_tokens: int) -> None:
        """A placement on ``replica_id`` for which the map predicted ``predicted_cached`` of
        ``prompt_tokens`` cached (the map's own estimate, before any discount)."""
        s = self._sums.get(replica_id)
        if s is None:
            self._sums[replica_id] = [float(predicted_cached), float(prompt_tokens)]
            return
        d = self._decay
        s[0] = s[0] * d + predicted_cached
        s[1] = s[1] * d + prompt_tokens

    def predicted_ratio(self, replica_id: str) -> float | None:
        """``p_r`` (None before a placement with prompt tokens)."""
        s = self._sums.get(replica_id)
        return None if s is None or s[1] <= 0 else s[0] / s[1]

    def factor(self, replica_id: str, queries: int, hits: int) -> float:
        """``f_r`` for a measured ``hits`` of ``queries`` tokens (module docstring), in [0, 1]."""
        p = self.predicted_ratio(replica_id)
        if p is None or p <= 0.0 or queries <= 0:
            return 1.0
        return min(1.0, max(0.0, hits / queries) / p)

    def discount(self, cached: dict[str, int], measured: Measured) -> dict[str, int]:
        """``cached`` (replica -> estimated cached tokens) with each entry scaled by its factor,
        floored; the same mapping when no factor is below 1."""
        out: dict[str, int] | None = None
        for rid, n in cached.items():
            f = self.factor(rid, *measured(rid))
            if f < 1.0:
                if out is None:
                    out = dict(cached)
                out[rid] = math.floor(f * n)
        return cached if out is None else out

    def forget(self, replica_id: str) -> None:
        """Drop a replica that left the fleet."""
        self._sums.pop(replica_id, None)
