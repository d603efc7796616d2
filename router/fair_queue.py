"""Weighted fair admission queue: priority bands, VTC across tenants, EDF within a tenant. PURE.

Plain data in, plain data out; no I/O and no clock reads (``now_ms`` is passed to :meth:`expire`).
It implements the :class:`router.admission_queue.AdmissionQueue` protocol, so the
:class:`~router.admission_queue.Dispatcher` serves it as it served the FIFO (docs/design.md section 5,
step 5: tenant quota, then the weighted fair queue, then deadline order).

Order of service (``ordered()``), one pick at a time:

1. **Band** (the SLO class's ``priority``, 0 = most urgent). The most urgent backlogged band is
   served unless it has taken more than its cap of the service given under contention:
   ``cap(b) = 1 - sum(min_share of backlogged tenants in bands below b)``; served is counted in
   raw cost (below) while at least two bands are backlogged and reset when contention ends.
   The least urgent backlogged band is never capped. With band 0 against a band-1 tenant of
   ``min_share`` 0.25 and equal costs the picks go H L H H H L H H H L ... (3:1).
2. **Tenant** within the band: the smallest virtual token counter (VTC, Sheng et al., "Fairness in
   Serving Large Language Models", arXiv 2401.00588, section 4, Algorithm 2). A tenant's counter
   grows by ``cost / weight`` as it is served, ``cost = w_prefill * prompt_tokens + w_decode *
   decode_tokens`` (the paper's w_p = 1, w_q = 2 by default). A tenant that becomes backlogged is
   lifted to ``max(own, min counter among backlogged tenants of its band)``, or, when none is
   backlogged, to the counter of the tenant that last left the band's backlog (the paper's lift;
   an idle tenant cannot bank service). Ties: the older head request first.
3. **Request** within the tenant: earliest first-token deadline (arrival + ttft_ms), then arrival.

The router charges a request when it is dispatched (prompt tokens and ``max_tokens``, or
``default_max_tokens`` when unknown, as the decode estimate) and may correct the decode part at
completion with :meth:`charge` of the difference (negative allowed).

Aging (issue 18): an entry is aged once it has waited its class's ``ttft_ms`` at the router
(``WaitingRequest.promote_at_ms`` = arrival + ttft_ms, set by the router; the first token is then
late whatever happens). While a tenant of a less urgent band has an aged entry, the band caps
above reserve for that band at least ``aging_floor_share`` (default 0.5) instead of the sum of
its tenants' min_share, so a band of ``min_share: 0`` tenants still gets that floor of the cost
served under contention while more urgent bands stay backlogged. Bound: from the moment an entry
is aged its band is picked whenever it has had less than ``aging_floor_share`` of the cost served
during the contention, so a lower band whose demand stays below that floor of the capacity is
served at its arrival rate after a delay of its ttft_ms, and one above it gets the floor; more
urgent bands keep at least ``1 - aging_floor_share`` (0.5) whatever waits below. Once picked, an
entry waits only for a replica to fit it (the dispatcher's holds bound that).

Bounds: at most ``max_requests`` entries and ``max_tokens`` waiting prompt tokens (a single prompt
larger than ``max_tokens`` is still accepted into an empty queue); every entry leaves at its
``deadline_ms`` (:meth:`expire`). The head-of-line bypass bound (a head that fits no replica may be
passed ``max_bypass`` times, then the dispatcher holds for it) lives in the Dispatcher.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from router.admission_queue import DeadlineIndex, QueueFull, WaitingRequest

_EPS = 1e-9


@dataclass(frozen=True, slots=True)
class TenantShare:
    """A tenant's fairness contract.

    Attributes:
        weight: VTC weight (> 0); its counter grows by cost / weight.
        band: priority band of its SLO class (0 = most urgent).
        min_share: share of service reserved against higher bands under contention (0..1).
    """

    weight: float = 1.0
    band: int = 0
    min_share: float = 0.0


@dataclass(slots=True)
class _Tenant:
    share: TenantShare
    counter: float = 0.0
    waiting: int = 0
    heap: list[tuple[float, int, WaitingRequest]] = field(default_factory=list)


class FairQueue:
    """Bounded weighted fair queue (see the module docstring).

    Args:
        max_requests: most waiting requests (>= 1).
        max_tokens: most waiting prompt tokens in total (>= 1).
        tenants: fairness contract per tenant name; unknown tenants get weight 1 and the band of
            their entry's ``priority``.
        w_prefill: cost per prompt token (>= 0).
        w_decode: cost per decode token (>= 0).
        default_max_tokens: decode tokens assumed when an entry's ``max_tokens`` is 0 (unknown).
        aging_floor_share: min_share a less urgent band's tenant counts while one of its entries
            is aged (module docstring, "Aging"), 0..1.
    """

    def __init__(
        self,
        max_requests: int,
        max_tokens: int,
        tenants: Mapping[str, TenantShare] | None = None,
        w_prefill: float = 1.0,
        w_decode: float = 2.0,
        default_max_tokens: int = 256,
        aging_floor_share: float = 0.5,
    ) -> None:
        if not 0.0 <= aging_floor_share <= 1.0:
            raise ValueError(f"aging_floor_share must be in [0, 1], got {aging_floor_share}")
        self.aging_floor_share = aging_floor_share
        self._aged: set[str] = set()
        self.max_requests = 1
        self.max_tokens = 1
        self.set_bounds(max_requests, max_tokens)
        self.w_prefill = w_prefill
        self.w_decode = w_decode
        self.default_max_tokens = default_max_tokens
        self._tenants: dict[str, _Tenant] = {}
        self._entries: dict[WaitingRequest, None] = {}
        self._tokens = 0
        self._band_tokens: dict[int, int] = {}
        self._band_waiting: dict[int, int] = {}
        self._band_served: dict[int, float] = {}
        self._last_left: dict[int, str] = {}  # band -> tenant that last left its backlog
        self._deadlines = DeadlineIndex()
        self._seq = itertools.count()
        self.set_tenants(tenants or {})

    # ------------------------------------------------------------------ configuration

    def set_bounds(self, max_requests: int, max_tokens: int) -> None:
        """Change the bounds (hot reload); entries already queued stay."""
        if max_requests < 1 or max_tokens < 1:
            raise ValueError("max_requests and max_tokens must be >= 1")
        self.max_requests = max_requests
        self.max_tokens = max_tokens

    def set_tenants(self, tenants: Mapping[str, TenantShare]) -> None:
        """Install new contracts (hot reload); counters and waiting entries are kept."""
        for name, share in tenants.items():
            if share.weight <= 0:
                raise ValueError(f"tenant {name!r}: weight must be > 0")
            t = self._tenants.get(name)
            if t is None:
                self._tenants[name] = _Tenant(share)
            else:
                t.share = share

    # ------------------------------------------------------------------ sizes and reads

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def tokens(self) -> int:
        """Prompt tokens waiting in total."""
        return self._tokens

    def tokens_ahead(self, band: int) -> int:
        """Prompt tokens waiting in bands at least as urgent as ``band`` (for the wait prediction)."""
        return sum(n for b, n in self._band_tokens.items() if b <= band)

    def backlogged_tenants(self) -> int:
        """How many tenants have requests waiting (2 or more = they contend)."""
        return sum(1 for t in self._tenants.values() if t.waiting)

    def counter(self, tenant: str) -> float:
        """The tenant's virtual token counter (weighted tokens / weight)."""
        t = self._tenants.get(tenant)
        return t.counter if t is not None else 0.0

    def counters(self) -> dict[str, float]:
        """Every known tenant's counter."""
        return {name: t.counter for name, t in self._tenants.items()}

    def band_served(self) -> dict[int, float]:
        """Cost served per band during the current contention (reset when it ends)."""
        return dict(self._band_served)

    def cost(self, prompt_tokens: int, decode_tokens: int) -> float:
        """VTC cost ``w_prefill * prompt_tokens + w_decode * decode_tokens`` (weighted tokens)."""
        return self.w_prefill * prompt_tokens + self.w_decode * decode_tokens

    def entry_cost(self, entry: WaitingRequest) -> float:
        """Cost charged at dispatch: prompt tokens and ``max_tokens`` (or the default estimate)."""
        return self.cost(entry.prompt_tokens, entry.max_tokens or self.default_max_tokens)

    # ------------------------------------------------------------------ mutations

    def _tenant(self, entry: WaitingRequest) -> _Tenant:
        t = self._tenants.get(entry.tenant)
        if t is None:
            t = self._tenants[entry.tenant] = _Tenant(TenantShare(1.0, entry.priority, 0.0))
        return t

    def push(self, entry: WaitingRequest) -> float:
        """Queue ``entry`` (its ``seq`` is set); returns its tenant's counter after any lift.

        Raises:
            QueueFull: ``max_requests`` reached, or the prompt would take the waiting total over
                ``max_tokens``.
        """
        if len(self._entries) >= self.max_requests:
            raise QueueFull("max_requests")
        if self._entries and self._tokens + entry.prompt_tokens > self.max_tokens:
            raise QueueFull("max_tokens")
        t = self._tenant(entry)
        band = t.share.band
        entry.priority = band
        if t.waiting == 0:  # becomes backlogged: VTC lift (arXiv 2401.00588, Algorithm 2)
            floor = self._backlogged_min(band)
            if floor is None and band in self._last_left:
                floor = self._tenants[self._last_left[band]].counter
            if floor is not None and floor > t.counter:
                t.counter = floor
        entry.seq = next(self._seq)
        t.waiting += 1
        heapq.heappush(t.heap, (entry.first_token_deadline_ms, entry.seq, entry))
        self._entries[entry] = None
        self._tokens += entry.prompt_tokens
        self._band_tokens[band] = self._band_tokens.get(band, 0) + entry.prompt_tokens
        self._band_waiting[band] = self._band_waiting.get(band, 0) + 1
        self._deadlines.add(entry)
        return t.counter

    def remove(self, entry: WaitingRequest) -> bool:
        """Take ``entry`` out (False when it was not queued)."""
        if entry not in self._entries:
            return False
        del self._entries[entry]
        t = self._tenants[entry.tenant]
        band = entry.priority
        t.waiting -= 1
        self._tokens -= entry.prompt_tokens
        self._band_tokens[band] -= entry.prompt_tokens
        self._band_waiting[band] -= 1
        if self._band_waiting[band] == 0:
            del self._band_waiting[band]
            del self._band_tokens[band]
        if t.waiting == 0:
            t.heap.clear()
            self._last_left[band] = entry.tenant
        if len(self._band_waiting) < 2:
            self._band_served.clear()  # contention between bands is over
        if not self._entries:
            self._deadlines.clear()
        return True

    def charge(self, tenant: str, prefill_tokens: int, decode_tokens: int) -> float:
        """Count service given to ``tenant``; returns the counter increase (cost / weight).

        Call at dispatch with the prompt tokens and the decode estimate, and optionally at
        completion with ``(0, actual - estimate)`` to correct it (may be negative).
        """
        t = self._tenants.get(tenant)
        if t is None:
            t = self._tenants[tenant] = _Tenant(TenantShare())
        cost = self.cost(prefill_tokens, decode_tokens)
        delta = cost / t.share.weight
        t.counter += delta
        band = t.share.band
        if any(b != band for b in self._band_waiting):  # contention with another band
            self._band_served[band] = self._band_served.get(band, 0.0) + cost
        return delta

    def merge_counters(self, shared: Mapping[str, float]) -> None:
        """Adopt counters from the shared ledger where they are ahead (several routers)."""
        for name, value in shared.items():
            t = self._tenants.get(name)
            if t is None:
                t = self._tenants[name] = _Tenant(TenantShare())
            if value > t.counter:
                t.counter = value

    def expire(self, now_ms: float) -> list[WaitingRequest]:
        """Remove and return the entries whose ``deadline_ms`` <= ``now_ms`` (simulated ms)."""
        return [e for e in self._deadlines.pop_due(now_ms) if self.remove(e)]

    def next_deadline_ms(self) -> float | None:
        """Earliest deadline among queued entries (simulated ms), None when empty."""
        return self._deadlines.earliest_ms(self._entries)

    # ------------------------------------------------------------------ order of service

    def _backlogged_min(self, band: int) -> float | None:
        values = [t.counter for t in self._tenants.values() if t.waiting and t.share.band == band]
        return min(values) if values else None

    def ordered(self, now_ms: float | None = None) -> Iterator[WaitingRequest]:
        """Entries in dispatch order, as if each were served in turn (charged its dispatch cost).

        ``now_ms`` (router clock, simulated ms) turns on aging (module docstring, "Aging"): a
        tenant of a less urgent band with an entry whose ``promote_at_ms <= now_ms`` counts a
        min_share of at least ``aging_floor_share``. None = no aging.

        A snapshot: removing entries while iterating is safe. Lazy: each step costs
        O(bands + backlogged tenants), so a dispatcher that stops after a few pays for a few
        (plus one O(entries) walk to build the heads).
        """
        heads: dict[str, list[tuple[float, int, WaitingRequest]]] = {}
        aged: set[str] = set()
        for name, t in self._tenants.items():
            if t.waiting:
                live = [item for item in t.heap if item[2] in self._entries]
                heapq.heapify(live)
                heads[name] = live
                if now_ms is not None and any(item[2].promote_at_ms <= now_ms for item in live):
                    aged.add(name)
        self._aged = aged
        counters = {name: self._tenants[name].counter for name in heads}
        served = dict(self._band_served)
        waiting: dict[int, int] = {}
        for name, items in heads.items():
            b = self._tenants[name].share.band
            waiting[b] = waiting.get(b, 0) + len(items)
        while heads:
            bands = sorted(waiting)
            band = self._pick_band(bands, served, heads)
            best: tuple[float, int, str] | None = None
            for name, items in heads.items():
                if self._tenants[name].share.band != band:
                    continue
                key = (counters[name], items[0][1], name)
                if best is None or key < best:
                    best = key
            assert best is not None
            name = best[2]
            _, _, entry = heapq.heappop(heads[name])
            if not heads[name]:
                del heads[name]
            share = self._tenants[name].share
            cost = self.entry_cost(entry)
            counters[name] += cost / share.weight
            if len(bands) >= 2:
                served[band] = served.get(band, 0.0) + cost
            waiting[band] -= 1
            if waiting[band] == 0:
                del waiting[band]
                if len(waiting) < 2:
                    served.clear()
            yield entry

    def _pick_band(
        self, bands: list[int], served: Mapping[int, float], heads: Mapping[str, list[object]]
    ) -> int:
        """The most urgent band still under its cap ``1 - reserve(bands below)``: per less urgent band,
        the sum of its backlogged tenants' min_share, raised to ``aging_floor_share`` while one of
        them has an aged entry (module docstring, "Aging")."""
        for i, band in enumerate(bands):
            if i == len(bands) - 1:
                return band
            per_band: dict[int, float] = {}
            aged_bands: set[int] = set()
            for name in heads:
                b = self._tenants[name].share.band
                if b > band:
                    per_band[b] = per_band.get(b, 0.0) + self._tenants[name].share.min_share
                    if name in self._aged:
                        aged_bands.add(b)
            reserve = sum(max(v, self.aging_floor_share) if b in aged_bands else v for b, v in per_band.items())
            cap = max(0.0, 1.0 - reserve)
            total = sum(served.get(b, 0.0) for b in bands[i:])
            if served.get(band, 0.0) <= cap * total + _EPS:
                return band
        return bands[-1]
