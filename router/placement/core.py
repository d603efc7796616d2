"""Placement core: the data placement reads and returns, the plugin interfaces and the policy
that chains them. PURE (plain data in, plain data out, no I/O, no clock).

A placement policy is filters -> scorers -> picker (the shape of llm-d's endpoint picker):
filters drop replicas that must not get the prompt, scorers give each remaining replica a number
(weighted and summed), the picker orders them; the caller reserves on the first and falls back to
the next. Plugins live one per file in ``router/placement/filters``, ``scorers`` and ``pickers``
and are found by name (router/placement/registry.py); hooks (:class:`PostDecisionHook`) see every
decision after the Reserve was granted, for plugins that learn.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from replica_agent.policy.pab import _EPS, ClassBudget, fits, on_time  # _EPS: fits()'s 1e-9 ms tolerance, reused as is
from replica_agent.policy.time_model import TimeModel
from router.placement.flow_control import FlowControlSettings

DEFAULT_MAX_CANDIDATES = 3  # candidates the ``pab`` policy returns: the Reserve calls a router tries

# The router's view of one replica's PAB for one SLO class is the agent's own ClassBudget
# (mirrors proto ClassBudget: horizon_ms, pab_ms, pab_tokens, decode/inflight reservations,
# kv_limited_tokens ...), so placement applies exactly the agent's fit rule ``fits``:
# ``a + b*P <= pab_ms and P <= pab_tokens`` (a + b*P: the time model's prefill_ms(P), with its
# cross-chunk term); a prompt with ``a + b*P > horizon_ms`` fits only
# where nothing is reserved and ``P <= kv_limited_tokens`` (it takes a whole idle replica).
ClassBudgetView = ClassBudget


# One SLO class of one usable view, as FusedPabPolicy reads it (a plain tuple: one unpack, no
# attribute loads in the hot loop). The fields are the very floats fits() and HeadroomScorer
# compute from the view, so comparisons give the same answers:
#   (replica_id, a_ms, b_ms_per_token, horizon_ms + 1e-9, pab_ms + 1e-9, pab_ms - a_ms, horizon_ms,
#    normal_max_tokens, oversize_max_tokens, pab_ms, inflight_reservation_ms, kv_limited_tokens,
#    kv_scale, e_cross, k_cross)
# e_cross, k_cross: a prompt longer than k_cross tokens adds e_cross * chunk_cross_tokens(P, k_cross) to
# b*P (TimeModel.prompt_body_ms; k_cross = TimeModel.cross_chunk_from, inf for a linear model).
# normal_max_tokens: P <= pab_tokens and the max-prompt limit (one cap, see _tokens_cap);
# oversize_max_tokens: P <= kv_limited_tokens and the max-prompt limit when nothing is reserved
# (pab_ms >= horizon_ms - 1e-9), else -1 (no oversize prompt fits).
# kv_scale = max(kv_free_tokens, kv_limited_tokens, 1), the denominator of KvHeadroomScorer.
# The fit test is the same for a fresh and an aged request (fits(), "Work conservation"); for an
# aged one the fused pass computes the headroom as (pab - w) - a and the on-time test (on_time())
# from horizon_ms and pab_ms, operation for operation.
PabFitEntry = tuple[str, float, float, float, float, float, float, float, float, float, float, int, int, float, float]


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
        inflight_prefill_ms: the in-flight reservation per prefill, in the order the engine serves
            them (ms; replica_agent/policy/pab.py ``inflight_lumps``); ``()`` when unknown.
        inflight_prefill_done_at_ms: when each of those ends (router clock, ms; the same length, or
            ``()`` when unknown).
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
    inflight_prefill_ms: tuple[float, ...] = ()
    inflight_prefill_done_at_ms: tuple[float, ...] = ()
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
    e = tm.e_ms_per_chunk_prefix  # the prompt's cross-chunk term (TimeModel.prompt_body_ms) ...
    k_cross = tm.cross_chunk_from  # ... paid by prompts longer than this (inf: none)
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
            max(cb.kv_free_tokens, cb.kv_limited_tokens, 1), e, k_cross,
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
        request_id: the router's id of the request ("" = not given; a policy that learns from the
            request's end keys it by this: ``llm-d-predicted-latency``).
        ttft_slo_ms, tpot_slo_ms: the request's latency SLO (ms; 0 = none), for policies that
            predict latency (``llm-d-predicted-latency``; the PAB rules read the class budgets).
        sheddable: the request's class may be refused rather than served late.
    """

    slo_class: str
    prompt_tokens: int
    exclude: frozenset[str] = frozenset()
    waited_ms: float = 0.0
    on_time_only: bool = False
    window_steps: float = 0.0
    step_tokens: int = 2048
    cached_tokens: Mapping[str, int] = field(default_factory=dict, compare=False)
    request_id: str = field(default="", compare=False)
    ttft_slo_ms: float = 0.0
    tpot_slo_ms: float = 0.0
    sheddable: bool = False


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


def window_admits(request: PlacementRequest, budget: ClassBudget, time_model: TimeModel,
                  prompt_tokens: int | None = None) -> bool:  # fmt: skip
    """The start-window rule of :class:`PlacementRequest` (``window_steps`` > 0), for one replica:
    ``inflight_ms <= 1e-9 or inflight_ms + body(P) <= window_steps * (a + b*step_tokens) + 1e-9``
    (P = ``prompt_tokens``, default the request's whole prompt; ``body(P)`` =
    ``TimeModel.prompt_body_ms(P)``, ``b*P`` plus the cross-chunk term, as the in-flight reservation
    prices its prompts)."""
    if request.window_steps <= 0:
        return True
    inflight = budget.inflight_reservation_ms
    if inflight <= _EPS:
        return True
    b = time_model.b_ms_per_new_token
    window = request.window_steps * (time_model.a_ms + b * request.step_tokens)
    p = request.prompt_tokens if prompt_tokens is None else prompt_tokens
    return inflight + time_model.prompt_body_ms(p) <= window + _EPS


def apply_filters(
    filters: Sequence[Filter], request: PlacementRequest, replicas: Sequence[ReplicaView]
) -> tuple[Sequence[ReplicaView], str]:
    """Run ``filters`` in order: (the replicas every filter kept, "") or ((), name of the filter that
    left none)."""
    remaining = replicas
    for f in filters:
        remaining = f.filter(request, remaining)
        if not remaining:
            return (), f.name
    return remaining, ""


class PostDecisionHook(Protocol):
    """Told of every placement that ended in a granted Reserve (plugins that learn: a prefix map,
    a load tracker). Must not raise and must not block (it runs on the request path)."""

    name: str

    def after_decision(self, request: PlacementRequest, replica_id: str) -> None: ...


OVERLOAD_FILTERS = frozenset({"dynamo-busy"})
"""Filters that drop replicas for being busy: when one of them leaves no replica, a direct placement
is refused ``overloaded`` (HTTP 529, as Dynamo's frontend answers "all workers busy"), not
``no-replica`` (router/core.py ``RouterCore.acquire``, router/answers.py ``overloaded``)."""


class SaturationGate(Protocol):
    """A baseline's router-queue gate (:class:`DirectAdmission` ``hold``)."""

    def saturated(self, replicas: Sequence[ReplicaView]) -> bool:
        """True while no replica has room (new requests are held at the router)."""
        ...


@dataclass(frozen=True, slots=True)
class DirectAdmission:
    """How a baseline profile (router/placement/baselines.py) has its placements admitted: like the
    router it imitates, it admits every request and forwards it at once to its first candidate, with
    no PAB fit, no admission queue and no lease (router/core.py ``RouterCore``, "Baseline profiles").

    Attributes:
        queue_cap_tokens: None = the replica takes whatever it is sent; a number
            (``static-queue-cap``): the replica refuses a prompt while it has work and its queued
            prompt tokens plus this one would exceed the cap, and the router tries the next
            candidate (at most :data:`DEFAULT_MAX_CANDIDATES` in all).
        flow_control: None = placed at once; else (``llm-d-flow-control``) llm-d's Flow Control
            settings (router/placement/flow_control.py, with its saturation detector,
            router/placement/saturation.py): while the pool is saturated the request waits at the
            router in llm-d's band / fairness / FCFS order (router/core.py ``RouterCore.dispatch_held``).
        hold: None = no router queue (the engine's waiting queue absorbs bursts); a
            :class:`SaturationGate` (``dynamo-kv``: Dynamo's ``--router-queue-threshold``): while it
            says every replica is saturated, the router holds new requests in a small first come,
            first served queue and places them as capacity frees (router/core.py ``RouterCore.dispatch_held``).
    """

    queue_cap_tokens: int | None = None
    flow_control: FlowControlSettings | None = None
    hold: SaturationGate | None = None

    def __post_init__(self) -> None:
        if self.queue_cap_tokens is not None and self.queue_cap_tokens < 0:
            raise ValueError(f"queue_cap_tokens must be >= 0, got {self.queue_cap_tokens}")


@dataclass(slots=True)
class PlacementPolicy:
    """Filters, then the weighted sum of scorers, then the picker.

    Attributes:
        filters: applied in order; the first that leaves no replica names the refusal.
        scorers: (scorer, weight) pairs summed into one score.
        picker: orders the scored replicas.
        hooks: told of every granted placement (:meth:`after_decision`).
        direct: None (PAB admission: the router reserves budget on the candidates, queues when none
            fits); a :class:`DirectAdmission` for a baseline profile.
        prefix_map: the policy reads the router's prefix map (``PlacementRequest.cached_tokens``), so
            the router keeps one even when ``placement.prefix_cache`` is off (the cache-aware
            baselines: their routers always learn from their own picks).
    """

    filters: Sequence[Filter]
    scorers: Sequence[tuple[Scorer, float]]
    picker: Picker
    hooks: Sequence[PostDecisionHook] = field(default=(), kw_only=True)
    direct: DirectAdmission | None = field(default=None, kw_only=True)
    prefix_map: bool = field(default=False, kw_only=True)

    def after_decision(self, request: PlacementRequest, replica_id: str) -> None:
        """The caller's Reserve on ``replica_id`` was granted for ``request``: tell every hook."""
        for h in self.hooks:
            h.after_decision(request, replica_id)

    def place(self, request: PlacementRequest, replicas: Sequence[ReplicaView]) -> PlacementResult:
        """Ordered candidate replica ids for ``request`` (empty with a reason when none fits)."""
        remaining, dropped_by = apply_filters(self.filters, request, replicas)
        if not remaining:
            return PlacementResult((), dropped_by)
        if len(self.scorers) == 1:  # the common case, without a generator per replica
            scorer, weight = self.scorers[0]
            scored = [(r, weight * scorer.score(request, r)) for r in remaining]
        else:
            scored = [(r, sum(w * s.score(request, r) for s, w in self.scorers)) for r in remaining]
        return PlacementResult(tuple(self.picker.order(scored)))


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
