"""Scorer ``headroom``: share of the TTFT horizon left after this prefill (docs/design.md section 9).
No parameters; weight in the profile."""

from __future__ import annotations

from dataclasses import dataclass

from router.placement.core import PlacementRequest, ReplicaView, effective_prompt_tokens

@dataclass(frozen=True, slots=True)
class HeadroomScorer:
    """``(pab_ms - w - prefill_ms(P)) / horizon_ms`` (``prefill_ms(P) = a + b*P + e*cross(P)``,
    replica_agent/policy/time_model.py): share of the class horizon left after this prefill
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
        return (budget.pab_ms - request.waited_ms - tm.a_ms - tm.prompt_body_ms(p)) / budget.horizon_ms


PLUGIN = HeadroomScorer
