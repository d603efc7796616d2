"""Fleet simulation with a replica killed (issue 29 item 6): its streams are continued through the
router's own migration rule (router/migration.py ``decide_resume``) and re-prefilled elsewhere."""

from __future__ import annotations

import pytest

from loadgen.fleet.sim import FleetConfig, FleetRequest, run_fleet
from replica_agent.policy.time_model import TimeModel

TM = TimeModel(9.8626, 0.0726711, 7.93966e-05)  # llama-3-8b-a100
KV = 467_291
PROMPT, OUTPUT = 1000, 100
KILL_MS = 500.0  # the prefill of 1000 tokens (~83 ms) is over; decode steps of ~10 ms run


def cfg(**kw: object) -> FleetConfig:
    return FleetConfig(policy="pab", replicas=2, time_model=TM, kv_capacity_tokens=KV, ttft_ms=1000.0, tpot_ms=100.0,
                       online_time_model=False, drain_ms=10_000.0, **kw)  # type: ignore[arg-type]  # fmt: skip


REQ = [FleetRequest(0.0, PROMPT, OUTPUT)]


def home() -> tuple[int, list[float]]:
    """The replica the request runs on without a fault (the seed decides) and its token times."""
    rec = run_fleet(cfg(), REQ).records[0]
    assert rec.outcome == "ok" and rec.replica is not None
    return int(rec.replica[1:]), rec.token_times_ms


def test_a_stream_on_a_killed_replica_is_continued_whole() -> None:
    ri, unbroken = home()
    sent = sum(1 for t in unbroken if t <= KILL_MS)  # tokens out before the kill (none of the cut step's)
    assert 0 < sent < OUTPUT
    res = run_fleet(cfg(faults=((KILL_MS, ri),)), REQ)
    rec = res.records[0]
    assert rec.outcome == "ok" and len(rec.token_times_ms) == OUTPUT  # every token, once
    assert rec.token_times_ms[:sent] == unbroken[:sent]
    assert rec.replica == f"r{1 - ri}"
    assert res.stats.migrations == {"resume": 1} and res.stats.replica_requests[1 - ri] == 1
    # the gap: at least the re-prefill of prompt + the tokens sent (a + b * 1000+sent, an idle replica),
    # at most that plus a generous 60 ms of network hops, placement and one decode step
    gap = res.stats.migration_added_ms[0]
    reprefill = TM.prefill_ms(PROMPT + sent)
    assert reprefill <= gap <= reprefill + 60.0
    assert rec.token_times_ms[sent] - rec.token_times_ms[sent - 1] >= reprefill


def test_past_the_migration_limit_the_stream_fails_with_what_was_sent() -> None:
    ri, unbroken = home()
    sent = sum(1 for t in unbroken if t <= KILL_MS)
    res = run_fleet(cfg(faults=((KILL_MS, ri),), max_migrations=0), REQ)
    rec = res.records[0]
    assert (rec.outcome, rec.reason, len(rec.token_times_ms)) == ("failed", "migration-limit", sent)
    assert res.stats.migrations == {"limit": 1}


def test_a_request_cut_before_its_first_token_is_re_placed_whole() -> None:
    ri, unbroken = home()
    kill_ms = unbroken[0] - 20.0  # inside the prefill step: it lasts ~83 ms and ends 0.5 ms before the token
    res = run_fleet(cfg(faults=((kill_ms, ri),)), REQ)
    rec = res.records[0]
    assert rec.outcome == "ok" and len(rec.token_times_ms) == OUTPUT and rec.replica == f"r{1 - ri}"
    assert res.stats.migrations == {"retries": 1} and res.stats.migration_added_ms == []
    assert rec.token_times_ms[0] > kill_ms + TM.prefill_ms(PROMPT)  # the whole prefill again, after the kill


def test_faults_are_checked() -> None:
    with pytest.raises(ValueError):
        cfg(faults=((10.0, 2),))
    with pytest.raises(ValueError):
        cfg(faults=((-1.0, 0),))
