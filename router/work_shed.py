"""Work-aware admission under contention (pure: state and work in, decision out).

When the fleet cannot serve every request on time, *which* requests it refuses decides how many it
meets: the GPU time of one large prompt is the budget of several small ones. PAB alone refuses the
requests that arrive when the budget is spent, whatever their size; a large prompt that arrives just
after a quiet spell is placed, and the small prompts of the next burst miss on the budget it took.
This rule refuses, while the router is refusing for lack of budget anyway, the arrivals whose
predicted work is in the costliest fraction of recent arrivals, so that the budget goes to the many
cheaper ones. It raises request-weighted SLO attainment (goodput in requests) and lowers
token-weighted attainment: an operator opts in (``admission.work_shed.enabled``, off by default).

**Work of a request** (:func:`request_work_ms`): the GPU time it adds to the steps it runs in, by the
replica's time model (docs/design.md section 3; the fixed cost ``a`` is the step's, not the request's):
a prompt of P tokens chunked over steps costs ``b*P + e*P^2/2`` (the chunk x prefix term summed over
its chunks: ``sum c_k x_k = (P^2 - sum c_k^2) / 2``, taken at its upper value ``P^2 / 2``); each of its O
decodes costs ``b + d`` plus ``c`` per context token, the context of decode j being ``P + j``, so
``O*(b + d) + c*(O*P + O*(O - 1)/2)``. O is the request's ``max_tokens`` (the decode estimate the fair
queue charges, router/charges.py). The same terms as loadgen/fleet/bound.py's per-request work.

**Contention** (:class:`WorkShed`): ``s``, the share of recent arrivals that the router refused or shed
for lack of budget (``slo-infeasible`` at arrival or from the queue, ``queue-timeout``), as an
exponentially weighted count per arrival: every arrival multiplies ``s`` by ``1 - 1/horizon``, every
such refusal adds ``1/horizon`` (about the last ``horizon`` arrivals count). Refusals by this rule are
not counted (the rule would otherwise feed itself).

**Decision**: the share refused by work is ``q = min(max_share, gain * s)`` (a proportional
controller: at equilibrium the budget refusals that remain are ``q / gain`` of the arrivals, the signal
that keeps it on); an arrival is refused when ``q > 0``, at least ``min_samples`` works are known,
and its work exceeds the ``(1 - q)`` quantile of the last ``window`` arrivals' works (the smallest
sample w with at least ``ceil((1 - q) * n)`` samples <= w). Without contention (``s = 0``) nothing
is refused by work.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from replica_agent.policy.time_model import TimeModel
from router.placement import ReplicaView

REASON = "work-shed"
"""The refusal's reason (``x-fairbatch-reason``, the fleet simulation's record)."""


def request_work_ms(tm: TimeModel, prompt_tokens: int, decode_tokens: int) -> float:
    """GPU time (ms) a request adds to the steps it runs in (module docstring, "Work").

    Args:
        tm: the replica's time model (ms, ms/token, ms/token^2).
        prompt_tokens: P, the prompt tokens left to compute (>= 0).
        decode_tokens: O, the decode estimate (>= 0).

    Returns:
        ``b*P + e*P^2/2 + O*(b + d) + c*(O*P + O*(O - 1)/2)`` in ms.
    """
    p = max(0, prompt_tokens)
    o = max(0, decode_tokens)
    b, c, e, d = tm.b_ms_per_new_token, tm.c_ms_per_context_token, tm.e_ms_per_chunk_prefix, tm.d_ms_per_decode
    return b * p + e * p * p / 2.0 + o * (b + d) + c * (o * p + o * (o - 1) / 2.0)


@dataclass(frozen=True, slots=True)
class WorkShedSettings:
    """The rule's knobs (router/config.py ``admission.work_shed``; module docstring).

    Attributes:
        gain: refused-by-work share per unit of budget-refusal share (> 0).
        max_share: the largest share of arrivals refused by work, in (0, 1).
        window: arrivals whose works form the quantile (>= 1).
        horizon: arrivals the contention share spans, about (>= 1).
        min_samples: works known before the rule refuses anything (>= 1).
    """

    gain: float = 4.0
    max_share: float = 0.25
    window: int = 2000
    horizon: int = 100
    min_samples: int = 200

    def __post_init__(self) -> None:
        if not (self.gain > 0 and 0 < self.max_share < 1 and self.window >= 1 and self.horizon >= 1
                and self.min_samples >= 1):  # fmt: skip
            raise ValueError(f"work_shed needs gain > 0, 0 < max_share < 1, window, horizon, min_samples >= 1; "
                             f"got {self}")


class WorkShed:
    """The contention share and the recent works of one router (module docstring).

    Call :meth:`arrive` once per new request (not again when it is re-placed) and
    :meth:`budget_refused` once per request refused or shed for lack of budget.
    """

    __slots__ = ("settings", "_decay", "_share", "_recent", "_sorted")

    def __init__(self, settings: WorkShedSettings) -> None:
        self.settings = settings
        self._decay = 1.0 - 1.0 / settings.horizon
        self._share = 0.0
        self._recent: deque[float] = deque()
        self._sorted: list[float] = []

    @property
    def contention_share(self) -> float:
        """``s``: the recent share of arrivals refused for lack of budget (in [0, 1])."""
        return self._share

    def refuse_share(self) -> float:
        """``q = min(max_share, gain * s)``: the share of arrivals refused by work now."""
        return min(self.settings.max_share, self.settings.gain * self._share)

    def threshold_ms(self) -> float:
        """The ``(1 - q)`` quantile of the recent works (ms); inf while ``q = 0`` or fewer than
        ``min_samples`` works are known."""
        n = len(self._sorted)
        q = self.refuse_share()
        if q <= 0.0 or n < self.settings.min_samples:
            return math.inf
        k = max(1, math.ceil((1.0 - q) * n - 1e-9))
        return self._sorted[k - 1]

    def arrive(self, work_ms: float) -> bool:
        """A new request of predicted work ``work_ms`` arrives: True when it is refused by work.

        The decision uses the state before this arrival; then its work joins the window and the
        contention share decays by one arrival."""
        refuse = work_ms > self.threshold_ms()
        self._share *= self._decay
        s = self.settings
        self._recent.append(work_ms)
        bisect.insort(self._sorted, work_ms)
        if len(self._recent) > s.window:
            old = self._recent.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, old)]
        return refuse

    def budget_refused(self) -> None:
        """A request was refused or shed for lack of budget (``slo-infeasible``, ``queue-timeout``)."""
        self._share = min(1.0, self._share + 1.0 / self.settings.horizon)


BUDGET_REASONS = frozenset({"slo-infeasible", "queue-timeout"})
"""Refusal reasons that count as contention (the router ran out of budget for the request)."""


def views_time_model(views: Iterable[ReplicaView]) -> TimeModel | None:
    """The time model the work is priced with: that of the first healthy, fresh view that has one
    (replicas of one fleet share a profile); None when there is none (then nothing is refused)."""
    for v in views:
        if v.healthy and v.fresh and v.time_model is not None:
            return v.time_model
    return None


def refuse_by_work(gate: WorkShed, views: Iterable[ReplicaView], prompt_tokens: int, decode_tokens: int) -> bool:
    """The arrival step of the rule, as the router and the fleet simulation run it: price the new
    request (:func:`request_work_ms` on :func:`views_time_model`) and :meth:`WorkShed.arrive` it.
    True: refuse it (reason :data:`REASON`). Without a usable view the request is neither priced nor
    counted (False)."""
    tm = views_time_model(views)
    if tm is None:
        return False
    return gate.arrive(request_work_ms(tm, prompt_tokens, decode_tokens))
