"""The fleet benchmark's baseline routers as placement profiles of the real router (issue 26 item 4):
each built from a YAML ``placement:`` section and run by the router core (router/core.py) on the
load view it supplies, hand-worked.

Two replicas. Snapshots (router/budgets.py, proto BudgetSnapshot fields 8-10) unless a test says
otherwise: r0 running 3, waiting 2, KV usage 0.25; r1 running 1, waiting 2, KV usage 0.75; both with
no PAB at all (pab_ms 0: a ``pab`` router would queue every request). Default prefix map: 16 tokens
per key (chunk_chars 64 / 4 bytes per token), so 5 matched keys of a 100-token prompt = 80 tokens.
"""

from __future__ import annotations

import pytest

from fairbatch_common.config_schema import ConfigError
from proto import admission_pb2
from replica_agent.policy.pab import PendingPrefill
from replica_agent.policy.queue_cap import over_queue_cap, queued_prompt_tokens
from router.budget_client import ReserveResult
from router.config import RouterConfig, parse_config
from router.core import CoreRequest, Grant, Placed, Refused, RouterCore
from router.placement import BASELINE_POLICIES, DEFAULT_QUEUE_CAP_TOKENS, MetricsSample
from tests.fakes import FakeClock

METRICS = {"r0": (3, 2, 0.25), "r1": (1, 2, 0.75)}


class NoReserve:
    """A ReservePort that records calls (a baseline profile must make none)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def reserve(self, replica_id: str, slo_class: str, prompt_tokens: int, request_id: str,
                      max_tokens: int, waited_ms: float) -> ReserveResult:  # fmt: skip
        self.calls.append(f"reserve {replica_id}")
        return ReserveResult(True, "lease")

    def release(self, lease_id: str, reason: str) -> None:
        self.calls.append(f"release {lease_id}")


def yaml_config(placement: str, extra: str = "") -> RouterConfig:
    return parse_config(
        "slo_classes: {i: {ttft_ms: 1000, tpot_ms: 100, sheddable: true}}\n"
        "tenants: {t: {slo_class: i}}\n"
        "replicas:\n"
        "  - {id: r0, http_url: 'http://127.0.0.1:1', grpc_target: '127.0.0.1:1'}\n"
        "  - {id: r1, http_url: 'http://127.0.0.1:2', grpc_target: '127.0.0.1:2'}\n"
        f"placement: {placement}\n{extra}", "fairbatch.yaml")  # fmt: skip


def snapshot(rid: str, seq: int, running: int, waiting: int, kv: float, healthy: bool = True,
             ttl_ms: int = 1000) -> admission_pb2.BudgetSnapshot:  # fmt: skip
    return admission_pb2.BudgetSnapshot(
        replica_id=rid, seq=seq, ttl_ms=ttl_ms, healthy=healthy, num_running=running, num_waiting=waiting,
        kv_usage=kv, coefficients=admission_pb2.TimeModelCoefficients(a_ms=10.0, b_ms_per_new_token=0.1),
        classes=[admission_pb2.ClassBudget(slo_class="i", horizon_ms=900.0, pab_ms=0.0, pab_tokens=0)],
    )  # fmt: skip


def make_core(placement: str, metrics: dict[str, tuple[int, int, float]] = METRICS, extra: str = "") \
        -> tuple[RouterCore, FakeClock, NoReserve]:  # fmt: skip
    clock, port = FakeClock(), NoReserve()
    core = RouterCore(yaml_config(placement, extra), clock, port, lambda: None, seed=1,  # type: ignore[arg-type]
                      replica_ids=["r0", "r1"])  # fmt: skip
    for rid, (running, waiting, kv) in metrics.items():
        core.book.update(rid, snapshot(rid, 1, running, waiting, kv))
    return core, clock, port


def request(n: int, prompt: int = 100, max_tokens: int = 20, keys: tuple[int, ...] = ()) -> CoreRequest:
    return CoreRequest(f"q{n}", "t", "i", prompt, max_tokens, 0.0, keys)


async def place(core: RouterCore, req: CoreRequest, exclude: frozenset[str] = frozenset()) -> Grant:
    core.track_prefix(req)
    got = await core.acquire(req, exclude)
    assert isinstance(got, Placed), got
    return got.grant


# ---------------------------------------------------------------- the load view


async def test_the_load_view_maps_snapshots_and_the_cores_own_counts() -> None:
    core, clock, _ = make_core("{profile: least-outstanding}")
    clock.t = 40.0
    core.refresh_load()
    # engine metrics: the snapshots' num_running, num_waiting, kv_usage, stamped with their arrival (t = 0)
    assert core.load.scraped == {"r0": MetricsSample(3, 2, 0.25, 0.0), "r1": MetricsSample(1, 2, 0.75, 0.0)}
    version = core.load.version
    core.refresh_load()
    assert core.load.version == version  # nothing changed in the book: not rebuilt
    # r1's next snapshot at t = 600 ms; r0's (sent at t = 0, TTL 1000 ms) goes stale at t = 1000
    clock.t = 600.0
    core.book.update("r1", snapshot("r1", 2, 0, 5, 0.5))
    clock.t = 1200.0
    core.book.update("r1", snapshot("r1", 3, 4, 1, 1.0))
    core.refresh_load()
    assert core.load.version == version + 1
    assert core.load.scraped == {"r1": MetricsSample(4, 1, 1.0, 1200.0)}  # a stale replica has no figures
    # outstanding requests and tokens: prompt + max_tokens, or + fairness.default_max_tokens (256) when unset
    a = await place(core, request(1, 100, 20))
    assert a.replica_id == "r1"  # r0 is stale: dropped by the fresh filter
    b = await place(core, request(2, 1000, 0))
    assert (dict(core.replica_load), dict(core.replica_tokens)) == ({"r1": 2}, {"r1": 120 + 1256})
    assert core.load.outstanding is core.replica_load and core.load.outstanding_tokens is core.replica_tokens
    core.lease_done(a)
    core.lease_done(a)  # idempotent
    assert (dict(core.replica_load), dict(core.replica_tokens)) == ({"r1": 1}, {"r1": 1256})
    core.release(b, "client-disconnect")  # nothing to give back to an agent
    assert (dict(core.replica_load), dict(core.replica_tokens)) == ({}, {})


def test_the_book_keeps_the_snapshots_kv_usage() -> None:
    core, _, _ = make_core("{}")
    b0, b1 = core.book.get("r0"), core.book.get("r1")
    assert b0 is not None and b1 is not None
    assert (b0.num_running, b0.num_waiting, b0.kv_usage) == (3, 2, 0.25)
    assert (b1.num_running, b1.num_waiting, b1.kv_usage) == (1, 2, 0.75)


# ---------------------------------------------------------------- every profile from YAML


def test_every_fleet_baseline_is_a_profile_of_the_yaml() -> None:
    for name in BASELINE_POLICIES:
        core, _, _ = make_core(f"{{profile: {name}}}")
        assert core.policy.direct is not None, name
        assert core.policy.direct.queue_cap_tokens == (DEFAULT_QUEUE_CAP_TOKENS if name == "static-queue-cap"
                                                       else None)  # fmt: skip
        # the cache-aware ones keep a prefix map although placement.prefix_cache is off
        assert (core.prefix is not None) == (name in ("llm-d-prefix", "sglang-cache-aware", "vllm-router-cache-aware",
                                                      "llm-d-flow-control", "dynamo-kv", "llm-d-sticky",
                                                      "llm-d-predicted-latency"))  # fmt: skip
        assert (core.held_queue is not None) == (name in ("llm-d-flow-control", "dynamo-kv"))
    core, _, _ = make_core("{profile: static-queue-cap, params: {queue_cap_tokens: 500}}")
    assert core.policy.direct is not None and core.policy.direct.queue_cap_tokens == 500
    assert make_core("{}")[0].policy.direct is None  # pab


def test_profile_params_are_checked() -> None:
    with pytest.raises(ConfigError, match="placement: .*params are the profile's"):
        yaml_config("{params: {queue_cap_tokens: 5}, scorers: [{name: least-outstanding}]}")
    with pytest.raises(ConfigError, match="placement.profile 'least-loaded'"):
        yaml_config("{profile: least-loaded}")
    with pytest.raises(TypeError):
        make_core("{profile: least-outstanding, params: {queue_cap_tokens: 5}}")
    with pytest.raises(ValueError, match="queue_cap_tokens must be >= 0"):
        make_core("{profile: static-queue-cap, params: {queue_cap_tokens: -1}}")


async def test_a_baseline_admits_at_once_without_budget_queue_or_lease() -> None:
    # no PAB anywhere and work shedding on: the pab profile would refuse or queue; a baseline places at once
    core, _, port = make_core("{profile: round-robin}", extra="admission: {work_shed: {enabled: true}}\n")
    assert not core.refuse_by_work(request(0))
    grants = [await place(core, request(i)) for i in range(4)]
    assert [g.replica_id for g in grants] == ["r0", "r1", "r0", "r1"]  # round-robin: in turn
    assert all(g.direct and not g.inline for g in grants) and port.calls == [] and len(core.queue) == 0
    headers: dict[str, str] = {}
    grants[0].add_headers(headers)
    assert headers == {"x-fairbatch-direct": "1"}  # no lease, no admit: the agent admits it as it is
    # for comparison, the pab profile on the same views queues the request (nothing fits a PAB of 0 ms)
    pab, _, _ = make_core("{}")
    pab.new_future = lambda: object()
    assert type(await pab.acquire(request(9))).__name__ == "Queued"


async def test_least_outstanding_avoids_the_replica_holding_a_request() -> None:
    core, _, _ = make_core("{profile: least-outstanding, seed: 3}")
    long = await place(core, request(1))
    other = "r1" if long.replica_id == "r0" else "r0"
    assert (await place(core, request(2))).replica_id == other  # 1 outstanding vs 0
    core.lease_done(long)  # the long one ends: its replica now holds 0, the other 1
    assert (await place(core, request(3))).replica_id == long.replica_id


async def test_least_outstanding_tokens_weighs_the_prompts() -> None:
    core, _, _ = make_core("{profile: least-outstanding-tokens, seed: 3}")
    big = await place(core, request(1, prompt=5000, max_tokens=100))  # 5100 tokens there
    other = "r1" if big.replica_id == "r0" else "r0"
    assert (await place(core, request(2, prompt=10, max_tokens=10))).replica_id == other  # 20 tokens
    # one request on each: by count a tie, by tokens 5100 vs 20 -> the other one again
    assert (await place(core, request(3, prompt=10, max_tokens=10))).replica_id == other


@pytest.mark.parametrize("profile, first", [("power-of-two", "r1"), ("llm-d-scorer", "r0")])
async def test_metric_profiles_read_the_agents_engine_figures(profile: str, first: str) -> None:
    # power-of-two: both replicas drawn; engine queues running + waiting r0 3 + 2 = 5, r1 1 + 2 = 3 -> r1
    # llm-d-scorer: waiting queues equal (2, 2) -> queue scores 1, 1; KV 1 - 0.25 = 0.75, 1 - 0.75 = 0.25 -> r0
    core, _, _ = make_core(f"{{profile: {profile}, seed: 1}}")
    grant = await place(core, request(1))
    assert (grant.replica_id, grant.fallbacks) == (first, ("r1" if first == "r0" else "r0",))


async def test_llm_d_prefix_weighs_its_own_prefix_map() -> None:
    # scores without a prefix: r0 queue 2 * 1 + KV 2 * 0.75 = 3.5, r1 2 + 2 * 0.25 = 2.5 -> r0.
    # A prompt learnt on r1 (placed with r0 excluded) scores there 3 * 80 / 100 = 2.4 more: 4.9 -> r1
    core, _, _ = make_core("{profile: llm-d-prefix, seed: 1}")
    assert (await place(core, request(1, keys=(1, 2, 3, 4, 5)))).replica_id == "r0"
    assert (await place(core, request(2, keys=(7, 8, 9, 10, 11)), frozenset({"r0"}))).replica_id == "r1"
    assert (await place(core, request(3, keys=(7, 8, 9, 10, 11)))).replica_id == "r1"
    assert (await place(core, request(4, keys=(20, 21)))).replica_id == "r0"


@pytest.mark.parametrize("profile, holder", [("sglang-cache-aware", "r1"), ("vllm-router-cache-aware", "r0")])
async def test_cache_aware_profiles_differ_by_their_threshold(profile: str, holder: str) -> None:
    # r1 learns 5 keys (placed with r0 excluded; load r0 0, r1 1: balanced for both rules). A
    # 200-token prompt matching them: 80 / 200 = 0.4 cached on r1, above SGLang's 0.3 (-> r1), not
    # above vllm-router's 0.5 (-> the least loaded, r0)
    core, _, _ = make_core(f"{{profile: {profile}}}")
    assert (await place(core, request(1, keys=(1, 2, 3, 4, 5)), frozenset({"r0"}))).replica_id == "r1"
    assert (await place(core, request(2, prompt=200, keys=(1, 2, 3, 4, 5)))).replica_id == holder


async def test_static_queue_cap_tries_the_next_candidate_then_refuses() -> None:
    core, _, port = make_core("{profile: static-queue-cap, params: {queue_cap_tokens: 500}, seed: 1}")
    req = request(1)
    core.track_prefix(req)
    got = await core.acquire(req)
    assert isinstance(got, Placed)
    first = got.grant
    headers: dict[str, str] = {}
    first.add_headers(headers)
    assert headers == {"x-fairbatch-direct": "1", "x-fairbatch-queue-cap": "500"}
    other = first.fallbacks[0]
    assert {first.replica_id, other} == {"r0", "r1"} and core.replica_load == {first.replica_id: 1}
    # the agent refuses it (409 x-fairbatch-refused: queue-cap): the core's rule after the attempt, then the
    # next candidate of the same placement (not a new placement)
    tries = core.attempts(2)
    assert tries.next_try()
    assert core.after_attempt(tries, req, first, "lease_refused").next == "replace"
    assert first.refused and dict(core.replica_load) == {}
    got = await core.acquire(req, tries.exclude, tries.refused_on, first)
    assert isinstance(got, Placed) and got.grant.replica_id == other and got.grant.fallbacks == ()
    assert dict(core.replica_tokens) == {other: 120}
    core.after_attempt(tries, req, got.grant, "lease_refused")
    assert await core.acquire(req, tries.exclude, tries.refused_on, got.grant) == Refused("queue-cap")
    assert dict(core.replica_load) == {} and port.calls == []


async def test_a_baseline_refuses_when_no_replica_is_usable() -> None:
    core, _, _ = make_core("{profile: round-robin}", metrics={"r0": (0, 0, 0.0)})  # r1: no snapshot yet
    core.book.update("r0", snapshot("r0", 2, 0, 0, 0.0, healthy=False))
    got = await core.acquire(request(1))
    assert got == Refused("no-replica", detail="healthy")


def test_reload_switches_between_pab_and_a_baseline() -> None:
    core, _, _ = make_core("{}")
    assert core.policy.direct is None and core.prefix is None
    core.apply_config(yaml_config("{profile: sglang-cache-aware}"))
    assert core.policy.direct is not None and core.prefix is not None
    core.apply_config(yaml_config("{}"))
    assert core.policy.direct is None and core.prefix is None


# ---------------------------------------------------------------- the agent's rule


def test_the_agents_queue_cap_rule() -> None:
    # cap 1000: queued 600 (two prefills, 100 of one computed: 400 + 300 - 100) + 400 = 1000 is taken, + 401 not
    queued = queued_prompt_tokens([PendingPrefill(400), PendingPrefill(300, 100)])
    assert queued == 600
    assert not over_queue_cap(queued, 400, 1000, busy=True)
    assert over_queue_cap(queued, 401, 1000, busy=True)
    assert not over_queue_cap(0, 5000, 1000, busy=False)  # an idle replica takes any prompt


def test_the_charts_values_schema_knows_every_profile() -> None:
    # the Helm chart validates config.placement.profile against an enum: it must offer every profile
    import json
    from pathlib import Path

    from fairbatch_common.config_schema import PLACEMENT_PLUGINS

    schema = json.loads((Path(__file__).parents[2] / "deploy/helm/fairbatch/values.schema.json").read_text())
    placement = schema["properties"]["config"]["properties"]["placement"]["properties"]
    assert set(placement["profile"]["enum"]) == set(PLACEMENT_PLUGINS["policies"])
