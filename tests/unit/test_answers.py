"""router/answers.py: the router's refusals (status, reason, outcome, message, Retry-After), by hand,
and their HTTP form (router/server.py ``answer_response``)."""

from __future__ import annotations

import json
import math

import pytest

from router.answers import (
    Answer,
    no_budget,
    placement_error,
    queue_expired,
    queue_full,
    retry_after,
    slo_infeasible,
    tenant_over,
)
from router.server import answer_response


def test_retry_after_is_whole_seconds_rounded_up_at_least_one() -> None:
    assert retry_after(0.0) == 1
    assert retry_after(0.2) == 1
    assert retry_after(1.0) == 1
    assert retry_after(2.01) == 3
    with pytest.raises(OverflowError):
        retry_after(math.inf)


def test_queue_full_and_tenant_limits() -> None:
    assert queue_full() == Answer("queue_full", 429, "queue-full", "The router's admission queue is full; retry later.")
    assert tenant_over("tenant-rate", "acme", 12.3) == Answer(
        "tenant_rate", 429, "tenant-rate", "Tenant 'acme' is over its rate limit; retry later.", 13)
    assert tenant_over("tenant-concurrency", "beta", 0.05) == Answer(
        "tenant_concurrency", 429, "tenant-concurrency", "Tenant 'beta' is over its concurrency limit; retry later.", 1)


def test_slo_infeasible_at_arrival_names_the_wait() -> None:
    a = slo_infeasible("batch", 2500.0, 3120.4, 3.1204)
    assert (a.outcome, a.status, a.code, a.retry_after_s) == ("slo_infeasible", 429, "slo-infeasible", 4)
    assert a.message == "The first-token deadline (2500 ms) of class 'batch' cannot be met (predicted wait 3120 ms)."
    # no replica can start it in time (an infinite wait): said so, Retry-After the default 1 s
    inf = slo_infeasible("batch", 2500.0, float("inf"), float("inf"))
    assert (inf.status, inf.code, inf.retry_after_s) == (429, "slo-infeasible", 1)
    assert inf.message == "The first-token deadline (2500 ms) of class 'batch' cannot be met (no replica can start it in time)."
    # a finite wait of years (a drain rate near 0 on a burst): Retry-After capped at 60 s, said so
    far = slo_infeasible("interactive", 500.0, 5.6e10, 5.6e7)
    assert (far.status, far.code, far.retry_after_s) == (429, "slo-infeasible", 60)
    assert far.message == "The first-token deadline (500 ms) of class 'interactive' cannot be met (predicted wait over 60 s)."
    assert slo_infeasible("batch", 2500.0, 60000.0, 60.0).retry_after_s == 60  # at the cap: the wait itself


def test_a_queue_expiry_is_a_timeout_or_no_replica_or_infeasible() -> None:
    shed = queue_expired("slo-infeasible", "batch", 2500.0, 8000.0, any_usable=False)
    assert (shed.outcome, shed.status, shed.code, shed.retry_after_s) == ("slo_infeasible", 429, "slo-infeasible", 1)
    assert shed.message == "The first-token deadline (2500 ms) of class 'batch' could no longer be met while queued."
    timeout = queue_expired("queue-timeout", "interactive", 1000.0, 8000.0, any_usable=True)
    assert (timeout.outcome, timeout.status, timeout.code) == ("queue_timeout", 429, "queue-timeout")
    assert timeout.message == "No replica could take the request within max_queue_ms (8000 ms) of class 'interactive'."
    none = queue_expired("queue-timeout", "interactive", 1000.0, 8000.0, any_usable=False)
    assert (none.outcome, none.status, none.code, none.err_type) == ("no_replica", 503, "no-replica",
                                                                     "service_unavailable")  # fmt: skip
    assert "none healthy with a fresh budget" in none.message


def test_placement_error_and_no_budget() -> None:
    assert placement_error("KeyError") == Answer("placement_error", 503, "placement-error",
                                                 "The request could not be placed (KeyError).", 1,
                                                 "service_unavailable")  # fmt: skip
    assert no_budget(8) == Answer("upstream_error", 503, "no-budget",
                                  "No replica could take the request (its budget was gone on arrival, 8 times).", 1,
                                  "service_unavailable")  # fmt: skip


def test_answer_response_is_openai_error_json_with_the_reason_headers() -> None:
    resp = answer_response(tenant_over("tenant-rate", "acme", 12.3))
    assert resp.status == 429
    assert resp.headers["Retry-After"] == "13"
    assert resp.headers["x-fairbatch-reason"] == "tenant-rate"
    assert json.loads(resp.body) == {"error": {"message": "Tenant 'acme' is over its rate limit; retry later.",
                                               "type": "rate_limit_error", "param": None, "code": "tenant-rate"}}
    resp = answer_response(no_budget(3))
    assert resp.status == 503 and resp.headers["x-fairbatch-reason"] == "no-budget"
    assert json.loads(resp.body)["error"]["type"] == "service_unavailable"
