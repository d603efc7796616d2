"""What a bare Python ext_proc stream costs the server, by gRPC server setup (docs/bench/ext_proc_pick.md "The floor").

Each variant is a server process that answers every ``ProcessingRequest`` with a fixed CONTINUE
(no picker work); one client process drives them all in interleaved rounds, the ``pick`` sequence of
scripts/bench_ext_proc.py (``request_headers`` -> answer -> half-close -> end), ``--concurrency``
streams over one channel, closed loop. CPU per stream is the server's utime + stime
(``/proc/<pid>/stat``) over a round, less its idle rate; the median of the rounds is printed.

Variants (comma-separated ``--variants``; a ``@LIST`` suffix sets ``GRPC_EXPERIMENTS=LIST`` for that
server, e.g. ``rw@-event_engine_listener``):

- ``rw``: grpc.aio, the generated servicer, ``context.read()`` / ``context.write()`` (the picker's shape), uvloop;
- ``gen``: grpc.aio, an async generator over the request iterator;
- ``bytes``: grpc.aio, a generic handler with no serializers (raw bytes in and out; the request parsed with upb);
- ``opts``: ``rw`` with server options (``grpc.so_reuseport`` 0, ``grpc.max_concurrent_streams`` 1000,
  no compression, no channelz, no BDP probe, no retries);
- ``minimal``: ``rw`` with ``grpc.minimal_stack`` (drops the deadline filter: not something to ship);
- ``asyncio``: ``rw`` on asyncio's own loop instead of uvloop;
- ``sync``: the threaded ``grpc.server`` (32 workers), a generator handler.

``python scripts/bench_grpc_floor.py --variants rw,rw@-event_engine_listener,bytes,sync --streams 800 --rounds 7``
No timed asserts: it reports.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

CLK_TCK = os.sysconf("SC_CLK_TCK")
SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
RESPONSE = ep.ProcessingResponse(request_headers=ep.HeadersResponse())
REQUEST = ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers={"headers": [
    {"key": k, "raw_value": v.encode()} for k, v in (
        (":method", "POST"), (":path", "/v1/completions"), (":authority", "gw"), ("content-type", "application/json"),
        ("content-length", "400"), ("authorization", "Bearer sk-bench"))]}))
OPTIONS = [("grpc.so_reuseport", 0), ("grpc.max_concurrent_streams", 1000), ("grpc.default_compression_algorithm", 0),
           ("grpc.enable_channelz", 0), ("grpc.http2.bdp_probe", 0), ("grpc.enable_retries", 0)]


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


class ReadWrite(ep_grpc.ExternalProcessorServicer):
    async def Process(self, request_iterator, context):  # noqa: N802 - gRPC name
        while True:
            msg = await context.read()
            if msg is grpc.aio.EOF:
                return
            await context.write(RESPONSE)


class Generator(ep_grpc.ExternalProcessorServicer):
    async def Process(self, request_iterator, context):  # noqa: N802
        async for _ in request_iterator:
            yield RESPONSE


async def serve_aio(variant: str, port: int) -> None:
    from grpc.experimental import aio

    aio.init_grpc_aio()
    options = OPTIONS if variant == "opts" else [("grpc.minimal_stack", 1)] if variant == "minimal" else []
    server = grpc.aio.server(options=options)
    if variant == "bytes":
        answer = RESPONSE.SerializeToString()

        async def process(request_iterator, context):
            while True:
                raw = await context.read()
                if raw is grpc.aio.EOF:
                    return
                ep.ProcessingRequest.FromString(raw)
                await context.write(answer)

        handler = grpc.stream_stream_rpc_method_handler(process)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {"Process": handler}),))
    else:
        ep_grpc.add_ExternalProcessorServicer_to_server(Generator() if variant == "gen" else ReadWrite(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def serve_sync(port: int) -> None:
    from concurrent import futures

    class Sync(ep_grpc.ExternalProcessorServicer):
        def Process(self, request_iterator, context):  # noqa: N802
            for _ in request_iterator:
                yield RESPONSE

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=32))
    ep_grpc.add_ExternalProcessorServicer_to_server(Sync(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    server.wait_for_termination()


async def one_stream(channel: grpc.aio.Channel) -> None:
    call = ep_grpc.ExternalProcessorStub(channel).Process(timeout=30)
    await call.write(REQUEST)
    await call.read()
    await call.done_writing()
    while await call.read() is not grpc.aio.EOF:
        pass


async def drive(servers: dict[str, tuple[int, int]], streams: int, rounds: int, concurrency: int,
                idle_s: float) -> dict[str, list[float]]:  # fmt: skip
    from grpc.experimental import aio

    aio.init_grpc_aio()
    channels = {v: grpc.aio.insecure_channel(f"127.0.0.1:{port}") for v, (port, _) in servers.items()}

    async def closed_loop(channel: grpc.aio.Channel, n: int) -> None:
        left = iter(range(n))

        async def worker() -> None:
            for _ in left:
                await one_stream(channel)

        await asyncio.gather(*(worker() for _ in range(concurrency)))

    for v, ch in channels.items():  # warm-up (and wait for every server)
        for _ in range(100):
            try:
                await closed_loop(ch, 300)
                break
            except grpc.aio.AioRpcError:
                await asyncio.sleep(0.2)
    idle = {}
    for v, (_, pid) in servers.items():
        c0, t0 = cpu_s(pid), time.perf_counter()
        await asyncio.sleep(idle_s)
        idle[v] = (cpu_s(pid) - c0) / (time.perf_counter() - t0)
    out: dict[str, list[float]] = {v: [] for v in servers}
    for _ in range(rounds):
        for v, ch in channels.items():
            pid = servers[v][1]
            c0, t0 = cpu_s(pid), time.perf_counter()
            await closed_loop(ch, streams)
            wall = time.perf_counter() - t0
            out[v].append((cpu_s(pid) - c0 - idle[v] * wall) / streams * 1000)
    for ch in channels.values():
        await ch.close()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--variants", default="rw,rw@-event_engine_listener,gen,bytes,opts,asyncio,sync")
    p.add_argument("--streams", type=int, default=800, help="streams per variant per round")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--idle-s", type=float, default=1.5)
    p.add_argument("--serve", nargs=2, metavar=("VARIANT", "PORT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        variant, port = args.serve[0], int(args.serve[1])
        if variant == "sync":
            serve_sync(port)
        elif variant == "asyncio":
            asyncio.run(serve_aio("rw", port))
        else:
            import uvloop

            uvloop.run(serve_aio(variant, port))
        return 0
    from loadgen.procs import free_port

    procs, servers = [], {}
    try:
        for v in args.variants.split(","):
            name, _, experiments = v.partition("@")
            env = dict(os.environ)
            if "@" in v:
                env["GRPC_EXPERIMENTS"] = experiments
            port = free_port()
            proc = subprocess.Popen([sys.executable, __file__, "--serve", name, str(port)], env=env)
            procs.append(proc)
            servers[v] = (port, proc.pid)
        import uvloop

        res = uvloop.run(drive(servers, args.streams, args.rounds, args.concurrency, args.idle_s))
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(10)
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}; CPU ms per stream, median of "
          f"{args.rounds} rounds of {args.streams}")
    for v, xs in res.items():
        print(f"{v:<28} {statistics.median(xs):.3f}   rounds {' '.join(f'{x:.3f}' for x in xs)}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main())
