"""The built-in ``pab`` profile computed in one pass (:class:`FusedPabPolicy`): the fast path of the
default chain (filters exclude, healthy, fresh, max-prompt, fits, on-time, window; scorers headroom
and kv-headroom, weight 1 each; picker highest). tests/unit/test_placement_fused.py checks that it
answers exactly as the chain. PURE."""

from __future__ import annotations

import math
from bisect import insort
from collections.abc import Sequence
from dataclasses import dataclass

from replica_agent.policy.pab import _EPS, fits, on_time
from replica_agent.policy.time_model import chunk_cross_tokens
from router.placement.core import (
    DEFAULT_MAX_CANDIDATES,
    PlacementPolicy,
    PlacementRequest,
    PlacementResult,
    ReplicaView,
    effective_prompt_tokens,
)
from router.placement.pickers.highest import HighestScorePicker

_PAB_FILTERS = ("exclude", "healthy", "fresh", "max-prompt", "fits", "on-time", "window")


@dataclass(slots=True)
class FusedPabPolicy(PlacementPolicy):
    """The ``pab`` chain in one pass: same candidates, same order, same refusal reason, same RNG draws.

    ``filters``, ``scorers`` and ``picker`` hold the chain it computes (filters exclude, healthy,
    fresh, max-prompt, fits, on-time, window; scorers headroom and kv-headroom with weight 1 each; a :class:`HighestScorePicker`, whose
    ``rng`` it shares); :meth:`place` reads the views directly instead of calling them, and
    :meth:`place_chain` runs the chain itself. Per view, from its precomputed ``pab_fit`` entry
    (:data:`PabFitEntry`; None = dropped by healthy, fresh or the class lookup): exclude, then the
    fit test with :func:`fits`'s arithmetic (with the request's ``waited_ms`` w), operation for
    operation, so the floats compare the same (the max-prompt limit is folded into the token caps),
    then ``headroom = (pab_ms - w - a - body) / horizon_ms`` with ``body`` = ``TimeModel.prompt_body_ms(P)``
    (``b*P``, plus the cross-chunk term for a prompt over K tokens; -inf when ``horizon_ms <= 0``), then a top-k
    by the picker's key, ascending ``(-headroom, replica_id)`` or, with a seed,
    ``(-headroom, u, replica_id)`` with one ``rng.random()`` per fitting view in input order, as
    :meth:`HighestScorePicker.order` draws them. The result is the chain's order cut to
    ``max_candidates``. A negative prompt or ``waited_ms`` goes to the chain (which raises like :func:`fits`).

    Attributes:
        max_candidates: keep the best this many (>= 1); None = every fitting replica, fully ordered.
    """

    max_candidates: int | None = DEFAULT_MAX_CANDIDATES

    def __post_init__(self) -> None:
        if self.max_candidates is not None and self.max_candidates < 1:
            raise ValueError(f"max_candidates must be >= 1 or None, got {self.max_candidates}")
        if not isinstance(self.picker, HighestScorePicker):
            raise TypeError("FusedPabPolicy needs a HighestScorePicker (it shares its tie-break RNG)")

    def place_chain(self, request: PlacementRequest, replicas: Sequence[ReplicaView]) -> PlacementResult:
        """The filters -> scorer -> picker chain itself (every fitting replica; reference for :meth:`place`)."""
        return PlacementPolicy.place(self, request, replicas)

    def place(self, request: PlacementRequest, replicas: Sequence[ReplicaView]) -> PlacementResult:
        """Ordered candidate replica ids (at most ``max_candidates``), or none with the chain's reason."""
        p_full = request.prompt_tokens
        w = request.waited_ms
        cached = request.cached_tokens
        if p_full < 0 or not w >= 0.0:  # negative (or NaN) waited_ms: the chain raises like fits()
            res = self.place_chain(request, replicas)
            k = self.max_candidates
            return res if k is None else PlacementResult(res.candidates[:k], res.reason)
        slo_class = request.slo_class
        exclude = request.exclude
        on_time_only = request.on_time_only
        window_steps = request.window_steps
        step_tokens = request.step_tokens
        rng = self.picker.rng  # type: ignore[attr-defined]
        draw = None if rng is None else rng.random
        k = self.max_candidates
        inf = math.inf
        top: list[tuple] = []  # picker keys, ascending (best first); at most k when k is set
        n_top = 0
        worst_ns = inf  # -headroom of the k-th best once the top-k is full; worse ones are skipped
        worst: tuple = ()
        for v in replicas:
            f = v.pab_fit.get(slo_class)
            if f is None:  # unhealthy, stale, no time model, or no budget for the class
                continue
            (rid, a, b, horizon_eps, pab_eps, pab_minus_a, h, normal_max, oversize_max, pab, infl, kv_lim, kv_scale,
             e_cross, k_cross) = f
            if exclude and rid in exclude:
                continue
            p = p_full
            if cached:  # prefix-aware: price the uncached tokens; the max-prompt rule keeps the whole prompt
                c = cached.get(rid, 0)
                if c > 0:
                    mp = v.max_prompt_tokens
                    if mp > 0 and p_full > mp:
                        continue
                    p = p_full - c if c < p_full else 0
            bp = b * p
            # fits(): the time model's prefill_ms(P) = a + b*P + e*cross(P), fresh prompt (the same rule for an aged one)
            cost = bp if p <= k_cross else bp + e_cross * chunk_cross_tokens(p, k_cross)
            prefill_ms = a + cost
            if prefill_ms > horizon_eps:  # oversize: only where nothing is reserved and the KV holds it
                if not p <= oversize_max:
                    continue
            elif not (prefill_ms <= pab_eps and p <= normal_max):
                continue
            if w:  # aged request: HeadroomScorer and on_time(), operation for operation
                pab_w = pab - w
                pab_minus_a = pab_w - a
                if on_time_only and not (
                    prefill_ms <= (h - w) + _EPS
                    and prefill_ms <= pab_w + _EPS
                    and p <= v.time_model.tokens_within_ms(pab_w)
                ):
                    continue
            elif on_time_only and prefill_ms > horizon_eps:  # on_time(): never for a prompt too long on its own
                continue
            if window_steps > 0 and infl > _EPS and not infl + cost <= window_steps * (a + b * step_tokens) + _EPS:
                continue  # window_admits()
            # -(headroom + kv-headroom): the chain's sum of the two scorers, negated as the picker does
            ns = inf if h <= 0 else -(((pab_minus_a - cost) / h) + (kv_lim - p) / kv_scale)
            if draw is None:
                if ns > worst_ns:
                    continue
                key: tuple = (ns, rid)
            else:
                u = draw()  # drawn for every fitting view, like HighestScorePicker.order
                if ns > worst_ns:
                    continue
                key = (ns, u, rid)
            if k is None:
                top.append(key)
            elif n_top < k:
                insort(top, key)
                n_top += 1
                if n_top == k:
                    worst = top[-1]
                    worst_ns = worst[0]
            elif key < worst:
                top.pop()
                insort(top, key)
                worst = top[-1]
                worst_ns = worst[0]
        if not top:
            return PlacementResult((), _refusal_reason(request, replicas))
        if k is None:
            top.sort()
        return PlacementResult(tuple([key[-1] for key in top]))


def _refusal_reason(request: PlacementRequest, replicas: Sequence[ReplicaView]) -> str:
    """Name of the first ``pab`` filter that leaves no replica (``exclude`` when there are none).

    A view passes the filters in order; the survivors of filter i are the views that passed more
    than i of them, so the first empty filter is the furthest any view got.
    """
    p_full = request.prompt_tokens
    furthest = 0
    last = len(_PAB_FILTERS) - 1
    for v in replicas:
        if v.replica_id in request.exclude:
            stage = 0
        elif not v.healthy:
            stage = 1
        elif not (v.fresh and v.time_model is not None):
            stage = 2
        elif not (v.max_prompt_tokens <= 0 or p_full <= v.max_prompt_tokens):
            stage = 3
        else:
            p = effective_prompt_tokens(request, v.replica_id)
            budget = v.classes.get(request.slo_class)
            tm = v.time_model
            if budget is None or not fits(p, budget, tm, request.waited_ms):
                stage = 4
            elif request.on_time_only and not on_time(p, budget, tm, request.waited_ms):
                stage = 5
            else:
                stage = 6  # the window (or the caller saw no candidate otherwise)
        if stage > furthest:
            furthest = stage
            if furthest == last:
                break
    return _PAB_FILTERS[furthest]
