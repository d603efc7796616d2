"""Filter ``long-prompt-pool``: keep a few replicas free of short prompts so that the prompts that
can meet their TTFT only on a replica without young decodes find one. No YAML parameters (the
defaults below). Opt-in.

Why (issue 27; docs/evaluation.md, "A pool for long prompts"). FairBatching bounds every step by the
running decodes' slack, and a decode paced from its first token has about one TPOT of slack
(replica_agent/policy/engine_state.py), so on a replica with young decodes a prompt is prefilled in
steps of about ``tpot`` ms, each paying the decode step's fixed cost ``F`` (``a`` plus the decodes'
own tokens and context). Its prefill then takes about::

    chunked_ms(P) = a + (prefill_ms(P) - a) * tpot / (tpot - F)      (inf when F >= tpot)

where ``prefill_ms(P) = a + b'*P + e*cross(P)`` is the price of the fit rule (replica_agent/policy/time_model.py).
When ``chunked_ms(P)`` exceeds the class's horizon H the prompt is *long*: it meets its TTFT only on a
replica whose decodes have more slack than its prefill (then FairBatching runs it in one or a few big
steps), in practice one without young decodes. Under load every replica that takes short prompts has
young decodes, so PAB refuses the long prompts (or they run late), and they hold a large share of the
tokens: on the Splitwise-fitted 70B engine (a = 28.6 ms, F about 32 ms at TPOT 100 ms) azure-code's
prompts over about 5,900 tokens. On an engine with a small fixed cost no prompt of these traces is
long (8B A100: F about 14 ms, an 8,192-token prompt 700 ms chunked against H = 900 ms) and the filter
changes nothing.

Rule, per placement of the request's class (the filter stands before ``fits`` in the chain, so it sees
every request that reaches placement and every healthy, fresh replica):

- ``F`` = the mean decode step of the candidates that have decodes (``decode_reservation_ms /
  decode_iterations`` of the class budget), ``a`` when none has; the time model, H and ``tpot`` of the
  candidate with the most PAB time. A request that already waited ``w`` ms is judged against ``H - w``
  (pab.py "Aged requests"): a short prompt that waited long enough may take the pool. A budget without
  a TPOT or horizon (an agent that does not send them) leaves the candidates as they are and is not
  counted. Meant for a fleet of one GPU kind: on a mixed fleet the prompt is judged on the roomiest
  candidate's model and the pool is the lowest ids whatever their kind.
- The long prompts' share ``s`` of the prefill work (``prefill_ms`` summed, at the judging candidate's
  price) over the recent distinct requests (an exponential average over about ``window`` requests, each
  request counted once, at its first placement, by its ``request_id``; requests without one are counted
  at every placement). One share for all classes: a fleet-wide mix.
- Pool: the ``k = min(n - 1, ceil(occupancy * s * n))`` replicas with the lowest ids (string order:
  r0, r1, r10, ...) among the ``n`` replicas seen in the last ``forget_calls`` placements (0 when ``s``
  = 0). Router copies that see the same fleet and mix pick the same pool without talking (their ``k`` may
  differ by one near a rounding edge). ``occupancy``: a pool replica is held by a long prompt for its
  prefill and then for its decode tail, during which its decodes are young; 1.5 was chosen on the
  Splitwise-fitted engine (1.0 x ``s n`` + 1 or 2 replicas, 1.5 and 2.0 x ``s n`` measured alike within
  0.7 point of token attainment; docs/evaluation.md).
- A short prompt does not get the pool's replicas; a long prompt gets every candidate (worst fit then
  sends it to the roomiest, usually a pool replica). Soft: when no replica outside the pool passes the
  PAB fit (and, for the dispatcher's on-time pass, the on-time rule), every candidate is kept, so the
  filter never refuses a prompt that fits somewhere.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from replica_agent.policy.pab import ClassBudget, fits, on_time
from replica_agent.policy.time_model import TimeModel
from router.placement.core import PlacementRequest, ReplicaView, _keep_by_budget, effective_prompt_tokens


def chunked_prefill_ms(tm: TimeModel, prompt_tokens: int, step_fixed_ms: float, tpot_ms: float) -> float:
    """A fresh prompt's prefill (ms) in steps of ``tpot_ms`` each paying ``step_fixed_ms`` (module docstring):
    ``a + (prefill_ms(P) - a) * tpot / (tpot - F)``; inf when ``F >= tpot`` (no step leaves room for it)."""
    if step_fixed_ms >= tpot_ms:
        return math.inf
    return tm.a_ms + (tm.prefill_ms(prompt_tokens) - tm.a_ms) * tpot_ms / (tpot_ms - step_fixed_ms)


def pool_size(share: float, replicas: int, occupancy: float) -> int:
    """Replicas kept for long prompts: 0 when ``share`` <= 0, else ``min(replicas - 1, ceil(occupancy *
    share * replicas))`` (one replica always stays open to short prompts)."""
    if share <= 0.0 or replicas <= 1:
        return 0
    return min(replicas - 1, math.ceil(occupancy * share * replicas - 1e-9))


@dataclass(slots=True)
class LongPromptPoolFilter:
    """Short prompts leave the lowest-id ``k`` replicas to long ones (module docstring). Stateful: the
    long prompts' work share and the replicas seen; no clock.

    Attributes:
        occupancy: pool replicas per unit of the long prompts' share of the fleet (> 0).
        window: requests over which the work share is averaged (exponential, weight 1/window; >= 1).
        forget_calls: a replica not among the candidates of this many placements leaves the pool's
            ranking (a replica gone from the fleet; >= 1); the map of replicas seen is pruned that often.
        seen_ids: request ids remembered so that a request's later placements are not counted again.

    The averages start at 0 with each instance: a router that reloads its configuration builds a new
    one and keeps no pool until long prompts come again.

    Raises:
        ValueError: a parameter out of range.
    """

    occupancy: float = 1.5
    window: int = 512
    forget_calls: int = 65536
    seen_ids: int = 4096
    name: str = "long-prompt-pool"
    _long_ms: float = field(default=0.0, repr=False)
    _all_ms: float = field(default=0.0, repr=False)
    _calls: int = field(default=0, repr=False)
    _known: dict[str, int] = field(default_factory=dict, repr=False)
    _seen: dict[str, None] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not self.occupancy > 0.0:
            raise ValueError(f"occupancy must be > 0, got {self.occupancy}")
        if self.window < 1 or self.forget_calls < 1 or self.seen_ids < 1:
            raise ValueError("window, forget_calls and seen_ids must be >= 1")

    @property
    def long_share(self) -> float:
        """The long prompts' share of the recent prefill work (0..1; 0 before any request)."""
        return self._long_ms / self._all_ms if self._all_ms > 0.0 else 0.0

    def pool(self) -> list[str]:
        """The replica ids held from short prompts now (lowest ids first)."""
        known = sorted(rid for rid, at in self._known.items() if self._calls - at < self.forget_calls)
        return known[: pool_size(self.long_share, len(known), self.occupancy)]

    def _count(self, request: PlacementRequest, prefill_ms: float, long: bool) -> None:
        """Add one request's prefill price (ms) to the averages, once per ``request_id``."""
        rid = request.request_id
        if rid:
            if rid in self._seen:
                return
            self._seen[rid] = None
            if len(self._seen) > self.seen_ids:
                del self._seen[next(iter(self._seen))]
        w = 1.0 / self.window
        self._long_ms += w * ((prefill_ms if long else 0.0) - self._long_ms)
        self._all_ms += w * (prefill_ms - self._all_ms)

    def filter(self, request: PlacementRequest, replicas: Sequence[ReplicaView]) -> list[ReplicaView]:
        """The candidates a prompt may use (module docstring)."""
        self._calls += 1
        for r in replicas:
            self._known[r.replica_id] = self._calls
        if self._calls % self.forget_calls == 0:  # bound the map: drop the forgotten
            self._known = {k: v for k, v in self._known.items() if self._calls - v < self.forget_calls}
        cls = request.slo_class
        top: tuple[ReplicaView, ClassBudget, TimeModel] | None = None  # the candidate with the most PAB time
        steps: list[float] = []
        for r in replicas:
            cb, model = r.classes.get(cls), r.time_model
            if cb is None or model is None:
                continue
            if cb.decode_iterations > 0:
                steps.append(cb.decode_reservation_ms / cb.decode_iterations)
            if top is None or cb.pab_ms > top[1].pab_ms:
                top = (r, cb, model)
        if top is None:
            return list(replicas)
        view, budget, tm = top
        if not (budget.tpot_ms > 0.0 and budget.horizon_ms > 0.0):
            return list(replicas)
        prompt = effective_prompt_tokens(request, view.replica_id)
        step_fixed = sum(steps) / len(steps) if steps else tm.a_ms
        chunked = chunked_prefill_ms(tm, prompt, step_fixed, budget.tpot_ms)
        self._count(request, tm.prefill_ms(prompt), chunked > budget.horizon_ms)
        if chunked > max(0.0, budget.horizon_ms - request.waited_ms):
            return list(replicas)
        held = set(self.pool())
        kept = [r for r in replicas if r.replica_id not in held]
        usable = _keep_by_budget(request, kept, fits)
        if request.on_time_only:
            usable = _keep_by_budget(request, usable, on_time)
        return kept if usable else list(replicas)


PLUGIN = LongPromptPoolFilter
