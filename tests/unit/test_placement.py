"""router/placement.py: made-up budget states -> "routed to X" or "none fits (reason)".

Time model in every case: a = 10 ms, b = 0.1 ms/token, c = 0 -> a prompt of P tokens needs
10 + 0.1 * P ms of prefill. Horizon 450 ms (ttft 500 minus a 10 % margin).
"""

from __future__ import annotations

from replica_agent.policy.pab import ClassBudget
from router.placement import (
    PlacementPolicy,
    PlacementRequest,
    ReplicaView,
    default_registry,
    fits,
    prompt_exceeds_every_replica,
)
from replica_agent.policy.time_model import TimeModel

TM = TimeModel(10.0, 0.1, 0.0)
H = 450.0


def replica(rid: str, pab_ms: float, *, healthy: bool = True, fresh: bool = True, kv: int = 100_000,
            max_prompt: int = 0, cls: str = "interactive") -> ReplicaView:
    pab_tokens = min(TM.tokens_within_ms(pab_ms), kv)
    reserved = H - pab_ms  # whatever is not available is reserved (decodes here)
    return ReplicaView(
        replica_id=rid,
        healthy=healthy,
        fresh=fresh,
        time_model=TM,
        classes={
            cls: ClassBudget(
                slo_class=cls, ttft_ms=500.0, tpot_ms=50.0, horizon_ms=H, pab_ms=pab_ms, pab_tokens=pab_tokens,
                decode_reservation_ms=reserved, inflight_reservation_ms=0.0, kv_free_tokens=kv,
                kv_limited_tokens=kv, decode_iterations=1 if reserved > 0 else 0,
            )
        },
        max_prompt_tokens=max_prompt,
    )


def pab_chain_then(extra_filter) -> PlacementPolicy:
    """The default ``pab`` chain with one more filter after its own (an opt-in filter's tests)."""
    chain = default_registry().build("pab-chain")
    return PlacementPolicy([*chain.filters, extra_filter], chain.scorers, chain.picker)


def place(replicas, prompt_tokens: int, cls: str = "interactive", exclude=frozenset(), seed=None):
    policy = default_registry().build("pab", seed=seed)
    return policy.place(PlacementRequest(cls, prompt_tokens, frozenset(exclude)), replicas)


def test_routed_to_replica_with_most_headroom() -> None:
    # P = 1000 -> prefill 110 ms. Headroom r0: (200-110)/450, r1: (400-110)/450, r2: (300-110)/450.
    res = place([replica("r0", 200), replica("r1", 400), replica("r2", 300)], 1000)
    assert res.candidates == ("r1", "r2", "r0")
    assert res.reason == ""


def test_only_fitting_replicas_are_candidates() -> None:
    # P = 2000 -> 210 ms: r0 (200 ms) does not fit, r1 (250 ms) does.
    res = place([replica("r0", 200), replica("r1", 250)], 2000)
    assert res.candidates == ("r1",)


def test_none_fits() -> None:
    res = place([replica("r0", 100), replica("r1", 50)], 2000)
    assert res.candidates == ()
    assert res.reason == "fits"


def test_kv_limit_blocks_fit() -> None:
    # time fits (400 ms), but pab_tokens = kv-limited 500 < 1000 tokens.
    res = place([replica("r0", 400, kv=500), replica("r1", 150)], 1000)
    assert res.candidates == ("r1",)


def test_stale_replica_excluded() -> None:
    res = place([replica("r0", 450, fresh=False), replica("r1", 150)], 1000)
    assert res.candidates == ("r1",)
    res = place([replica("r0", 450, fresh=False)], 1000)
    assert res.candidates == () and res.reason == "fresh"


def test_unhealthy_replica_excluded() -> None:
    res = place([replica("r0", 450, healthy=False)], 100)
    assert res.candidates == () and res.reason == "healthy"


def test_no_snapshot_yet_is_not_fresh() -> None:
    never = ReplicaView("r0", healthy=False, fresh=False, time_model=None, classes={})
    assert place([never, replica("r1", 300)], 100).candidates == ("r1",)


def test_unknown_class_fits_nowhere() -> None:
    assert place([replica("r0", 450)], 100, cls="batch").reason == "fits"


def test_excluded_replica_skipped() -> None:
    res = place([replica("r0", 450), replica("r1", 300)], 100, exclude={"r0"})
    assert res.candidates == ("r1",)


def test_ties_lowest_id_or_seeded_rng() -> None:
    reps = [replica("r2", 300), replica("r0", 300), replica("r1", 300)]
    assert place(reps, 100).candidates == ("r0", "r1", "r2")
    a = place(reps, 100, seed=7).candidates
    b = place(reps, 100, seed=7).candidates
    assert a == b and sorted(a) == ["r0", "r1", "r2"]


def test_oversize_prompt_takes_a_whole_idle_replica() -> None:
    # P = 5000 -> 510 ms > H = 450: fits only where pab_ms == H (nothing reserved) and KV allows.
    big = 5000
    assert not fits(big, replica("r0", 449).classes["interactive"], TM)
    assert fits(big, replica("r1", H).classes["interactive"], TM)
    assert not fits(big, replica("r2", H, kv=4000).classes["interactive"], TM)
    res = place([replica("r0", 449), replica("r1", H), replica("r2", H, kv=4000)], big)
    assert res.candidates == ("r1",)


def test_boundary_fit_is_inclusive() -> None:
    # P = 1900 -> exactly 200 ms.
    assert fits(1900, replica("r0", 200).classes["interactive"], TM)
    assert not fits(1901, replica("r0", 200).classes["interactive"], TM)


def test_max_prompt_filter_and_oversize_rule() -> None:
    reps = [replica("r0", 450, max_prompt=1000), replica("r1", 450, max_prompt=2000)]
    assert place(reps, 1500).candidates == ("r1",)
    assert not prompt_exceeds_every_replica(1500, reps)
    assert prompt_exceeds_every_replica(2001, reps)
    # an unknown limit (0) could take it
    assert not prompt_exceeds_every_replica(10**6, reps + [replica("r2", 450, max_prompt=0)])
    assert not prompt_exceeds_every_replica(10, [])


def test_registry_unknown_policy() -> None:
    import pytest

    with pytest.raises(KeyError, match="unknown placement policy 'nope'"):
        default_registry().build("nope")
