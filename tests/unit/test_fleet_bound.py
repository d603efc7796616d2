"""Steady-state bound that lets the costliest 10 % miss (loadgen/fleet/bound.py), worked by hand.

Engine model in every case: a = 10, b = 0.1, c = 0, d = 0, e = 0.001, f = 0.002 ms (no noise), so
g = f - e/2 = 0.0015 and a prefill of P tokens in K chunks costs b P + e P^2/2 + g P^2/K ms; a decode
reading context x costs b + f + e x = 0.102 + 0.001 x ms. TTFT 100 ms, TPOT 50 ms.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from loadgen.fleet.bound import (
    WorkModel,
    cheapest_cover,
    interval_attainment_bound,
    pooled_interval_attainment_bound,
    request_work_ms,
    shared_prefix_tokens,
    steady_state_bound,
    windowed_attainment_bound,
)
from loadgen.sim.engine_time import EngineTimeModel
from replica_agent.policy.time_model import TimeModel

M = EngineTimeModel(a_ms=10.0, b_ms=0.1, e_ms=0.001, f_ms=0.002)
BIG = 10**12  # KV, sequences: never binding here
D_MS = 8.0  # the brute-force cases: cost per sequence in a step (ms)


def test_request_work_hand_worked() -> None:
    # T = 50: K <= floor(100 / 50) = 2 chunks.
    # A (P 100, O 11): prefill K = 2: 0.1*100 (10) + 0.001*100^2/2 (5) + 0.0015*100^2/2 (7.5) = 22.5;
    #   10 decodes: 10 * 0.102 (1.02) + 0.001 * (10*100 + 10*9/2 = 1045) (1.045) -> W = 24.565
    # B (P 1000, O 1): 100 + 500 + 0.0015 * 10^6 / 2 (750) = 1350
    w = request_work_ms(np.array([100, 1000]), np.array([11, 1]), M, 50.0, 100.0, 10_000)
    assert w == pytest.approx([24.565, 1350.0])
    # T = 25: K <= 4: A's prefill 10 + 5 + 15/4 (3.75) = 18.75 -> 20.815; B: 100 + 500 + 375 = 975
    w = request_work_ms(np.array([100, 1000]), np.array([11, 1]), M, 25.0, 100.0, 10_000)
    assert w == pytest.approx([20.815, 975.0])
    # 400 tokens per step at most: B needs K >= ceil(1000 / 400) = 3 > 2 allowed at T = 50 -> cannot meet TTFT
    w = request_work_ms(np.array([100, 1000]), np.array([11, 1]), M, 50.0, 100.0, 400)
    assert w[0] == pytest.approx(24.565) and math.isinf(w[1])


def test_bound_lets_the_costliest_tenth_miss() -> None:
    p, o = [100] * 9 + [1000], [11] * 9 + [1]
    # q = 0.9: ceil(0.9 * 10) = 9 served, the 9 A's. T = 50: 1000 (1 - 10/50) = 800 GPU-ms/s for work;
    # served work per request of the trace = 9 * 24.565 / 10 = 22.1085 -> 800 / 22.1085 = 36.1851 req/s per replica.
    # T = 25: 600 / (9 * 20.815 / 10 = 18.7335) = 32.0282: T = 50 is the better step length.
    b = steady_state_bound(p, o, M, 100.0, 50.0, 2, BIG, BIG, 10_000, 0.9, steps_ms=[25.0, 50.0])
    assert b.per_replica_rps == pytest.approx(800 / 22.1085)
    assert b.rps == pytest.approx(2 * 800 / 22.1085)  # 72.370 for 2 replicas
    assert (b.iteration_ms, b.limit, b.infeasible) == (50.0, "time", 0)
    assert b.mean_work_ms == pytest.approx(24.565)
    # q = 1 charges B too: (9 * 24.565 + 1350) / 10 = 157.1085 -> 800 / 157.1085 = 5.0920 at T = 50;
    # T = 25: 600 / ((9 * 20.815 + 975) / 10 = 116.2335) = 5.1620: with B served, shorter steps win.
    b1 = steady_state_bound(p, o, M, 100.0, 50.0, 2, BIG, BIG, 10_000, 1.0, steps_ms=[25.0, 50.0])
    assert b1.per_replica_rps == pytest.approx(600 / 116.2335) and b1.iteration_ms == 25.0


def test_cheapest_cover_by_hand() -> None:
    cost, weight = np.array([4.0, 1.0, 3.0]), np.array([2.0, 1.0, 1.0])
    # cost per weight 2, 1, 3: item 1 first, then item 0. q = 0.75 of 4 = 3: items 1 and 0 whole -> 5
    assert cheapest_cover(cost, weight, 0.75) == pytest.approx((5.0, 2.0))
    # q = 0.5 of 4 = 2: item 1 (weight 1) and half of item 0 (1 of its 2) -> 1 + 2 = 3, 1.5 items
    assert cheapest_cover(cost, weight, 0.5) == pytest.approx((3.0, 1.5))
    # an item that cannot be served (inf) costs inf only when the cover needs it
    assert cheapest_cover(np.array([math.inf, 1.0]), np.array([1.0, 1.0]), 0.5) == pytest.approx((1.0, 1.0))
    assert cheapest_cover(np.array([math.inf, 1.0]), np.array([1.0, 1.0]), 1.0)[0] == math.inf


def test_token_floor_bound_must_serve_most_of_the_long_prompt() -> None:
    p, o = [100] * 9 + [1000], [11] * 9 + [1]
    # tokens: nine A's of 111 (999) and B's 1001, 2000 in all; the floor needs 1800. Per token A is
    # cheaper (T = 50: 24.565 / 111 against 1350 / 1001), so all A's and 801 / 1001 of B are served.
    # T = 50: 9 * 24.565 + 0.8002 * 1350 = 1301.355 per 10 requests -> 800 / 130.1355 = 6.1474;
    # T = 25: 9 * 20.815 + 0.8002 * 975 = 967.530 -> 600 / 96.7530 = 6.2014: T = 25 wins.
    frac = 801 / 1001
    work25 = 9 * 20.815 + frac * 975
    b = steady_state_bound(p, o, M, 100.0, 50.0, 2, BIG, BIG, 10_000, 0.9, steps_ms=[25.0, 50.0], served_by="tokens")
    assert b.per_replica_rps == pytest.approx(600 / (work25 / 10))
    assert (b.iteration_ms, b.limit, b.served_by) == (25.0, "time", "tokens")
    assert b.mean_work_ms == pytest.approx(work25 / (9 + frac))
    # far below the per-request floor's 36.19 req/s per replica, which may drop B altogether
    assert b.per_replica_rps < steady_state_bound(p, o, M, 100.0, 50.0, 2, BIG, BIG, 10_000, 0.9,
                                                  steps_ms=[25.0, 50.0]).per_replica_rps / 5  # fmt: skip
    with pytest.raises(ValueError):
        steady_state_bound(p, o, M, 100.0, 50.0, 2, BIG, BIG, 10_000, 0.9, served_by="bytes")


def test_bound_ttft_chunk_limit_and_kv_limit() -> None:
    # 8 A's, 2 B's, 400 tokens per step. T = 50: both B's infeasible, only 8 < 9 can be served -> no bound at 50.
    # T = 25: B in K = 4 chunks (>= 3): 975. Served: 8 A's + 1 B = 8 * 20.815 + 975 = 1141.52 -> /10 = 114.152;
    # 600 / 114.152 = 5.25615 per replica.
    p, o = [100] * 8 + [1000] * 2, [11] * 8 + [1] * 2
    b = steady_state_bound(p, o, M, 100.0, 50.0, 1, BIG, BIG, 400, 0.9, steps_ms=[25.0, 50.0])
    assert b.per_replica_rps == pytest.approx(600 / 114.152) and b.iteration_ms == 25.0
    # KV: A holds sum_{j=0}^{10} (100 + j) = 1155 token-steps, B 1000; the 9 smallest: 2 * 1000 + 7 * 1155
    # = 10085 -> /10 = 1008.5. With kv = 100 tokens at T = 25: 1000 * 100 / (1008.5 * 25) = 3.9663 < 5.256
    # (time) -> kv-limited.
    b = steady_state_bound(p, o, M, 100.0, 50.0, 1, 100, BIG, 400, 0.9, steps_ms=[25.0])
    assert b.limit == "kv" and b.per_replica_rps == pytest.approx(1000 * 100 / (1008.5 * 25))


def test_policy_time_model_adaptor_and_errors() -> None:
    # A policy TimeModel: e over prefill chunks only, no f, no noise. TimeModel(a 10, b 0.1, c 0, e 0.001),
    # request (P 100, O 11) at T = 50: g = f - e/2 = -0.0005 < 0, so one chunk is cheapest (no chunk x prefix):
    # prefill 0.1 * 100 (10) + 0.001 * 100^2 / 2 (5) - 0.0005 * 100^2 (5) = 10; decodes 10 * 0.1 = 1, and no e
    # on decodes (c = 0) -> W = 11.
    wm = WorkModel.of(TimeModel(9.86, 0.0727, 7.94e-5))
    assert (wm.a, wm.b, wm.c, wm.d, wm.e, wm.f, wm.e_dec, wm.d_dec, wm.mean_factor) == (
        9.86, 0.0727, 7.94e-5, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0)
    w = request_work_ms(np.array([100]), np.array([11]), TimeModel(10.0, 0.1, 0.0, 0.001), 50.0, 100.0, 10_000)
    assert w == pytest.approx([11.0])
    wn = WorkModel.of(EngineTimeModel(a_ms=1.0, b_ms=0.1, e_ms=0.002, noise_sigma=0.2))
    assert (wn.e, wn.e_dec) == (0.002, 0.002) and wn.mean_factor == pytest.approx(math.exp(0.02))
    with pytest.raises(ValueError):
        steady_state_bound([], [], M, 100.0, 50.0, 1, BIG)
    with pytest.raises(ValueError):
        steady_state_bound([1], [1], M, 100.0, 50.0, 1, BIG, served_frac=0.0)


def test_shared_prefix_tokens_by_hand() -> None:
    # block 512, TTFT 1000 ms. A (1,2,3) P 2000 at 0; B (1,2,9) P 1500 at 500; C (1,2,3,4) P 1800 at 5000;
    # D () P 100; E, F (7,) P 300 at 0.
    ids = [(1, 2, 3), (1, 2, 9), (1, 2, 3, 4), (), (7,), (7,)]
    p = [2000, 1500, 1800, 100, 300, 300]
    t = [0.0, 500.0, 5000.0, 0.0, 0.0, 0.0]
    # A: (1), (1,2) shared with B (500 <= 0 + 1000); (1,2,3) only with C, which arrives at 5000 > 1000: A's
    #    prompt must be computed by 1000, before C exists -> 2 blocks = 1024. B: 2 blocks with A -> 1024.
    # C: 3 blocks with A (an earlier arrival counts) -> 1536. D: nothing. E, F: 1 block each, capped at P - 1 = 299.
    h = shared_prefix_tokens(ids, p, 512, t, 1000.0)
    assert list(h) == [1024, 1024, 1536, 0, 299, 299]
    # without the TTFT window C serves A too: 3 blocks = 1536
    assert list(shared_prefix_tokens(ids, p, 512)) == [1536, 1024, 1536, 0, 299, 299]
    with pytest.raises(ValueError):
        shared_prefix_tokens(ids, p[:2], 512)


def test_cached_prefix_work_by_hand() -> None:
    # P 1000, O 1, 600 tokens cached: U = 400; T = 50 -> K <= 2. In 2 chunks of 200 at prefixes 600 and 800:
    # step 1: b*200 (20) + e*200*600 (120) + f*200^2 (80) = 220; step 2: 20 + e*200*800 (160) + 80 = 260 -> 480.
    # Formula: b U (40) + e (h U + U^2/2) (0.001 * (240000 + 80000) = 320) + g U^2 / K (0.0015 * 160000 / 2 = 120).
    w = request_work_ms(np.array([1000]), np.array([1]), M, 50.0, 100.0, 10_000, np.array([600]))
    assert w == pytest.approx([480.0])
    # ten such requests, q = 0.9: 9 served at 480 -> 800 / (9 * 480 / 10 = 432) per replica at T = 50
    b = steady_state_bound([1000] * 10, [1] * 10, M, 100.0, 50.0, 1, BIG, BIG, 10_000, 0.9, steps_ms=[50.0],
                           cached_tokens=[600] * 10)  # fmt: skip
    assert b.per_replica_rps == pytest.approx(800 / 432)
    with pytest.raises(ValueError):
        request_work_ms(np.array([1000]), np.array([1]), M, 50.0, 100.0, 10_000, np.array([1000]))


def test_windowed_attainment_bound_by_hand() -> None:
    # a = 10, b = 0.1 only; T = 50: the replica does 1 - 10/50 = 0.8 ms of work per ms. Five prompts of 1000
    # tokens (100 ms of work each, output 1) arrive at 0, 10, ..., 40 ms; TTFT 100 ms, counted window [0, 1000).
    m = EngineTimeModel(a_ms=10.0, b_ms=0.1)
    t, p, o = [0.0, 10.0, 20.0, 30.0, 40.0], [1000] * 5, [1] * 5
    # L = 1000: one interval, 0.8 * (1000 + 100) = 880 ms of work -> all 5 fit.
    att, length, _ = windowed_attainment_bound(t, p, o, m, 100.0, 50.0, 1, 0.0, 1000.0, 10_000, windows_ms=[1000.0],
                                               steps_ms=[50.0])  # fmt: skip
    assert (att, length) == (1.0, 1000.0)  # the length that allowed it (every length does), not 0
    # L = 100: all 5 in [0, 100); D = 0: 0.8 * (100 + 100) = 160 ms -> one fits (two need 200); D = 100: 240 ms
    # -> two. The bound is the smaller: 1 of 5. By hand: the second prompt done needs 2 * 100 / 0.8 = 250 ms of
    # the machine from time 0, past every deadline (<= 140 ms), so no schedule meets more than one.
    att, length, step = windowed_attainment_bound(t, p, o, m, 100.0, 50.0, 1, 0.0, 1000.0, 10_000,
                                                  windows_ms=[100.0, 1000.0], steps_ms=[50.0])  # fmt: skip
    assert (att, length, step) == (0.2, 100.0, 50.0)
    # two replicas pooled: 320 ms -> 3 of 5 (D = 0)
    att, _, _ = windowed_attainment_bound(t, p, o, m, 100.0, 50.0, 2, 0.0, 1000.0, 10_000, windows_ms=[100.0],
                                          steps_ms=[50.0])  # fmt: skip
    assert att == pytest.approx(0.6)
    with pytest.raises(ValueError):
        windowed_attainment_bound(t, p, o, m, 100.0, 50.0, 1, 2000.0, 3000.0)


def test_interval_attainment_bound_burst_by_hand() -> None:
    # a = 10, b = 0.1 only, T = 50: one replica does 0.8 ms of work per ms. Six 400-token prompts (40 ms of work
    # each, output 1) at 60, 70, ..., 110 ms; TTFT 100 ms; counted window [0, 1000); grid 10 ms, spans <= 200 ms.
    m = EngineTimeModel(a_ms=10.0, b_ms=0.1)
    t, p, o = [60.0, 70.0, 80.0, 90.0, 100.0, 110.0], [400] * 6, [1] * 6
    # Windowed, L = 100: [0, 100) holds 60..90 (4): 0.8 * (100 + 100) = 160 ms -> all 4 fit; [100, 200) holds 100,
    # 110: 160 ms -> both fit. L = 1000: 0.8 * 1100 = 880 -> all 6. So it allows 1.0.
    att, _, _ = windowed_attainment_bound(t, p, o, m, 100.0, 50.0, 1, 0.0, 1000.0, 10_000,
                                          windows_ms=[100.0, 1000.0], steps_ms=[50.0])  # fmt: skip
    assert att == 1.0
    # Disjoint spans: a span holding a request ends at >= its arrival + 100 > 110, after the last arrival, so one
    # span of a family at most holds any. A span holding k consecutive arrivals from the first, s and e on the
    # grid, has e - s >= 10 (k - 1) + 100, and forces k - floor(0.8 (e - s) / 40) misses: k = 6 in [60, 210]:
    # 120 ms -> 3 fit, 3 miss; k = 5 in [60, 200]: 112 ms -> 2 fit, 3 miss; k = 4 in [60, 190]: 104 -> 2 miss; a
    # later first arrival only removes requests. So 3 forced misses: 1 - 3/6 = 0.5. A schedule meets that: serve
    # 60 in [60, 110], 70 in [110, 160], 110 in [160, 210] (each by its arrival + 100).
    att, step = interval_attainment_bound(t, p, o, m, 100.0, 50.0, 1, 0.0, 1000.0, 10_000, grid_ms=10.0,
                                          max_span_ms=200.0, steps_ms=[50.0])  # fmt: skip
    assert (att, step) == (0.5, 50.0)
    # A 40 ms grid (points 0, 40, 80, ...): from s = 40, all six need e >= 210 -> 240: 0.8 * 200 = 160, 4 fit, 2 miss;
    # five need e >= 200: 128 -> 3 fit, 2 miss; from s = 80 (80..110) at most 1 miss. The coarser grid: 1 - 2/6
    # (looser, and still valid).
    att, _ = interval_attainment_bound(t, p, o, m, 100.0, 50.0, 1, 0.0, 1000.0, 10_000, grid_ms=40.0,
                                       max_span_ms=200.0, steps_ms=[50.0])  # fmt: skip
    assert att == pytest.approx(4 / 6)
    with pytest.raises(ValueError):
        interval_attainment_bound(t, p, o, m, 100.0, 50.0, 1, 0.0, 1000.0, grid_ms=10.0, max_span_ms=50.0)
    with pytest.raises(ValueError):
        interval_attainment_bound(t, p, o, m, 100.0, 50.0, 1, 2000.0, 3000.0)
    with pytest.raises(ValueError):
        interval_attainment_bound(t, p, o, m, 100.0, 50.0, 1, 0.0, 1000.0, grid_ms=0.0)


def test_interval_attainment_bound_light_load_and_infeasible() -> None:
    # 400-token prompts with 10 decodes (0.1 ms each at b = 0.1: 41 ms of work) every 200 ms, T = 50 (0.8 ms of
    # work per ms). A span of length l >= 100 holds at most 1 + (l - 100) / 200 of them (each needs t >= s and
    # t + 100 <= e), 41 + 0.205 (l - 100) ms of work <= 0.8 l: every span fits, nothing is forced to miss.
    m = EngineTimeModel(a_ms=10.0, b_ms=0.1)
    t = [200.0 * i for i in range(10)]
    att, _ = interval_attainment_bound(t, [400] * 10, [11] * 10, m, 100.0, 50.0, 1, 0.0, 2000.0, 10_000,
                                       grid_ms=10.0, max_span_ms=1000.0, steps_ms=[50.0])  # fmt: skip
    assert att == 1.0
    # 150 tokens per step at most: the prompt of 400 needs ceil(400 / 150) = 3 chunks > floor(100 / 50) = 2
    # steps within the TTFT, so it cannot meet its SLO at T = 50; one such request in ten -> 0.9.
    p = [400] + [300] * 9
    att, _ = interval_attainment_bound(t, p, [11] * 10, m, 100.0, 50.0, 1, 0.0, 2000.0, 150, grid_ms=10.0,
                                       max_span_ms=1000.0, steps_ms=[50.0])  # fmt: skip
    assert att == pytest.approx(0.9)


def test_interval_attainment_bound_decodes_by_hand() -> None:
    # a = 10, b = 0.1, d = 35 ms per sequence in a step; T = 50 (0.8 ms of work per ms), TTFT 100, TPOT 50.
    # Two requests at 0 with P = 40, O = 2: prefill 0.1 * 40 + 35 = 39 ms, one decode 35.1 ms due at
    # 0 + 100 + 50 = 150. Span [0, 100]: both prefills, 78 <= 80: no miss. Span [0, 150]: both in full, 148.2 >
    # 0.8 * 150 = 120: one must miss (and does: after both prefills by 100, 50 ms do 40 < 70.2 of decodes).
    m = EngineTimeModel(a_ms=10.0, b_ms=0.1, d_ms=35.0)
    args = (m, 100.0, 50.0, 1, 0.0, 1000.0, 10_000)
    att, _ = interval_attainment_bound([0.0, 0.0], [40, 40], [2, 2], *args, grid_ms=50.0, max_span_ms=200.0,
                                       steps_ms=[50.0])  # fmt: skip
    assert att == 0.5
    # with output 1 (no decode) both fit every span; with spans of at most 100 ms the decode is never due inside
    att, _ = interval_attainment_bound([0.0, 0.0], [40, 40], [1, 1], *args, grid_ms=50.0, max_span_ms=200.0,
                                       steps_ms=[50.0])  # fmt: skip
    assert att == 1.0
    att, _ = interval_attainment_bound([0.0, 0.0], [40, 40], [2, 2], *args, grid_ms=50.0, max_span_ms=100.0,
                                       steps_ms=[50.0])  # fmt: skip
    assert att == 1.0


def _brute_force_interval_bound(t, p, o, ttft, tpot, rate_of, start, end, grid_ms, max_span_ms, m_tokens):
    """Independent of the library's search: every family of disjoint spans, every subset within a span.

    Model a = 10, b = 0.1, d = D_MS (per sequence in a step), so at step T a request's least prefill is
    0.1 P + D_MS K ms with K = ceil(P / m_tokens) chunks if K <= floor(ttft / T) (else it cannot meet its TTFT)
    and its decodes (0.1 + D_MS) (O - 1) ms.
    """
    counted = [i for i in range(len(t)) if start <= t[i] < end]
    n_grid = math.ceil((end + max_span_ms - start) / grid_ms)
    grid = [start + grid_ms * j for j in range(n_grid + 1)]
    best = 0.0
    for step, rate in rate_of.items():
        spans = []
        for a in range(len(grid)):
            for b in range(a + 1, len(grid)):
                s, e = grid[a], grid[b]
                if not ttft <= e - s <= max_span_ms:
                    continue
                cost = []
                for i in counted:
                    if s <= t[i] and t[i] + ttft <= e:
                        k = math.ceil(p[i] / m_tokens)
                        due = t[i] + ttft + (o[i] - 1) * tpot
                        dec = (0.1 + D_MS) * (o[i] - 1) if due <= e else 0.0
                        cost.append(0.1 * p[i] + D_MS * k + dec if k <= math.floor(ttft / step) else math.inf)
                fit = max(k for k in range(len(cost) + 1)
                          if any(sum(c) <= rate * (e - s) + 1e-6 for c in itertools.combinations(cost, k)))
                spans.append((a, b, len(cost) - fit))

        def most(after: int) -> int:  # most forced misses of disjoint spans starting at grid index >= after
            return max([0] + [x + most(b) for a, b, x in spans if a >= after and x > 0])

        best = max(best, 1.0 - most(0) / len(counted))
    return best


@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5])
def test_interval_attainment_bound_matches_brute_force(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = 10
    t = sorted(rng.uniform(0.0, 400.0, n).round(1).tolist())
    p = (rng.integers(10, 120, n) * 10).tolist()  # 100..1190 tokens: 10..119 ms of prefill
    o = rng.integers(1, 6, n).tolist()  # 0..4 decodes, due within 200 ms after the TTFT (TPOT 50)
    m = EngineTimeModel(a_ms=10.0, b_ms=0.1, d_ms=D_MS)
    steps = {20.0: 0.5, 25.0: 0.6, 50.0: 0.8}  # T -> 1 - 10 / T (one replica)
    want = _brute_force_interval_bound(t, p, o, 100.0, 50.0, steps, 50.0, 350.0, 50.0, 400.0, 400)
    got, _ = interval_attainment_bound(t, p, o, m, 100.0, 50.0, 1, 50.0, 350.0, 400, grid_ms=50.0,
                                       max_span_ms=400.0, steps_ms=list(steps))  # fmt: skip
    assert got == pytest.approx(want)
    assert want < 1.0  # the streams are loaded enough to force misses
    # the decodes count where they are due inside a span: without them (all outputs 1) the bound is no lower
    fewer, _ = interval_attainment_bound(t, p, [1] * n, m, 100.0, 50.0, 1, 50.0, 350.0, 400, grid_ms=50.0,
                                         max_span_ms=400.0, steps_ms=list(steps))  # fmt: skip
    assert fewer == pytest.approx(_brute_force_interval_bound(t, p, [1] * n, 100.0, 50.0, steps, 50.0, 350.0, 50.0,
                                                              400.0, 400)) and fewer >= got  # fmt: skip


def test_self_consistent_rate_is_the_grid_rate_above_the_last_that_passes() -> None:
    from loadgen.fleet.bound import self_consistent_rate

    # docstring example: bound 10 + λ/2 (fixed point 20) on the grid 16, 20, 25, 31.25, 39.0625
    seen: list[float] = []

    def bound_at(rate: float) -> float:
        seen.append(rate)
        return 10.0 + rate / 2.0

    assert self_consistent_rate(bound_at, 16.0, 40.0, 1.25) == (25.0, 5)
    assert seen == pytest.approx([16.0, 20.0, 25.0, 31.25, 39.0625])
    # against the offered rate, here 10 % above the label: 16 passes (18 >= 17.6), 20 does not (20 < 22)
    assert self_consistent_rate(bound_at, 16.0, 40.0, 1.25, offered_at=lambda r: 1.1 * r) == (20.0, 5)
    # not monotone: a pass above a failure counts (every grid point is evaluated)
    assert self_consistent_rate(lambda r: 100.0 if 24 < r < 30 else 0.0, 16.0, 40.0, 1.25) == (31.25, 5)
    # nothing passes: the first grid rate
    assert self_consistent_rate(lambda r: r / 2.0, 1.0, 8.0, 2.0) == (1.0, 4)
    # the last grid rate passes: the grid stops below the crossing
    with pytest.raises(ValueError, match="raise stop"):
        self_consistent_rate(lambda r: 2.0 * r, 1.0, 8.0, 2.0)
    with pytest.raises(ValueError):
        self_consistent_rate(bound_at, 0.0, 1.0)
    with pytest.raises(ValueError):
        self_consistent_rate(bound_at, 2.0, 1.0)
    with pytest.raises(ValueError):
        self_consistent_rate(bound_at, 1.0, 2.0, 1.0)


def test_interval_attainment_bound_per_token_by_hand() -> None:
    # a = 10, b = 0.1, T = 50: one replica does 0.8 ms of work per ms. Three prompts at 0 ms of 600, 300 and 100
    # tokens, output 1 (60, 30 and 10 ms of prefill; 601 + 301 + 101 = 1003 tokens); TTFT 100 ms. Every span that
    # holds them contains [0, 100]: 80 ms of work. The knapsack takes the densest first (tokens per ms: 101 / 10 =
    # 10.1, 301 / 30 = 10.03, 601 / 60 = 10.02): the 100 and the 300 whole (40 ms), 40 / 60 of the 600 (400.67
    # tokens): at most 802.67 tokens on time, so the token attainment is at most 802.67 / 1003 = 0.8003 (the best
    # real schedule serves 600 + 100: 702 / 1003 = 0.70). Per request one must miss: 2 / 3.
    m = EngineTimeModel(a_ms=10.0, b_ms=0.1)
    t, p, o = [0.0, 0.0, 0.0], [600, 300, 100], [1, 1, 1]
    kw = {"grid_ms": 10.0, "max_span_ms": 300.0, "steps_ms": [50.0]}
    att, step = interval_attainment_bound(t, p, o, m, 100.0, 50.0, 1, 0.0, 1000.0, 10_000, served_by="tokens", **kw)
    assert step == 50.0 and att == pytest.approx((101 + 301 + 601 * 40 / 60) / 1003)
    att, _ = interval_attainment_bound(t, p, o, m, 100.0, 50.0, 1, 0.0, 1000.0, 10_000, **kw)
    assert att == pytest.approx(2 / 3)
    # The same burst again at 500 ms: disjoint spans, the missed tokens add up (same share); a third burst at
    # 1,200 ms is outside the counted window [0, 1000) and is left out.
    att, _ = interval_attainment_bound(t + [500.0] * 3 + [1200.0] * 3, p * 3, o * 3, m, 100.0, 50.0, 1, 0.0, 1000.0,
                                       10_000, served_by="tokens", **kw)  # fmt: skip
    assert att == pytest.approx((101 + 301 + 601 * 40 / 60) / 1003)
    # 250 tokens per step at most: the 600-token prompt needs ceil(600 / 250) = 3 chunks > 2 steps in the TTFT,
    # so it always misses (601 tokens); the other two (40 ms) fit: at most 402 / 1003.
    att, _ = interval_attainment_bound(t, p, o, m, 100.0, 50.0, 1, 0.0, 1000.0, 250, served_by="tokens", **kw)
    assert att == pytest.approx(402 / 1003)
    with pytest.raises(ValueError):
        interval_attainment_bound(t, p, o, m, 100.0, 50.0, 1, 0.0, 1000.0, served_by="bytes")


def test_pooled_interval_attainment_bound_two_kinds_by_hand() -> None:
    # Kind 0: a = 10, b = 0.1; kind 1 twice as fast per token (b = 0.05); one replica each; TPOT 50: each does
    # 1 - 10 / 50 = 0.8 ms of its own work per ms. The default exchange rate is the median cost ratio, 2: the pool
    # does 0.8 + 2 * 0.8 = 2.4 kind-0 ms per ms, and request i costs min(0.1 P, 2 * 0.05 P) = 0.1 P kind-0 ms.
    # Three prompts at 0 (1,200, 800, 800 tokens, output 1: 120, 80, 80 ms; 1,201 + 801 + 801 = 2,803 tokens),
    # TTFT 100: the span [0, 100] holds 240 ms. Per request the costliest must go: 2 / 3. Per token the densest
    # first (801 / 80 > 1,201 / 120): both 800s (160 ms), then 80 / 120 of the 1,200 (800.67 tokens): at most
    # (801 + 801 + 800.67) / 2,803 = 0.8572. (A real schedule serves 1,200 on kind 1, 800 on kind 0: 0.71.)
    k0, k1 = EngineTimeModel(a_ms=10.0, b_ms=0.1), EngineTimeModel(a_ms=10.0, b_ms=0.05)
    t, p, o = [0.0] * 3, [1200, 800, 800], [1, 1, 1]
    kinds = [(k0, 1, 10_000), (k1, 1, 10_000)]
    kw = {"grid_ms": 10.0, "max_span_ms": 300.0}
    att, sig = pooled_interval_attainment_bound(t, p, o, kinds, 100.0, 50.0, 0.0, 1000.0, **kw)
    assert sig == pytest.approx((1.0, 2.0)) and att == pytest.approx(2 / 3)
    att, _ = pooled_interval_attainment_bound(t, p, o, kinds, 100.0, 50.0, 0.0, 1000.0, served_by="tokens", **kw)
    assert att == pytest.approx((801 + 801 + 1201 * 80 / 120) / 2803)
    # Exchange rate 1 instead: costs min(0.1 P, 0.05 P) = 60, 40, 40 ms against 0.8 + 0.8 = 1.6 ms per ms, 160 ms
    # in the span: everything fits. Valid too, and looser.
    att, sig = pooled_interval_attainment_bound(t, p, o, kinds, 100.0, 50.0, 0.0, 1000.0, exchange=[1.0, 1.0], **kw)
    assert sig == (1.0, 1.0) and att == 1.0
    # One kind: the one-kind programme at T = tpot (costs b P do not depend on T): the burst of the test above.
    att, _ = pooled_interval_attainment_bound([60.0, 70.0, 80.0, 90.0, 100.0, 110.0], [400] * 6, [1] * 6,
                                              [(k0, 1, 10_000)], 100.0, 50.0, 0.0, 1000.0, grid_ms=10.0,
                                              max_span_ms=200.0)  # fmt: skip
    assert att == 0.5
    for bad in ({"exchange": [1.0]}, {"exchange": [1.0, 0.0]}, {"served_by": "bytes"}):
        with pytest.raises(ValueError):
            pooled_interval_attainment_bound(t, p, o, kinds, 100.0, 50.0, 0.0, 1000.0, **bad)
    with pytest.raises(ValueError):
        pooled_interval_attainment_bound(t, p, o, [(k0, 0, 10_000)], 100.0, 50.0, 0.0, 1000.0)


def test_grid_crossing_takes_the_test_itself() -> None:
    from loadgen.fleet.bound import grid_crossing

    # grid 16, 20, 25, 31.25, 39.0625: a test that holds below 21 passes at 16 and 20 -> 25
    assert grid_crossing(lambda r: r < 21.0, 16.0, 40.0, 1.25) == (25.0, 5)
    assert grid_crossing(lambda r: r in (16.0, 31.25), 16.0, 40.0, 1.25) == (39.0625, 5)
    with pytest.raises(ValueError, match="raise stop"):
        grid_crossing(lambda r: True, 16.0, 40.0, 1.25)


def test_per_token_bound_takes_the_densest_not_the_cheapest() -> None:
    # a = 10, b = 0.1, T = 50 (0.8 ms of work per ms), TTFT 100, TPOT 50: prompts of 50 tokens (output 1: 51
    # tokens, 5 ms) and 780 tokens (output 200: 980 tokens, 78 ms of prefill; its decodes are due at 10,050 ms,
    # past every span). [0, 100] holds 80 ms: densest first (980 / 78 = 12.6 > 51 / 5 = 10.2) takes the 780 whole
    # and 2 / 5 of the 50: at most (980 + 20.4) / 1,031 = 0.97032 (cheapest first would give 0.96344).
    m = EngineTimeModel(a_ms=10.0, b_ms=0.1)
    att, _ = interval_attainment_bound([0.0, 0.0], [50, 780], [1, 200], m, 100.0, 50.0, 1, 0.0, 1000.0, 10_000,
                                       grid_ms=10.0, max_span_ms=300.0, steps_ms=[50.0], served_by="tokens")  # fmt: skip
    assert att == pytest.approx((980 + 51 * 2 / 5) / 1031)


def test_default_step_cells_cover_steps_shorter_than_the_first_grid_point() -> None:
    # a = 10, b = 0.01, 100 tokens per step, TTFT 100, TPOT 50: an 800-token prompt needs 8 chunks, so steps
    # of at most 12.5 ms; 8 steps of 11 ms (10 + 1 ms of prefill each) meet its TTFT. At T = 50 alone it cannot
    # (2 steps): 0. The default cells cover (10, 50]: the first, (10, 14], prices it at T just above 10 (9
    # chunks allowed, 8 ms) against 1 - 10 / 14 = 0.29 ms of work per ms (28.6 ms in [0, 100]): it fits, 1.0.
    m = EngineTimeModel(a_ms=10.0, b_ms=0.01)
    args = ([0.0], [800], [1], m, 100.0, 50.0, 1, 0.0, 1000.0, 100)
    assert interval_attainment_bound(*args, grid_ms=10.0, max_span_ms=300.0, steps_ms=[50.0])[0] == 0.0
    att, step = interval_attainment_bound(*args, grid_ms=10.0, max_span_ms=300.0)
    assert att == 1.0 and step == pytest.approx(14.0)
    assert windowed_attainment_bound(*args, windows_ms=[100.0])[0] == 1.0
    # pooled kinds price every kind just above its fixed cost the same way: a 400-token prompt (4 chunks of
    # 100) on a = 10, b = 0.1 meets its TTFT in 4 steps of 20 ms, not at T = TPOT = 50 (2 steps)
    k0 = EngineTimeModel(a_ms=10.0, b_ms=0.1)
    att, _ = pooled_interval_attainment_bound([0.0], [400], [1], [(k0, 1, 100)], 100.0, 50.0, 0.0, 1000.0,
                                              grid_ms=10.0, max_span_ms=300.0)  # fmt: skip
    assert att == 1.0
