"""How fast each replica frees prefill budget, from its budget stream. PURE (times passed in).

Used by the router's arrival-time ``slo-infeasible`` decision (:meth:`router.server.Router.predict`,
issue 18): a request that does not fit now waits until some replica's budget for its class covers
its prefill, and that depends on how fast the replica's reservations actually end, not on the
1 ms per ms a replica that only prefills would give (a replica busy with long decodes frees almost
nothing within a TTFT).

Model. For one replica and SLO class k, ``reserved_k = decode_reservation_ms + inflight_reservation_ms``
of its snapshot (pab.py: the time of the horizon H_k already promised). Between two snapshots at
t0 and t1 this router added ``added`` ms of prefill there (``b * P`` per lease it took, the
in-flight reservation's own formula; other routers' leases are not seen and make the estimate
conservative), so the reservation that ended in between is::

    freed_k = max(0, reserved_k(t0) + added - reserved_k(t1))

and the drain rate is its exponentially weighted mean (weight ``alpha`` per sample) of
``freed_k / (t1 - t0)`` (ms of budget per ms). Units: simulated ms throughout.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(slots=True)
class _ReplicaDrain:
    t_ms: float
    reserved: dict[str, float]
    added_ms: float = 0.0
    rate: dict[str, float] = field(default_factory=dict)


@dataclass(slots=True)
class DrainEstimator:
    """Per replica and class: the EWMA drain rate of its reservations (module docstring).

    Args:
        alpha: weight of the newest sample, 0 < alpha <= 1.
        min_dt_ms: samples closer than this to the previous one are merged into the next (ms).
    """

    alpha: float = 0.3
    min_dt_ms: float = 5.0
    _replicas: dict[str, _ReplicaDrain] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0.0 < self.alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {self.alpha}")

    def observe(self, replica_id: str, now_ms: float, reserved_ms: Mapping[str, float]) -> None:
        """A snapshot arrived at ``now_ms`` with ``reserved_ms[class]`` = decode + in-flight reservation."""
        st = self._replicas.get(replica_id)
        if st is None or now_ms < st.t_ms:  # first snapshot, or a clock that went back
            self._replicas[replica_id] = _ReplicaDrain(now_ms, dict(reserved_ms))
            return
        dt = now_ms - st.t_ms
        if dt < self.min_dt_ms:
            return
        for name, now_reserved in reserved_ms.items():
            before = st.reserved.get(name)
            if before is None:
                continue
            sample = max(0.0, before + st.added_ms - now_reserved) / dt
            old = st.rate.get(name)
            st.rate[name] = sample if old is None else old + self.alpha * (sample - old)
        st.t_ms = now_ms
        st.reserved = dict(reserved_ms)
        st.added_ms = 0.0

    def note_added(self, replica_id: str, prefill_ms: float) -> None:
        """This router took ``prefill_ms`` (= b * P) of budget on the replica since its last snapshot."""
        st = self._replicas.get(replica_id)
        if st is not None:
            st.added_ms += max(0.0, prefill_ms)

    def rate(self, replica_id: str, slo_class: str) -> float | None:
        """Drain rate (ms of budget per ms) of the class on the replica; None before two snapshots."""
        st = self._replicas.get(replica_id)
        return None if st is None else st.rate.get(slo_class)

    def forget(self, replica_id: str) -> None:
        """Drop a replica's history (it was removed or reconnected)."""
        self._replicas.pop(replica_id, None)


def wait_for_budget_ms(deficit_ms: float, rate: float | None, fallback_rate: float = 1.0) -> float:
    """ms until ``deficit_ms`` of budget frees at ``rate`` ms/ms (``fallback_rate`` when unknown);
    0 when nothing is missing, inf when the rate is 0."""
    if deficit_ms <= 0.0:
        return 0.0
    r = fallback_rate if rate is None else rate
    return deficit_ms / r if r > 0.0 else float("inf")
