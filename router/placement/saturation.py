"""llm-d's saturation detector as a pure rule: is the pool too loaded to dispatch another request?
PURE (plain data in, a number out; the caller passes the clock reading).

llm-d v0.8 (llm-d-inference-scheduler v0.8.0, go.mod: sigs.k8s.io/gateway-api-inference-extension
v1.5.0) gates its Flow Control layer with the *utilization detector* (plugin type
``utilization-detector``, the default when no ``saturationDetector`` is configured:
pkg/epp/config/loader/defaults.go ``ensureSaturationDetector``). Sources, read at GIE tag v1.5.0
(https://github.com/kubernetes-sigs/gateway-api-inference-extension/tree/v1.5.0/pkg/epp/framework/plugins/flowcontrol/saturationdetector/utilization,
``detector.go``, ``config.go``, ``README.md``; the same text is at llm-d-inference-scheduler HEAD of
2026-05, https://github.com/llm-d/llm-d-inference-scheduler/tree/main/pkg/epp/framework/plugins/flowcontrol/saturationdetector/utilization):

- per endpoint (pod), the "roofline" score ``max(waiting / queueDepthThreshold, kv_usage /
  kvCacheUtilThreshold)``; an endpoint with no metrics, or metrics older than
  ``metricsStalenessThreshold``, scores 1.0 (``time.Since(UpdateTime) > threshold``: an age equal
  to the threshold is still fresh);
- the pool's saturation is the unweighted mean of the endpoint scores (1.0 for an empty pool);
- the Flow Control dispatch cycle (pkg/epp/flowcontrol/controller/internal/processor.go
  ``dispatchCycle``) dispatches nothing while ``saturation >= ceiling``, the ceiling of the default
  static usage-limit policy being 1.0 (pkg/epp/framework/plugins/flowcontrol/usagelimits: "threshold
  of 1.0 (the default) means no gating"), so the pool is *saturated* at a mean score >= 1.0.

Defaults (``config.go``: ``DefaultQueueDepthThreshold``, ``DefaultKVCacheUtilThreshold``,
``DefaultMetricsStalenessThreshold``): queueDepthThreshold 5 requests, kvCacheUtilThreshold 0.8,
metricsStalenessThreshold 200 ms. (The detector's ``headroom`` only widens its *filter* role in a
scheduling profile, which llm-d's default profile does not include; not modelled.)

Older releases (GIE v1.0.0, ``pkg/epp/saturationdetector/saturationdetector.go`` ``IsSaturated``,
same three defaults) used a binary rule instead: a pod has headroom when its metrics are fresh and
``waiting <= queueDepthThreshold`` and ``kv_usage <= kvCacheUtilThreshold``; the pool is saturated
when no pod has headroom. It is kept as ``rule="headroom"`` (:func:`any_headroom`) for comparison;
GIE switched to the gradient in PR #2224 ("refactor: switch SaturationDetector to gradient").

The metrics are the router's :class:`~router.placement.load.MetricsSample` per replica (engine
``vllm:num_requests_waiting`` and ``vllm:kv_cache_usage_perc``, ``scraped_ms`` on the router clock),
as llm-d reads its datalayer's scraped ``WaitingQueueSize``, ``KVCacheUsagePercent`` and ``UpdateTime``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from router.placement.load import MetricsSample

DEFAULT_QUEUE_DEPTH_THRESHOLD = 5
"""llm-d ``DefaultQueueDepthThreshold`` (waiting requests per pod)."""
DEFAULT_KV_CACHE_UTIL_THRESHOLD = 0.8
"""llm-d ``DefaultKVCacheUtilThreshold`` (fraction of the KV cache)."""
DEFAULT_METRICS_STALENESS_MS = 200.0
"""llm-d ``DefaultMetricsStalenessThreshold`` (200 ms)."""
SATURATION_CEILING = 1.0
"""The static usage-limit policy's ceiling: saturated at a pool saturation >= this."""
RULES = ("gradient", "headroom")
"""``gradient``: GIE v1.5.0's mean roofline score (llm-d v0.8, the default); ``headroom``: GIE v1.0's
"no pod has headroom"."""


@dataclass(frozen=True, slots=True)
class UtilizationDetector:
    """llm-d's utilization detector (module docstring) with its thresholds.

    Attributes:
        queue_depth_threshold: waiting requests per pod at which its queue score reaches 1 (> 0).
        kv_cache_util_threshold: KV usage (0..1] at which its memory score reaches 1.
        metrics_staleness_ms: metrics older than this (ms, > 0) make the pod score 1 (``gradient``)
            or have no headroom (``headroom``).
        rule: one of :data:`RULES`.

    Raises:
        ValueError: a threshold out of range (as llm-d's ``validateConfig``) or an unknown rule.
    """

    queue_depth_threshold: int = DEFAULT_QUEUE_DEPTH_THRESHOLD
    kv_cache_util_threshold: float = DEFAULT_KV_CACHE_UTIL_THRESHOLD
    metrics_staleness_ms: float = DEFAULT_METRICS_STALENESS_MS
    rule: str = "gradient"

    def __post_init__(self) -> None:
        if self.queue_depth_threshold <= 0:
            raise ValueError(f"queue_depth_threshold must be > 0, got {self.queue_depth_threshold}")
        if not 0.0 < self.kv_cache_util_threshold <= 1.0:
            raise ValueError(f"kv_cache_util_threshold must be in (0, 1], got {self.kv_cache_util_threshold}")
        if not self.metrics_staleness_ms > 0:
            raise ValueError(f"metrics_staleness_ms must be > 0, got {self.metrics_staleness_ms}")
        if self.rule not in RULES:
            raise ValueError(f"rule must be one of {RULES}, got {self.rule!r}")

    def fresh(self, sample: MetricsSample | None, now_ms: float) -> bool:
        """A sample exists and is at most ``metrics_staleness_ms`` old at ``now_ms``."""
        return sample is not None and now_ms - sample.scraped_ms <= self.metrics_staleness_ms

    def endpoint_score(self, sample: MetricsSample | None, now_ms: float) -> float:
        """One pod's roofline score ``max(waiting / Q, kv / KV)`` (>= 0); 1.0 without fresh metrics."""
        if sample is None or not self.fresh(sample, now_ms):
            return 1.0
        return max(sample.num_waiting / self.queue_depth_threshold, sample.kv_usage / self.kv_cache_util_threshold)

    def saturation(self, samples: Mapping[str, MetricsSample], replica_ids: Iterable[str], now_ms: float) -> float:
        """The pool's saturation: the mean :meth:`endpoint_score` over ``replica_ids`` (a replica
        missing from ``samples`` scores 1.0); 1.0 for no replica."""
        n = 0
        total = 0.0
        for rid in replica_ids:
            n += 1
            total += self.endpoint_score(samples.get(rid), now_ms)
        return total / n if n else 1.0

    def has_headroom(self, sample: MetricsSample | None, now_ms: float) -> bool:
        """GIE v1.0's per-pod rule: fresh, ``waiting <= Q`` and ``kv <= KV``."""
        return (sample is not None and self.fresh(sample, now_ms)
                and sample.num_waiting <= self.queue_depth_threshold
                and sample.kv_usage <= self.kv_cache_util_threshold)  # fmt: skip

    def saturated(self, samples: Mapping[str, MetricsSample], replica_ids: Iterable[str], now_ms: float) -> bool:
        """Whether dispatch is held: ``gradient``: :meth:`saturation` >= :data:`SATURATION_CEILING`;
        ``headroom``: no replica has headroom (:func:`any_headroom`)."""
        if self.rule == "headroom":
            return not any_headroom(self, samples, replica_ids, now_ms)
        return self.saturation(samples, replica_ids, now_ms) >= SATURATION_CEILING


def any_headroom(detector: UtilizationDetector, samples: Mapping[str, MetricsSample], replica_ids: Iterable[str],
                 now_ms: float) -> bool:  # fmt: skip
    """GIE v1.0's pool rule: some replica of ``replica_ids`` has headroom (:meth:`UtilizationDetector.has_headroom`)."""
    return any(detector.has_headroom(samples.get(rid), now_ms) for rid in replica_ids)
