"""Scorer ``llm-d-queue``: llm-d / Gateway API Inference Extension queue scorer,
``(max_q - q) / (max_q - min_q)`` over the scraped waiting queues (``vllm:num_requests_waiting``),
1 when all are equal. Reads the router's :class:`~router.placement.load.RouterLoad` (``load``,
injected by the registry). No parameters."""

from __future__ import annotations

from dataclasses import dataclass

from router.placement.core import PlacementRequest, ReplicaView
from router.placement.load import RouterLoad


@dataclass(slots=True)
class LlmdQueueScorer:
    """llm-d queue scorer: ``(max_q - q) / (max_q - min_q)`` over the scraped waiting queues, 1 if all
    equal (min and max over every scraped replica, cached per ``load.version``)."""

    load: RouterLoad
    name: str = "llm-d-queue"
    _cached_version: int = -1
    _min_q: int = 0
    _max_q: int = 0

    def score(self, request: PlacementRequest, replica: ReplicaView) -> float:
        load = self.load
        if load.version != self._cached_version:
            qs = [m.num_waiting for m in load.scraped.values()] or [0]
            self._min_q, self._max_q = min(qs), max(qs)
            self._cached_version = load.version
        m = load.scraped.get(replica.replica_id)
        q = 0 if m is None else m.num_waiting
        if self._max_q == self._min_q:
            return 1.0
        return (self._max_q - q) / (self._max_q - self._min_q)


PLUGIN = LlmdQueueScorer
