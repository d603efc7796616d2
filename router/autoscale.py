"""PURE autoscaling rules for the vLLM fleet: how many replicas the fleet's signals ask for.

Two rules, both as a Kubernetes HorizontalPodAutoscaler (driven by KEDA or an external-metrics
adapter) evaluates them: the metric's value is the *raw* desired replica count (``AverageValue``
target 1), clamped to ``[min_replicas, max_replicas]``; :class:`Stabilizer` then applies the HPA's
scale-down stabilization (the largest raw recommendation of the last window), so a scale-out
takes effect at the next evaluation and a scale-in only after the signal stayed low a whole
window. The chart renders the same expressions in PromQL (deploy/helm/fairbatch/templates/
vllm-autoscaling.yaml); the fleet simulation (loadgen/fleet/sim.py) calls these functions.

- :func:`pab_desired` (fairbatch): scale out by one when the fleet turns work away for lack of
  budget: requests wait in the router queue while no replica has PAB left for the class
  (``fairbatch_router_fleet_pab_seconds == 0``), or the router refused requests since the last
  evaluation (429 ``slo-infeasible``, ``queue-full``, ``queue-timeout``: a sheddable class is
  refused rather than queued, each refusal a moment with no budget in reach); scale in by one
  when the spare PAB over the fleet exceeds one idle replica's worth (its horizon
  H, replica_agent/policy/pab.py ``planning_horizon_ms``) with nothing queued or refused: removing one replica would still
  leave budget to spare. Else hold at the ready replicas (a starting replica is held by the
  stabilization window, which should be longer than a start-up).
- :func:`waiting_desired` (the baseline of vLLM production-stack's KEDA example): ``ceil(sum of
  vllm:num_requests_waiting / target)``, the HPA's ``AverageValue`` formula.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class FleetSignal:
    """What the autoscaler reads (the router's and the engines' metrics).

    Attributes:
        ready_replicas: replicas serving (``fairbatch_router_replicas``, discovered and ready).
        spare_pab_ms: PAB of the class summed over usable replicas (ms;
            ``fairbatch_router_fleet_pab_seconds`` x 1000).
        queue_depth: requests waiting in the router queues (``fairbatch_router_queue_depth``).
        num_waiting: requests waiting inside the engines (sum of ``vllm:num_requests_waiting``).
        refused: requests refused for capacity since the last evaluation (``increase`` of
            ``fairbatch_router_requests_total{outcome=~"slo_infeasible|queue_full|queue_timeout"}``).
    """

    ready_replicas: int
    spare_pab_ms: float
    queue_depth: int
    num_waiting: int = 0
    refused: int = 0


def clamp(n: int, lo: int, hi: int) -> int:
    """``n`` within ``[lo, hi]``."""
    return max(lo, min(hi, n))


def pab_desired(signal: FleetSignal, one_replica_pab_ms: float) -> int:
    """Raw desired replicas by the PAB rule (module docstring), before clamping.

    Args:
        signal: the fleet's signals.
        one_replica_pab_ms: an idle replica's PAB for the class: its horizon H
            (replica_agent/policy/pab.py ``planning_horizon_ms``; ms, > 0).

    Raises:
        ValueError: ``one_replica_pab_ms`` not positive.
    """
    if not one_replica_pab_ms > 0:
        raise ValueError(f"one_replica_pab_ms must be > 0, got {one_replica_pab_ms}")
    n = signal.ready_replicas
    if signal.refused > 0 or (signal.queue_depth > 0 and signal.spare_pab_ms <= 0.0):
        return n + 1
    if signal.spare_pab_ms > one_replica_pab_ms and signal.queue_depth == 0:
        return n - 1
    return n


def waiting_desired(signal: FleetSignal, target_per_replica: float) -> int:
    """Raw desired replicas by the HPA ``AverageValue`` formula on engine waiting requests:
    ``ceil(num_waiting / target_per_replica)`` (0 when nothing waits; clamping raises it to the minimum).

    Raises:
        ValueError: ``target_per_replica`` not positive.
    """
    if not target_per_replica > 0:
        raise ValueError(f"target_per_replica must be > 0, got {target_per_replica}")
    return math.ceil(signal.num_waiting / target_per_replica)


class Stabilizer:
    """The HPA's scale-down stabilization: the recommendation is the largest raw (clamped) desired
    count seen within the last ``window_ms`` (scale-out is immediate, scale-in waits a window).

    Args:
        window_ms: stabilization window (ms, >= 0; the HPA's default is 300 s).
        min_replicas, max_replicas: bounds (1 <= min <= max).

    Raises:
        ValueError: bad bounds or a negative window.
    """

    def __init__(self, window_ms: float, min_replicas: int, max_replicas: int) -> None:
        if window_ms < 0 or not 1 <= min_replicas <= max_replicas:
            raise ValueError(f"need window_ms >= 0 and 1 <= min <= max, got {window_ms}, {min_replicas}, {max_replicas}")
        self.window_ms = window_ms
        self.min_replicas = min_replicas
        self.max_replicas = max_replicas
        self._recent: deque[tuple[float, int]] = deque()

    def recommend(self, now_ms: float, raw: int) -> int:
        """Record ``raw`` at ``now_ms`` (non-decreasing) and return the replica count to run."""
        value = clamp(raw, self.min_replicas, self.max_replicas)
        self._recent.append((now_ms, value))
        while self._recent and self._recent[0][0] < now_ms - self.window_ms:
            self._recent.popleft()
        return max(v for _, v in self._recent)
