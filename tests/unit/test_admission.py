"""router/admission.py: the prompt cap, the contention cap, the held replica and the rule after a
relay attempt, the offers of a placement and one request's relay attempts, worked by hand."""

from __future__ import annotations

import pytest

from replica_agent.policy.pab import ClassBudget
from replica_agent.policy.time_model import TimeModel
from router.admission import (
    MAX_ADMIT_REFUSALS,
    MAX_RELAY_TRIES,
    ContentionCap,
    PromptDecision,
    RelayAction,
    RelayAttempts,
    after_relay,
    contention_excluded,
    hold_replica,
    lease_tokens,
    offer_replicas,
    prompt_decision,
)
from router.placement import ReplicaView

TM = TimeModel(10.0, 0.1, 0.0)


def view(rid: str, max_prompt: int, decode_ms: float = 0.0, inflight_ms: float = 0.0, kv_tokens: int = 10**6,
         healthy: bool = True, fresh: bool = True, slot_ms: float = 0.0) -> ReplicaView:
    pab = max(0.0, 900.0 - slot_ms - decode_ms - inflight_ms)
    cb = ClassBudget("c", 900.0, pab, TM.tokens_within_ms(pab), kv_tokens, 1000.0, 100.0, decode_ms, inflight_ms,
                     0, 0, slot_ms)
    return ReplicaView(rid, healthy, fresh, TM, {"c": cb}, max_prompt)


def test_an_exact_prompt_over_every_context_is_refused_and_one_within_is_kept() -> None:
    views = [view("r0", 4096), view("r1", 8192)]
    assert prompt_decision(8192, True, views, 4.0, 1.5) == PromptDecision(8192)  # fits r1
    d = prompt_decision(8193, True, views, 4.0, 1.5)
    assert d.tokens == 8193 and d.refusal == ("The prompt (8193 tokens) is longer than every replica's maximum "
                                              "context (8192 tokens).")  # fmt: skip


def test_an_estimate_is_refused_only_beyond_the_factor_and_otherwise_capped() -> None:
    views = [view("r0", 4096), view("r1", 8192)]
    # 12288 / 1.5 = 8192: not beyond r1's context, so kept, and placed as the largest context 8192
    assert prompt_decision(12288, False, views, 4.0, 1.5) == PromptDecision(8192)
    # 12290 / 1.5 = 8193.3 -> 8194 > 8192: refused
    d = prompt_decision(12290, False, views, 4.0, 1.5)
    assert d.refusal is not None and "about 12290 tokens, estimated at 4 bytes per token" in d.refusal
    assert "(8192 tokens) by more than 1.5x" in d.refusal
    # within every context: placed as estimated
    assert prompt_decision(3000, False, views, 4.0, 1.5) == PromptDecision(3000)


def test_unknown_contexts_never_refuse_or_cap() -> None:
    views = [view("r0", 0)]
    assert prompt_decision(10**6, True, views, 4.0, 1.5) == PromptDecision(10**6)
    assert prompt_decision(10**6, False, views, 4.0, 1.5) == PromptDecision(10**6)


def test_contention_cap_applies_only_with_two_tenants_waiting_and_a_positive_cap() -> None:
    load = {"r0": 32, "r1": 31, "r2": 40}
    assert contention_excluded(32, 2, load) == frozenset({"r0", "r2"})
    assert contention_excluded(32, 1, load) == frozenset()  # one tenant: its own FCFS, nothing to weigh
    assert contention_excluded(0, 5, load) == frozenset()  # cap off


def test_keep_running_cap_is_the_larger_of_the_cap_and_the_load_at_onset() -> None:
    # onset: r0 ran 60 (over the cap of 32), r1 ran 10 (under it), r2 joined later (no onset: 32)
    assert contention_excluded(32, 2, {"r0": 60, "r1": 31, "r2": 32}, {"r0": 60, "r1": 10}) == frozenset({"r0", "r2"})
    assert contention_excluded(32, 2, {"r0": 59, "r1": 32}, {"r0": 60, "r1": 10}) == frozenset({"r1"})


def test_contention_cap_records_the_onset_once_and_forgets_it_when_contention_ends() -> None:
    cap = ContentionCap(32)
    assert cap.excluded(1, {"r0": 50}) == frozenset() and cap.onset is None  # one tenant waiting: no contention
    assert cap.excluded(2, {"r0": 50, "r1": 5}) == frozenset({"r0"})  # onset {r0: 50, r1: 5}: r0 at its 50
    assert cap.excluded(3, {"r0": 49, "r1": 31}) == frozenset()  # r0 ended one: a slot for the fair queue
    assert cap.excluded(3, {"r0": 55, "r1": 32}) == frozenset({"r0", "r1"})  # onset kept (not 55)
    assert cap.onset == {"r0": 50, "r1": 5}
    assert cap.excluded(0, {"r0": 55}) == frozenset() and cap.onset is None  # contention over
    assert cap.excluded(2, {"r0": 40}) == frozenset({"r0"})  # a new contention records afresh: 40
    fixed = ContentionCap(32, keep_running=False)
    assert fixed.excluded(2, {"r0": 50, "r1": 31}) == frozenset({"r0"}) and fixed.onset is None
    assert ContentionCap(0).excluded(5, {"r0": 500}) == frozenset()  # cap off


def test_the_hold_goes_where_least_is_reserved_then_most_kv() -> None:
    views = [
        view("r0", 8192, decode_ms=300.0, inflight_ms=200.0),  # 900 - 500 = 400 left
        view("r1", 8192, decode_ms=100.0, inflight_ms=100.0, kv_tokens=5000),  # 700 left
        view("r2", 8192, decode_ms=200.0, inflight_ms=0.0, kv_tokens=9000),  # 700 left, more KV
        view("r3", 8192, healthy=False),  # 900 left, but not usable
        view("r4", 2048),  # 900 left, but the prompt is longer than its context
    ]
    assert hold_replica("c", 3000, frozenset(), views) == "r2"
    assert hold_replica("c", 3000, frozenset({"r2"}), views) == "r1"
    assert hold_replica("c", 1000, frozenset({"r2"}), views) == "r4"  # now within r4's context
    assert hold_replica("other-class", 1000, frozenset(), views) is None
    # r2 at its engine's max_num_seqs with a slot 400 ms away: 700 - 400 = 300 left, behind r1's 700
    views[2] = view("r2", 8192, decode_ms=200.0, kv_tokens=9000, slot_ms=400.0)
    assert hold_replica("c", 3000, frozenset(), views) == "r1"


@pytest.mark.parametrize(("kind", "refusals", "expected"), [
    # the answer is the outcome; the agent consumed the lease, nothing to refund
    ("ok", 0, RelayAction(False, None, "answer", "ok")),
    # an inline admission refused on arrival: refund, no lease to release, placed again (not a failure)
    ("lease_refused", 3, RelayAction(True, None, "replace")),
    ("lease_refused", 8, RelayAction(True, None, "give_up")),  # the 8th refusal with at most 8
    # the engine's 4xx: nothing ran, the engine's answer is relayed
    ("refused", 0, RelayAction(True, "upstream-refused", "answer", "upstream_refused")),
    # failed before the first byte: refund and try another replica
    ("retryable", 0, RelayAction(True, "upstream-error", "retry")),
    # tokens went out: no refund
    ("client_gone", 0, RelayAction(False, "client-disconnect", "answer", "client_disconnect")),
    ("upstream_error", 0, RelayAction(False, "upstream-error", "answer", "upstream_error")),
])
def test_after_relay_table(kind: str, refusals: int, expected: RelayAction) -> None:
    assert after_relay(kind, refusals, 8) == expected


def test_after_relay_unknown_kind() -> None:
    with pytest.raises(ValueError, match="teapot"):
        after_relay("teapot", 0, 8)


def test_offers_are_the_first_candidate_inline_else_the_first_max_reserve() -> None:
    cands = ["r3", "r1", "r0", "r2"]
    assert list(offer_replicas(cands, True, 3)) == ["r3"]  # the agent decides on arrival: one replica
    assert list(offer_replicas(cands, False, 3)) == ["r3", "r1", "r0"]  # a refused Reserve tries the next
    assert list(offer_replicas(cands[:2], False, 3)) == ["r3", "r1"]
    assert list(offer_replicas([], True, 3)) == [] and list(offer_replicas([], False, 3)) == []


def test_a_lease_covers_the_uncached_prompt() -> None:
    cached = {"r0": 512, "r1": 999}
    assert lease_tokens(1000, cached, "r0") == 488
    assert lease_tokens(1000, cached, "r1") == 1  # the map caps a hit at prompt - 1: one token to compute
    assert lease_tokens(1000, cached, "r2") == 1000  # nothing known cached there
    assert lease_tokens(1000, {}, "r0") == 1000
    assert lease_tokens(100, {"r0": 512}, "r0") == 0  # never below 0


def test_failures_before_the_first_byte_are_bounded_and_excluded() -> None:
    t = RelayAttempts(2, 8)
    assert t.next_try()
    assert t.after("retryable", "r0") == RelayAction(True, "upstream-error", "retry")
    assert t.exclude == {"r0"} and t.refused_on == frozenset()
    assert t.next_try()
    assert t.after("retryable", "r1").next == "retry"
    assert t.exclude == {"r0", "r1"}
    assert not t.next_try()  # two failures: the request is answered with the last one
    assert t.tries == 2


def test_inline_refusals_do_not_count_as_tries_and_give_up_at_the_bound() -> None:
    t = RelayAttempts(2, 8)
    attempts = 0
    for i in range(7):  # seven refusals, each placed again at once (attempt given back)
        assert t.next_try()
        attempts += 1
        assert t.after("lease_refused", f"r{i % 3}") == RelayAction(True, None, "replace")
    assert t.tries == 0 and t.refusals == 7
    assert t.refused_on == {"r0", "r1", "r2"} and t.exclude == frozenset()  # refused: not failed
    assert t.next_try()
    attempts += 1
    assert t.after("retryable", "r0").next == "retry"  # one real failure: tries 1
    assert t.next_try()
    attempts += 1
    assert t.after("lease_refused", "r1") == RelayAction(True, None, "give_up")  # the 8th refusal
    # at most max_tries + max_refusals - 1 attempts: 2 + 8 - 1 = 9
    assert attempts == 9 == MAX_RELAY_TRIES + MAX_ADMIT_REFUSALS - 1


def test_a_queue_wait_lets_the_refusals_count_afresh() -> None:
    t = RelayAttempts(2, 8)
    for i in range(7):
        assert t.next_try()
        assert t.after("lease_refused", f"r{i % 2}").next == "replace"
    t.waited()  # the 8th placement came from the queue, after a wait for budget
    for i in range(7):  # seven more refusals: still placed again
        assert t.next_try()
        assert t.after("lease_refused", f"r{i % 2}").next == "replace"
    assert t.refusals == 7 and t.tries == 0
    assert t.next_try()
    assert t.after("lease_refused", "r0").next == "give_up"  # the 8th since the wait


def test_an_answer_ends_the_attempts_without_changing_them() -> None:
    t = RelayAttempts()
    assert (t.max_tries, t.max_refusals) == (MAX_RELAY_TRIES, MAX_ADMIT_REFUSALS) == (2, 8)
    assert t.next_try()
    assert t.after("ok", "r0") == RelayAction(False, None, "answer", "ok")
    assert (t.tries, t.refusals, t.exclude, t.refused_on) == (1, 0, frozenset(), frozenset())
    with pytest.raises(ValueError):
        t.after("teapot", "r0")
