"""llm-d's predicted-latency scheduling as a placement policy (:class:`PredictedLatencyPolicy`, the
``llm-d-predicted-latency`` baseline profile). PURE but for its seeded RNG and what it learns.

llm-d's profile (https://github.com/llm-d/llm-d-inference-scheduler, ``config/charts/epplib/templates/
_config.yaml`` with ``latencyPredictor.enabled``; guide https://llm-d.ai/docs/guides/predicted-latency;
blog "Predicted Latency-Based Scheduling for LLMs", llm-d, 2026-03-13), after the baselines' filters
(exclude, healthy, fresh, max-prompt):

1. ``predicted-latency-producer``: per pod, predicted TTFT and TPOT from the online model
   (router/placement/latency_predictor.py) on the pod's scraped KV-cache usage, waiting and running
   requests, the prompt length, the pod's prefix-cache score and the prompt tokens this router has in
   flight there; headrooms ``TTFT SLO - predicted TTFT`` and, streaming, ``min(TPOT SLO, the lowest
   TPOT SLO of the requests this router runs there) * sloBufferFactor (1) - predicted TPOT``; a pod
   is *valid* when both predictions are strictly below. The SLO is the request's
   ``x-slo-ttft-ms`` / ``x-slo-tpot-ms`` (router/server.py), else its class's ``ttft_ms`` / ``tpot_ms``;
   no SLO: 0, every headroom negative, the scorer then ranks by predicted latency. Streaming mode
   (TTFT at the first token, TPOT trained) is assumed: llm-d's guide supports streaming workloads only.
2. ``latency-slo-admitter``: a sheddable request (llm-d: priority < 0) with an SLO is refused
   (``latency-slo-admitter``) when predictions exist and no pod is valid, none is idle (scraped
   running requests 0) and none is cold (KV-cache usage < 2 %); every other request is admitted.
3. ``prefix-cache-affinity-filter`` at 0.99 (strict), then ``slo-headroom-tier-filter``, then the
   affinity filter at 0.80 (loose). Affinity: with probability 0.01 keep all (exploration); else keep
   the pods whose prefix score ``matched / prompt`` >= the threshold, unless none is, or the best
   such pod's predicted TTFT exceeds the best other pod's by more than 5000 ms. Tier: pods with both
   headrooms >= 0 (positive) or not (negative); with both tiers, the negative one with probability
   0.01, else the positive one.
4. ``latency-scorer`` (``least`` strategy, TTFT weight 0.8, TPOT weight 0.2): only the positive pods
   when any; else only the idle ones (no outstanding request of this router) when any; else the best
   non-empty of: TPOT-only negative, TTFT-only negative, both negative. Within the bucket each
   |headroom| is min-max normalised (0.5 when its range is 0; a dimension of zero range gets weight
   0 and the other 1), blended ``0.8 * nTTFT + 0.2 * nTPOT``, and the score is
   ``(int((1 - blend) * 100) + 1) / 100`` (``least``: closest to the SLO first; ``most``, positive
   bucket only: ``int(blend * 100) + 1``). Others score 0. Without predictions: the composite
   ``(kv_free + relative queue + prefix score) / 3`` rounded to 1/100.
5. ``weighted-random-picker``: A-Res, key ``u ** (1 / score)``, largest key first; all scores <= 0:
   uniform. The order returned is the keys' order (the core takes the first; the rest are fallbacks).

The model learns from this router's own requests: :meth:`PredictedLatencyPolicy.after_decision`
keeps the chosen pod's features at dispatch, :meth:`~PredictedLatencyPolicy.observe_latency` (the
driver, at the request's end) adds them with the TTFT and TPOT measured; trainings run when the
driver calls them (:attr:`~PredictedLatencyPolicy.predictor`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from router.placement.core import PlacementPolicy, PlacementRequest, PlacementResult, ReplicaView, apply_filters
from router.placement.latency_predictor import LatencyFeatures, LatencyPredictor
from router.placement.load import RouterLoad

REASON = "latency-slo-admitter"
"""The refusal reason of the admitter (a direct placement's ``no-replica`` detail)."""


@dataclass(frozen=True, slots=True)
class PredictedLatencySettings:
    """llm-d's defaults (module docstring; each plugin's ``DefaultConfig``).

    Attributes:
        ttft_weight, tpot_weight: the scorer's blend.
        strategy: ``least`` or ``most``.
        epsilon_explore_neg: the tier filter's chance of the negative tier.
        strict_affinity, loose_affinity: the two affinity filters' thresholds.
        affinity_exploration: their chance of keeping all.
        max_ttft_penalty_ms: their TTFT load gate (0: always stick).
        slo_buffer_factor: multiplies the TPOT SLO.
        cold_kv: KV-cache usage below which a pod is cold (the admitter).
        streaming: TPOT headroom counts (False: neutralised to 0 and valid, llm-d's non-streaming mode).
    """

    ttft_weight: float = 0.8
    tpot_weight: float = 0.2
    strategy: str = "least"
    epsilon_explore_neg: float = 0.01
    strict_affinity: float = 0.99
    loose_affinity: float = 0.80
    affinity_exploration: float = 0.01
    max_ttft_penalty_ms: float = 5000.0
    slo_buffer_factor: float = 1.0
    cold_kv: float = 0.02
    streaming: bool = True

    def __post_init__(self) -> None:
        if self.strategy not in ("least", "most"):
            raise ValueError(f"strategy must be least or most, got {self.strategy!r}")
        if not (0 <= self.epsilon_explore_neg <= 1 and 0 <= self.affinity_exploration <= 1):
            raise ValueError("epsilon_explore_neg and affinity_exploration must be in [0, 1]")
        if self.slo_buffer_factor <= 0 or self.max_ttft_penalty_ms < 0 or min(self.ttft_weight, self.tpot_weight) < 0:
            raise ValueError("slo_buffer_factor must be > 0, max_ttft_penalty_ms and the weights >= 0")


@dataclass(frozen=True, slots=True)
class PodPrediction:
    """One pod's prediction for one request (ms). ``tpot_headroom`` is 0 when TPOT is neutralised."""

    replica_id: str
    ttft_ms: float
    tpot_ms: float
    ttft_headroom: float
    tpot_headroom: float
    valid: bool


def features_for(request: PlacementRequest, replica_id: str, load: RouterLoad,
                 prefill_in_flight: int) -> LatencyFeatures:  # fmt: skip
    """The predictor's features of ``replica_id`` for ``request``: the replica's latest scrape from
    ``load`` (never scraped: zeros, as llm-d's empty metrics), the prompt tokens, the prefix score
    ``cached / prompt`` (clamped to 1) and ``prefill_in_flight`` (prompt tokens)."""
    m = load.scraped.get(replica_id)
    p = request.prompt_tokens
    cached = request.cached_tokens.get(replica_id, 0) if request.cached_tokens else 0
    return LatencyFeatures(m.kv_usage if m else 0.0, p, m.num_waiting if m else 0, m.num_running if m else 0,
                           min(1.0, cached / p) if p > 0 and cached > 0 else 0.0, prefill_in_flight)  # fmt: skip


def headroom(replica_id: str, ttft_ms: float, tpot_ms: float, ttft_slo_ms: float, tpot_slo_ms: float,
             pod_min_tpot_slo_ms: float, s: PredictedLatencySettings) -> PodPrediction:  # fmt: skip
    """llm-d's ``validatePrediction``: TTFT headroom ``ttft_slo - ttft`` (valid when ttft < slo);
    streaming, the TPOT bound ``tpot_slo * buffer``, lowered to ``pod_min * buffer`` when the pod
    runs requests with a TPOT SLO (> 0), headroom ``bound - tpot`` (valid when tpot < bound); not
    streaming, TPOT headroom 0 and valid."""
    ttft_ok = ttft_ms < ttft_slo_ms
    tpot_ok, tpot_h = True, 0.0
    if s.streaming:
        bound = tpot_slo_ms * s.slo_buffer_factor
        if pod_min_tpot_slo_ms > 0:
            bound = min(bound, pod_min_tpot_slo_ms * s.slo_buffer_factor)
        tpot_ok, tpot_h = tpot_ms < bound, bound - tpot_ms
    return PodPrediction(replica_id, ttft_ms, tpot_ms, ttft_slo_ms - ttft_ms, tpot_h, ttft_ok and tpot_ok)


def admits(request: PlacementRequest, preds: Sequence[PodPrediction] | None, load: RouterLoad,
           replica_ids: Sequence[str], s: PredictedLatencySettings) -> bool:  # fmt: skip
    """llm-d's ``latency-slo-admitter``: False only for a sheddable request with an SLO when
    predictions exist and no pod is valid, idle (scraped running 0) or cold (KV usage < ``cold_kv``)."""
    if not request.sheddable or not (request.ttft_slo_ms > 0 or request.tpot_slo_ms > 0) or not preds:
        return True
    if any(p.valid for p in preds):
        return True
    for rid in replica_ids:
        m = load.scraped.get(rid)
        if m is None or m.num_running == 0 or m.kv_usage < s.cold_kv:  # never scraped: llm-d's zero metrics
            return True
    return False


def affinity_filter(ids: list[str], prefix: dict[str, float], preds: dict[str, PodPrediction] | None,
                    threshold: float, s: PredictedLatencySettings, rng: random.Random) -> list[str]:  # fmt: skip
    """llm-d's ``prefix-cache-affinity-filter`` at ``threshold`` (module docstring, step 3)."""
    if len(ids) <= 1 or threshold <= 0:
        return ids
    if rng.random() < s.affinity_exploration:
        return ids
    sticky = [r for r in ids if prefix.get(r, 0.0) >= threshold]
    if not sticky:
        return ids
    rest = [r for r in ids if prefix.get(r, 0.0) < threshold]
    if s.max_ttft_penalty_ms > 0 and rest and preds:
        best_sticky = min((preds[r].ttft_ms for r in sticky if r in preds), default=math.inf)
        best_rest = min((preds[r].ttft_ms for r in rest if r in preds), default=math.inf)
        if best_sticky - best_rest > s.max_ttft_penalty_ms:
            return ids
    return sticky


def tier_filter(ids: list[str], preds: dict[str, PodPrediction] | None, s: PredictedLatencySettings,
                rng: random.Random) -> list[str]:  # fmt: skip
    """llm-d's ``slo-headroom-tier-filter`` (module docstring, step 3)."""
    if len(ids) <= 1 or not preds:
        return ids
    pos = [r for r in ids if r in preds and preds[r].ttft_headroom >= 0 and preds[r].tpot_headroom >= 0]
    neg = [r for r in ids if r not in pos]
    if pos and neg:
        return neg if rng.random() < s.epsilon_explore_neg else pos
    return pos or neg


def _bucket_scores(bucket: list[PodPrediction], s: PredictedLatencySettings, least: bool) -> dict[str, float]:
    total = s.ttft_weight + s.tpot_weight
    alpha, beta = (s.ttft_weight / total, s.tpot_weight / total) if total > 0 else (1.0, 0.0)
    tt = [abs(p.ttft_headroom) for p in bucket]
    tp = [abs(p.tpot_headroom) for p in bucket]
    t_lo, t_rng = min(tt), max(tt) - min(tt)
    p_lo, p_rng = min(tp), max(tp) - min(tp)
    eps = 1e-9
    if t_rng <= eps < p_rng:
        alpha, beta = 0.0, 1.0
    elif p_rng <= eps < t_rng:
        alpha, beta = 1.0, 0.0
    out = {}
    for p, a, b in zip(bucket, tt, tp):
        blend = alpha * ((a - t_lo) / t_rng if t_rng > eps else 0.5) + beta * ((b - p_lo) / p_rng if p_rng > eps else 0.5)
        w = int((1.0 - blend) * 100) + 1 if least else int(blend * 100) + 1
        out[p.replica_id] = w / 100
    return out


def latency_scores(ids: list[str], preds: dict[str, PodPrediction] | None, load: RouterLoad,
                   prefix: dict[str, float], s: PredictedLatencySettings) -> dict[str, float]:  # fmt: skip
    """llm-d's ``latency-scorer`` (module docstring, step 4): replica id -> score, 0 for the unscored."""
    scores = dict.fromkeys(ids, 0.0)
    if not preds or not any(r in preds for r in ids):
        return composite_scores(ids, load, prefix)
    positive = [preds[r] for r in ids if r in preds and preds[r].ttft_headroom >= 0 and preds[r].tpot_headroom >= 0]
    if positive:
        scores.update(_bucket_scores(positive, s, s.strategy == "least"))
        return scores
    negative = [preds[r] for r in ids if r in preds]
    idle = [p for p in negative if load.outstanding.get(p.replica_id, 0) == 0]
    if idle:
        scores.update(_bucket_scores(idle, s, True))
        return scores
    tpot_only = [p for p in negative if p.ttft_headroom >= 0 > p.tpot_headroom]
    ttft_only = [p for p in negative if p.ttft_headroom < 0 <= p.tpot_headroom]
    both = [p for p in negative if p.ttft_headroom < 0 and p.tpot_headroom < 0]
    for bucket in (tpot_only, ttft_only, both):
        if bucket:
            scores.update(_bucket_scores(bucket, s, True))
            break
    return scores


def composite_scores(ids: list[str], load: RouterLoad, prefix: dict[str, float]) -> dict[str, float]:
    """The latency scorer's fallback without predictions, weights 1 / 1 / 1:
    ``round(100 * (kv_free + (max_q - q) / max_q + prefix) / 3) / 100`` (relative queue 1 when max_q = 0)."""
    waiting = {r: (load.scraped[r].num_waiting if r in load.scraped else 0) for r in ids}
    max_q = max(waiting.values(), default=0)
    out = {}
    for r in ids:
        kv_free = 1.0 - (load.scraped[r].kv_usage if r in load.scraped else 0.0)
        rel_q = (max_q - waiting[r]) / max_q if max_q > 0 else 1.0
        out[r] = round(100 * (kv_free + rel_q + prefix.get(r, 0.0)) / 3) / 100
    return out


def weighted_random_order(scores: dict[str, float], rng: random.Random) -> list[str]:
    """llm-d's ``weighted-random-picker`` as an order: A-Res keys ``u ** (1 / w)`` (u uniform in
    (0, 1)), largest first; every score <= 0: a uniform shuffle (score <= 0 among positive: last)."""
    ids = list(scores)
    if all(w <= 0 for w in scores.values()):
        rng.shuffle(ids)
        return ids
    keys = {}
    for r in ids:
        u = rng.random() or 1e-300
        keys[r] = u ** (1.0 / scores[r]) if scores[r] > 0 else -1.0 + u
    return sorted(ids, key=lambda r: -keys[r])


@dataclass(slots=True)
class _Dispatched:
    replica_id: str
    features: LatencyFeatures
    prompt_tokens: int
    tpot_slo_ms: float
    in_flight: bool = True  # its prompt still counts in the replica's prefill tokens in flight


@dataclass(slots=True)
class PredictedLatencyPolicy(PlacementPolicy):
    """llm-d's predicted-latency profile after the filters (module docstring).

    Attributes:
        load: the router's load view (scraped metrics, outstanding requests).
        predictor: the online model (the driver trains it: :meth:`LatencyPredictor.refit_due`).
        settings: :class:`PredictedLatencySettings`.
        rng: the exploration and picker RNG (seeded by the profile).
        last: the predictions of the latest :meth:`place` (replica id -> :class:`PodPrediction`; for
            tests and debugging).
    """

    load: RouterLoad = field(default_factory=RouterLoad)
    predictor: LatencyPredictor = field(default_factory=LatencyPredictor)
    settings: PredictedLatencySettings = field(default_factory=PredictedLatencySettings)
    rng: random.Random = field(default_factory=random.Random)
    last: dict[str, PodPrediction] = field(default_factory=dict)
    _features: dict[str, LatencyFeatures] = field(default_factory=dict, repr=False)
    _in_flight: dict[str, int] = field(default_factory=dict, repr=False)
    _dispatched: dict[str, _Dispatched] = field(default_factory=dict, repr=False)

    def prefill_in_flight(self, replica_id: str) -> int:
        """Prompt tokens this router sent to ``replica_id`` whose first token it has not seen."""
        return self._in_flight.get(replica_id, 0)

    def _pod_min_tpot_slo(self, replica_id: str) -> float:
        return min((d.tpot_slo_ms for d in self._dispatched.values()
                    if d.replica_id == replica_id and d.tpot_slo_ms > 0), default=0.0)  # fmt: skip

    def predictions(self, request: PlacementRequest, ids: Sequence[str]) -> dict[str, PodPrediction] | None:
        """Each replica's :class:`PodPrediction` for ``request`` (None when the model failed)."""
        feats = [features_for(request, r, self.load, self._in_flight.get(r, 0)) for r in ids]
        self._features = dict(zip(ids, feats))
        try:
            got = self.predictor.predict(feats)
        except Exception:  # noqa: BLE001 - a broken model: llm-d's "sidecar down" fallback
            return None
        s = self.settings
        return {r: headroom(r, t, p, request.ttft_slo_ms, request.tpot_slo_ms, self._pod_min_tpot_slo(r), s)
                for r, (t, p) in zip(ids, got)}  # fmt: skip

    def place(self, request: PlacementRequest, replicas: Sequence[ReplicaView]) -> PlacementResult:
        remaining, dropped_by = apply_filters(self.filters, request, replicas)
        if not remaining:
            return PlacementResult((), dropped_by)
        ids = [r.replica_id for r in remaining]
        preds = self.predictions(request, ids)
        self.last = preds or {}
        s = self.settings
        if not admits(request, list(preds.values()) if preds else None, self.load, ids, s):
            return PlacementResult((), REASON)
        prefix = {r: f.prefix_cache_score for r, f in self._features.items()}
        kept = affinity_filter(ids, prefix, preds, s.strict_affinity, s, self.rng)
        kept = tier_filter(kept, preds, s, self.rng)
        kept = affinity_filter(kept, prefix, preds, s.loose_affinity, s, self.rng)
        order = weighted_random_order(latency_scores(kept, preds, self.load, prefix, s), self.rng)
        return PlacementResult(tuple(order))

    def after_decision(self, request: PlacementRequest, replica_id: str) -> None:
        """The request went to ``replica_id``: its prompt counts in the replica's prefill tokens in
        flight and its features at dispatch (the latest :meth:`place`'s, the in-flight tokens with
        its own) wait for :meth:`observe_latency`. Hooks then run."""
        n = self._in_flight.get(replica_id, 0) + request.prompt_tokens
        self._in_flight[replica_id] = n
        f = self._features.get(replica_id) or features_for(request, replica_id, self.load, 0)
        if request.request_id:
            old = self._dispatched.pop(request.request_id, None)
            if old is not None:
                self._release(old)
            self._dispatched[request.request_id] = _Dispatched(
                replica_id, LatencyFeatures(f.kv_cache_percentage, f.input_token_length, f.num_request_waiting,
                                            f.num_request_running, f.prefix_cache_score, n),
                request.prompt_tokens, request.tpot_slo_ms)  # fmt: skip
        PlacementPolicy.after_decision(self, request, replica_id)

    def _release(self, d: _Dispatched) -> None:
        if d.in_flight:
            d.in_flight = False
            left = self._in_flight.get(d.replica_id, 0) - d.prompt_tokens
            if left > 0:
                self._in_flight[d.replica_id] = left
            else:
                self._in_flight.pop(d.replica_id, None)

    def first_token(self, request_id: str) -> None:
        """The request's first token came back: its prompt no longer counts in flight."""
        d = self._dispatched.get(request_id)
        if d is not None:
            self._release(d)

    def observe_latency(self, request_id: str, ttft_ms: float | None, tpot_ms: float | None) -> bool:
        """The request ended with ``ttft_ms`` / ``tpot_ms`` measured (None: not measured): its
        features at dispatch and these go to the predictor. False when it was not placed here."""
        d = self._dispatched.pop(request_id, None)
        if d is None:
            return False
        self._release(d)
        self.predictor.observe(d.features, ttft_ms, tpot_ms)
        return True

    def forget(self, request_id: str) -> None:
        """The request ended without a measurement (failed, refused, gone): nothing is learnt."""
        d = self._dispatched.pop(request_id, None)
        if d is not None:
            self._release(d)


TTFT_SLO_HEADER = "x-slo-ttft-ms"
"""llm-d's request header of the TTFT SLO (ms; ``predicted-latency-producer`` ``TTFTSLOHeaderKey``)."""

TPOT_SLO_HEADER = "x-slo-tpot-ms"
"""llm-d's request header of the TPOT SLO (ms)."""


def slo_header_ms(value: str | None) -> float:
    """An SLO header's value in ms: a finite number > 0, else 0 (absent or malformed: llm-d parses
    it as 0, and a 0 here means the request's class SLO)."""
    if not value:
        return 0.0
    try:
        v = float(value)
    except ValueError:
        return 0.0
    return v if v > 0 and math.isfinite(v) else 0.0
