"""The shipped router and the fleet simulation's router are one core (router/core.py; issue 26).

- Hook parity: one placement on the same state runs the placement plugins' post-decision hooks in
  both (before the core the simulator recorded ``{}`` where the server recorded ``{'r0': 1}``).
- Replay parity: 1,000 arrivals of a real trace (Azure 2023 code, the first 1,000 requests; two
  tenants, weights 1 and 2, a sheddable class) into the server's :class:`~router.server.Router`
  (its own ``_acquire``, the per-request sequence its HTTP handler runs) and into a fleet
  simulation's router (its ``arrive``, what its event loop runs), with the same budget snapshots
  before every arrival, the same Reserve answers and the same request ends: both take the same
  decision for every arrival (placed on which replica for how many tokens, queued, or refused for
  which reason), the queue's dispatcher grants the same queued requests to the same replicas, and
  the fair-queue counters and per-replica loads agree at the end. The same with the prefix-aware
  profile on the Mooncake conversation trace (prefix keys from its block ids).

Snapshots: four replicas, time model a = 10 ms, b = 0.1 ms/token, horizon 900 ms; before arrival i,
replica r's PAB is one of five levels (0 to 900 ms) picked by (7 i + 3 r) mod 5, so placements,
queueing and slo-infeasible refusals all occur. Reserve: granted unless the prompt's uncached
prefill (10 + 0.1 P ms) exceeds the snapshot's PAB by the router's own rule, refused one time in
seven by the index of the call (an agent whose exact view differs).
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter

import pytest

from loadgen.fleet.sim import FleetConfig, FleetRequest, FleetSim, _drive, sim_router_config
from loadgen.traces import load_trace, resolve_trace
from proto import admission_pb2
from replica_agent.policy.time_model import TimeModel
from router.budget_client import ReserveResult
from router.config import RouterConfig, hash_api_key
from router.core import CoreRequest, Grant
from router.server import Router
from tests.fakes import FakeClock

TM = TimeModel(10.0, 0.1, 0.0)
LEVELS = (0.0, 120.0, 300.0, 600.0, 900.0)
END_AFTER = 12  # a granted request ends this many arrivals later (its lease settles)


def snapshot(rid: str, pab_ms: float, seq: int) -> admission_pb2.BudgetSnapshot:
    return admission_pb2.BudgetSnapshot(
        replica_id=rid, seq=seq, ttl_ms=10_000_000, healthy=True, max_prompt_tokens=200_000,
        coefficients=admission_pb2.TimeModelCoefficients(a_ms=10.0, b_ms_per_new_token=0.1),
        classes=[admission_pb2.ClassBudget(slo_class="interactive", ttft_ms=1000.0, tpot_ms=100.0, horizon_ms=900.0,
                                           pab_ms=pab_ms, pab_tokens=int(max(0.0, pab_ms - 10.0) / 0.1),
                                           kv_free_tokens=400_000, kv_limited_tokens=400_000,
                                           decode_reservation_ms=900.0 - pab_ms)],
        inline_admission=False,
    )  # fmt: skip


class FakeAgents:
    """The same Reserve answers for both routers (a call counter per router)."""

    def __init__(self) -> None:
        self.calls = itertools.count()
        self.leases = itertools.count()
        self.released: list[str] = []

    async def reserve(self, replica_id: str, slo_class: str, prompt_tokens: int, request_id: str,
                      max_tokens: int = 0, waited_ms: float = 0.0, on_time_only: bool = False) -> ReserveResult:
        n = next(self.calls)
        if n % 7 == 6:
            return ReserveResult(False, "", "no-budget", 0.0, 0)
        return ReserveResult(True, f"lease-{next(self.leases)}", "", -1.0, -1)

    def release(self, lease_id: str, reason: str) -> None:
        self.released.append(lease_id)


def fleet_config(policy: str, n: int) -> FleetConfig:
    return FleetConfig(policy=policy, replicas=n, time_model=TM, kv_capacity_tokens=400_000, ttft_ms=1000.0,
                       tpot_ms=100.0, lease_mode="reserve", start_window_steps=4.0, max_num_batched_tokens=2048,
                       sheddable=True, max_queue_ms=2000.0, tenant_weights=(("t0", 1.0), ("t1", 2.0)),
                       prefix_block_tokens=512, placement_hooks=("decision-count",))  # fmt: skip


def server_config(cfg: FleetConfig, seed: int) -> RouterConfig:
    doc = sim_router_config(cfg, seed).model_dump(exclude_none=True)
    doc["api_keys"] = {hash_api_key("k0"): "t0", hash_api_key("k1"): "t1"}
    return RouterConfig.model_validate(doc)


def trace_requests(name: str, n: int) -> list[FleetRequest]:
    reqs = load_trace(resolve_trace(name))[:n]
    return [FleetRequest(r.arrival_ms, r.prompt_tokens, max(1, r.output_tokens), f"t{i % 2}", r.hash_ids)
            for i, r in enumerate(reqs)]  # fmt: skip


async def replay_both(policy: str, trace: str, n_arrivals: int = 1000) -> tuple[list, list, Router, object]:
    n = 4
    cfg = fleet_config(policy, n)
    reqs = trace_requests(trace, n_arrivals)
    sim = FleetSim(cfg, reqs)
    srouter = sim.routers[0]
    seed = cfg.seed * 1000  # the simulation's first router's seed
    clock = FakeClock()
    router = Router(server_config(cfg, seed), clock, "parity")  # type: ignore[arg-type]
    router.core.reserve = FakeAgents()  # type: ignore[assignment]
    srouter.core.reserve = FakeAgents()  # type: ignore[attr-defined]
    server_log: list[tuple] = []
    sim_log: list[tuple] = []
    tasks: dict[int, asyncio.Task] = {}
    server_grants: dict[int, Grant] = {}
    ends: dict[int, list[int]] = {}
    logged: set[int] = set()
    queued: set[int] = set()  # arrivals that waited in the server's queue

    def creq(i: int) -> CoreRequest:
        return srouter.core_request(i)  # type: ignore[attr-defined,no-any-return]

    async def settle() -> None:
        for _ in range(3):
            await asyncio.sleep(0)

    def record_server(i: int) -> None:
        task = tasks[i]
        if not task.done():
            return
        got = task.result()
        del tasks[i]
        if isinstance(got, Grant):
            server_grants[i] = got
            server_log.append((i, "granted", got.replica_id, got.prompt_tokens))
        else:
            server_log.append((i, "refused", got.reason))

    for i, req in enumerate(reqs):
        t = req.arrival_ms
        clock.t = srouter.clock.t = t  # type: ignore[attr-defined]
        for r in range(n):
            snap = snapshot(f"r{r}", LEVELS[(7 * i + 3 * r) % len(LEVELS)], i + 1)
            router.book.update(f"r{r}", snap)
            srouter.book.update(f"r{r}", snap)  # type: ignore[attr-defined]
        for j in ends.pop(i, []):  # requests granted END_AFTER arrivals ago end now, in both
            if j in server_grants:
                router.core.lease_done(server_grants.pop(j))
            srouter.ended(j)  # type: ignore[attr-defined]
        # the server: its per-request sequence (as _serve runs it once the body is parsed)
        c = creq(i)
        if router.core.refuse_by_work(c):
            server_log.append((i, "refused", "work-shed"))
        else:
            router.core.track_prefix(c)
            tasks[i] = asyncio.create_task(router._acquire(c, frozenset()))
        # the simulation
        srouter.arrive(i)  # type: ignore[attr-defined]
        await settle()
        queued.update(int(e.request_id) for e in router.queue.ordered(t))
        assert len(router.queue) == len(srouter.queue)  # type: ignore[attr-defined]
        # one dispatcher wake-up in each (the sim's event loop and the router's task would run it)
        await router.dispatcher.dispatch_chain()
        _drive(srouter.dispatcher.dispatch_chain())  # type: ignore[attr-defined]
        await settle()
        for k in sorted(tasks):
            record_server(k)
        for k in range(i + 1):
            st = sim.states[k]
            if k in logged:
                continue
            if st.grant is not None:
                sim_log.append((k, "granted", st.grant.replica_id, st.grant.prompt_tokens))
                logged.add(k)
                ends.setdefault(i + END_AFTER, []).append(k)
            elif st.outcome == "rejected":
                sim_log.append((k, "refused", st.reason))
                logged.add(k)
        for k, g in list(server_grants.items()):
            if not any(k in v for v in ends.values()):
                ends.setdefault(i + END_AFTER, []).append(k)
    for task in tasks.values():
        task.cancel()
    router.queued_in_replay = queued  # type: ignore[attr-defined]
    return server_log, sim_log, router, srouter


def test_hooks_run_in_both_after_one_placement() -> None:
    async def go() -> tuple[dict, dict]:
        server_log, sim_log, router, srouter = await replay_both("pab", "azure-code", 1)
        hook = router.policy.hooks[0]
        shook = srouter.core.policy.hooks[0]  # type: ignore[attr-defined]
        return dict(hook.counts), dict(shook.counts)

    server_counts, sim_counts = asyncio.run(go())
    # arrival 0: r0's PAB level (7*0 + 0) mod 5 = 0 -> 0 ms, r1: 3 -> 600 ms, r2: 6 mod 5 = 1 -> 120,
    # r3: 9 mod 5 = 4 -> 900 ms: the most headroom, r3
    assert server_counts == sim_counts == {"r3": 1}


@pytest.mark.parametrize(("policy", "trace"), [("pab", "azure-code"), ("pab-prefix", "mooncake-conv")])
def test_a_thousand_arrivals_of_a_real_trace_get_the_same_decisions(policy: str, trace: str) -> None:
    server_log, sim_log, router, srouter = asyncio.run(replay_both(policy, trace))
    assert len(server_log) >= 900  # (a few still queued at the end)
    assert sorted(server_log) == sorted(sim_log)
    outcomes = Counter(e[1] if e[1] == "granted" else e[2] for e in server_log)
    # the replay exercises every path: grants, queue time-outs or infeasible refusals
    assert outcomes["granted"] > 100 and outcomes["slo-infeasible"] > 10, outcomes
    assert len(router.queued_in_replay) > 20  # type: ignore[attr-defined]
    assert dict(router.queue.counters()) == pytest.approx(dict(srouter.queue.counters()))  # type: ignore[attr-defined]
    assert dict(router.core.replica_load) == dict(srouter.core.replica_load)  # type: ignore[attr-defined]
    assert router.policy.hooks[0].counts == srouter.core.policy.hooks[0].counts  # type: ignore[attr-defined]
