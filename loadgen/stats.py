"""Latency figures, SLO attainment and goodput of a replay (pure: records in, figures out).

Definitions (docs/design.md section 2), all times in simulated ms:

- TTFT = first-token time - arrival (send) time.
- TPOT = (last-token time - first-token time) / (output tokens - 1); undefined for 1 token.
- ITL  = gaps between consecutive token timestamps of one request (one timestamp per
  content-bearing stream chunk).
- SLO attainment = share of ALL requests (rejected and failed count as misses) that completed
  with TTFT <= their tenant's ``ttft_ms`` and TPOT <= ``tpot_ms`` (a 1-token request has no TPOT
  and meets that half).
- goodput_rps = SLO-meeting requests / duration (simulated s); goodput_tokens_per_s = output
  tokens of SLO-meeting requests / duration.

Percentiles are numpy's ``linear`` method; an empty sample gives ``None``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

OK = "ok"
REJECTED = "rejected"
FAILED = "failed"


@dataclass(frozen=True, slots=True)
class Slo:
    """Latency targets of an SLO class (simulated ms)."""

    ttft_ms: float
    tpot_ms: float


@dataclass(slots=True)
class RequestRecord:
    """What one replayed request did.

    Attributes:
        tenant: tenant the request was sent as.
        arrival_ms: time the request was sent (simulated ms since the replay start).
        prompt_tokens: prompt length (tokens; the server's ``usage`` when it reported one).
        output_tokens: output tokens received (``usage.completion_tokens`` when reported, else
            the count of content-bearing chunks).
        token_times_ms: one timestamp per content-bearing chunk (simulated ms, same origin as
            ``arrival_ms``); empty when no token arrived.
        outcome: ``ok`` | ``rejected`` (HTTP 429) | ``failed`` (any other error).
        reason: for ``rejected`` the ``x-fairbatch-reason`` (or ``unknown``), for ``failed`` a
            short error label (``http-500``, ``timeout``, ``sse-error``, ...); None when ok.
        replica: the ``x-fairbatch-replica`` response header, if any.
        expected_output_tokens: output tokens asked for (``max_tokens``).
        send_lag_ms: how late the request was sent versus its scheduled arrival (simulated ms).
    """

    tenant: str
    arrival_ms: float
    prompt_tokens: int
    output_tokens: int
    token_times_ms: list[float] = field(default_factory=list)
    outcome: str = OK
    reason: str | None = None
    replica: str | None = None
    expected_output_tokens: int = 0
    send_lag_ms: float = 0.0

    @property
    def ttft_ms(self) -> float | None:
        """First-token time - arrival (ms), None without tokens."""
        return self.token_times_ms[0] - self.arrival_ms if self.token_times_ms else None

    @property
    def tpot_ms(self) -> float | None:
        """(last - first token time) / (output tokens - 1) (ms), None below 2 tokens."""
        if len(self.token_times_ms) < 1 or self.output_tokens < 2:
            return None
        return (self.token_times_ms[-1] - self.token_times_ms[0]) / (self.output_tokens - 1)

    def itl_ms(self) -> np.ndarray:
        """Gaps between consecutive token timestamps (ms)."""
        if len(self.token_times_ms) < 2:
            return np.empty(0)
        return np.diff(np.asarray(self.token_times_ms, dtype=float))


@dataclass(frozen=True, slots=True)
class LatencySummary:
    """p50/p95/p99/mean of a latency sample (ms); all None for an empty sample."""

    p50: float | None
    p95: float | None
    p99: float | None
    mean: float | None
    count: int


@dataclass(slots=True)
class Figures:
    """The figures of one set of requests (all, or one tenant's).

    Attributes:
        requests_total: requests in the set (= completed + sum(rejected) + failed).
        completed: requests with outcome ``ok``.
        rejected: reason -> count of 429 answers.
        failed: requests with outcome ``failed``.
        failed_reasons: error label -> count.
        ttft_ms, tpot_ms, itl_ms, e2e_ms: latency summaries over completed requests (ms).
        slo_attainment: share of all requests meeting their SLO (0..1; None for an empty set).
        slo_met: number of requests meeting their SLO.
        goodput_rps: SLO-meeting requests per simulated second.
        goodput_tokens_per_s: output tokens of SLO-meeting requests per simulated second.
        throughput_rps: completed requests per simulated second.
        output_tokens_per_s: output tokens of completed requests per simulated second.
        per_replica_requests: ``x-fairbatch-replica`` -> requests placed there.
    """

    requests_total: int
    completed: int
    rejected: dict[str, int]
    failed: int
    failed_reasons: dict[str, int]
    ttft_ms: LatencySummary
    tpot_ms: LatencySummary
    itl_ms: LatencySummary
    e2e_ms: LatencySummary
    slo_attainment: float | None
    slo_met: int
    goodput_rps: float
    goodput_tokens_per_s: float
    throughput_rps: float
    output_tokens_per_s: float
    per_replica_requests: dict[str, int]


def summarize(sample: Iterable[float] | np.ndarray) -> LatencySummary:
    """p50, p95, p99 (numpy ``linear``) and mean of ``sample``."""
    arr = np.asarray(sample if isinstance(sample, np.ndarray) else list(sample), dtype=float)
    if arr.size == 0:
        return LatencySummary(None, None, None, None, 0)
    p50, p95, p99 = np.percentile(arr, [50, 95, 99], method="linear")
    return LatencySummary(float(p50), float(p95), float(p99), float(arr.mean()), int(arr.size))


def meets_slo(rec: RequestRecord, slo: Slo) -> bool:
    """Completed with TTFT <= slo.ttft_ms and (TPOT undefined or TPOT <= slo.tpot_ms)."""
    if rec.outcome != OK:
        return False
    ttft = rec.ttft_ms
    if ttft is None or ttft > slo.ttft_ms:
        return False
    tpot = rec.tpot_ms
    return tpot is None or tpot <= slo.tpot_ms


def figures(records: list[RequestRecord], slos: Mapping[str, Slo], duration_s: float) -> Figures:
    """Figures over ``records``.

    Args:
        records: the requests.
        slos: tenant -> its SLO targets.
        duration_s: length of the measurement (simulated s), the denominator of the rates.

    Raises:
        KeyError: if a record's tenant has no SLO in ``slos``.
        ValueError: if ``duration_s`` is not positive.
    """
    if not duration_s > 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    ok = [r for r in records if r.outcome == OK]
    rejected = Counter(r.reason or "unknown" for r in records if r.outcome == REJECTED)
    failed = [r for r in records if r.outcome == FAILED]
    met = [r for r in records if meets_slo(r, slos[r.tenant])]
    itl_parts = [r.itl_ms() for r in ok]
    itl = np.concatenate(itl_parts) if itl_parts else np.empty(0)
    replicas = Counter(r.replica for r in records if r.replica)
    n = len(records)
    return Figures(
        requests_total=n,
        completed=len(ok),
        rejected=dict(sorted(rejected.items())),
        failed=len(failed),
        failed_reasons=dict(sorted(Counter(r.reason or "unknown" for r in failed).items())),
        ttft_ms=summarize(t for r in ok if (t := r.ttft_ms) is not None),
        tpot_ms=summarize(t for r in ok if (t := r.tpot_ms) is not None),
        itl_ms=summarize(itl),
        e2e_ms=summarize(r.token_times_ms[-1] - r.arrival_ms for r in ok if r.token_times_ms),
        slo_attainment=len(met) / n if n else None,
        slo_met=len(met),
        goodput_rps=len(met) / duration_s,
        goodput_tokens_per_s=sum(r.output_tokens for r in met) / duration_s,
        throughput_rps=len(ok) / duration_s,
        output_tokens_per_s=sum(r.output_tokens for r in ok) / duration_s,
        per_replica_requests=dict(sorted(replicas.items())),
    )


def per_tenant(records: list[RequestRecord], slos: Mapping[str, Slo], duration_s: float) -> dict[str, Figures]:
    """:func:`figures` per tenant (tenant names sorted)."""
    by_tenant: dict[str, list[RequestRecord]] = {}
    for r in records:
        by_tenant.setdefault(r.tenant, []).append(r)
    return {t: figures(by_tenant[t], slos, duration_s) for t in sorted(by_tenant)}
