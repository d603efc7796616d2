"""Placement: which replica takes a prompt. PURE (plain data in, plain data out, no I/O, no clock).

Filters -> scorers -> picker (STYLE.md, llm-d endpoint picker):

- filters drop replicas that must not get the prompt: already tried, unhealthy, stale budget
  (not received within its TTL), prompt above the engine's max length, prompt does not fit the
  PAB of its SLO class (docs/architecture.md, section "PAB"; the agent's
  ``replica_agent.policy.pab.fits``): ``a + b*P <= PAB_ms(k)`` and ``P <= PAB_tokens(k)``; a
  prompt whose ``a + b*P`` exceeds the horizon H fits only on a replica with nothing reserved
  and enough KV (``P <= kv_limited_tokens``). The fit is the same for a request that already
  waited ``w`` ms (``PlacementRequest.waited_ms``; pab.py "Work conservation": a late request takes
  the budget a fresh arrival would take, at once); ``on_time_only`` keeps only replicas where it
  can still meet its TTFT (``on_time(..., waited_ms=w)``: ``a + b*P <= PAB_ms(k) - w`` ...), and
  the start window (``window_steps``) keeps only replicas whose un-started prefill work plus this
  prompt fits the work of the next few engine steps (issue 18: the rest waits in the fair queue,
  where tenant weights decide).
- scorers give each remaining replica a number; ``headroom = (pab_ms - w - (a + b*P)) / horizon_ms``
  plus ``kv-headroom = (kv_limited_tokens - P) / max(kv_free_tokens, kv_limited_tokens, 1)``.
- the picker orders the replicas by score (ties: lowest replica id, or a seeded RNG; the router
  always seeds it, from the YAML's ``placement.seed`` or at random per process); the caller
  reserves on the first and falls back to the next one when the Reserve is refused.

Plugins are looked up by name in a :class:`PlacementRegistry` (no module-level mutable state).
The built-in ``pab`` policy is :class:`FusedPabPolicy`: the same chain (exclude, healthy, fresh,
max-prompt, fits; headroom; highest) computed in one pass over the views, keeping only the best
``max_candidates`` (default 3, the Reserve calls a router makes per placement) instead of sorting
every replica; ``pab-chain`` builds the plugin chain itself (reference, same answers, slower).
"""

from __future__ import annotations

import math
import random
from bisect import insort
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from replica_agent.policy.time_model import TimeModel

from replica_agent.policy.pab import _EPS, ClassBudget, fits, on_time  # _EPS: fits()'s 1e-9 ms tolerance, reused as is

DEFAULT_MAX_CANDIDATES = 3  # candidates the ``pab`` policy returns: the Reserve calls a router tries

# The router's view of one replica's PAB for one SLO class is the agent's own ClassBudget
# (mirrors proto ClassBudget: horizon_ms, pab_ms, pab_tokens, decode/inflight reservations,
# kv_limited_tokens ...), so placement applies exactly the agent's fit rule ``fits``:
# ``a + b*P <= pab_ms and P <= pab_tokens``; a prompt with ``a + b*P > horizon_ms`` fits only
# where nothing is reserved and ``P <= kv_limited_tokens`` (it takes a whole idle replica).
ClassBudgetView = ClassBudget


# One SLO class of one usable view, as FusedPabPolicy reads it (a plain tuple: one unpack, no
# attribute loads in the hot loop). The fields are the very floats fits() and HeadroomScorer
# compute from the view, so comparisons give the same answers:
#   (replica_id, a_ms, b_ms_per_token, horizon_ms + 1e-9, pab_ms + 1e-9, pab_ms - a_ms, horizon_ms,
#    normal_max_tokens, oversize_max_tokens, pab_ms, inflight_reservation_ms, kv_limited_tokens,
#    kv_scale)
# normal_max_tokens: P <= pab_tokens and the max-prompt limit (one cap, see _tokens_cap);
# oversize_max_tokens: P <= kv_limited_tokens and the max-prompt limit when nothing is reserved
# (pab_ms >= horizon_ms - 1e-9), else -1 (no oversize prompt fits).
# kv_scale = max(kv_free_tokens, kv_limited_tokens, 1), the denominator of KvHeadroomScorer.
# The fit test is the same for a fresh and an aged request (fits(), "Work conservation"); for an
# aged one the fused pass computes the headroom as (pab - w) - a and the on-time test (on_time())
# from horizon_ms and pab_ms, operation for operation.
PabFitEntry = tuple[str, float, float, float, float, float, float, float, float, float, float, int, int]


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """One replica as placement sees it at one instant.

    A view is a snapshot: ``classes`` must not change after it is built (:meth:`BudgetBook.views`
    gives each view its own copy), because the view precomputes ``pab_fit`` from it.

    Attributes:
        replica_id: replica id.
        healthy: the agent says the engine is reachable and its metrics fresh.
        fresh: the latest snapshot arrived within its TTL (router clock).
        time_model: a, b, c (ms) from the snapshot; None before the first snapshot.
        classes: PAB per SLO class name.
        max_prompt_tokens: engine max model length in tokens (0 = unknown).
        pab_fit: derived, not an argument: per SLO class, the :data:`PabFitEntry` constants of the
            fit rule and headroom; empty when the view is unhealthy, stale or has no time model
            (then the ``pab`` chain drops it before the fit test).
    """

    replica_id: str
    healthy: bool
    fresh: bool
    time_model: TimeModel | None
    classes: Mapping[str, ClassBudget]
    max_prompt_tokens: int = 0
    pab_fit: Mapping[str, PabFitEntry] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "pab_fit", _pab_fit_table(self))


def _tokens_cap(limit: float, max_prompt_tokens: float) -> float:
    """One cap C with ``P <= C`` exactly when ``P <= limit`` and the max-prompt filter passes
    (``max_prompt_tokens <= 0 or P <= max_prompt_tokens``); -1 when a NaN makes both impossible."""
    if max_prompt_tokens <= 0 or limit <= max_prompt_tokens:
        return limit
    if max_prompt_tokens <= limit:
        return max_prompt_tokens
    return -1


def _pab_fit_table(view: ReplicaView) -> dict[str, PabFitEntry]:
    """The view's :data:`PabFitEntry` per class; empty unless healthy, fresh and with a time model."""
    tm = view.time_model
    if not view.healthy or not (view.fresh and tm is not None):
        return {}
    a = tm.a_ms
    b = tm.b_ms_per_new_token
    mp = view.max_prompt_tokens
    table = {}
    for name, cb in view.classes.items():
        if cb is None:
            continue
        h = cb.horizon_ms
        pab = cb.pab_ms
        idle = pab >= h - _EPS  # fits(): nothing reserved, an oversize prompt may take the replica
        table[name] = (
            view.replica_id, a, b, h + _EPS, pab + _EPS, pab - a, h,
            _tokens_cap(cb.pab_tokens, mp),
            _tokens_cap(cb.kv_limited_tokens, mp) if idle else -1,
            pab, cb.inflight_reservation_ms, cb.kv_limited_tokens,
            max(cb.kv_free_tokens, cb.kv_limited_tokens, 1),
        )  # fmt: skip
    return table


@dataclass(frozen=True, slots=True)
class PlacementRequest:
    """What placement needs to know about a request.

    Attributes:
        slo_class: SLO class name.
        prompt_tokens: estimated prompt tokens (tokens).
        exclude: replica ids not to use (already tried for this request).
        waited_ms: ms since the request's arrival at the router (queued or retried), >= 0; its
            TTFT has that much less time left (pab.py "Aged requests"). It does not change the fit
            (pab.py "Work conservation"), only ``on_time_only`` and the headroom.
        on_time_only: keep only replicas where the request can still meet its TTFT
            (:func:`~replica_agent.policy.pab.on_time`); the dispatcher's first pass.
        window_steps: the start window (issue 18): a replica takes the prompt only when its
            un-started prefill work (``inflight_reservation_ms`` of the class budget) plus this
            prompt's ``b*P`` is at most ``window_steps * (a + b * step_tokens)`` ms (the work of the
            next ``window_steps`` engine steps by the replica's own time model), or when nothing
            is pending at all (so a prompt longer than the window still starts). 0 = no window.
        step_tokens: tokens per engine step in that window (vLLM's ``max_num_batched_tokens``).
        cached_tokens: replica id -> prompt tokens estimated to be in that replica's prefix cache
            (router/prefix_index.py; 0 for a replica not listed). The PAB rules and scorers price
            the prompt there at its uncached tokens ``P - cached`` (:func:`effective_prompt_tokens`);
            the max-prompt filter keeps the whole P. Empty = no prefix awareness.
    """

    slo_class: str
    prompt_tokens: int
    exclude: frozenset[str] = frozenset()
    waited_ms: float = 0.0
    on_time_only: bool = False
    window_steps: float = 0.0
    step_tokens: int = 2048
    cached_tokens: Mapping[str, int] = field(default_factory=dict, compare=False)


def effective_prompt_tokens(request: PlacementRequest, replica_id: str) -> int:
    """Prompt tokens the replica must compute: ``P - cached_tokens[replica]`` (at least 0); P itself
    when nothing is cached there (a negative P stays negative, for the rules to refuse)."""
    c = request.cached_tokens.get(replica_id, 0) if request.cached_tokens else 0
    return request.prompt_tokens if c <= 0 else max(0, request.prompt_tokens - c)


@dataclass(frozen=True, slots=True)
class PlacementResult:
    """Ordered candidates (best first) or, when empty, the name of the filter that left none.

    Attributes:
        candidates: replica ids to try in order (the ``pab`` policy keeps the best ``max_candidates``).
        reason: "" when candidates exist, else e.g. ``"fresh"`` or ``"fits"``.
    """

    candidates: tuple[str, ...]
    reason: str = ""


class Filter(Protocol):
    """Replicas in, fewer out (same order)."""

    name: str

    def filter(self, request: PlacementRequest, replicas: Sequence[ReplicaView]) -> list[ReplicaView]: ...


class Scorer(Protocol):
    """Replica -> score (higher is better)."""

    name: str

    def score(self, request: PlacementRequest, replica: ReplicaView) -> float: ...


class Picker(Protocol):
    """Scored replicas -> replica ids in the order to try them."""

    name: str

    def order(self, scored: Sequence[tuple[ReplicaView, float]]) -> list[str]: ...


# ---------------------------------------------------------------- filters


@dataclass(frozen=True, slots=True)
class ExcludeFilter:
    """Drops the replicas already tried for this request."""

    name: str = "exclude"

    def filter(self, request: PlacementRequest, replicas: Sequence[ReplicaView]) -> list[ReplicaView]:
        if not request.exclude:
            return list(replicas)
        return [r for r in replicas if r.replica_id not in request.exclude]


@dataclass(frozen=True, slots=True)
class HealthyFilter:
    """Keeps replicas whose agent reports healthy."""

    name: str = "healthy"

    def filter(self, request: PlacementRequest, replicas: Sequence[ReplicaView]) -> list[ReplicaView]:
        return [r for r in replicas if r.healthy]


@dataclass(frozen=True, slots=True)
class FreshFilter:
    """Keeps replicas whose latest budget arrived within its TTL (else their budget counts as zero)."""

    name: str = "fresh"

    def filter(self, request: PlacementRequest, replicas: Sequence[ReplicaView]) -> list[ReplicaView]:
        return [r for r in replicas if r.fresh and r.time_model is not None]


@dataclass(frozen=True, slots=True)
class MaxPromptFilter:
    """Keeps replicas whose engine accepts a prompt of this length (unknown limit = accepts)."""

    name: str = "max-prompt"

    def filter(self, request: PlacementRequest, replicas: Sequence[ReplicaView]) -> list[ReplicaView]:
        p = request.prompt_tokens
        return [r for r in replicas if r.max_prompt_tokens <= 0 or p <= r.max_prompt_tokens]


@dataclass(frozen=True, slots=True)
class FitsFilter:
    """Keeps replicas where the prompt fits the PAB of its SLO class (see :func:`fits`)."""

    name: str = "fits"

    def filter(self, request: PlacementRequest, replicas: Sequence[ReplicaView]) -> list[ReplicaView]:
        return _keep_by_budget(request, replicas, fits)


def _keep_by_budget(
    request: PlacementRequest, replicas: Sequence[ReplicaView],
    rule: Callable[[int, ClassBudget, TimeModel, float], bool],
) -> list[ReplicaView]:
    """The replicas with a budget for the request's class and a time model on which
    ``rule(uncached prompt tokens, budget, time_model, waited_ms)`` holds (pab.fits, pab.on_time)."""
    out = []
    for r in replicas:
        budget = r.classes.get(request.slo_class)
        if budget is not None and r.time_model is not None and rule(
            effective_prompt_tokens(request, r.replica_id), budget, r.time_model, request.waited_ms
        ):
            out.append(r)
    return out


@dataclass(frozen=True, slots=True)
class OnTimeFilter:
    """With ``request.on_time_only``: keeps replicas where the request can still meet its TTFT
    (:func:`~replica_agent.policy.pab.on_time`); otherwise keeps every replica."""

    name: str = "on-time"

    def filter(self, request: PlacementRequest, replicas: Sequence[ReplicaView]) -> list[ReplicaView]:
        if not request.on_time_only:
            return list(replicas)
        return _keep_by_budget(request, replicas, on_time)


def window_admits(request: PlacementRequest, budget: ClassBudget, time_model: TimeModel,
                  prompt_tokens: int | None = None) -> bool:  # fmt: skip
    """The start-window rule of :class:`PlacementRequest` (``window_steps`` > 0), for one replica:
    ``inflight_ms <= 1e-9 or inflight_ms + b*P <= window_steps * (a + b*step_tokens) + 1e-9``
    (P = ``prompt_tokens``, default the request's whole prompt)."""
    if request.window_steps <= 0:
        return True
    inflight = budget.inflight_reservation_ms
    if inflight <= _EPS:
        return True
    b = time_model.b_ms_per_new_token
    window = request.window_steps * (time_model.a_ms + b * request.step_tokens)
    p = request.prompt_tokens if prompt_tokens is None else prompt_tokens
    return inflight + b * p <= window + _EPS


@dataclass(frozen=True, slots=True)
class WindowFilter:
    """Keeps replicas that can start the prompt within the start window (:func:`window_admits`)."""

    name: str = "window"

    def filter(self, request: PlacementRequest, replicas: Sequence[ReplicaView]) -> list[ReplicaView]:
        if request.window_steps <= 0:
            return list(replicas)
        out = []
        for r in replicas:
            budget = r.classes.get(request.slo_class)
            if budget is not None and r.time_model is not None and window_admits(
                request, budget, r.time_model, effective_prompt_tokens(request, r.replica_id)
            ):
                out.append(r)
        return out


# ---------------------------------------------------------------- scorers


@dataclass(frozen=True, slots=True)
class HeadroomScorer:
    """``(pab_ms - w - (a + b*P)) / horizon_ms``: share of the class horizon left after this prefill
    (``w`` = ``request.waited_ms``, 0 for a fresh request; the ms it already waited are gone too).

    P is the prompt's uncached tokens on that replica (:func:`effective_prompt_tokens`), so a
    replica that holds the prefix scores higher by the prefill time it saves, ``b * cached / H``,
    and a busier one lower by the budget its queued work took: affinity is weighed against load
    in one unit (ms of the TTFT horizon), and the fit filter before it bounds both."""

    name: str = "headroom"

    def score(self, request: PlacementRequest, replica: ReplicaView) -> float:
        budget = replica.classes.get(request.slo_class)
        if budget is None or replica.time_model is None or budget.horizon_ms <= 0:
            return float("-inf")
        tm = replica.time_model
        p = effective_prompt_tokens(request, replica.replica_id)
        return (budget.pab_ms - request.waited_ms - tm.a_ms - tm.b_ms_per_new_token * p) / budget.horizon_ms


@dataclass(frozen=True, slots=True)
class KvHeadroomScorer:
    """``(kv_limited_tokens - P) / max(kv_free_tokens, kv_limited_tokens, 1)``: share of the
    replica's free KV cache left after this prompt (growth reserve and pending prompts already
    taken off, pab.py "KV cache"), so that of two replicas with the same time headroom the one with
    more free KV gets a long prompt."""

    name: str = "kv-headroom"

    def score(self, request: PlacementRequest, replica: ReplicaView) -> float:
        budget = replica.classes.get(request.slo_class)
        if budget is None:
            return float("-inf")
        scale = max(budget.kv_free_tokens, budget.kv_limited_tokens, 1)
        return (budget.kv_limited_tokens - effective_prompt_tokens(request, replica.replica_id)) / scale


# ---------------------------------------------------------------- pickers


@dataclass(slots=True)
class HighestScorePicker:
    """Highest score first; ties by lowest replica id, or shuffled by a seeded RNG when ``seed`` is set.

    With ``seed`` the order is ascending ``(-score, u, replica_id)`` where ``u`` is one
    ``rng.random()`` drawn per scored replica, in input order (:class:`FusedPabPolicy` draws the same).

    Attributes:
        seed: RNG seed for tie-breaks; None = ties by lowest replica id.
        rng: the tie-break RNG (None without ``seed``); its state advances with every call.
    """

    seed: int | None = None
    name: str = "highest"
    rng: random.Random | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.seed is not None:
            self.rng = random.Random(self.seed)

    def order(self, scored: Sequence[tuple[ReplicaView, float]]) -> list[str]:
        if self.rng is None:
            ranked = sorted(scored, key=lambda rs: (-rs[1], rs[0].replica_id))
        else:
            keyed = [(-s, self.rng.random(), r.replica_id) for r, s in scored]
            keyed.sort()
            return [rid for _, _, rid in keyed]
        return [r.replica_id for r, _ in ranked]


# ---------------------------------------------------------------- policy + registry


@dataclass(slots=True)
class PlacementPolicy:
    """Filters, then the weighted sum of scorers, then the picker.

    Attributes:
        filters: applied in order; the first that leaves no replica names the refusal.
        scorers: (scorer, weight) pairs summed into one score.
        picker: orders the scored replicas.
    """

    filters: Sequence[Filter]
    scorers: Sequence[tuple[Scorer, float]]
    picker: Picker

    def place(self, request: PlacementRequest, replicas: Sequence[ReplicaView]) -> PlacementResult:
        """Ordered candidate replica ids for ``request`` (empty with a reason when none fits)."""
        remaining: Sequence[ReplicaView] = replicas
        for f in self.filters:
            remaining = f.filter(request, remaining)
            if not remaining:
                return PlacementResult((), f.name)
        if len(self.scorers) == 1:  # the common case, without a generator per replica
            scorer, weight = self.scorers[0]
            scored = [(r, weight * scorer.score(request, r)) for r in remaining]
        else:
            scored = [(r, sum(w * s.score(request, r) for s, w in self.scorers)) for r in remaining]
        return PlacementResult(tuple(self.picker.order(scored)))


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
    then ``headroom = (pab_ms - w - a - b*P) / horizon_ms`` (-inf when ``horizon_ms <= 0``), then a top-k
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
            rid, a, b, horizon_eps, pab_eps, pab_minus_a, h, normal_max, oversize_max, pab, infl, kv_lim, kv_scale = f
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
            prefill_ms = a + bp  # fits(): a + b*P, fresh prompt (the same rule for an aged one)
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
            if window_steps > 0 and infl > _EPS and not infl + bp <= window_steps * (a + b * step_tokens) + _EPS:
                continue  # window_admits()
            # -(headroom + kv-headroom): the chain's sum of the two scorers, negated as the picker does
            ns = inf if h <= 0 else -(((pab_minus_a - bp) / h) + (kv_lim - p) / kv_scale)
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


def prompt_exceeds_every_replica(prompt_tokens: int, replicas: Sequence[ReplicaView]) -> bool:
    """True when every replica reports a max prompt length (> 0) and the prompt is above all of them.

    A replica with no snapshot yet or an unknown limit (0) could take it, so the answer is False then.
    """
    if not replicas:
        return False
    for r in replicas:
        if r.max_prompt_tokens <= 0 or prompt_tokens <= r.max_prompt_tokens:
            return False
    return True


def largest_max_prompt(replicas: Sequence[ReplicaView]) -> int:
    """The largest max prompt length (tokens) that a replica reports; 0 when none reports one."""
    return max((r.max_prompt_tokens for r in replicas), default=0)


class PlacementRegistry:
    """Name -> factory for filters, scorers and pickers, and named policies built from them."""

    def __init__(self) -> None:
        self.filters: dict[str, Callable[[], Filter]] = {}
        self.scorers: dict[str, Callable[[], Scorer]] = {}
        self.pickers: dict[str, Callable[..., Picker]] = {}
        self.policies: dict[str, Callable[..., PlacementPolicy]] = {}

    def build(self, name: str, **params: object) -> PlacementPolicy:
        """A fresh policy by name.

        Raises:
            KeyError: unknown policy name (the message lists the known ones).
        """
        try:
            factory = self.policies[name]
        except KeyError:
            raise KeyError(f"unknown placement policy {name!r}; known: {', '.join(sorted(self.policies))}") from None
        return factory(**params)


def default_registry() -> PlacementRegistry:
    """Registry with the built-in plugins and two policies of the same chain (filters exclude,
    healthy, fresh, max-prompt, fits, on-time, window; scorers headroom + kv-headroom; picker highest, optional ``seed`` for RNG
    tie-breaks): ``pab`` (:class:`FusedPabPolicy`, one pass, the best ``max_candidates``, default
    :data:`DEFAULT_MAX_CANDIDATES`; None = all) and ``pab-chain`` (the plugin chain, every fitting
    replica ordered)."""
    reg = PlacementRegistry()
    reg.filters.update(
        {
            "exclude": ExcludeFilter,
            "healthy": HealthyFilter,
            "fresh": FreshFilter,
            "max-prompt": MaxPromptFilter,
            "fits": FitsFilter,
            "on-time": OnTimeFilter,
            "window": WindowFilter,
        }
    )
    reg.scorers["headroom"] = HeadroomScorer
    reg.scorers["kv-headroom"] = KvHeadroomScorer
    reg.pickers["highest"] = HighestScorePicker

    def pab_chain(seed: int | None = None) -> PlacementPolicy:
        return PlacementPolicy(
            filters=[reg.filters[n]() for n in _PAB_FILTERS],
            scorers=[(reg.scorers["headroom"](), 1.0), (reg.scorers["kv-headroom"](), 1.0)],
            picker=reg.pickers["highest"](seed=seed),
        )

    def pab_policy(seed: int | None = None, max_candidates: int | None = DEFAULT_MAX_CANDIDATES) -> PlacementPolicy:
        chain = pab_chain(seed)
        return FusedPabPolicy(chain.filters, chain.scorers, chain.picker, max_candidates=max_candidates)

    reg.policies["pab"] = pab_policy
    reg.policies["pab-chain"] = pab_chain
    return reg
