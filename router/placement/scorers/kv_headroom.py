"""Scorer ``kv-headroom``: share of the free KV cache left after this prompt. No parameters; weight in the profile."""

from __future__ import annotations

from dataclasses import dataclass

from router.placement.core import PlacementRequest, ReplicaView, effective_prompt_tokens

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


PLUGIN = KvHeadroomScorer
