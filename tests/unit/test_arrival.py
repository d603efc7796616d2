"""router/arrival.py: what the router does with a request at arrival, worked by hand."""

from __future__ import annotations

import pytest

from router.arrival import (
    Enqueue,
    Refuse,
    no_replica_left,
    place_now_exclude,
    queue_full_before_body,
    queue_or_refuse,
)

IDS = {"r0": 0, "r1": 0, "r2": 0}.keys()  # as the server passes them: the replica dict's keys


def never() -> float:
    raise AssertionError("must not be called")


def test_a_full_queue_refuses_before_the_body() -> None:
    assert queue_full_before_body(64, 64) is True
    assert queue_full_before_body(65, 64) is True
    assert queue_full_before_body(63, 64) is False


def test_no_replica_left_only_when_failures_cover_every_replica() -> None:
    assert no_replica_left(IDS, frozenset({"r0", "r1", "r2"})) is True
    assert no_replica_left(IDS, frozenset({"r0", "r1", "r2", "gone"})) is True
    assert no_replica_left(IDS, frozenset({"r0", "r1"})) is False
    # no failure yet: a request waits for replicas to appear (discovery), even with none now
    assert no_replica_left({}.keys(), frozenset()) is False
    assert no_replica_left({}.keys(), frozenset({"r0"})) is True


def test_placed_at_once_only_when_nobody_waits() -> None:
    assert place_now_exclude(IDS, frozenset(), frozenset(), 1) is None
    assert place_now_exclude(IDS, frozenset({"r0"}), frozenset({"r1"}), 3) is None
    failed = frozenset({"r0"})
    assert place_now_exclude(IDS, failed, frozenset(), 0) is failed  # nothing to add: the same set
    # an inline refusal on r1 keeps r1 out of the immediate placement while r2 is left
    assert place_now_exclude(IDS, failed, frozenset({"r1"}), 0) == {"r0", "r1"}
    # ... but not when it would leave no replica: then only the failed ones are out
    assert place_now_exclude(IDS, failed, frozenset({"r1", "r2"}), 0) == {"r0"}
    assert place_now_exclude(IDS, frozenset(), frozenset({"r0", "r1", "r2"}), 0) == frozenset()


def test_max_queue_passed_already_is_a_queue_timeout_without_a_prediction() -> None:
    # arrived at 0 with max_queue 8000 ms; now 8000 (a retry after a slow failure): no wait left
    assert queue_or_refuse(8000.0, 0.0, 1000.0, 8000.0, True, never, never) == Refuse("queue-timeout")


def test_a_non_sheddable_request_waits_max_queue_and_is_never_predicted() -> None:
    d = queue_or_refuse(1000.0, 900.0, 1000.0, 5000.0, False, never, never)
    # deadline 900 + 5000; EDF key and aging both at arrival + ttft = 1900
    assert d == Enqueue(5900.0, "queue-timeout", 1900.0, 1900.0)


def test_a_sheddable_request_queues_until_its_last_useful_dispatch() -> None:
    # now 1000, arrived 900, ttft 1000 -> first-token deadline 1900; margin 100 -> must start by 1800.
    # wait 300 + prefill 50 from now: 1350 <= 1800, so it queues; the last dispatch that still
    # makes the first token is 1900 - 50 = 1850, before the max_queue deadline 900 + 5000
    d = queue_or_refuse(1000.0, 900.0, 1000.0, 5000.0, True, lambda: (300.0, 50.0), lambda: 100.0)
    assert d == Enqueue(1850.0, "slo-infeasible", 1900.0, 1900.0)
    # with max_queue 500 the queue deadline 1400 comes first: a plain queue-timeout then
    d = queue_or_refuse(1000.0, 900.0, 1000.0, 500.0, True, lambda: (300.0, 50.0), lambda: 100.0)
    assert d == Enqueue(1400.0, "queue-timeout", 1900.0, 1900.0)


def test_a_sheddable_request_predicted_late_is_refused_with_the_wait() -> None:
    # 1000 + 800 + 50 = 1850 > 1900 - 100: refused, Retry-After from the 800 ms wait
    d = queue_or_refuse(1000.0, 900.0, 1000.0, 5000.0, True, lambda: (800.0, 50.0), lambda: 100.0)
    assert d == Refuse("slo-infeasible", 800.0)
    # without the margin it would have fit (1850 <= 1900)
    d = queue_or_refuse(1000.0, 900.0, 1000.0, 5000.0, True, lambda: (800.0, 50.0), lambda: 0.0)
    assert isinstance(d, Enqueue) and d.deadline_ms == 1850.0


def test_without_a_usable_replica_a_sheddable_request_waits_max_queue() -> None:
    d = queue_or_refuse(1000.0, 900.0, 1000.0, 5000.0, True, lambda: None, never)
    assert d == Enqueue(5900.0, "queue-timeout", 1900.0, 1900.0)


@pytest.mark.parametrize(("now", "expected"), [
    (1849.0, Enqueue(1850.0, "slo-infeasible", 1900.0, 1900.0)),  # 1849 + 0 + 50 <= 1900
    (1850.0, Enqueue(1850.0, "slo-infeasible", 1900.0, 1900.0)),  # due now: the caller's wait ends at once
    (1851.0, Refuse("slo-infeasible", 0.0)),  # 1851 + 0 + 50 = 1901 > 1900
])
def test_the_shed_deadline_at_the_edge(now: float, expected: Enqueue | Refuse) -> None:
    assert queue_or_refuse(now, 900.0, 1000.0, 5000.0, True, lambda: (0.0, 50.0), lambda: 0.0) == expected
