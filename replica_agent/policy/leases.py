"""Lease table: prefill budget reserved by a router before its request reaches this replica.

A router calls Reserve (proto/admission.proto) before forwarding a prompt; the agent grants a
lease, which counts in the in-flight reservation of PAB (docs/design.md section 4) until the request
arrives (:meth:`LeaseTable.consume`: the lease becomes an in-flight prefill on the tracker), the
router gives it back (:meth:`LeaseTable.release`), or it lapses (:meth:`LeaseTable.expire`). Two
routers therefore cannot spend one budget twice.

PURE: the clock value is passed in (``now_ms``, simulated ms); ids are ``<prefix>-<counter>``
with a prefix chosen by the caller (e.g. a random hex per agent process), so no randomness here.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field


class LeaseTableFull(Exception):
    """Raised by :meth:`LeaseTable.grant` when ``max_leases`` leases are already active."""


@dataclass(slots=True)
class Lease:
    """One granted lease.

    Attributes:
        lease_id: opaque id handed to the router (sent back in ``x-fairbatch-lease``).
        prompt_tokens: the prompt size the router reserved (tokens).
        slo_class: SLO class name.
        max_tokens: requested output tokens, None when unknown.
        granted_ms: grant time (simulated ms).
        expires_ms: the lease lapses at this time if its request never arrives (simulated ms).
        request_id: the router's request id (logs only).
    """

    lease_id: str
    prompt_tokens: int
    slo_class: str
    max_tokens: int | None
    granted_ms: float
    expires_ms: float
    request_id: str = ""


@dataclass(slots=True)
class LeaseTable:
    """Active leases, bounded in number.

    Attributes:
        max_leases: bound on active leases (> 0); :meth:`grant` raises beyond it.
        id_prefix: prefix of lease ids (make it unique per agent process).
    """

    max_leases: int = 4096
    id_prefix: str = "lease"
    _leases: dict[str, Lease] = field(default_factory=dict)
    _counter: itertools.count = field(default_factory=lambda: itertools.count(1))

    def __post_init__(self) -> None:
        if self.max_leases <= 0:
            raise ValueError(f"max_leases must be > 0, got {self.max_leases}")

    def __len__(self) -> int:
        return len(self._leases)

    def grant(
        self,
        prompt_tokens: int,
        slo_class: str,
        max_tokens: int | None,
        now_ms: float,
        ttl_ms: float,
        request_id: str = "",
    ) -> str:
        """Record a lease valid until ``now_ms + ttl_ms`` and return its id.

        Raises:
            ValueError: if ``prompt_tokens`` < 0 or ``ttl_ms`` <= 0.
            LeaseTableFull: when ``max_leases`` leases are active.
        """
        if prompt_tokens < 0:
            raise ValueError(f"prompt_tokens must be >= 0, got {prompt_tokens}")
        if ttl_ms <= 0:
            raise ValueError(f"ttl_ms must be > 0, got {ttl_ms}")
        if len(self._leases) >= self.max_leases:
            raise LeaseTableFull(f"{len(self._leases)} leases active (max {self.max_leases})")
        lease_id = f"{self.id_prefix}-{next(self._counter)}"
        self._leases[lease_id] = Lease(
            lease_id=lease_id,
            prompt_tokens=int(prompt_tokens),
            slo_class=slo_class,
            max_tokens=max_tokens if max_tokens and max_tokens > 0 else None,
            granted_ms=now_ms,
            expires_ms=now_ms + ttl_ms,
            request_id=request_id,
        )
        return lease_id

    def get(self, lease_id: str) -> Lease | None:
        """The active lease with this id, or None."""
        return self._leases.get(lease_id)

    def consume(self, lease_id: str) -> Lease | None:
        """The lease's request arrived: remove and return it (it becomes an in-flight prefill).

        Returns None when the id is unknown (never granted, released, expired or already consumed).
        """
        return self._leases.pop(lease_id, None)

    def release(self, lease_id: str) -> bool:
        """Give a lease back; True when it was active."""
        return self._leases.pop(lease_id, None) is not None

    def expire(self, now_ms: float) -> list[Lease]:
        """Remove and return the leases with ``expires_ms <= now_ms``."""
        expired = [lease for lease in self._leases.values() if lease.expires_ms <= now_ms]
        for lease in expired:
            del self._leases[lease.lease_id]
        return expired

    def active(self) -> list[Lease]:
        """Active leases, oldest grant first."""
        return list(self._leases.values())
