"""CPU per budget push over gRPC: the agent's WatchBudget stream, server and client apart (issue 17).

The agent's real :class:`~replica_agent.admission_server.AdmissionService` (grpc.aio, the shared
snapshot feed) serves one real :class:`~replica_agent.agent.Agent` tracking ``--decodes`` decodes
of one class; a driver task in the agent's process signals a change ``--rate`` times per wall
second (``Agent.notify``, what an arrival, a first token or a finish does), with
``min_push_interval_ms`` 0 so that every change is one push. A client process reads the stream
with a plain grpc.aio stub (what the router's BudgetClient does before its own bookkeeping). Each
side's CPU (``getrusage``, all threads) over the counted pushes, net of its own idle rate measured
for 2 s before, divided by the pushes. In the agent's process the budget computation and the
protobuf (``compute_budget`` + ``snapshot_pb``) are also timed alone, in a loop, so the push's
cost splits into the agent's own work and gRPC's.

``--bare`` measures the reference instead: a WatchBudget generator that yields one prebuilt
snapshot every ``1 / rate`` s (gRPC's own cost per message; "compute" is then not spent per push).

Run: ``python scripts/bench_grpc_push.py --out grpc_push.json`` (about 1 minute; prints a table).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc  # noqa: E402

from proto import admission_pb2, admission_pb2_grpc  # noqa: E402
from replica_agent.admission_server import AdmissionService, snapshot_pb  # noqa: E402
from replica_agent.agent import Agent, AgentConfig  # noqa: E402
from fairbatch_common.clock import Clock  # noqa: E402
from replica_agent.policy.pab import SloClass  # noqa: E402
from replica_agent.policy.profiles import load_profile  # noqa: E402
from fairbatch_common.runtime import run  # noqa: E402


def cpu_s() -> float:
    """User + system CPU of this process, all threads (s)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def make_agent(decodes: int) -> Agent:
    """An agent (llama-3-8b-a100 profile, one class) tracking ``decodes`` requests that have their first token."""
    prof = load_profile("llama-3-8b-a100")
    cfg = AgentConfig(replica_id="r0", time_model=prof.time_model, slo_classes=(SloClass("interactive", 2000.0, 200.0),),
                      default_slo_class="interactive", kv_capacity_tokens=400_000, metrics_stale_ms=1e12,
                      min_push_interval_ms=0.0)
    agent = Agent(cfg, Clock(1.0))
    now = agent.clock.now_ms()
    for i in range(decodes):
        agent.request_arrived(f"q{i}", "interactive", 200, 64, now)
        agent.request_tokens(f"q{i}", now + 30.0, 1 + i % 7)
    return agent


class BareService(admission_pb2_grpc.AdmissionServiceServicer):
    """The reference: WatchBudget as a generator that yields one prebuilt snapshot ``--pushes`` times,
    ``1 / rate`` s apart (gRPC's own cost per message, no feed, no budget computation)."""

    def __init__(self, snap: admission_pb2.BudgetSnapshot, pushes: int, rate: float, sent: list[int]) -> None:
        self._snap, self._pushes, self._rate, self._sent = snap, pushes, rate, sent

    async def WatchBudget(self, request, context):  # noqa: N802, ANN001, ANN201 - gRPC method
        yield self._snap  # the stream's first snapshot
        while not self._sent[1]:
            await asyncio.sleep(0.01)
        for i in range(self._pushes):
            self._snap.seq = i + 2
            self._sent[0] += 1
            yield self._snap
            await asyncio.sleep(1.0 / self._rate)
        await asyncio.sleep(3600)


async def serve(args: argparse.Namespace) -> None:
    agent = make_agent(args.decodes)
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        snap = snapshot_pb(agent, agent.compute_budget(agent.clock.now_ms()))
    compute_us = (time.perf_counter() - t0) / n * 1e6
    server = grpc.aio.server()
    bare_sent = [0, 0]  # pushes yielded, started
    service = BareService(snap, args.pushes, args.rate, bare_sent) if args.bare else AdmissionService(agent)
    admission_pb2_grpc.add_AdmissionServiceServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    sync = Path(args.sync_dir)
    (sync / "port").write_text(str(port))
    c0, w0 = cpu_s(), time.monotonic()
    await asyncio.sleep(2.0)  # idle: the stream not yet open
    idle = (cpu_s() - c0) / (time.monotonic() - w0)
    while not (sync / "subscribed").exists():
        await asyncio.sleep(0.01)
    def snapshots() -> float:
        return agent.metrics.registry.get_sample_value("fairbatch_agent_budget_snapshots_total") or 0.0

    pushes0 = snapshots()
    c1, w1 = cpu_s(), time.monotonic()
    if args.bare:
        bare_sent[1] = 1
        while bare_sent[0] < args.pushes:
            await asyncio.sleep(0.01)
    else:
        for _ in range(args.pushes):
            agent.notify()
            await asyncio.sleep(1.0 / args.rate)
    await asyncio.sleep(0.05)
    cpu, wall = cpu_s() - c1, time.monotonic() - w1
    pushes = bare_sent[0] if args.bare else snapshots() - pushes0
    (sync / "server.json").write_text(json.dumps({
        "pushes": pushes, "wall_s": wall, "cpu_s": cpu, "idle_cpu_per_s": idle,
        "net_cpu_us_per_push": (cpu - idle * wall) / max(1.0, pushes) * 1e6, "compute_us_per_push": compute_us}))
    for _ in range(3000):  # the client read its pushes and left (30 s at most)
        if (sync / "done").exists():
            break
        await asyncio.sleep(0.01)
    await server.stop(0)


async def client(args: argparse.Namespace, sync: Path) -> dict[str, float]:
    while not (sync / "port").exists():
        await asyncio.sleep(0.01)
    c0, w0 = cpu_s(), time.monotonic()
    await asyncio.sleep(1.0)
    idle = (cpu_s() - c0) / (time.monotonic() - w0)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{(sync / 'port').read_text()}") as channel:
        stream = admission_pb2_grpc.AdmissionServiceStub(channel).WatchBudget(
            admission_pb2.WatchBudgetRequest(router_id="bench"))
        await stream.read()  # the stream's own first snapshot
        (sync / "subscribed").write_text("1")
        got = 0
        c1, w1 = cpu_s(), time.monotonic()
        try:
            async with asyncio.timeout(args.pushes / args.rate * 3 + 30):
                while got < args.pushes:  # the change-driven pushes (and the periodic ones between them)
                    await stream.read()
                    got += 1
        except TimeoutError:
            pass
        cpu, wall = cpu_s() - c1, time.monotonic() - w1
        stream.cancel()
    (sync / "done").write_text("1")
    return {"snapshots": got, "cpu_s": cpu, "idle_cpu_per_s": idle,
            "net_cpu_us_per_push": (cpu - idle * wall) / max(1, got) * 1e6}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rates", type=float, nargs="+", default=[50.0, 100.0, 200.0], help="pushes per wall second")
    p.add_argument("--pushes", type=int, default=2000, help="pushes counted per rate")
    p.add_argument("--decodes", type=int, default=50, help="decodes the agent tracks (the stream load's 50 streams)")
    p.add_argument("--bare", action="store_true",
                   help="the reference instead: a bare WatchBudget generator yielding one prebuilt snapshot per 1/rate s")
    p.add_argument("--out", type=Path, default=None, help="write the JSON here")
    p.add_argument("--role", choices=["main", "server"], default="main", help=argparse.SUPPRESS)
    p.add_argument("--rate", type=float, default=100.0, help=argparse.SUPPRESS)
    p.add_argument("--sync-dir", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.role == "server":
        run(serve(args))
        return 0
    rows = []
    for rate in args.rates:
        with tempfile.TemporaryDirectory(prefix="fb-grpc-push-") as tmp:
            server = subprocess.Popen([sys.executable, __file__, "--role", "server", "--rate", str(rate),
                                       "--pushes", str(args.pushes), "--decodes", str(args.decodes), "--sync-dir", tmp,
                                       *(["--bare"] if args.bare else [])])
            try:
                args.rate = rate
                c = run(client(args, Path(tmp)))
                server.wait(timeout=60)
            finally:
                if server.poll() is None:
                    server.kill()
            s = json.loads((Path(tmp) / "server.json").read_text())
        compute = 0.0 if args.bare else s["compute_us_per_push"]  # the reference computes nothing per push
        rows.append({"rate_per_s": rate, "pushes": s["pushes"], "client_snapshots": c["snapshots"],
                     "agent_us_per_push": s["net_cpu_us_per_push"], "agent_compute_us_per_push": compute,
                     "agent_grpc_us_per_push": s["net_cpu_us_per_push"] - compute,
                     "client_us_per_push": c["net_cpu_us_per_push"]})
    what = "bare WatchBudget generator (reference)" if args.bare else "the agent's AdmissionService and feed"
    print(f"CPU per budget push, {what}, {args.decodes} decodes tracked, grpcio {grpc.__version__} "
          "(net of each process's idle rate)")
    print(f"{'pushes/s':>9} {'pushes':>7} {'agent us':>9} {'  of which compute':>19} {'  gRPC':>7} {'router-side us':>15}")
    for r in rows:
        print(f"{r['rate_per_s']:>9.0f} {r['pushes']:>7.0f} {r['agent_us_per_push']:>9.1f} {r['agent_compute_us_per_push']:>19.1f}"
              f" {r['agent_grpc_us_per_push']:>7.1f} {r['client_us_per_push']:>15.1f}")
    if args.out:
        args.out.write_text(json.dumps({"command": "python scripts/bench_grpc_push.py " + " ".join(
            argv if argv is not None else sys.argv[1:]), "python": platform.python_version(), "grpcio": grpc.__version__,
            "cpus": os.cpu_count(), "bare": args.bare, "rows": rows}, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
