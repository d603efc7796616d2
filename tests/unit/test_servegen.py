"""loadgen.servegen: the quantile law, IAT rescaling, seeding, and the embedded servegen-m-large trace."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from loadgen import servegen as sg
from loadgen.traces import TraceFormatError, TraceRequest, load_trace, resolve_trace, select, spread_arrivals

# knots: q0 = p10 - (p50 - p10) / 4 = 10 - 2.5 = 7.5, then 10, 20, 60, 100, 200 at u = 0, .1, .5, .9, .99, 1
# A = sum du * q_a = .1*7.5 + .4*10 + .4*20 + .09*60 + .01*100 = 19.15
# S = sum du * (q_b - q_a) = .1*2.5 + .4*10 + .4*40 + .09*40 + .01*100 = 24.85
# law mean = A + S / (k + 1): k = 1 -> 31.575, k = 3 -> 25.3625
LINEAR = sg.LengthStats(mean=31.575, p10=10, p50=20, p90=60, p99=100, max=200)
CUBIC = sg.LengthStats(mean=25.3625, p10=10, p50=20, p90=60, p99=100, max=200)
KNOT_U = [0.0, 0.1, 0.5, 0.9, 0.99, 1.0]
KNOT_Q = [7.5, 10.0, 20.0, 60.0, 100.0, 200.0]


def test_inverse_cdf_hits_the_knots() -> None:
    for stats in (LINEAR, CUBIC):
        assert sg.inverse_cdf(stats, np.array(KNOT_U)) == pytest.approx(KNOT_Q)
    assert list(sg.sample_lengths(CUBIC, np.array(KNOT_U))) == [8, 10, 20, 60, 100, 200]  # 7.5 rounds to even


def test_inverse_cdf_between_the_knots() -> None:
    assert LINEAR.exponent() == pytest.approx(1.0)
    assert CUBIC.exponent() == pytest.approx(3.0)
    # u = 0.3: t = (0.3 - 0.1) / 0.4 = 0.5 in the band 10..20; u = 0.995: t = 0.5 in the band 100..200
    u = np.array([0.05, 0.3, 0.7, 0.995])
    assert sg.inverse_cdf(LINEAR, u) == pytest.approx([8.75, 15.0, 40.0, 150.0])
    # k = 3: q_a + (q_b - q_a) * 0.5**3 = q_a + (q_b - q_a) / 8
    assert sg.inverse_cdf(CUBIC, u) == pytest.approx([7.5 + 2.5 / 8, 11.25, 25.0, 112.5])
    assert CUBIC.law_mean() == pytest.approx(25.3625)


def test_law_mean_is_the_sampled_mean() -> None:
    u = np.random.default_rng(3).random(200_000)
    x = sg.inverse_cdf(CUBIC, u)
    # 4 standard errors of the sample mean
    assert abs(x.mean() - 25.3625) < 4 * x.std() / np.sqrt(x.size)


def test_knot_edge_cases() -> None:
    # q0 clamped to [min(1, p10), p10]: 2 - (30 - 2) / 4 = -5 -> 1
    assert sg.LengthStats(10, 2, 30, 40, 50, 60).knots()[0] == 1.0
    # all knots equal: a constant, exponent 1
    flat = sg.LengthStats(100, 100, 100, 100, 100, 100)
    assert flat.exponent() == 1.0 and list(sg.sample_lengths(flat, np.array([0.0, 0.5, 1.0]))) == [100] * 3
    # a mean below every band's lower knot cannot be met: the exponent is clamped
    assert sg.LengthStats(5, 10, 20, 60, 100, 200).exponent() == sg.EXPONENT_MAX


def test_window_arrivals_rescale_the_drawn_gaps_to_the_window() -> None:
    # r W = 0.005 * 600 = 3 exactly: the extra request's coin (one uniform) never fires, n = 3,
    # 4 gamma gaps, arrivals = first 3 partial sums times 600 / (sum of the 4)
    win = sg.RateWindow(7, 0.0, 0.005, "Gamma", 0.4, 2.5)
    got = sg.window_arrivals(win, 0.005, np.random.default_rng(5))
    ref = np.random.default_rng(5)
    ref.random()
    gaps = ref.gamma(0.4, 2.5, 4)
    assert got == pytest.approx(np.cumsum(gaps[:3]) * 600.0 / gaps.sum())
    # the law's scale cancels in the rescaling: Weibull at scale 1 and 1000 give the same arrivals
    w1 = sg.RateWindow(7, 0.0, 0.5, "Weibull", 0.3, 1.0)
    w2 = sg.RateWindow(7, 0.0, 0.5, "Weibull", 0.3, 1000.0)
    a1 = sg.window_arrivals(w1, 0.5, np.random.default_rng(1))
    a2 = sg.window_arrivals(w2, 0.5, np.random.default_rng(1))
    assert a1.size == 300 and a2 == pytest.approx(a1)
    assert np.all(np.diff(a1) >= 0) and 0 <= a1[0] and a1[-1] < 600.0
    assert sg.window_arrivals(sg.RateWindow(7, 0.0, 0.0, "", 0.0, 0.0), 1.0, np.random.default_rng(0)).size == 0


def test_window_rate_holds_in_expectation() -> None:
    # r W = 0.0125 * 600 = 7.5: every window has 7 or 8 requests, 8 with probability 0.5, so over 4000
    # windows the mean count has standard error sqrt(0.25 / 4000) = 0.0079; 4 of them = 0.032
    win = sg.RateWindow(1, 0.0, 0.0125, "Gamma", 0.2, 50.0)
    rng = np.random.default_rng(11)
    counts = np.array([sg.window_arrivals(win, 0.0125, rng).size for _ in range(4000)])
    assert set(counts) == {7, 8}
    assert abs(counts.mean() - 7.5) < 0.032


def test_window_keeps_the_laws_burstiness() -> None:
    # Gamma shape 0.25: IAT CV = 1 / sqrt(0.25) = 2. 6000 gaps; the CV estimate's relative standard error
    # is about sqrt((excess kurtosis 6 / 0.25 + 2) / n) / 2 = 0.033, so 15 % is 4.5 of them
    win = sg.RateWindow(1, 0.0, 10.0, "Gamma", 0.25, 1.0)
    a = sg.window_arrivals(win, 10.0, np.random.default_rng(2))
    gaps = np.diff(a)
    assert a.size == 6000
    assert gaps.std() / gaps.mean() == pytest.approx(2.0, rel=0.15)


def _table() -> tuple[list[sg.RateWindow], dict[tuple[int, float, str], sg.LengthStats]]:
    rates = [sg.RateWindow(c, float(t), r, "Gamma", 0.5, 1.0) for c, r in ((1, 0.3), (2, 0.1), (3, 0.2)) for t in (0, 600)]
    const = {1: 100.0, 2: 500.0}  # client 3 has no length statistics
    lengths = {(c, 0.0, f): sg.LengthStats(*[v] * 6) for c, v in const.items() for f in ("input_tokens", "output_tokens")}
    return rates, lengths


def test_synthesize_is_seeded_and_pools_lengths_for_clients_without_them() -> None:
    rates, lengths = _table()
    a = sg.synthesize(rates, lengths, start_s=0, end_s=1200, seed=4)
    assert a == sg.synthesize(rates, lengths, start_s=0, end_s=1200, seed=4)
    assert a != sg.synthesize(rates, lengths, start_s=0, end_s=1200, seed=5)
    n = Counter(r.client_id for r in a)
    # 2 windows of r W = 180, 60, 120 requests each: exact counts
    assert n == {1: 360, 2: 120, 3: 240}
    assert {r.prompt_tokens for r in a if r.client_id == 1} == {100}
    # client 3 draws a donor per request, weighted by the donors' requests: 100 w.p. 360 / 480 = 0.75
    p3 = [r.prompt_tokens for r in a if r.client_id == 3]
    assert set(p3) == {100, 500}
    # binomial(240, 0.75): standard error 0.028; 4 of them
    assert abs(p3.count(100) / 240 - 0.75) < 0.112
    # the window starting at 600 s lies in the length window at 0 (latest start <= 600)
    assert max(r.arrival_s for r in a) < 1200.0 and sorted(a, key=lambda r: (r.arrival_s, r.client_id)) == a
    # the stretch rebases arrivals: [600, 1200) starts at 0
    b = sg.synthesize(rates, lengths, start_s=600, end_s=1200, seed=4)
    assert len(b) == 360 and 0 <= min(r.arrival_s for r in b) and max(r.arrival_s for r in b) < 600
    with pytest.raises(ValueError, match="no rate windows"):
        sg.synthesize(rates, lengths, start_s=1200, end_s=1800)
    with pytest.raises(ValueError, match="no length statistics and no donor"):
        sg.synthesize(rates, {}, start_s=0, end_s=600)


def test_parse_tables_and_errors() -> None:
    rates = sg.parse_rate_windows([",".join(sg.RATE_HEADER), "61,864000,196.8,20.2,Weibull,0.21,0.05", "3,864000,0,0,,0,0"])
    assert rates[0] == sg.RateWindow(61, 864000.0, 196.8, "Weibull", 0.21, 0.05)
    assert rates[1].iat_dist == "" and rates[1].rate_rps == 0.0
    lengths = sg.parse_length_windows([",".join(sg.LENGTH_HEADER), "0,864000,input_tokens,406.588,231,263,307,4547,4658"])
    assert lengths[(0, 864000.0, "input_tokens")] == sg.LengthStats(406.588, 231, 263, 307, 4547, 4658)
    with pytest.raises(sg.ServeGenFormatError, match="header"):
        sg.parse_rate_windows(["a,b"])
    with pytest.raises(sg.ServeGenFormatError, match="line 2: iat_dist"):
        sg.parse_rate_windows([",".join(sg.RATE_HEADER), "1,0,1,1,Pareto,1,1"])
    with pytest.raises(sg.ServeGenFormatError, match="line 2: quantiles"):
        sg.parse_length_windows([",".join(sg.LENGTH_HEADER), "0,0,input_tokens,5,9,8,10,11,12"])


def test_peak_to_mean() -> None:
    # bins of 10 s over 20 s: counts [3, 1]; peak 0.3 req/s over mean 4 / 20 = 0.2 -> 1.5
    assert sg.peak_to_mean([0.0, 1.0, 2.0, 15.0], 10.0, 20.0) == pytest.approx(1.5)


# the embedded trace: language/m-large, rate windows starting 864000..867000 s, thinned x 0.015

SPEC = json.loads(resolve_trace("servegen-m-large").read_text())


def _stats() -> tuple[list[sg.RateWindow], dict[tuple[int, float, str], sg.LengthStats]]:
    folder = resolve_trace("servegen-m-large").parent
    rates = sg.parse_rate_windows((folder / SPEC["rate_windows"]).read_text().splitlines())
    lengths = sg.parse_length_windows((folder / SPEC["length_windows"]).read_text().splitlines())
    return rates, lengths


def test_servegen_m_large_shape() -> None:
    reqs = load_trace(resolve_trace("servegen-m-large"))
    assert reqs == load_trace(resolve_trace("servegen-m-large"))  # seeded
    rates, lengths = _stats()
    expected = sg.expected_requests(rates, SPEC["start_s"], SPEC["end_s"], SPEC["rate_scale"])
    windows = Counter(w.client_id for w in rates if w.iat_dist)
    # sum of r W x 0.015 over 354 client windows = 10,887.96; each window gives floor or ceil of its share
    assert sum(expected.values()) == pytest.approx(10_887.96)
    n = Counter(r.tenant for r in reqs)
    for c, e in expected.items():  # per client: within one request per window of its expected count
        assert abs(n.get(f"c{c}", 0) - e) <= windows[c]
    assert abs(len(reqs) - 10_888) <= 50
    span_s = reqs[-1].arrival_ms / 1000.0
    assert 3590.0 < span_s < 3600.0 and reqs[0].arrival_ms == 0.0
    # client 61 (48 % of the requests), prompts p50 479, p90 557: rounded to tokens, a prompt is <= 479 when
    # Q(u) < 479.5, i.e. u < u* = 0.5 + 0.4 * (0.5 / (557 - 479)) ** (1 / k); binomial standard error
    # over ~5200 requests <= 0.007, 4 of them
    s61 = lengths[(61, 864000.0, "input_tokens")]
    assert (s61.p50, s61.p90) == (479, 557)
    u_star = 0.5 + 0.4 * (0.5 / 78) ** (1 / s61.exponent())
    p61 = [r.prompt_tokens for r in reqs if r.tenant == "c61"]
    assert abs(sum(p <= 479 for p in p61) / len(p61) - u_star) < 0.028
    # and < 479 when Q(u) < 478.5, in the band 464..479 below p50: u < 0.1 + 0.4 * (14.5 / 15) ** (1 / k)
    u_low = 0.1 + 0.4 * (14.5 / 15) ** (1 / s61.exponent())
    assert abs(sum(p < 479 for p in p61) / len(p61) - u_low) < 0.028
    # the mean prompt over clients with statistics matches the request-weighted published means
    have = [c for c in expected if (c, 864000.0, "input_tokens") in lengths]
    want = sum(expected[c] * lengths[(c, 864000.0, "input_tokens")].mean for c in have) / sum(expected[c] for c in have)
    got = np.array([r.prompt_tokens for r in reqs if int(r.tenant[1:]) in have], dtype=float)
    assert abs(got.mean() - want) < 4 * got.std() / np.sqrt(got.size)
    # bursts: the first 10 minutes run at 1.8x the hour's mean (345.3 of 201.6 req/s before thinning)
    arrivals = [r.arrival_ms / 1000.0 for r in reqs]
    assert sg.peak_to_mean(arrivals, 600.0, 3600.0) == pytest.approx(1.8, abs=0.05)
    assert sg.peak_to_mean(arrivals, 10.0, 3600.0) > 3.0


def test_tenant_survives_windowing_and_spreading() -> None:
    reqs = [TraceRequest(0.0, 1, 1, (), "c1"), TraceRequest(1000.0, 2, 2, (), "c2")]
    assert [r.tenant for r in select(reqs, 10.0, 2.0)] == ["c1", "c2"]
    assert sorted(r.tenant for r in spread_arrivals(reqs, 100.0)) == ["c1", "c2"]


def test_bad_servegen_spec(tmp_path: Path) -> None:
    spec = tmp_path / "s.json"
    spec.write_text(json.dumps({"format": "servegen-stats", "rate_windows": "r.csv"}))
    with pytest.raises(TraceFormatError, match="bad ServeGen spec"):
        load_trace(spec)
    (tmp_path / "r.csv").write_text("nope\n")
    (tmp_path / "l.csv").write_text(",".join(sg.LENGTH_HEADER) + "\n")
    spec.write_text(json.dumps({"format": "servegen-stats", "rate_windows": "r.csv", "length_windows": "l.csv",
                                "start_s": 0, "end_s": 600}))  # fmt: skip
    with pytest.raises(TraceFormatError, match="header"):
        load_trace(spec)


@pytest.mark.timeout(480)  # CPU-bound (a 2-replica simulation of a ServeGen hour's busiest window): beside a
# parallel make test on 2 cores it ran past the default 120 s
def test_bench_fleet_runs_on_servegen(tmp_path: Path) -> None:
    from loadgen.fleet.bench import main as bench_main, trace_rows

    kept, native, n = trace_rows("servegen-m-large", 0.0, 0)
    assert len(kept) == n and native == pytest.approx(3.02, abs=0.05)
    out = tmp_path / "fleet.json"
    assert bench_main(["--trace", "servegen-m-large", "--replicas", "2", "--duration-s", "20", "--drain-s", "20",
                       "--policies", "round-robin", "--rates", "4", "--out", str(out)]) == 0  # fmt: skip
    rows = json.loads(out.read_text())["policies"]["round-robin"]["rows"]
    assert rows[0]["requests"] > 50 and 0.0 <= rows[0]["slo_attainment"] <= 1.0
