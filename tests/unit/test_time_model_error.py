"""The online time model's one-step-ahead error on short fleet runs (issue 27 item 7): <= 5 % on the Splitwise
engine model, which no policy was tuned on, and on the shipped 70B engine where the five-term model was off.

Each case is one seeded fleet simulation of scripts/bench_time_model_error.py (``run_one``: 2 replicas,
30 s of azure-code arrivals, the first 10 s not counted, 10 s drain; well under a second each), scored as
the simulator scores the model: mean |measured / predicted - 1| of the point model before each update,
over the counted steps. The engines' step time comes from their engine-time files; the replicas' models
start from the profile and learn online.

Bounds: 5 % is the issue's target. The tighter one is the noise floor ``E|exp(sigma Z) - 1|`` (2.155 % for
the Splitwise engine's sigma 0.027): a model with the engine's terms can only add its estimation error to
it (about +3-8 % of the floor in docs/bench/time_model_error.json), and over the 64 counted steps of the
least-outstanding run the sample mean's standard error is about 0.2 points (sd of |r - 1| ~ 0.016), so
1.5 x the floor (3.23 %) sits about 5 standard errors above what the model reaches (2.31 %) and below the
five-term model's 4.08 %. The runs are deterministic (seeded), so the margins guard against benign
changes, not against chance.
"""

from __future__ import annotations

import pytest

from tests.scripts import load_script

SPLITWISE = ("splitwise-70b", "llama-2-70b-h100-tp4", "llama-2-70b-h100-tp4-splitwise")
SHIPPED_70B = ("shipped-70b", "llama-2-70b-h100-tp4", "llama-2-70b-h100-tp4")


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_time_model_error")


def _run(bench, engine, policy, rate, model="after"):
    return bench.run_one(*engine, policy, 0.0, "azure-code", 2, 30.0, 10.0, 10.0, model, False, rate)


def test_noise_floor_by_hand(bench) -> None:
    # E|exp(sigma Z) - 1| = exp(sigma^2 / 2) * erf(sigma / sqrt 2) ~ sigma * sqrt(2 / pi) for small sigma
    assert bench.noise_floor(0.027) == pytest.approx(0.021548, abs=2e-6)
    assert bench.noise_floor(0.0) == 0.0
    assert bench.noise_floor(0.01) == pytest.approx(0.01 * (2 / 3.141592653589793) ** 0.5, rel=1e-3)


def test_splitwise_engine_pab_fairbatching_within_5_percent(bench) -> None:
    r = _run(bench, SPLITWISE, "pab+fairbatching", 8.0)
    floor = bench.noise_floor(0.027)
    assert r["steps"] > 500
    assert r["mean_abs_error"] <= 0.05
    assert r["mean_abs_error"] <= 1.25 * floor  # 2.24 % against a floor of 2.16 %
    assert abs(r["signed_mean"]) < 0.005
    # what it learned is the engine's chunk^2 term (f = 3.19e-6 ms/token^2 in the file), from a prior without one
    assert 1e-6 < r["final_model"]["f_ms_per_chunk_sq"] < 6e-6


def test_splitwise_engine_large_chunks_within_5_percent(bench) -> None:
    # least-outstanding in front of vLLM-default replicas, over its capacity: 2k-8k-token chunks, where the
    # five-term model's error is 4.08 % (1.9 x the floor) and grows with the chunk length
    r = _run(bench, SPLITWISE, "least-outstanding", 8.0)
    floor = bench.noise_floor(0.027)
    assert r["steps"] >= 50
    assert r["mean_abs_error"] <= 0.05 and r["mean_abs_error"] <= 1.5 * floor
    before = _run(bench, SPLITWISE, "least-outstanding", 8.0, model="before")
    assert before["mean_abs_error"] > 1.5 * floor  # the case tells the two models apart


def test_shipped_70b_engine_large_chunks_within_5_percent(bench) -> None:
    # the shipped engine of the same profile, where the five-term model was over the target (6.96 % here)
    r = _run(bench, SHIPPED_70B, "least-outstanding", 15.0)
    assert r["mean_abs_error"] <= 0.05 and r["mean_abs_error"] <= 1.5 * bench.noise_floor(0.0154)
    before = _run(bench, SHIPPED_70B, "least-outstanding", 15.0, model="before")
    assert before["mean_abs_error"] > 0.05
