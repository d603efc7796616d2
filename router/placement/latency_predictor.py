"""An online latency predictor in the manner of llm-d's (the ``llm-d-latency-predictor`` training and
prediction servers behind the ``predicted-latency-producer`` plugin of llm-d's inference scheduler).
SANS-IO: no clock, no thread, no socket; the driver decides when to refit and where the training runs.

What llm-d does (sources, read 2026; our code is written from their descriptions, not copied):

- https://github.com/llm-d/llm-d-latency-predictor ``training/training_server.py``: one XGBoost
  regressor per target (TTFT, TPOT), ``LATENCY_MODEL_TYPE`` default ``xgboost`` (Bayesian ridge and
  LightGBM are options); the parameters 200 trees, depth 6, learning rate 0.05, subsample 0.8,
  colsample_bytree 0.8, min_child_weight 5, gamma 0.2, reg_alpha 0.01, reg_lambda 0.1, ``hist``
  trees; objective ``reg:squarederror`` for ``LATENCY_OBJECTIVE_TYPE=mean`` (what llm-d's Helm chart
  sets: https://github.com/llm-d/llm-d-inference-scheduler ``config/charts/epplib/values.yaml``),
  ``reg:quantileerror`` at alpha 0.9 for ``quantile`` (the server's own default: p90).
- Training window: samples are kept in buckets by (waiting requests 0 / 1-2 / 3-5 / 6-10 / 11+,
  KV-cache usage in 5 % steps, prefix-cache score in quarters), at most 500 per bucket
  (``LATENCY_MAX_TRAINING_DATA_SIZE_PER_BUCKET``; the oldest drop out); 10 % of the samples are held
  out as a test set by a hash of the sample (``LATENCY_TEST_TRAIN_RATIO`` 0.1) and never trained on.
- Retraining: a loop that waits 10 s, trains, then waits ``LATENCY_RETRAINING_INTERVAL_SEC`` (the
  chart sets 10 s; the server's default is 1800 s) between trainings. A training runs when the TTFT
  and TPOT samples together number at least ``LATENCY_MIN_SAMPLES_FOR_RETRAIN``; a fresh server (no
  saved model, as every pod of the chart: its model volume is an emptyDir) lowers that to
  ``LATENCY_MIN_SAMPLES_FOR_RETRAIN_FRESH`` = 10; each target's model is retrained only with at least
  that many samples of its own.
- Cold start: a fresh server trains a *default model* on one sample whose target is 10 ms, so every
  pod is predicted 10 ms TTFT and 10 ms TPOT until the first retraining (:data:`DEFAULT_PREDICTION_MS`).
- Ensemble (``LATENCY_ENSEMBLE_MODE``, default on): once each of TTFT-without-queue,
  TTFT-with-queue, TPOT-without-queue and TPOT-with-queue has at least 200 training samples
  (``LATENCY_MIN_SAMPLES_FOR_ENSEMBLE_SPLIT``), a second pair of models per target is trained, one on
  the samples taken with no waiting request (without the queue features) and one on the others; a
  prediction then takes the sub-model of the pod's queue state.
- Features (their ``_prepare_features_with_interaction``), TTFT: is_queued (waiting > 0), KV-cache
  usage, input length, waiting requests, running requests, prefill tokens in flight, decode tokens
  in flight, prefix-cache score, effective input tokens ``(1 - prefix score) * input length`` and the
  prefix score's quarter bucket; TPOT: the first seven and the tokens generated (0: the server zeroes
  it, ``LATENCY_TPOT_ZERO_TOKEN_COUNT``). Their pod-type and (multimodal) encoder columns are constant
  for one monolithic text pool and left out here; the prefix bucket, an ordered categorical there, is
  its integer code here.

Deviations, all for running inside the router: the trees use ``n_jobs`` = 1 (the sidecar has cores of
its own), predictions are clamped at >= 0 ms, and the test set is only held out (their MAE / quantile
metrics on it are not computed).
"""

from __future__ import annotations

import importlib.util

import math
import zlib
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

DEFAULT_PREDICTION_MS = 10.0
"""The cold-start prediction of TTFT and TPOT (ms): the target of llm-d's default model."""


@dataclass(frozen=True, slots=True)
class LatencyFeatures:
    """One pod's state and one request, as llm-d's predictor sees them (its ``PredictionRequest``).

    Attributes:
        kv_cache_percentage: the pod's KV-cache usage, 0..1 (``vllm:kv_cache_usage_perc``, scraped).
        input_token_length: the request's prompt length (tokens; llm-d counts whitespace-separated
            words of the prompt text, the router its token estimate).
        num_request_waiting: the pod's waiting requests (``vllm:num_requests_waiting``, scraped).
        num_request_running: the pod's running requests (``vllm:num_requests_running``, scraped).
        prefix_cache_score: matched / prompt prefix blocks on that pod, 0..1.
        prefill_tokens_in_flight: prompt tokens this router sent to the pod whose first token has
            not come back yet (at dispatch, the request's own included; for a prediction, without it).
        decode_tokens_in_flight: always 0 in llm-d today (``decodeTokensAtDispatch = 0``).
    """

    kv_cache_percentage: float
    input_token_length: int
    num_request_waiting: int
    num_request_running: int
    prefix_cache_score: float = 0.0
    prefill_tokens_in_flight: int = 0
    decode_tokens_in_flight: int = 0


def _prefix_bucket(score: float) -> int:
    return min(int(min(1.0, max(0.0, score)) * 4), 3)


def _queue_bucket(waiting: int) -> int:
    return 0 if waiting <= 0 else 1 if waiting <= 2 else 2 if waiting <= 5 else 3 if waiting <= 10 else 4


def _cache_bucket(kv: float) -> int:
    return min(int(min(1.0, max(0.0, kv)) * 20), 19)


def ttft_row(f: LatencyFeatures, queued_features: bool = True) -> list[float]:
    """The TTFT model's input row: ``[is_queued, kv, input, waiting, running, prefill_tif, decode_tif,
    prefix, (1 - prefix) * input, prefix bucket]``; without is_queued and waiting when
    ``queued_features`` is False (the ensemble's no-queue sub-model)."""
    p = min(1.0, max(0.0, f.prefix_cache_score))
    head = [float(f.num_request_waiting > 0), f.kv_cache_percentage, float(f.input_token_length),
            float(f.num_request_waiting)] if queued_features else [f.kv_cache_percentage, float(f.input_token_length)]
    return head + [float(f.num_request_running), float(f.prefill_tokens_in_flight), float(f.decode_tokens_in_flight),
                   p, (1.0 - p) * f.input_token_length, float(_prefix_bucket(p))]  # fmt: skip


def tpot_row(f: LatencyFeatures, queued_features: bool = True) -> list[float]:
    """The TPOT model's input row: ``[is_queued, kv, input, waiting, running, prefill_tif, decode_tif,
    tokens generated = 0]`` (is_queued and waiting dropped as in :func:`ttft_row`)."""
    head = [float(f.num_request_waiting > 0), f.kv_cache_percentage, float(f.input_token_length),
            float(f.num_request_waiting)] if queued_features else [f.kv_cache_percentage, float(f.input_token_length)]
    return head + [float(f.num_request_running), float(f.prefill_tokens_in_flight), float(f.decode_tokens_in_flight),
                   0.0]  # fmt: skip


@dataclass(frozen=True, slots=True)
class PredictorSettings:
    """The predictor's knobs, llm-d's defaults (module docstring).

    Attributes:
        model_type: ``xgboost`` (llm-d's default) or ``bayesian-ridge`` (needs scikit-learn, not a
            dependency of the router: for tests and experiments).
        objective: ``mean`` (squared error, the chart's) or ``quantile``.
        quantile: the quantile of the ``quantile`` objective.
        first_refit_ms: the first training's delay after start (ms; their loop sleeps 10 s).
        refit_interval_ms: between trainings (ms; the chart's 10 s).
        min_samples: TTFT + TPOT samples a training needs, and each model of its own (the fresh 10).
        bucket_size: samples kept per bucket.
        test_ratio: share held out by hash.
        max_test_samples: held-out samples kept.
        ensemble: train queue-gated sub-models once each split has ``min_ensemble_split`` samples.
        n_estimators, max_depth, learning_rate, subsample, colsample_bytree, min_child_weight, gamma,
            reg_alpha, reg_lambda: the XGBoost parameters.
        n_jobs: XGBoost threads (1 in the router).
        random_state: XGBoost seed (theirs: 42).
    """

    model_type: str = "xgboost"
    objective: str = "mean"
    quantile: float = 0.9
    first_refit_ms: float = 10_000.0
    refit_interval_ms: float = 10_000.0
    min_samples: int = 10
    bucket_size: int = 500
    test_ratio: float = 0.1
    max_test_samples: int = 1000
    ensemble: bool = True
    min_ensemble_split: int = 200
    n_estimators: int = 200
    max_depth: int = 6
    learning_rate: float = 0.05
    subsample: float = 0.8
    colsample_bytree: float = 0.8
    min_child_weight: float = 5.0
    gamma: float = 0.2
    reg_alpha: float = 0.01
    reg_lambda: float = 0.1
    n_jobs: int = 1
    random_state: int = 42

    def __post_init__(self) -> None:
        if self.model_type not in ("xgboost", "bayesian-ridge"):
            raise ValueError(f"model_type must be xgboost or bayesian-ridge, got {self.model_type!r}")
        need = "xgboost" if self.model_type == "xgboost" else "sklearn"
        if importlib.util.find_spec(need) is None:  # a config error at load, not a failure at the first refit
            raise ValueError(f"model_type {self.model_type} needs the {need} package: pip install 'fairbatch[baselines]'"
                             if need == "xgboost" else f"model_type {self.model_type} needs scikit-learn")  # fmt: skip
        if self.objective not in ("mean", "quantile"):
            raise ValueError(f"objective must be mean or quantile, got {self.objective!r}")
        if self.refit_interval_ms <= 0 or self.first_refit_ms < 0:
            raise ValueError("refit_interval_ms must be > 0 and first_refit_ms >= 0")
        if self.min_samples < 1 or self.bucket_size < 1 or not 0.0 <= self.test_ratio < 1.0:
            raise ValueError("min_samples and bucket_size must be >= 1, test_ratio in [0, 1)")


@dataclass(frozen=True, slots=True)
class Sample:
    """One observed request: its features at dispatch and what it measured (ms; 0 = not measured)."""

    features: LatencyFeatures
    ttft_ms: float
    tpot_ms: float


@dataclass(frozen=True, slots=True)
class TrainingSet:
    """A copy of the training samples (:meth:`LatencyPredictor.snapshot`), safe to train on elsewhere."""

    ttft: tuple[Sample, ...]
    tpot: tuple[Sample, ...]
    settings: PredictorSettings


@dataclass(frozen=True, slots=True)
class FittedModels:
    """What one training produced (None: that model was not retrained and the old one stays).

    Attributes:
        ttft, tpot: the all-samples models.
        gated: (ttft no-queue, ttft queued, tpot no-queue, tpot queued) when the ensemble trained.
        samples: TTFT + TPOT samples trained on.
    """

    ttft: Any = None
    tpot: Any = None
    gated: tuple[Any, Any, Any, Any] | None = None
    samples: int = 0


@dataclass(frozen=True, slots=True)
class _Booster:
    """An XGBoost booster with a ``predict(rows)`` like a regressor's (xgboost's native API: its
    scikit-learn wrapper would need scikit-learn, which the router does not install)."""

    booster: Any

    def predict(self, rows: Any) -> Any:
        return self.booster.inplace_predict(rows)


def _fit(s: PredictorSettings, rows: list[list[float]], targets: list[float]) -> Any:
    """One regressor trained on ``rows`` -> ``targets`` (ms): XGBoost with llm-d's parameters (their
    ``XGBRegressor(n_estimators=200, learning_rate=0.05, ...)`` in the native API's names), or a
    scaled Bayesian ridge."""
    import numpy as np

    x, y = np.asarray(rows, dtype=np.float64), np.asarray(targets, dtype=np.float64)
    if s.model_type == "bayesian-ridge":
        from sklearn.linear_model import BayesianRidge  # optional: not a router dependency
        from sklearn.pipeline import make_pipeline
        from sklearn.preprocessing import StandardScaler

        return make_pipeline(StandardScaler(), BayesianRidge(compute_score=True)).fit(x, y)
    import xgboost as xgb  # imported at the first training only: no placement waits for it

    params: dict[str, Any] = {
        "eta": s.learning_rate, "max_depth": s.max_depth, "subsample": s.subsample,
        "colsample_bytree": s.colsample_bytree, "min_child_weight": s.min_child_weight, "gamma": s.gamma,
        "alpha": s.reg_alpha, "lambda": s.reg_lambda, "tree_method": "hist", "nthread": s.n_jobs,
        "seed": s.random_state, "verbosity": 0,
    }  # fmt: skip
    if s.objective == "mean":
        params["objective"] = "reg:squarederror"
    else:
        params.update(objective="reg:quantileerror", quantile_alpha=s.quantile)
    return _Booster(xgb.train(params, xgb.DMatrix(x, label=y), num_boost_round=s.n_estimators))


def train(data: TrainingSet) -> FittedModels | None:
    """Train on ``data`` (pure: touches no predictor; may run in a worker thread). None when the
    samples together are fewer than ``min_samples`` (no training, llm-d's "skipping training")."""
    s = data.settings
    if len(data.ttft) + len(data.tpot) < s.min_samples:
        return None
    ttft = _fit(s, [ttft_row(x.features) for x in data.ttft], [x.ttft_ms for x in data.ttft]) \
        if len(data.ttft) >= s.min_samples else None  # fmt: skip
    tpot = _fit(s, [tpot_row(x.features) for x in data.tpot], [x.tpot_ms for x in data.tpot]) \
        if len(data.tpot) >= s.min_samples else None  # fmt: skip
    gated = None
    if s.ensemble:
        splits = [[x for x in d if (x.features.num_request_waiting > 0) == q] for d in (data.ttft, data.tpot)
                  for q in (False, True)]  # fmt: skip
        if all(len(p) >= s.min_ensemble_split for p in splits):
            gated = (
                _fit(s, [ttft_row(x.features, False) for x in splits[0]], [x.ttft_ms for x in splits[0]]),
                _fit(s, [ttft_row(x.features) for x in splits[1]], [x.ttft_ms for x in splits[1]]),
                _fit(s, [tpot_row(x.features, False) for x in splits[2]], [x.tpot_ms for x in splits[2]]),
                _fit(s, [tpot_row(x.features) for x in splits[3]], [x.tpot_ms for x in splits[3]]),
            )
    return FittedModels(ttft, tpot, gated, len(data.ttft) + len(data.tpot))


@dataclass(slots=True)
class LatencyPredictor:
    """Online TTFT / TPOT predictor (module docstring). Sans-IO: :meth:`observe` adds a finished
    request, :meth:`refit_due` says when the next training is due, :meth:`fit` trains in place (the
    fleet simulation), or :meth:`snapshot` -> :func:`train` elsewhere -> :meth:`install` (the router:
    the training runs off the event loop); :meth:`predict` answers from the installed models, or the
    cold-start 10 ms before the first training.

    Attributes:
        settings: :class:`PredictorSettings`.
        fits: trainings installed so far.
    """

    settings: PredictorSettings = field(default_factory=PredictorSettings)
    fits: int = 0
    _ttft_buckets: dict[tuple[int, int, int], deque[Sample]] = field(default_factory=dict, repr=False)
    _tpot_buckets: dict[tuple[int, int, int], deque[Sample]] = field(default_factory=dict, repr=False)
    _test: deque[Sample] = field(default_factory=deque, repr=False)
    _models: FittedModels = field(default_factory=FittedModels, repr=False)
    _next_refit_ms: float | None = field(default=None, repr=False)

    def observe(self, features: LatencyFeatures, ttft_ms: float | None, tpot_ms: float | None) -> None:
        """A finished request: its ``features`` at dispatch and its measured TTFT and TPOT (ms; None
        or <= 0: not measured, e.g. TPOT of a one-token answer; nothing kept when neither is)."""
        ttft = ttft_ms if ttft_ms is not None and ttft_ms > 0 and math.isfinite(ttft_ms) else 0.0
        tpot = tpot_ms if tpot_ms is not None and tpot_ms > 0 and math.isfinite(tpot_ms) else 0.0
        if ttft <= 0 and tpot <= 0:
            return
        sample = Sample(features, ttft, tpot)
        s = self.settings
        if (zlib.crc32(repr(sample).encode()) % 100) < s.test_ratio * 100:  # deterministic hold-out
            self._test.append(sample)
            while len(self._test) > s.max_test_samples:
                self._test.popleft()
            return
        key = (_queue_bucket(features.num_request_waiting), _cache_bucket(features.kv_cache_percentage),
               _prefix_bucket(features.prefix_cache_score))  # fmt: skip
        for keep, buckets in ((ttft > 0, self._ttft_buckets), (tpot > 0, self._tpot_buckets)):
            if keep:
                b = buckets.get(key)
                if b is None:
                    b = buckets[key] = deque(maxlen=s.bucket_size)
                b.append(sample)

    def sample_counts(self) -> tuple[int, int, int]:
        """(TTFT training samples, TPOT training samples, held-out samples)."""
        return (sum(map(len, self._ttft_buckets.values())), sum(map(len, self._tpot_buckets.values())),
                len(self._test))  # fmt: skip

    @property
    def trained(self) -> bool:
        """A training was installed (before: the cold-start predictions)."""
        return self._models.ttft is not None or self._models.tpot is not None

    def refit_due(self, now_ms: float) -> bool:
        """A training is due at ``now_ms``: ``first_refit_ms`` after the first call, then every
        ``refit_interval_ms`` after the previous :meth:`snapshot`."""
        if self._next_refit_ms is None:
            self._next_refit_ms = now_ms + self.settings.first_refit_ms
        return now_ms >= self._next_refit_ms

    def snapshot(self, now_ms: float) -> TrainingSet:
        """Copy the training samples for :func:`train` and start the next interval at ``now_ms``."""
        self._next_refit_ms = now_ms + self.settings.refit_interval_ms
        return TrainingSet(tuple(x for b in self._ttft_buckets.values() for x in b),
                           tuple(x for b in self._tpot_buckets.values() for x in b), self.settings)  # fmt: skip

    def install(self, fitted: FittedModels | None) -> bool:
        """Use what a training produced (a model it did not retrain stays); False for None."""
        if fitted is None:
            return False
        old = self._models
        self._models = FittedModels(fitted.ttft if fitted.ttft is not None else old.ttft,
                                    fitted.tpot if fitted.tpot is not None else old.tpot,
                                    fitted.gated if fitted.gated is not None else old.gated, fitted.samples)  # fmt: skip
        self.fits += 1
        return True

    def fit(self, now_ms: float) -> bool:
        """Train now, in place (:meth:`snapshot`, :func:`train`, :meth:`install`); True when a training ran."""
        return self.install(train(self.snapshot(now_ms)))

    def predict(self, features: Sequence[LatencyFeatures]) -> list[tuple[float, float]]:
        """(TTFT ms, TPOT ms) per entry of ``features``, >= 0: the queue-gated sub-model of each pod's
        queue state once the ensemble trained, else the all-samples model, else 10 ms (cold start)."""
        if not features:
            return []
        m = self._models
        ttft = self._predict(features, m.ttft, m.gated[0] if m.gated else None, m.gated[1] if m.gated else None,
                             ttft_row)  # fmt: skip
        tpot = self._predict(features, m.tpot, m.gated[2] if m.gated else None, m.gated[3] if m.gated else None,
                             tpot_row)  # fmt: skip
        return list(zip(ttft, tpot))

    @staticmethod
    def _predict(features: Sequence[LatencyFeatures], model: Any, noqueue: Any, queued: Any,
                 row: Any) -> list[float]:  # fmt: skip
        import numpy as np

        if model is None and noqueue is None:
            return [DEFAULT_PREDICTION_MS] * len(features)
        out = [0.0] * len(features)
        groups: list[tuple[Any, list[int], bool]] = []
        if noqueue is not None and queued is not None:
            idle = [i for i, f in enumerate(features) if f.num_request_waiting <= 0]
            busy = [i for i, f in enumerate(features) if f.num_request_waiting > 0]
            groups = [(noqueue, idle, False), (queued, busy, True)]
        else:
            groups = [(model, list(range(len(features))), True)]
        for mdl, idx, queued_features in groups:
            if not idx:
                continue
            pred = mdl.predict(np.asarray([row(features[i], queued_features) for i in idx], dtype=np.float64))
            for i, p in zip(idx, pred):
                out[i] = max(0.0, float(p))
        return out
