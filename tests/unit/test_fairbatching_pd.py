"""fairbatching-pd: the step budget grows for the most urgent waiting prefill (hand-worked).

Time model a = 8 ms, b = 0.125 ms/new token, c = 0 (exact in binary). One running decode D with
slack 0 and TPOT 50 ms -> the seed's budget max(0, 50) = 50 ms. Waiting prefill P: 2000 tokens
(R * b = 250 ms of compute). F = a + D's token (0.125) = 8.125 ms.
At 50 ms steps P gets (50 - 8.125) / 0.125 = 335 tokens a step and needs 250 * 50 / 41.875 =
298.5 ms in all. The policy plans against P's slack less one 50 ms step (and F with P's context at
its last chunk, 0 here as c = 0).
"""

from __future__ import annotations

import pytest

from replica_agent.policy.batching import (
    FairBatchingPolicy,
    PrefillDeadlineFairBatchingPolicy,
    SchedRequest,
    SchedState,
    make_policy,
    prefill_deadline_budget,
)
from replica_agent.policy.time_model import TimeModel

TM = TimeModel(8.0, 0.125, 0.0)
NOW = 1000.0


def scene(p_slack_ms: float, cap: int = 8192) -> SchedState:
    # D: first token at 900, 2 tokens out: anchored deadline 900 + 2 * 50 = 1000 = now -> slack 0
    d = SchedRequest("D", prompt_tokens=10, computed_tokens=11, tokens_out=2, max_tokens=100, arrival_ms=0.0,
                     ttft_ms=1000.0, tpot_ms=50.0, first_token_ms=900.0)  # fmt: skip
    # P: first-token deadline arrival + 1000 -> slack = arrival (now = 1000)
    p = SchedRequest("P", prompt_tokens=2000, arrival_ms=p_slack_ms, ttft_ms=1000.0, tpot_ms=50.0)
    return SchedState(now_ms=NOW, running=[d], waiting=[p], max_num_batched_tokens=cap, max_num_seqs=256,
                      kv_free_blocks=100_000, block_size=16, time_model=TM)  # fmt: skip


def test_registered_and_separate_from_the_seed_policy() -> None:
    assert isinstance(make_policy("fairbatching-pd"), PrefillDeadlineFairBatchingPolicy)
    assert not FairBatchingPolicy.raise_budget_for_prefills


def test_budget_grows_to_the_smallest_step_that_meets_the_prefill_deadline() -> None:
    # slack 260 < 298.5: T' = F * s / (s - R b) = 8.125 * 260 / 10 = 211.25 ms
    assert prefill_deadline_budget(50.0, 8.125, 0.125, 2000, 260.0, 8192) == pytest.approx(211.25)
    # P with slack 310 is planned at 310 - 50 = 260: it gets (211.25 - 8.125) / 0.125 = 1625 tokens;
    # the seed's policy gives it 335
    assert make_policy("fairbatching-pd").form_batch(scene(310.0)).items == [("D", 1), ("P", 1625)]
    assert FairBatchingPolicy().form_batch(scene(310.0)).items == [("D", 1), ("P", 335)]


@pytest.mark.parametrize(("slack", "cap", "why"), [
    (450.0, 8192, "planned at 400: on time at 50 ms steps (298.5 <= 400)"),
    (290.0, 8192, "planned at 240: too late whatever the steps (240 < R b = 250)"),
    (310.0, 1000, "planned at 260: needs 211.25 ms steps, more than a full cap: 8.125 + 0.125 * 1000 = 133.125"),
])
def test_budget_unchanged(slack: float, cap: int, why: str) -> None:
    assert prefill_deadline_budget(50.0, 8.125, 0.125, 2000, slack - 50.0, cap) == 50.0, why
    assert make_policy("fairbatching-pd").form_batch(scene(slack, cap)).items == [("D", 1), ("P", 335)], why


def test_the_plugin_policy_by_name() -> None:
    from replica_agent.policy.batching import FairBatchingPolicy, PrefillDeadlineFairBatchingPolicy, plugin_policy

    default = plugin_policy(None, 870.0, 40.0)
    assert type(default) is FairBatchingPolicy
    assert (default.default_ttft_ms, default.default_tpot_ms) == (870.0, 40.0)
    assert type(plugin_policy("  ", 1000.0, 100.0)) is FairBatchingPolicy
    pd = plugin_policy("fairbatching-pd", 870.0, 40.0)
    assert type(pd) is PrefillDeadlineFairBatchingPolicy and pd.raise_budget_for_prefills
    with pytest.raises(ValueError, match="fairbatching, fairbatching-pd"):
        plugin_policy("vllm-default", 1000.0, 100.0)  # vLLM's own scheduler is the plugin switched off
    with pytest.raises(ValueError):
        plugin_policy("fairbatching", 0.0, 100.0)


def test_the_plugin_plan_model_setting() -> None:
    from replica_agent.policy.batching import plan_with_point_model

    assert plan_with_point_model(None) is False and plan_with_point_model("") is False
    assert plan_with_point_model("conservative") is False
    assert plan_with_point_model(" Point ") is True
    with pytest.raises(ValueError, match="conservative or point"):
        plan_with_point_model("median")
