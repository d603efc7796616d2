"""llm-d's Flow Control queues as a pure data structure: where a request waits at the router while
the pool is saturated (router/placement/saturation.py), and in which order it leaves.
PURE (no I/O, no clock: times are passed in, simulated ms on the router clock).

Modelled on llm-d v0.8's Flow Control layer (feature gate ``flowControl``; the EPP of
llm-d-inference-scheduler v0.8.0 is Gateway API Inference Extension v1.5.0). Sources, at GIE tag v1.5.0
(https://github.com/kubernetes-sigs/gateway-api-inference-extension/tree/v1.5.0/pkg/epp):

- a request's *flow* is (fairness id, priority) (``requestcontrol/admission.go``
  ``flowControlRequest.FlowKey``; the fairness id is the ``x-gateway-inference-fairness-id``
  header, the priority the InferenceObjective's). Here the fairness id is the tenant and the
  priority the SLO class's band (:func:`band_key`).
- three tiers (``framework/plugins/flowcontrol/fairness/doc.go``): (1) strict priority between bands,
  highest first, a higher band always starving lower ones; (2) a fairness policy between the flows
  of one band; (3) an ordering policy within a flow. Defaults (``flowcontrol/registry/config.go``
  ``DefaultFairnessPolicyRef`` = ``global-strict-fairness-policy``, ``DefaultOrderingPolicyRef`` =
  ``fcfs-ordering-policy``): **global-strict** (the best head over all flows of the band by the
  ordering policy: with FCFS, the oldest enqueue time in the band, ``fairness/besthead.go``) and
  **FCFS** (``ordering/fcfs.go``: earlier ``EnqueueTime`` first). The **round-robin** fairness
  policy (``fairness/roundrobin.go``) is the option: flows in sorted id order, the next non-empty
  flow after the last one served, wrapping (work conserving).
- capacity (``registry/config.go``; ``apix/config/v1alpha1`` ``FlowControlConfig``): each band holds
  at most ``defaultPriorityBandMaxBytes`` = 1 GB of request bytes; ``MaxRequests`` per band and the
  global ``MaxBytes`` / ``MaxRequests`` are unlimited (0) unless configured. A request over a limit
  is rejected at once (``QueueOutcomeRejectedCapacity`` -> 429 ResourceExhausted,
  ``requestcontrol/admission.go`` ``translateFlowControlOutcome``).
- TTL (``flowcontrol/controller/config.go`` ``DefaultRequestTTL``): none by default ("If 0 or
  omitted ... requests may wait indefinitely unless cancelled by the client"); a request whose TTL
  passes is evicted (``QueueOutcomeEvictedTTL`` -> 503 ServiceUnavailable).

The queue holds :class:`FlowItem` values whose ``payload`` is the caller's (router/core.py keeps its
:class:`~router.admission_queue.WaitingRequest` there); it never resolves anything itself.
"""

from __future__ import annotations

import collections
import heapq
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from router.placement.saturation import UtilizationDetector

FAIRNESS_POLICIES = ("global-strict", "round-robin")
"""Fairness policies between the flows of one band (llm-d ``global-strict-fairness-policy``, the
default, and ``round-robin-fairness-policy``)."""
DEFAULT_BAND_MAX_BYTES = 1_000_000_000
"""llm-d ``defaultPriorityBandMaxBytes``: 1 GB of request bytes per priority band."""


def band_key(band: int, sheddable: bool) -> tuple[int, int]:
    """The order of a request's priority band, smallest first: the project's SLO-class band
    (0 = most urgent) with every sheddable class below every other one, as llm-d's sheddable
    requests are exactly those of negative priority (``util/request/sheddable.go``)."""
    return (1 if sheddable else 0, band)


@dataclass(frozen=True, slots=True)
class FlowControlSettings:
    """One profile's Flow Control settings (module docstring for the defaults' sources).

    Attributes:
        detector: the saturation detector that gates dispatch (router/placement/saturation.py).
        fairness: one of :data:`FAIRNESS_POLICIES`.
        ttl_ms: a queued request is evicted (503) after this long (ms); None = never (llm-d's
            default: only the client's own deadline ends the wait).
        band_max_bytes: request bytes one band may hold (0 = no limit).
        band_max_requests: requests one band may hold (0 = no limit).
        max_bytes, max_requests: the same over all bands (0 = no limit).
        reject_sheddable: a sheddable request arriving while the pool is saturated is refused 429
            at once instead of queued. llm-d v0.8's flow-control path does not do that (GIE PR #1952,
            "Enable Scale-from-Zero with Flow Control enabled", removed the check from
            ``FlowControlAdmissionController.Admit``); its legacy admission (no flow control) and
            the first flow-control release (GIE PR #1701) did. Default False (v0.8).

    Raises:
        ValueError: an unknown fairness policy, a negative limit or a TTL <= 0.
    """

    detector: UtilizationDetector = field(default_factory=UtilizationDetector)
    fairness: str = "global-strict"
    ttl_ms: float | None = None
    band_max_bytes: int = DEFAULT_BAND_MAX_BYTES
    band_max_requests: int = 0
    max_bytes: int = 0
    max_requests: int = 0
    reject_sheddable: bool = False

    def __post_init__(self) -> None:
        if self.fairness not in FAIRNESS_POLICIES:
            raise ValueError(f"fairness must be one of {FAIRNESS_POLICIES}, got {self.fairness!r}")
        if self.ttl_ms is not None and not self.ttl_ms > 0:
            raise ValueError(f"ttl_ms must be > 0 or None, got {self.ttl_ms}")
        for name in ("band_max_bytes", "band_max_requests", "max_bytes", "max_requests"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


@dataclass(slots=True, eq=False)
class FlowItem:
    """One waiting request (compared by identity).

    Attributes:
        flow_id: its fairness id (the tenant).
        band: its :func:`band_key`.
        byte_size: request bytes counted against the capacity limits (>= 0).
        enqueued_ms: router clock at push (the FCFS key).
        deadline_ms: evicted at this time (inf = never).
        payload: the caller's object.
        seq: push order (set by the queue; breaks FCFS ties).
    """

    flow_id: str
    band: tuple[int, int]
    byte_size: int
    enqueued_ms: float
    deadline_ms: float = float("inf")
    payload: Any = None
    seq: int = 0


@dataclass(slots=True)
class _Band:
    flows: dict[str, collections.deque[FlowItem]] = field(default_factory=dict)
    count: int = 0
    bytes: int = 0
    last_flow: str | None = None  # round-robin cursor: the flow served last


class FlowControlQueue:
    """Priority bands -> flows -> FCFS queues (module docstring).

    Args:
        settings: the fairness policy and capacity limits (its TTL is the caller's to apply: it sets
            :attr:`FlowItem.deadline_ms`).
    """

    def __init__(self, settings: FlowControlSettings = FlowControlSettings()) -> None:
        self.settings = settings
        self._bands: dict[tuple[int, int], _Band] = {}
        self._count = 0
        self._bytes = 0
        self._seq = 0
        self._where: dict[int, FlowItem] = {}  # id(item) -> item, for remove()
        self._deadlines: list[tuple[float, int, FlowItem]] = []  # min-heap; removed items skipped lazily

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[FlowItem]:
        """Every waiting item, in no particular order."""
        return iter(list(self._where.values()))

    def has_capacity(self, band: tuple[int, int], byte_size: int) -> bool:
        """Whether one more item of ``byte_size`` bytes fits in ``band`` and in the global limits."""
        s = self.settings
        b = self._bands.get(band)
        count, size = (b.count, b.bytes) if b is not None else (0, 0)
        return not ((s.max_requests and self._count + 1 > s.max_requests)
                    or (s.max_bytes and self._bytes + byte_size > s.max_bytes)
                    or (s.band_max_requests and count + 1 > s.band_max_requests)
                    or (s.band_max_bytes and size + byte_size > s.band_max_bytes))  # fmt: skip

    def push(self, item: FlowItem) -> bool:
        """Queue ``item`` at the tail of its flow; False (nothing queued) when over a capacity limit."""
        if not self.has_capacity(item.band, item.byte_size):
            return False
        self._seq += 1
        item.seq = self._seq
        band = self._bands.setdefault(item.band, _Band())
        band.flows.setdefault(item.flow_id, collections.deque()).append(item)
        band.count += 1
        band.bytes += item.byte_size
        self._count += 1
        self._bytes += item.byte_size
        self._where[id(item)] = item
        if item.deadline_ms != float("inf"):
            heapq.heappush(self._deadlines, (item.deadline_ms, item.seq, item))
        return True

    def _take(self, band_key_: tuple[int, int], band: _Band, flow_id: str, item: FlowItem) -> None:
        q = band.flows[flow_id]
        q.remove(item)
        if not q:
            del band.flows[flow_id]
        band.count -= 1
        band.bytes -= item.byte_size
        self._count -= 1
        self._bytes -= item.byte_size
        del self._where[id(item)]
        if band.count == 0 and band.last_flow is None:
            del self._bands[band_key_]

    def remove(self, item: FlowItem) -> bool:
        """Take ``item`` out wherever it waits (False when it was not queued)."""
        if self._where.get(id(item)) is not item:
            return False
        self._take(item.band, self._bands[item.band], item.flow_id, item)
        return True

    def peek(self) -> FlowItem | None:
        """The item :meth:`pop` would return (None when empty), without moving the round-robin cursor."""
        return self._select(advance=False)

    def pop(self) -> FlowItem | None:
        """Take the next item to dispatch: the highest band with items, the flow its fairness policy
        picks, that flow's oldest item (FCFS). None when empty."""
        return self._select(advance=True)

    def _select(self, advance: bool) -> FlowItem | None:
        for key in sorted(self._bands):
            band = self._bands[key]
            if not band.flows:
                continue
            if self.settings.fairness == "global-strict":
                item = min((q[0] for q in band.flows.values()), key=lambda i: (i.enqueued_ms, i.seq))
            else:  # round-robin: the next flow id after the last one served, in sorted order, wrapping
                ids = sorted(band.flows)
                last = band.last_flow
                flow = next((f for f in ids if last is None or f > last), ids[0])
                item = band.flows[flow][0]
                if advance:
                    band.last_flow = flow
            if advance:
                self._take(key, band, item.flow_id, item)
            return item
        return None

    def expire(self, now_ms: float) -> list[FlowItem]:
        """Take out and return every item whose ``deadline_ms`` <= ``now_ms`` (earliest deadline first)."""
        gone = []
        heap = self._deadlines
        while heap and heap[0][0] <= now_ms:
            item = heapq.heappop(heap)[2]
            if self.remove(item):
                gone.append(item)
        return gone

    def next_deadline_ms(self) -> float | None:
        """The earliest finite ``deadline_ms`` of a waiting item; None when none has one."""
        heap = self._deadlines
        while heap and self._where.get(id(heap[0][2])) is not heap[0][2]:
            heapq.heappop(heap)
        return heap[0][0] if heap else None
