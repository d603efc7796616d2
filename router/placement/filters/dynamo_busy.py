"""Filter ``dynamo-busy``: NVIDIA Dynamo's busy thresholds (Request Rejection; router/placement/dynamo_kv.py).
A replica is busy, and dropped, when its KV-cache usage (scraped ``vllm:kv_cache_usage_perc``, the
worker-reported share of KV blocks in use) exceeds ``active_decode_blocks_threshold`` (0..1) or its
router-local active prefill tokens (:class:`~router.placement.load.RouterLoad` ``prefill_tokens``)
exceed ``active_prefill_tokens_threshold`` (tokens); a threshold of None is off (Dynamo's default,
each). Reads the router's load view (``load``, injected by the registry). When it leaves no replica
the placement is refused ``overloaded`` (HTTP 529; router/placement/core.py ``OVERLOAD_FILTERS``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from router.placement.core import PlacementRequest, ReplicaView
from router.placement.load import RouterLoad


@dataclass(slots=True)
class DynamoBusyFilter:
    """Drop replicas over a busy threshold (module docstring; strictly over: at the threshold a
    replica is not busy). A replica never scraped counts as 0 KV usage.

    Attributes:
        load: the router's load view.
        active_decode_blocks_threshold: KV usage bound (0..1), or None = off.
        active_prefill_tokens_threshold: prefill tokens bound (>= 0), or None = off.

    Raises:
        ValueError: a threshold out of range.
    """

    load: RouterLoad = field(default_factory=RouterLoad)
    active_decode_blocks_threshold: float | None = None
    active_prefill_tokens_threshold: int | None = None
    name: str = "dynamo-busy"

    def __post_init__(self) -> None:
        b, t = self.active_decode_blocks_threshold, self.active_prefill_tokens_threshold
        if (b is not None and not 0.0 <= b <= 1.0) or (t is not None and t < 0):
            raise ValueError(f"active_decode_blocks_threshold must be in [0, 1] and active_prefill_tokens_threshold "
                             f">= 0, got {b} and {t}")  # fmt: skip

    def busy(self, replica_id: str) -> bool:
        """True when ``replica_id`` is over an enabled threshold."""
        b, t = self.active_decode_blocks_threshold, self.active_prefill_tokens_threshold
        if b is not None:
            m = self.load.scraped.get(replica_id)
            if m is not None and m.kv_usage > b:
                return True
        return t is not None and self.load.prefill_tokens.get(replica_id, 0) > t

    def filter(self, request: PlacementRequest, replicas: Sequence[ReplicaView]) -> list[ReplicaView]:
        if self.active_decode_blocks_threshold is None and self.active_prefill_tokens_threshold is None:
            return list(replicas)
        return [r for r in replicas if not self.busy(r.replica_id)]


PLUGIN = DynamoBusyFilter
