"""NVIDIA Dynamo's KV router (``python -m dynamo.frontend --router-mode kv``) as a placement profile,
``dynamo-kv``: its defaults, its router queue's gate (:class:`DynamoQueueGate`) and the profile's
parameters. PURE (plain data, no I/O, no clock). The cost is the scorer ``dynamo-kv-cost``
(router/placement/scorers/dynamo_kv_cost.py), the pick the picker ``softmax``
(router/placement/pickers/softmax.py), the busy thresholds the filter ``dynamo-busy``
(router/placement/filters/dynamo_busy.py).

What Dynamo does (sources below; defaults of ``lib/kv-router/src/scheduling/config.rs`` at commit
0243c51bb6e8958be89df4978b5761677c9adc23 unless noted):

1. Cost per worker, in KV blocks of ``block_size`` tokens (``--kv-cache-block-size``, the engine's:
   vLLM's 16): ``prefill_load_scale * max(0, active_prefill_tokens + P - overlap_credit * overlap_blocks
   * block_size) / block_size + (active_blocks + P / block_size)`` -- the worker's prompt work not yet
   prefilled (router-local, from routing to the first token) plus this prompt's uncached part, plus
   its active decode blocks and this request's. ``--kv-overlap-score-weight`` (default 1; now
   split into ``--router-kv-overlap-score-credit`` 1.0 and ``--router-prefill-load-scale`` 1.0,
   the old weight setting the scale) weighs the prefill term.
2. Pick: ``--router-temperature`` 0 (default) = the lowest cost, ties at random; T > 0 = a softmax
   draw over the costs normalised to [0, 1]: ``p_i ~ exp(-(c_i - c_min) / ((c_max - c_min) * T))``,
   uniform when all are equal (``selector/default.rs`` ``softmax_sample_index``).
3. Busy workers (Request Rejection, ``--active-decode-blocks-threshold``: KV blocks in use over
   total, 0..1, from the worker's load metrics; ``--active-prefill-tokens-threshold``: prefill
   tokens, a count): each disabled by default (None); a worker over any enabled one is excluded;
   when every eligible worker is busy the frontend answers HTTP 529 ("Overloaded"; 503 before
   v1.3; ``DYN_HTTP_OVERLOAD_STATUS_CODE`` changes it).
4. Router queue (``--router-queue-threshold``, default 16.0 in config.rs; 2.0 in the v1.0.0
   Frontend Configuration Reference; None disables it): when every worker's active prefill tokens
   exceed ``threshold * max_num_batched_tokens``, new requests wait in the router's
   ``SchedulerQueue`` (``--router-queue-policy`` fcfs by default) and are scheduled as capacity
   frees (a request finishing or its prefill completing). Queued, not refused.

Here: the router-local counts are the core's (:class:`~router.placement.load.RouterLoad`
``prompt_tokens``: whole prompts in flight, grant to end, / ``block_size`` = active blocks without
Dynamo's per-request rounding up and without deduplicating blocks shared between active requests
(``--router-assume-kv-reuse``); ``prefill_tokens``: uncached prompt tokens, grant to first token).
The overlap is the router's approximate prefix map (router/prefix_index.py), as Dynamo's own
``--no-router-kv-events`` mode (``ApproxKvIndexer``) learns from its routing decisions; Dynamo's
default reads KV events from the engines instead. The block-usage threshold reads the scraped
``vllm:kv_cache_usage_perc``. The queue is the core's small hold queue (router/core.py
``RouterCore._hold``; a separate, saturation-gated queue for llm-d flow control is another piece of
work), first come first served, bounded by the class's ``max_queue_ms`` in the HTTP router (Dynamo
has no queue timeout; the client's own applies) and unbounded in the fleet simulation.

Sources: https://docs.nvidia.com/dynamo/latest/router/kv_cache_routing.html (cost, temperature),
https://docs.nvidia.com/dynamo/user-guides/kv-cache-aware-routing (Router Guide),
https://docs.nvidia.com/dynamo/dev/components/frontend/configuration-reference and
https://docs.nvidia.com/dynamo/v1.0.0/additional-resources/frontend-configuration-reference (flags,
defaults), https://docs.nvidia.com/dynamo/v1.3.0/user-guides/fault-tolerance/request-rejection
(busy thresholds, 529), github.com/ai-dynamo/dynamo ``lib/kv-router/src/scheduling/config.rs``,
``selector/default.rs``, ``queue.rs`` (``all_workers_busy``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from router.placement.core import ReplicaView
from router.placement.load import RouterLoad

DYNAMO_BLOCK_SIZE = 16
"""Default ``block_size`` (tokens per KV block): vLLM's default block size, which Dynamo's router
takes from the engine (``--kv-cache-block-size``: backend-specific)."""

DYNAMO_KV_DEFAULTS: dict[str, float | int | None] = {
    "block_size": DYNAMO_BLOCK_SIZE,
    "overlap_score_weight": 1.0,
    "router_temperature": 0.0,
    "active_decode_blocks_threshold": None,
    "active_prefill_tokens_threshold": None,
    "router_queue_threshold": 16.0,
    "max_num_batched_tokens": 2048,
}
"""The ``dynamo-kv`` profile's parameters and their defaults (module docstring). ``max_num_batched_tokens``
is the engine's (Dynamo reads it from each worker's runtime config): 2048 is ``vllm serve``'s on an
A100 (replica_agent/policy/profiles.py ``vllm_serve_batch_defaults``); the fleet simulation passes its own."""


@dataclass(slots=True)
class DynamoQueueGate:
    """Dynamo's router-queue gate: saturated while every healthy replica's router-local active
    prefill tokens exceed ``threshold * max_num_batched_tokens`` (``queue.rs`` ``all_workers_busy``:
    a worker at or under the bound has room). No healthy replica: not saturated (the placement then
    answers for itself).

    Attributes:
        load: the router's load view (``prefill_tokens``).
        threshold: ``--router-queue-threshold`` (>= 0).
        max_num_batched_tokens: the engines' token budget per step (> 0).

    Raises:
        ValueError: a negative threshold or a budget <= 0.
    """

    load: RouterLoad = field(default_factory=RouterLoad)
    threshold: float = 16.0
    max_num_batched_tokens: int = 2048

    def __post_init__(self) -> None:
        if self.threshold < 0 or self.max_num_batched_tokens <= 0:
            raise ValueError(f"router_queue_threshold must be >= 0 and max_num_batched_tokens > 0, got "
                             f"{self.threshold} and {self.max_num_batched_tokens}")  # fmt: skip

    def saturated(self, replicas: Sequence[ReplicaView]) -> bool:
        bound = self.threshold * self.max_num_batched_tokens
        prefill = self.load.prefill_tokens
        checked = False
        for r in replicas:
            if not r.healthy:
                continue
            checked = True
            if prefill.get(r.replica_id, 0) <= bound:
                return False
        return checked
