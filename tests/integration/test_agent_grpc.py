"""The agent's AdmissionService served for real by grpc.aio on loopback.

Engine metrics are injected (no engine needed): KV usage 0 of 100 000 tokens. Time model a = 10,
b = 0.1, c = 0.001 ms; class interactive TTFT 500 / TPOT 50, margin 0.1 -> H = 450 ms.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from proto import admission_pb2, admission_pb2_grpc
from replica_agent.admission_server import expire_leases_loop, start_grpc_server
from replica_agent.agent import Agent, AgentConfig
from fairbatch_common.clock import Clock
from replica_agent.engine_metrics import EngineMetrics
from replica_agent.policy.pab import SloClass
from replica_agent.policy.time_model import TimeModel

TM = TimeModel(10.0, 0.1, 0.001)


def make_agent(lease_ttl_ms: float = 60_000.0, push_interval_ms: float = 50.0,
               min_push_interval_ms: float = 5.0) -> Agent:
    cfg = AgentConfig(
        replica_id="r-test",
        time_model=TM,
        slo_classes=(SloClass("interactive", 500.0, 50.0), SloClass("batch", 20_000.0, 200.0)),
        default_slo_class="interactive",
        margin_frac=0.1,
        kv_capacity_tokens=100_000,
        push_interval_ms=push_interval_ms,
        min_push_interval_ms=min_push_interval_ms,
        ttl_ms=1000.0,
        lease_ttl_ms=lease_ttl_ms,
        metrics_stale_ms=600_000.0,
    )
    agent = Agent(cfg, Clock(1.0), lease_id_prefix="t")
    agent.on_engine_metrics(EngineMetrics(num_running=0, num_waiting=0, kv_usage=0.0), [], "")
    return agent


@pytest.fixture
async def served():
    servers = []

    async def start(agent: Agent):
        server, port = await start_grpc_server(agent, "127.0.0.1", 0)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        servers.append((server, channel))
        return admission_pb2_grpc.AdmissionServiceStub(channel)

    yield start
    for server, channel in servers:
        await channel.close()
        await server.stop(grace=None)


def interactive(snap: admission_pb2.BudgetSnapshot) -> admission_pb2.ClassBudget:
    return next(c for c in snap.classes if c.slo_class == "interactive")


async def next_snapshot(stream, after_seq: int, predicate=lambda s: True, timeout_s: float = 5.0):
    async def loop():
        while True:
            snap = await stream.read()
            assert snap is not grpc.aio.EOF
            if snap.seq > after_seq and predicate(snap):
                return snap

    return await asyncio.wait_for(loop(), timeout_s)


async def test_watch_budget_streams_increasing_seq(served):
    agent = make_agent()
    stub = await served(agent)
    stream = stub.WatchBudget(admission_pb2.WatchBudgetRequest(router_id="test"))
    first = await asyncio.wait_for(stream.read(), 5.0)
    assert first.replica_id == "r-test" and first.healthy and first.ttl_ms == 1000
    assert first.coefficients.b_ms_per_new_token == pytest.approx(0.1)
    assert first.kv_capacity_tokens == 100_000
    b = interactive(first)
    assert b.horizon_ms == pytest.approx(450.0) and b.pab_ms == pytest.approx(450.0) and b.pab_tokens == 4400
    assert {c.slo_class for c in first.classes} == {"interactive", "batch"}
    seqs = [first.seq]
    for _ in range(3):  # periodic pushes with nothing changing
        seqs.append((await asyncio.wait_for(stream.read(), 5.0)).seq)
    assert seqs == sorted(set(seqs))
    stream.cancel()


async def test_changes_coalesce_into_one_snapshot_per_min_interval(served):
    # period 5 s (no periodic push in the test's window), at most one change push per 300 ms
    agent = make_agent(push_interval_ms=5000.0, min_push_interval_ms=300.0)
    stub = await served(agent)
    stream = stub.WatchBudget(admission_pb2.WatchBudgetRequest(router_id="test"))
    first = await asyncio.wait_for(stream.read(), 5.0)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    leases = []
    for i in range(20):  # 20 changes (the loop runs in between): 20 grants
        leases.append(agent.reserve("interactive", 100, None, f"q{i}", agent.clock.now_ms()).lease_id)
        await asyncio.sleep(0)
    grants_s = loop.time() - t0
    snaps = [await next_snapshot(stream, first.seq)]
    while snaps[-1].active_leases < 20:  # every change is in a snapshot, the last one holds all 20
        snaps.append(await next_snapshot(stream, snaps[-1].seq))
    assert snaps[-1].active_leases == 20
    assert [s.active_leases for s in snaps] == sorted(s.active_leases for s in snaps)
    # change pushes are >= 300 ms apart (agent timestamps, so the reader's own lateness does not count;
    # the first may follow the stream's first snapshot sooner when this reader was late to start)
    gaps = [b.timestamp_ms - a.timestamp_ms for a, b in zip(snaps, snaps[1:])]
    assert all(g >= 290 for g in gaps), gaps
    # so 20 changes made within grants_s give at most one push per started interval, plus the first
    assert len(snaps) <= 2 + int(grants_s / 0.29), (len(snaps), grants_s)
    # no change since: nothing more until the next change (or the 5 s period)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(stream.read(), 0.6)
    stream.cancel()


async def test_reserve_lowers_pab_and_release_restores(served):
    agent = make_agent()
    stub = await served(agent)
    stream = stub.WatchBudget(admission_pb2.WatchBudgetRequest(router_id="test"))
    first = await asyncio.wait_for(stream.read(), 5.0)
    before = interactive(first).pab_ms

    resp = await stub.Reserve(admission_pb2.ReserveRequest(slo_class="interactive", prompt_tokens=1000, request_id="q1"))
    assert resp.granted and resp.lease_id and resp.reason == ""
    # in-flight reservation b * 1000 = 100 ms -> 350 ms; tokens floor(340 / 0.1) = 3400
    assert resp.pab_ms == pytest.approx(before - 100.0)
    assert resp.pab_tokens == 3400
    assert resp.expires_ms > first.timestamp_ms
    assert resp.seq > first.seq
    # the first snapshot that carries the grant (seq >= resp.seq): a periodic one made between `first` and the
    # Reserve can still be in the stream on a loaded machine (it has no lease yet)
    snap = await next_snapshot(stream, resp.seq - 1)
    assert snap.active_leases == 1
    assert interactive(snap).pab_ms == pytest.approx(before - 100.0)
    assert interactive(snap).inflight_reservation_ms == pytest.approx(100.0)

    assert (await stub.Release(admission_pb2.ReleaseRequest(lease_id=resp.lease_id, reason="test"))).released
    snap2 = await next_snapshot(stream, snap.seq, lambda s: s.active_leases == 0)
    assert interactive(snap2).pab_ms == pytest.approx(before)
    assert not (await stub.Release(admission_pb2.ReleaseRequest(lease_id=resp.lease_id))).released
    stream.cancel()


async def test_lease_expiry_restores_budget(served):
    agent = make_agent(lease_ttl_ms=200.0)
    stub = await served(agent)
    expiry = asyncio.create_task(expire_leases_loop(agent))
    try:
        stream = stub.WatchBudget(admission_pb2.WatchBudgetRequest(router_id="test"))
        first = await asyncio.wait_for(stream.read(), 5.0)
        resp = await stub.Reserve(admission_pb2.ReserveRequest(slo_class="interactive", prompt_tokens=2000))
        assert resp.granted and resp.pab_ms == pytest.approx(250.0)
        low = await next_snapshot(stream, first.seq, lambda s: s.active_leases == 1)
        assert interactive(low).pab_ms == pytest.approx(250.0)
        restored = await next_snapshot(stream, low.seq, lambda s: s.active_leases == 0)
        assert interactive(restored).pab_ms == pytest.approx(450.0)
        assert not (await stub.Release(admission_pb2.ReleaseRequest(lease_id=resp.lease_id))).released
        stream.cancel()
    finally:
        expiry.cancel()


async def test_refusals(served):
    agent = make_agent()
    stub = await served(agent)
    r = await stub.Reserve(admission_pb2.ReserveRequest(slo_class="nope", prompt_tokens=10))
    assert not r.granted and r.reason == "unknown-class" and r.lease_id == ""
    # 4000 tokens fit (410 ms); a second 4000 no longer does (50 ms left)
    assert (await stub.Reserve(admission_pb2.ReserveRequest(slo_class="interactive", prompt_tokens=4000))).granted
    r = await stub.Reserve(admission_pb2.ReserveRequest(slo_class="interactive", prompt_tokens=4000))
    assert not r.granted and r.reason == "no-budget"
    assert r.pab_ms == pytest.approx(50.0)
    # KV: 100 000 - 4 000 pending; a long-horizon class asks for more than the rest of the KV cache
    r = await stub.Reserve(admission_pb2.ReserveRequest(slo_class="batch", prompt_tokens=97_000))
    assert not r.granted and r.reason == "kv-full"
    agent.on_engine_metrics(None, [], "engine /metrics unreachable: ClientConnectorError")
    r = await stub.Reserve(admission_pb2.ReserveRequest(slo_class="batch", prompt_tokens=10))
    assert not r.granted and r.reason == "unhealthy"


async def test_unhealthy_snapshot_names_the_reason(served):
    agent = make_agent()
    stub = await served(agent)
    agent.on_engine_metrics(None, [], "engine /metrics answered 500")
    stream = stub.WatchBudget(admission_pb2.WatchBudgetRequest(router_id="test"))
    snap = await asyncio.wait_for(stream.read(), 5.0)
    assert not snap.healthy and "500" in snap.status_detail
    stream.cancel()


async def test_reserve_of_aged_and_late_requests(served):
    agent = make_agent()
    stub = await served(agent)

    def reserve(request_id: str, prompt_tokens: int, waited_ms: float = 0.0):
        req = admission_pb2.ReserveRequest(
            slo_class="interactive", prompt_tokens=prompt_tokens, request_id=request_id, waited_ms=waited_ms
        )
        return stub.Reserve(req)

    # a first lease of 1000 tokens: in-flight 0.1 * 1000 = 100 ms -> PAB_ms = 450 - 100 = 350
    first = await reserve("q1", 1000)
    assert first.granted and first.pab_ms == pytest.approx(350.0)
    # the same 1000-token prompt (10 + 100 = 110 ms), aged 300 ms: no longer on time (exact horizon
    # 450 - 300 = 150 ms, PAB_ms 150 - 100 = 50 < 110), but it takes the budget a fresh arrival
    # would take (110 <= 350, pab.py "Work conservation") -> granted, PAB_ms 350 - 100 = 250
    aged = await reserve("q2", 1000, waited_ms=300.0)
    assert aged.granted and aged.pab_ms == pytest.approx(250.0)
    # past its TTFT (w = 1000 > 450) on a replica with leases in flight: the normal fit too (110 <= 250)
    late = await reserve("q3", 1000, waited_ms=1000.0)
    assert late.granted and late.pab_ms == pytest.approx(150.0)
    # a prompt too long on its own (10 + 0.1 * 5000 = 510 ms > 450) keeps the idle rule: refused here
    big = await reserve("q4", 5000, waited_ms=1000.0)
    assert not big.granted and big.lease_id == ""
    # fresh, 110 <= 150 -> granted, PAB_ms 50; then nothing of 110 ms fits, aged or not
    fresh = await reserve("q5", 1000)
    assert fresh.granted and fresh.pab_ms == pytest.approx(50.0)
    refused = await reserve("q7", 1000, waited_ms=100.0)
    assert not refused.granted and refused.reason == "no-budget" and refused.pab_ms == pytest.approx(50.0)
    assert len(agent.leases) == 4
    bad = await reserve("q6", 10, waited_ms=-1.0)
    assert not bad.granted and bad.reason == "bad-request"


async def test_one_snapshot_per_push_for_every_subscribed_router() -> None:
    """Two routers watch one agent: after a burst of changes both get the same snapshot (one seq),
    computed once (compute_budget counted); a stream that leaves keeps the other's pushes going, and
    the feed's task stops with the last stream."""
    from replica_agent.admission_server import AdmissionService

    agent = make_agent(push_interval_ms=5000.0, min_push_interval_ms=200.0)
    calls = 0
    compute = agent.compute_budget

    def counting(now_ms, state=None):
        nonlocal calls
        calls += 1
        return compute(now_ms, state)

    agent.compute_budget = counting  # type: ignore[method-assign]
    service = AdmissionService(agent)
    server = grpc.aio.server()
    admission_pb2_grpc.add_AdmissionServiceServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        stub = admission_pb2_grpc.AdmissionServiceStub(channel)
        s1 = stub.WatchBudget(admission_pb2.WatchBudgetRequest(router_id="r1"))
        s2 = stub.WatchBudget(admission_pb2.WatchBudgetRequest(router_id="r2"))
        f1 = await asyncio.wait_for(s1.read(), 5.0)
        f2 = await asyncio.wait_for(s2.read(), 5.0)
        assert f1.seq != f2.seq and calls == 2  # each stream's first snapshot is its own
        assert service.feed.running
        for i in range(10):  # 10 grants, the loop running in between (no Reserve answer budget)
            agent.reserve("interactive", 100, None, f"q{i}", agent.clock.now_ms(), answer_budget=False)
            await asyncio.sleep(0)
        a = await asyncio.wait_for(s1.read(), 5.0)
        b = await asyncio.wait_for(s2.read(), 5.0)
        assert a.seq == b.seq > max(f1.seq, f2.seq) and a.active_leases == b.active_leases == 10
        assert interactive(a).inflight_reservation_ms == pytest.approx(10 * 100 * 0.1)  # b * 100 tokens each
        assert calls == 3 and service.feed.computed == 1  # one computation for both routers
        # the operator's count: two first snapshots and one push
        assert agent.metrics.registry.get_sample_value("fairbatch_agent_budget_snapshots_total") == 3.0
        s1.cancel()
        for _ in range(100):  # the server sees the cancellation
            if len(service.feed._subs) == 1:
                break
            await asyncio.sleep(0.02)
        assert len(service.feed._subs) == 1 and service.feed.running
        agent.reserve("interactive", 100, None, "q-last", agent.clock.now_ms(), answer_budget=False)
        c = await asyncio.wait_for(s2.read(), 5.0)
        assert c.seq > b.seq and c.active_leases == 11
        s2.cancel()
        for _ in range(100):
            if not service.feed.running:
                break
            await asyncio.sleep(0.02)
        assert not service.feed.running and not service.feed._subs
    finally:
        await channel.close()
        await server.stop(grace=None)
