"""loadgen.stats: hand-worked percentiles, TTFT/TPOT/ITL, SLO attainment and goodput."""

from __future__ import annotations

import pytest

from loadgen.stats import FAILED, OK, REJECTED, RequestRecord, Slo, figures, meets_slo, per_tenant, summarize

SLO = Slo(ttft_ms=200.0, tpot_ms=20.0)


def rec(times: list[float], n_out: int | None = None, arrival: float = 0.0, tenant: str = "acme",
        outcome: str = OK, reason: str | None = None, replica: str | None = None) -> RequestRecord:
    return RequestRecord(tenant, arrival, 100, len(times) if n_out is None else n_out, list(times), outcome, reason,
                         replica)


def test_percentiles_linear() -> None:
    s = summarize([4.0, 1.0, 3.0, 2.0])
    # sorted 1,2,3,4: rank p*(n-1): p50 -> 1.5 -> 2.5; p95 -> 2.85 -> 3.85; p99 -> 2.97 -> 3.97
    assert (s.p50, s.p95, s.p99, s.mean, s.count) == pytest.approx((2.5, 3.85, 3.97, 2.5, 4))
    one = summarize([7.0])
    assert (one.p50, one.p99, one.mean) == (7.0, 7.0, 7.0)
    empty = summarize([])
    assert (empty.p50, empty.p95, empty.p99, empty.mean, empty.count) == (None, None, None, None, 0)


def test_ttft_tpot_itl() -> None:
    r = rec([100.0, 110.0, 130.0, 160.0], arrival=0.0)
    assert r.ttft_ms == 100.0
    assert r.tpot_ms == pytest.approx(20.0)  # (160 - 100) / 3
    assert list(r.itl_ms()) == [10.0, 20.0, 30.0]
    # usage says 7 tokens in 4 chunks: TPOT uses the token count
    assert rec([100.0, 110.0, 130.0, 160.0], n_out=7).tpot_ms == pytest.approx(10.0)
    single = rec([50.0], arrival=10.0)
    assert single.ttft_ms == 40.0 and single.tpot_ms is None and single.itl_ms().size == 0
    assert rec([]).ttft_ms is None


def test_meets_slo() -> None:
    assert meets_slo(rec([200.0, 220.0, 240.0]), SLO)  # equal to the targets meets them
    assert not meets_slo(rec([201.0, 210.0]), SLO)  # TTFT miss
    assert not meets_slo(rec([100.0, 121.0]), SLO)  # TPOT miss
    assert meets_slo(rec([150.0]), SLO)  # one token: no TPOT
    assert not meets_slo(rec([100.0, 110.0], outcome=FAILED, reason="timeout"), SLO)
    assert not meets_slo(rec([], outcome=REJECTED, reason="queue-full"), SLO)


def test_figures_attainment_counts_rejected_and_failed_as_misses() -> None:
    records = [
        rec([100.0, 110.0, 120.0], replica="r0"),                 # meets, 3 tokens, TTFT 100, TPOT 10
        rec([300.0, 310.0], replica="r1"),                        # TTFT miss
        rec([1100.0, 1150.0], arrival=1000.0, replica="r0"),      # TPOT 50 miss, TTFT 100
        rec([], outcome=REJECTED, reason="queue-full"),
        rec([], outcome=REJECTED, reason=None),
        rec([500.0], outcome=FAILED, reason="http-500", replica="r1"),
    ]
    f = figures(records, {"acme": SLO}, duration_s=2.0)
    assert f.requests_total == 6
    assert f.completed == 3
    assert f.rejected == {"queue-full": 1, "unknown": 1}
    assert f.failed == 1 and f.failed_reasons == {"http-500": 1}
    assert f.completed + sum(f.rejected.values()) + f.failed == f.requests_total
    assert f.slo_met == 1
    assert f.slo_attainment == pytest.approx(1 / 6)
    assert f.goodput_rps == pytest.approx(0.5)
    assert f.goodput_tokens_per_s == pytest.approx(1.5)  # 3 tokens / 2 s
    assert f.throughput_rps == pytest.approx(1.5)
    assert f.output_tokens_per_s == pytest.approx(3.5)  # (3 + 2 + 2) / 2
    # TTFT over completed only: 100, 300, 100
    assert f.ttft_ms.p50 == 100.0 and f.ttft_ms.mean == pytest.approx(500 / 3)
    # TPOT: 10, 10, 50 ; ITL gaps: 10, 10, 10, 50
    assert f.tpot_ms.p50 == pytest.approx(10.0) and f.tpot_ms.mean == pytest.approx(70 / 3)
    assert f.itl_ms.count == 4 and f.itl_ms.p50 == pytest.approx(10.0) and f.itl_ms.mean == pytest.approx(20.0)
    assert f.e2e_ms.p50 == pytest.approx(150.0)  # 120, 310, 150
    assert f.per_replica_requests == {"r0": 2, "r1": 2}


def test_per_tenant_uses_each_tenants_slo() -> None:
    slos = {"acme": SLO, "beta": Slo(ttft_ms=400.0, tpot_ms=20.0)}
    records = [rec([300.0, 310.0], tenant="acme"), rec([300.0, 310.0], tenant="beta"),
               rec([], tenant="beta", outcome=REJECTED, reason="tenant-rate")]
    pt = per_tenant(records, slos, duration_s=1.0)
    assert list(pt) == ["acme", "beta"]
    assert pt["acme"].slo_attainment == 0.0
    assert pt["beta"].slo_attainment == pytest.approx(0.5)
    assert pt["beta"].rejected == {"tenant-rate": 1}
    assert figures(records, slos, 1.0).slo_attainment == pytest.approx(1 / 3)


def test_figures_errors_and_empty() -> None:
    with pytest.raises(ValueError):
        figures([], {}, 0.0)
    with pytest.raises(KeyError):
        figures([rec([1.0], tenant="ghost")], {"acme": SLO}, 1.0)
    f = figures([], {}, 1.0)
    assert f.requests_total == 0 and f.slo_attainment is None and f.ttft_ms.p50 is None
