"""``llm-d-predicted-latency`` (router/placement/predicted_latency.py, router/placement/latency_predictor.py),
hand-worked.

Most tests fix the predictions by construction: the predictor's installed models are stand-ins whose
TTFT is a given function of a row (row[3] = waiting requests in the queued-feature rows), so every
headroom, score and admission below is exact. One test trains the real XGBoost on step data.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from loadgen.fleet.sim import FleetConfig, FleetRequest, FleetSim
from replica_agent.policy.time_model import TimeModel
from router.placement import MetricsSample, PlacementRequest, ReplicaView, RouterLoad, default_registry
from router.placement.latency_predictor import (
    DEFAULT_PREDICTION_MS,
    FittedModels,
    LatencyFeatures,
    LatencyPredictor,
    PredictorSettings,
    tpot_row,
    train,
    ttft_row,
)
from router.placement.predicted_latency import (
    REASON,
    PredictedLatencyPolicy,
    PredictedLatencySettings,
    headroom,
    latency_scores,
    slo_header_ms,
    weighted_random_order,
)

TM = TimeModel(9.8626, 0.0726711, 7.93966e-05)
IDS = ("r0", "r1", "r2")
NO_EXPLORATION = {"epsilon_explore_neg": 0.0, "affinity_exploration": 0.0}


class Fixed:
    """A stand-in model: ``predict(rows)`` = ``per_waiting[row[3]]`` (TTFT rows) or ``value`` (TPOT)."""

    def __init__(self, per_waiting: dict[int, float] | None = None, value: float = 0.0) -> None:
        self.per_waiting, self.value = per_waiting, value

    def predict(self, rows: Any) -> list[float]:
        return [self.per_waiting[int(r[3])] if self.per_waiting else self.value for r in rows]


def views(ids: tuple[str, ...] = IDS) -> list[ReplicaView]:
    return [ReplicaView(rid, True, True, TM, {}, 32768) for rid in ids]


def load(metrics: dict[str, tuple[int, int, float]], outstanding: dict[str, int] | None = None) -> RouterLoad:
    """replica -> (running, waiting, kv usage)."""
    return RouterLoad(dict(outstanding or {}), {r: MetricsSample(a, b, c, 0.0) for r, (a, b, c) in metrics.items()})


def policy(lv: RouterLoad, ttft_by_waiting: dict[int, float], tpot: float = 50.0, **params: Any) -> PredictedLatencyPolicy:
    p = default_registry().build("llm-d-predicted-latency", load=lv, seed=7, **{**NO_EXPLORATION, **params})
    assert isinstance(p, PredictedLatencyPolicy)
    p.predictor.install(FittedModels(Fixed(ttft_by_waiting), Fixed(value=tpot)))
    return p


def req(prompt: int = 1000, sheddable: bool = True, ttft: float = 1000.0, tpot: float = 100.0, rid: str = "q1",
        cached: dict[str, int] | None = None) -> PlacementRequest:  # fmt: skip
    return PlacementRequest("i", prompt, cached_tokens=cached or {}, request_id=rid, ttft_slo_ms=ttft,
                            tpot_slo_ms=tpot, sheddable=sheddable)  # fmt: skip


# ---------------------------------------------------------------- features


def test_features_of_a_pod_and_request() -> None:
    # r0 scraped: running 3, waiting 2, KV 0.25; prompt 1000 tokens of which the prefix map puts 800 on r0
    p = policy(load({"r0": (3, 2, 0.25)}), {2: 500.0})
    p.predictions(req(cached={"r0": 800}), ["r0"])
    f = p._features["r0"]
    assert f == LatencyFeatures(0.25, 1000, 2, 3, 0.8, 0, 0)
    # TTFT row: is_queued, kv, input, waiting, running, prefill tif, decode tif, prefix, (1-0.8)*1000, bucket 3
    assert ttft_row(f) == [1.0, 0.25, 1000.0, 2.0, 3.0, 0.0, 0.0, 0.8, pytest.approx(200.0), 3.0]
    assert ttft_row(f, queued_features=False) == [0.25, 1000.0, 3.0, 0.0, 0.0, 0.8, pytest.approx(200.0), 3.0]
    assert tpot_row(f) == [1.0, 0.25, 1000.0, 2.0, 3.0, 0.0, 0.0, 0.0]
    # a pod never scraped: llm-d's zero metrics
    p.predictions(req(), ["r9"])
    assert p._features["r9"] == LatencyFeatures(0.0, 1000, 0, 0, 0.0, 0, 0)


def test_dispatch_counts_prefill_tokens_in_flight_until_the_first_token() -> None:
    p = policy(load({r: (1, 0, 0.5) for r in IDS}), {0: 100.0})
    r = req(rid="a")
    assert p.place(r, views()).candidates
    p.after_decision(r, "r1")
    assert p.prefill_in_flight("r1") == 1000
    assert p._dispatched["a"].features.prefill_tokens_in_flight == 1000  # at dispatch: its own included
    r2 = req(prompt=300, rid="b")
    p.place(r2, views())
    assert p._features["r1"].prefill_tokens_in_flight == 1000  # a prediction: without its own
    p.after_decision(r2, "r1")
    assert p.prefill_in_flight("r1") == 1300
    p.first_token("a")
    assert p.prefill_in_flight("r1") == 300
    assert p.observe_latency("a", 120.0, 30.0)  # the training sample: features at dispatch, measured latencies
    assert p.prefill_in_flight("r1") == 300  # not released twice
    assert p.predictor.sample_counts()[0] + p.predictor.sample_counts()[2] >= 1
    p.forget("b")
    assert p.prefill_in_flight("r1") == 0
    assert not p.observe_latency("b", 1.0, 1.0)  # gone: nothing learnt


# ---------------------------------------------------------------- headroom, tiers, scorer, admitter


def test_headroom_and_validity() -> None:
    s = PredictedLatencySettings()
    assert headroom("r", 500.0, 50.0, 1000.0, 100.0, 0.0, s) == pytest.approx(
        type(headroom("r", 0, 0, 0, 0, 0, s))("r", 500.0, 50.0, 500.0, 50.0, True))
    # a running request on the pod with TPOT SLO 40 lowers the bound: 40 - 50 = -10, invalid
    h = headroom("r", 500.0, 50.0, 1000.0, 100.0, 40.0, s)
    assert (h.tpot_headroom, h.valid) == (-10.0, False)
    # strict: predicted == SLO is not valid, but its headroom 0 is in the positive tier
    h = headroom("r", 1000.0, 50.0, 1000.0, 100.0, 0.0, s)
    assert (h.ttft_headroom, h.valid) == (0.0, False)
    # no SLO: headroom = -predicted
    h = headroom("r", 300.0, 20.0, 0.0, 0.0, 0.0, s)
    assert (h.ttft_headroom, h.tpot_headroom, h.valid) == (-300.0, -20.0, False)
    # not streaming: TPOT neutralised
    h = headroom("r", 300.0, 500.0, 1000.0, 100.0, 0.0, PredictedLatencySettings(streaming=False))
    assert (h.tpot_headroom, h.valid) == (0.0, True)


def test_tier_filter_and_least_headroom_scores() -> None:
    # waiting r0 0, r1 1, r2 2 -> predicted TTFT 500, 900, 1500 (TPOT 50): TTFT headrooms 500, 100, -500
    lv = load({"r0": (1, 0, 0.5), "r1": (1, 1, 0.5), "r2": (1, 2, 0.5)})
    p = policy(lv, {0: 500.0, 1: 900.0, 2: 1500.0})
    preds = p.predictions(req(), list(IDS))
    assert preds is not None
    assert [preds[r].ttft_headroom for r in IDS] == [500.0, 100.0, -500.0]
    # positive tier r0, r1; TTFT |h| 500, 100 -> n 1, 0; TPOT range 0 -> weights (1, 0);
    # least: r0 int((1-1)*100)+1 = 1 -> 0.01, r1 int((1-0)*100)+1 = 101 -> 1.01; r2 (negative) 0
    assert latency_scores(list(IDS), preds, lv, {}, p.settings) == {"r0": 0.01, "r1": 1.01, "r2": 0.0}
    most = PredictedLatencySettings(strategy="most")
    assert latency_scores(list(IDS), preds, lv, {}, most) == {"r0": 1.01, "r1": 0.01, "r2": 0.0}
    # the tier filter drops r2: it is never a candidate
    for n in range(20):
        assert set(p.place(req(rid=f"x{n}"), views()).candidates) == {"r0", "r1"}
    # with exploration 1 the negative tier alone is kept
    p2 = policy(lv, {0: 500.0, 1: 900.0, 2: 1500.0}, epsilon_explore_neg=1.0)
    assert p2.place(req(), views()).candidates == ("r2",)


def test_all_negative_prefers_idle_then_least_deficit() -> None:
    lv = load({"r0": (1, 0, 0.5), "r1": (1, 1, 0.5), "r2": (1, 2, 0.5)}, {"r0": 2, "r1": 1, "r2": 0})
    p = policy(lv, {0: 1100.0, 1: 1200.0, 2: 1600.0}, tpot=50.0)
    preds = p.predictions(req(), list(IDS))
    # every TTFT headroom negative; r2 has no outstanding request of this router: only it is scored,
    # alone in its bucket: both ranges 0 -> n = 0.5, blend 0.5 -> int(0.5 * 100) + 1 = 51 -> 0.51
    assert latency_scores(list(IDS), preds, lv, {}, p.settings) == {"r0": 0.0, "r1": 0.0, "r2": 0.51}
    # nobody idle: TTFT-only-negative bucket, |h| 100, 200, 600 -> n 0, 0.2, 1 (TPOT range 0: weights 1, 0)
    lv.outstanding["r2"] = 1
    assert latency_scores(list(IDS), preds, lv, {}, p.settings) == {"r0": 1.01, "r1": 0.81, "r2": 0.01}


def test_admitter_refuses_a_sheddable_request_no_pod_meets() -> None:
    busy = load({"r0": (2, 1, 0.5), "r1": (3, 1, 0.6), "r2": (1, 1, 0.3)})
    p = policy(busy, {1: 1500.0})
    got = p.place(req(), views())
    assert (got.candidates, got.reason) == ((), REASON)
    # a non-sheddable request goes to the best pod anyway
    assert p.place(req(sheddable=False), views()).candidates
    # no SLO at all: admitted (llm-d cannot tell)
    assert p.place(req(ttft=0.0, tpot=0.0), views()).candidates
    # an idle pod (no running request) or a cold one (KV < 2 %) admits it
    for m in ((0, 1, 0.5), (2, 1, 0.01)):
        lv = load({"r0": (2, 1, 0.5), "r1": (3, 1, 0.6), "r2": m})
        assert policy(lv, {1: 1500.0}).place(req(), views()).candidates
    # one pod predicted in time admits it
    lv = load({"r0": (2, 0, 0.5), "r1": (3, 1, 0.6), "r2": (1, 1, 0.3)})
    assert policy(lv, {0: 900.0, 1: 1500.0}).place(req(), views()).candidates[0] == "r0"


def test_prefix_affinity_keeps_sticky_pods_unless_much_slower() -> None:
    lv = load({r: (1, 0, 0.5) for r in IDS})
    p = policy(lv, {0: 500.0})
    cached = {"r1": 995}  # 995 / 1000 >= 0.99: r1 alone is sticky
    for n in range(10):
        assert p.place(req(cached=cached, rid=f"s{n}"), views()).candidates == ("r1",)
    # r1 busier: predicted TTFT 6000 vs 500 elsewhere: more than 5000 ms worse, stickiness breaks
    lv2 = load({"r0": (1, 0, 0.5), "r1": (1, 1, 0.5), "r2": (1, 0, 0.5)})
    p2 = policy(lv2, {0: 500.0, 1: 6000.0})
    assert set(p2.place(req(cached=cached, sheddable=False), views()).candidates) == {"r0", "r2"}


def test_weighted_random_order_and_composite_fallback() -> None:
    rng = random.Random(1)
    wins = sum(weighted_random_order({"a": 0.01, "b": 1.01}, rng)[0] == "b" for _ in range(2000))
    assert 1950 < wins < 2000  # P(b first) = 1.01 / 1.02 (A-Res)
    assert sorted(weighted_random_order({"a": 0.0, "b": 0.0}, rng)) == ["a", "b"]
    assert weighted_random_order({"a": 0.0, "b": 0.5}, rng) == ["b", "a"]
    # a broken model: the composite kv_free / relative queue / prefix, 1 / 1 / 1
    lv = load({"r0": (1, 4, 0.2), "r1": (1, 0, 0.9)})
    p = policy(lv, {0: 1.0})
    p.predictor.install(FittedModels(object(), object()))  # no predict(): raises
    assert p.predictions(req(), ["r0", "r1"]) is None
    # r0: (0.8 + 0 + 0.5) / 3 = 0.43; r1: (0.1 + 1 + 0) / 3 = 0.37
    assert latency_scores(["r0", "r1"], None, lv, {"r0": 0.5}, p.settings) == {"r0": 0.43, "r1": 0.37}
    assert p.place(req(), views(("r0", "r1"))).candidates


def test_slo_headers() -> None:
    assert [slo_header_ms(v) for v in (None, "", "250", "abc", "-1", "inf", "0")] == [0, 0, 250.0, 0, 0, 0, 0]


# ---------------------------------------------------------------- the predictor


def test_cold_start_and_refit_cadence() -> None:
    pr = LatencyPredictor()
    f = LatencyFeatures(0.5, 100, 0, 1)
    assert pr.predict([f, f]) == [(DEFAULT_PREDICTION_MS, DEFAULT_PREDICTION_MS)] * 2 and not pr.trained
    assert not pr.refit_due(0.0)  # the first call starts the clock: due 10 s later
    assert not pr.refit_due(9_999.0) and pr.refit_due(10_000.0)
    for i in range(4):  # 4 requests: up to 8 samples < 10, no training
        pr.observe(LatencyFeatures(0.5, 100 + i, 0, 1), 50.0, 5.0)
    assert not pr.fit(10_000.0) and pr.fits == 0
    assert not pr.refit_due(19_999.0) and pr.refit_due(20_000.0)  # the interval restarts at each tick
    pr.observe(f, None, None)  # nothing measured: nothing kept
    assert sum(pr.sample_counts()) == sum(LatencyPredictor().sample_counts()) + 8


def test_training_window_buckets_and_holdout() -> None:
    pr = LatencyPredictor(PredictorSettings(bucket_size=3, test_ratio=0.0))
    for i in range(5):  # all in one bucket (waiting 0, KV 0.5, prefix 0): the 3 newest stay
        pr.observe(LatencyFeatures(0.5, 100 + i, 0, 1), 50.0 + i, 0.0)
    assert pr.sample_counts() == (3, 0, 0)
    assert [x.ttft_ms for x in pr.snapshot(0.0).ttft] == [52.0, 53.0, 54.0]
    held = LatencyPredictor(PredictorSettings(test_ratio=0.5))
    for i in range(200):
        held.observe(LatencyFeatures(0.5, i, 0, 1), 50.0, 5.0)
    ttft, tpot, test = held.sample_counts()
    assert ttft == tpot and ttft + test == 200 and 60 < test < 140


def test_xgboost_learns_a_step_and_the_ensemble_gates_by_queue() -> None:
    # TTFT 100 ms with no waiting request, 900 ms with one or more; TPOT 20 + 2 * running
    rng = random.Random(0)
    pr = LatencyPredictor(PredictorSettings(test_ratio=0.0, min_ensemble_split=50))
    for _ in range(300):
        f = LatencyFeatures(rng.random(), rng.randint(100, 2000), rng.choice((0, 0, 1, 3)), rng.randint(0, 8))
        pr.observe(f, 100.0 if f.num_request_waiting == 0 else 900.0, 20.0 + 2 * f.num_request_running)
    assert pr.fit(0.0) and pr.trained and pr.fits == 1
    fitted = train(pr.snapshot(0.0))
    assert fitted is not None and fitted.gated is not None and fitted.samples == 600
    (t0, p0), (t1, p1) = pr.predict([LatencyFeatures(0.3, 500, 0, 2), LatencyFeatures(0.3, 500, 2, 6)])
    assert t0 == pytest.approx(100.0, abs=5.0) and t1 == pytest.approx(900.0, abs=5.0)
    assert p0 == pytest.approx(24.0, abs=1.0) and p1 == pytest.approx(32.0, abs=1.0)


def test_unknown_parameters_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown parameters"):
        default_registry().build("llm-d-predicted-latency", seed=1, nope=1)
    p = default_registry().build("llm-d-predicted-latency", seed=1, refit_interval_ms=5000.0, ttft_weight=1.0)
    assert isinstance(p, PredictedLatencyPolicy)
    assert p.predictor.settings.refit_interval_ms == 5000.0 and p.settings.ttft_weight == 1.0


# ---------------------------------------------------------------- the fleet simulation


def test_fleet_sim_learns_and_serves() -> None:
    # 2 replicas, 15 s of ~12 requests/s: the router's model trains at its first tick (10 s) from
    # the requests that finished by then, and every request is served (none is sheddable).
    rng = random.Random(3)
    reqs, t = [], 0.0
    while t < 15_000.0:
        t += rng.expovariate(12 / 1000)
        reqs.append(FleetRequest(t, rng.randint(100, 2000), rng.randint(10, 60)))
    cfg = FleetConfig(policy="llm-d-predicted-latency", replicas=2, time_model=TM, kv_capacity_tokens=467_291,
                      ttft_ms=1000.0, tpot_ms=100.0)  # fmt: skip
    sim = FleetSim(cfg, reqs)
    res = sim.run()
    pr = sim.routers[0].core.latency_predictor
    assert pr is not None and pr.fits >= 1 and pr.trained
    assert all(r.outcome == "ok" for r in res.records)
    assert {r.replica for r in res.records} == {"r0", "r1"}
    ttft, tpot, _ = pr.sample_counts()
    assert ttft > 50 and tpot > 50
    # a trained TTFT grows with the prompt on an idle pod (its prefill)
    (short, _), (long, _) = pr.predict([LatencyFeatures(0.0, 100, 0, 0), LatencyFeatures(0.0, 2000, 0, 0)])
    assert long > short


# ---------------------------------------------------------------- the router core


async def test_the_core_carries_the_slo_and_the_training_signal() -> None:
    from router.core import CoreRequest, Placed
    from tests.unit.test_placement_profiles import make_core

    core, _, port = make_core("{profile: llm-d-predicted-latency, seed: 3}")  # class i: TTFT 1000, TPOT 100
    policy = core.policy
    assert isinstance(policy, PredictedLatencyPolicy) and core.latency_predictor is policy.predictor
    got = await core.acquire(CoreRequest("q1", "t", "i", 100, 20, 0.0))  # the class's SLO
    assert isinstance(got, Placed) and port.calls == []
    # cold start: every pod predicted 10 ms, so the headrooms are the SLO less 10
    assert {(p.ttft_headroom, p.tpot_headroom) for p in policy.last.values()} == {(990.0, 90.0)}
    got2 = await core.acquire(CoreRequest("q2", "t", "i", 100, 20, 0.0, (), 250.0, 0.0))  # x-slo-ttft-ms: 250
    assert isinstance(got2, Placed)
    assert {(p.ttft_headroom, p.tpot_headroom) for p in policy.last.values()} == {(240.0, 90.0)}
    assert policy._dispatched["q2"].tpot_slo_ms == 100.0
    core.latency_first_token("q1")
    core.latency_observed("q1", 80.0, 12.0)
    core.latency_forget("q2")
    ttft, tpot, test = policy.predictor.sample_counts()
    assert (ttft + test, tpot + test) in ((1, 1), (1, 2), (2, 1))  # one request: one sample, maybe held out
    assert policy.prefill_in_flight(got.grant.replica_id) == 0 and policy.prefill_in_flight(got2.grant.replica_id) == 0
