"""CPU per pick of the ext_proc endpoint picker, side by side with the HTTP router in the same process and run.

One ``fairbatch-router --ext-proc-port`` process (the picker and the HTTP front door on one core,
router/ext_proc.py) in front of ``--replicas`` fake agents that this script serves itself: a gRPC
AdmissionService pushing a large budget every 50 ms (so no pick waits: this measures the picker,
not admission) and an HTTP side that answers every generation at once. Loads, each sent by
``--concurrency`` client streams, closed loop, ``--requests`` requests each, in interleaved rounds
(``--rounds``; so a slow spell of the shared machine hits all of them):

- ``pick``: the ext_proc stream of a request whose response Envoy does not send to the processor
  (response processing SKIP): ``request_headers`` -> the pick -> close;
- ``pick+settle``: the whole sequence of the EPP protocol: ``request_headers`` -> the pick ->
  ``response_headers`` (served endpoint) -> ``response_trailers`` -> close (the lease settled);
- ``http``: the same request through the HTTP front door (body read and validated, placed by the
  same core, relayed to the fake agent and answered): the HTTP router's cost per request;
- ``grpc-floor``: the ``pick`` sequence against a bare grpc.aio ``ExternalProcessor`` in a process of
  its own (on the same event loop as the router, uvloop) that answers CONTINUE without looking: what
  any Python grpc.aio picker pays for the stream alone, so ``pick - grpc-floor`` is the picker's own work.

CPU is the router process's utime + stime (``/proc/<pid>/stat``, all threads) over the load, less
its idle rate (measured for ``--idle-s`` before: budget pushes, the dispatcher) times the load's
wall time; "picks/s per core" is ``1 / CPU per request``. The placement decision alone (the core's
``fairbatch_router_placement_seconds``, wall, the same code for both drivers) is read from /metrics.
The picker's added latency is the client's time from sending ``request_headers`` to the pick, at one
stream (``--latency-requests`` sequential requests; the client's own gRPC cost included).

No timed asserts: it reports. ``python scripts/bench_ext_proc.py --out docs/bench/ext_proc_pick.json``
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import yaml
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fairbatch_common.runtime import hold_grpc_aio  # noqa: E402
from loadgen.envoy_ext_proc import EnvoyStream, parse_pick  # noqa: E402
from loadgen.procs import ProcessGroup, free_port, script  # noqa: E402
from proto import admission_pb2, admission_pb2_grpc  # noqa: E402
from router.cli import GRPC_EXPERIMENTS_DEFAULT  # noqa: E402

API_KEY = "sk-bench"
CLK_TCK = os.sysconf("SC_CLK_TCK")
BODY = json.dumps({"model": "bench", "prompt": "x" * 340, "max_tokens": 16}).encode()  # 100 tokens at 4 B/token


class BigBudget(admission_pb2_grpc.AdmissionServiceServicer):
    """A fake agent's gRPC side: a PAB far above the load (a = 10 ms, b = 0.1 ms/token), pushed every 50 ms."""

    def __init__(self, replica_id: str) -> None:
        self.replica_id = replica_id
        self.seq = 0

    def snapshot(self) -> admission_pb2.BudgetSnapshot:
        self.seq += 1
        pab = 1e9
        cls = admission_pb2.ClassBudget(slo_class="interactive", ttft_ms=500, tpot_ms=50, horizon_ms=pab, pab_ms=pab,
                                        pab_tokens=int(pab * 10), kv_free_tokens=10**9, kv_limited_tokens=10**9)
        return admission_pb2.BudgetSnapshot(
            replica_id=self.replica_id, seq=self.seq, ttl_ms=1000, healthy=True,
            coefficients=admission_pb2.TimeModelCoefficients(a_ms=10.0, b_ms_per_new_token=0.1),
            classes=[cls], max_prompt_tokens=32768, inline_admission=True)

    async def WatchBudget(self, request, context):  # noqa: N802 - gRPC name
        while True:
            yield self.snapshot()
            await asyncio.sleep(0.05)

    async def Reserve(self, request, context):  # noqa: N802
        return admission_pb2.ReserveResponse(granted=True, lease_id=f"{self.replica_id}-{request.request_id}",
                                             pab_ms=1e9, pab_tokens=10**10)

    async def Release(self, request, context):  # noqa: N802
        return admission_pb2.ReleaseResponse(released=True)


class Floor:
    """A bare ExternalProcessor: one read, one CONTINUE, then the rest of the stream read."""

    async def Process(self, request_iterator: Any, context: Any) -> None:  # noqa: N802
        from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

        resp = ep.ProcessingResponse(request_headers=ep.HeadersResponse())
        while True:
            msg = await context.read()
            if msg is grpc.aio.EOF:
                return
            await context.write(resp)


async def serve_floor(port: int) -> None:
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

    hold_grpc_aio()
    server = grpc.aio.server()
    ep_grpc.add_ExternalProcessorServicer_to_server(Floor(), server)  # type: ignore[arg-type]
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


async def one_floor(channel: grpc.aio.Channel) -> float:
    s = EnvoyStream.open(channel, 30.0)
    t0 = time.perf_counter()
    await s.request_headers(headers())
    dt = time.perf_counter() - t0
    await s.close()
    return dt


async def upstream(request: web.Request) -> web.Response:
    await request.read()
    return web.json_response({"id": "cmpl-bench", "choices": [{"text": "ok"}],
                              "usage": {"prompt_tokens": 100, "completion_tokens": 1}})


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def headers() -> dict[str, str]:
    return {":method": "POST", ":path": "/v1/completions", ":authority": "gw", "content-type": "application/json",
            "content-length": str(len(BODY)), "authorization": f"Bearer {API_KEY}"}


async def one_pick(channel: grpc.aio.Channel, settle: bool) -> float:
    """One ext_proc request; returns the seconds from sending the headers to the pick."""
    s = EnvoyStream.open(channel, 30.0)
    t0 = time.perf_counter()
    resp = await s.request_headers(headers())
    dt = time.perf_counter() - t0
    pick = parse_pick(resp)
    if pick is None:
        raise RuntimeError(f"refused: {resp}")
    if settle:
        await s.response_headers(200, {"content-type": "application/json"}, served=pick.endpoints[0])
        await s.response_trailers()
    await s.close()
    return dt


async def one_http(session: aiohttp.ClientSession, url: str) -> float:
    t0 = time.perf_counter()
    async with session.post(url + "/v1/completions", data=BODY, headers={
            "Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}) as resp:
        await resp.read()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}")
    return time.perf_counter() - t0


async def closed_loop(n: int, concurrency: int, fn: Any) -> tuple[float, list[float]]:
    """``n`` calls of ``fn`` over ``concurrency`` workers; (wall seconds, per-call results)."""
    left = iter(range(n))
    out: list[float] = []

    async def worker() -> None:
        for _ in left:
            out.append(await fn())

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - t0, out


def placement_stats(url: str) -> tuple[float, float]:
    """(sum, count) of fairbatch_router_placement_seconds."""
    import urllib.request

    text = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
    got = {}
    for line in text.splitlines():
        for k in ("sum", "count"):
            if line.startswith(f"fairbatch_router_placement_seconds_{k} "):
                got[k] = float(line.split()[1])
    return got.get("sum", 0.0), got.get("count", 0.0)


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    hold_grpc_aio()
    grpc_servers, runners, replicas = [], [], []
    for i in range(args.replicas):
        server = grpc.aio.server()
        admission_pb2_grpc.add_AdmissionServiceServicer_to_server(BigBudget(f"r{i}"), server)
        gport = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        grpc_servers.append(server)
        app = web.Application()
        app.router.add_post("/v1/completions", upstream)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        runners.append(runner)
        replicas.append({"id": f"r{i}", "http_url": f"http://127.0.0.1:{runner.addresses[0][1]}",
                         "grpc_target": f"127.0.0.1:{gport}"})
    tmp = Path(tempfile.mkdtemp(prefix="bench-ext-proc-"))
    cfg = {
        "model": "bench",
        "slo_classes": {"interactive": {"ttft_ms": 500, "tpot_ms": 50, "max_queue_ms": 5000}},
        "tenants": {"acme": {"slo_class": "interactive"}},
        "api_keys": {hashlib.sha256(API_KEY.encode()).hexdigest(): "acme"},
        "replicas": replicas,
        "queue": {"max_requests": 4096, "max_tokens": 100_000_000},
        "admission": {"bytes_per_token": 4.0, "lease_mode": args.lease_mode, "contention_max_inflight": 0,
                      "start_window_steps": 0},
    }
    (tmp / "fairbatch.yaml").write_text(yaml.safe_dump(cfg))
    group = ProcessGroup(tmp / "logs")
    port, ext_port = free_port(), free_port()
    cmd = script("fairbatch-router")
    if args.profile:  # cProfile of the router process, written when it stops (SIGTERM drains and returns)
        cmd = [sys.executable, "-m", "cProfile", "-o", args.profile, "-m", "router.cli"]
    # the router's gRPC core settings (router/cli.py GRPC_EXPERIMENTS_DEFAULT unless --grpc-experiments),
    # the same for the floor server, so that its row is what the picker's stream pays
    experiments = args.grpc_experiments
    if experiments is None:
        experiments = os.environ.get("GRPC_EXPERIMENTS", GRPC_EXPERIMENTS_DEFAULT)
    grpc_env = {"GRPC_EXPERIMENTS": experiments}
    router = group.start("router", cmd + [
        "--config", str(tmp / "fairbatch.yaml"), "--port", str(port), "--ext-proc-port", str(ext_port),
        "--log-level", "WARNING"], env=grpc_env)
    floor_port = free_port()
    floor = group.start("grpc-floor", [sys.executable, str(Path(__file__).resolve()), "--floor-server",
                                       str(floor_port)], env=grpc_env)
    url = f"http://127.0.0.1:{port}"
    result: dict[str, Any] = {}
    try:
        group.wait_http_ok(router, url + "/health")
        while True:  # every replica's first snapshot in
            async with aiohttp.ClientSession() as s, s.get(url + "/health") as r:
                if len((await r.json())["replicas_usable"]) == args.replicas:
                    break
            await asyncio.sleep(0.05)
        pids = {"router": router.popen.pid, "floor": floor.popen.pid}
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{ext_port}")
        floor_channel = grpc.aio.insecure_channel(f"127.0.0.1:{floor_port}")
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        loads = {"pick": lambda: one_pick(channel, False), "pick+settle": lambda: one_pick(channel, True),
                 "http": lambda: one_http(session, url), "grpc-floor": lambda: one_floor(floor_channel)}
        pid_of = {"pick": "router", "pick+settle": "router", "http": "router", "grpc-floor": "floor"}
        loads = {k: v for k, v in loads.items() if k in args.loads}
        for name, fn in loads.items():  # warm-up
            await closed_loop(200, args.concurrency, fn)
        c0 = {k: cpu_s(p) for k, p in pids.items()}
        t0 = time.perf_counter()
        await asyncio.sleep(args.idle_s)
        idle = {k: (cpu_s(p) - c0[k]) / (time.perf_counter() - t0) for k, p in pids.items()}
        acc: dict[str, dict[str, float]] = {n: {"cpu_s": 0.0, "wall_s": 0.0, "requests": 0, "placement_s": 0.0,
                                                "placements": 0} for n in loads}
        for _ in range(args.rounds):
            for name, fn in loads.items():
                p0 = placement_stats(url)
                pid = pids[pid_of[name]]
                c0 = cpu_s(pid)
                wall, _ = await closed_loop(args.requests, args.concurrency, fn)
                c1 = cpu_s(pid)
                p1 = placement_stats(url)
                a = acc[name]
                a["cpu_s"] += c1 - c0
                a["wall_s"] += wall
                a["requests"] += args.requests
                a["placement_s"] += p1[0] - p0[0]
                a["placements"] += p1[1] - p0[1]
        # the picker's added latency: one stream at a time
        lat_loads = {"pick": lambda: one_pick(channel, False), "http": lambda: one_http(session, url),
                     "grpc-floor": lambda: one_floor(floor_channel)}
        lat = {k: (await closed_loop(args.latency_requests, 1, fn))[1] for k, fn in lat_loads.items()
               if k in args.loads}
        await session.close()
        await channel.close()
        await floor_channel.close()
        for name, a in acc.items():
            net = a["cpu_s"] - idle[pid_of[name]] * a["wall_s"]
            per = net / a["requests"]
            result[name] = {
                "requests": int(a["requests"]), "wall_s": round(a["wall_s"], 3), "cpu_s": round(a["cpu_s"], 4),
                "net_cpu_s": round(net, 4), "cpu_ms_per_request": round(per * 1000, 4),
                "requests_per_s_per_core": round(1.0 / per, 1) if per > 0 else None,
                "throughput_per_s": round(a["requests"] / a["wall_s"], 1),
                "placement_us_per_decision": round(a["placement_s"] / a["placements"] * 1e6, 2)
                if a["placements"] and name != "grpc-floor" else None,
            }

        def pct(xs: list[float], q: float) -> float:
            xs = sorted(xs)
            return round(xs[min(len(xs) - 1, int(q * len(xs)))] * 1000, 3)

        result["latency_ms"] = {"requests": args.latency_requests}
        for k, xs in lat.items():
            key = k.replace("-", "_").replace("http", "http_request")
            result["latency_ms"][f"{key}_p50"] = pct(xs, 0.5)
            result["latency_ms"][f"{key}_p99"] = pct(xs, 0.99)
        result["idle_cpu_per_s"] = {k: round(v, 5) for k, v in idle.items()}
        result["load_average"] = os.getloadavg()
        result["grpc_experiments"] = experiments
    finally:
        group.stop()
        for r in runners:
            await r.cleanup()
        for s in grpc_servers:
            await s.stop(0)
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--requests", type=int, default=2000, help="requests per load per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--idle-s", type=float, default=3.0)
    p.add_argument("--latency-requests", type=int, default=500)
    p.add_argument("--lease-mode", default="inline", choices=["inline", "reserve"])
    p.add_argument("--loads", default="pick,pick+settle,http,grpc-floor",
                   type=lambda s: [x for x in s.split(",") if x], help="the loads to run (comma-separated)")
    p.add_argument("--grpc-experiments", default=None, metavar="LIST",
                   help="GRPC_EXPERIMENTS for the router and the floor server (default: router/cli.py's; '' = gRPC's)")
    p.add_argument("--profile", default=None, metavar="PATH", help="cProfile the router process into PATH")
    p.add_argument("--floor-server", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help="write the JSON here (e.g. docs/bench/ext_proc_pick.json)")
    args = p.parse_args()
    if args.floor_server is not None:
        from fairbatch_common.runtime import run

        run(serve_floor(args.floor_server))
        return 0
    res = asyncio.run(bench(args))
    print(f"{'load':<13} {'requests':>8} {'CPU ms/req':>10} {'req/s/core':>10} {'req/s':>8} {'placement us':>12}")
    for name in args.loads:
        r = res[name]
        print(f"{name:<13} {r['requests']:>8} {r['cpu_ms_per_request']:>10.3f} {r['requests_per_s_per_core']:>10} "
              f"{r['throughput_per_s']:>8} {r['placement_us_per_decision'] or '-':>12}")
    lat = res["latency_ms"]
    print("added latency (one stream, ms): " + ", ".join(f"{k} {v}" for k, v in lat.items() if k != "requests"))
    if args.out:
        doc = {"script": "scripts/bench_ext_proc.py", "args": vars(args), "machine": {
            "cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
            "results": res}
        Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
