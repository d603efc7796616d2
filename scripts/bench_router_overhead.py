"""Relay cost of the agent and the router against vllm-router: CPU per request and per chunk, added TTFT, req/s.

Prints one table per load and the headline table, writes JSON. Each load (``--loads``, default
``single,short,stream``; sizes in ``LOADS``) starts its own fleet: one simulated engine (its
``--time-scale``; 1 = real step times), one agent, one router, and vllm-router when installed
(``pip install -e '.[bench]'``, or ``--vllm-router PATH``). The same closed-loop load (N streams,
each sending its next request when the last one ended; ``ignore_eos``, streamed, usage included) is
sent through each path:

- ``direct``: client -> engine
- ``agent``: client -> agent -> engine
- ``router+agent``: client -> router -> agent -> engine (admission, lease, relay)
- ``vllm-router``: client -> vllm-router (Rust, ``--policy round_robin``) -> engine

Paths are run in interleaved rounds (direct, agent, router+agent, vllm-router, direct, ...) so a
slow spell of a shared machine hits all of them. TTFT is measured by the client (send -> first
token chunk). "Added TTFT" is the path's percentile minus the direct path's percentile. CPU is
utime + stime of each process from ``/proc/<pid>/stat`` (all threads) before and after a path's
runs, per 1000 requests; the idle rate is the same process's CPU per wall second while the load went
to paths that do not go through it (background work: budget pushes, engine /metrics scrapes, health
checks), and ``net`` subtracts that rate times the path's wall time. With at least one core per server process
plus one for the client, engine, agent, router and vllm-router are each pinned to their own core
(``taskset``); otherwise nothing is pinned and the JSON says ``pinned: false``.

No timed asserts: this reports. Run:
``python scripts/bench_router_overhead.py --out docs/bench/router_overhead.json``
(``--router-config '{"admission": {...}}'`` and ``--agent-arg=--flag=value`` change one side for an A/B).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadgen.procs import Child, ProcessGroup, free_port, script  # noqa: E402
from loadgen.sim.tokenizer import make_prompt  # noqa: E402

MODEL = "llama-3-8b-a100"
API_KEY = "sk-bench"
CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """utime + stime of process ``pid`` (all its threads), seconds."""
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "; field 3 is fields[0]
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def agent_snapshots(base: str) -> float | None:
    """The agent's ``fairbatch_agent_budget_snapshots_total`` from its /metrics (None when the agent
    does not export it: an older checkout in an A/B)."""
    import urllib.request

    with urllib.request.urlopen(f"{base}/metrics", timeout=5.0) as r:  # noqa: S310 - loopback
        for line in r.read().decode().splitlines():
            if line.startswith("fairbatch_agent_budget_snapshots_total "):
                return float(line.split()[1])
    return None


def pct(xs: list[float], q: float) -> float:
    """Nearest-rank percentile ``q`` (0..100) of ``xs``."""
    s = sorted(xs)
    k = max(0, min(len(s) - 1, int(round(q / 100.0 * len(s) + 0.5)) - 1))
    return s[k]


def write_router_config(path: Path, agent_http: int, agent_grpc: int, extra: dict[str, Any] | None = None) -> None:
    """The bench fleet's router YAML (one tenant, one class, one replica); ``extra`` merged per section."""
    cfg = {
        "model": MODEL,
        "slo_classes": {
            "interactive": {"ttft_ms": 2000, "tpot_ms": 200, "priority": 0, "sheddable": False, "max_queue_ms": 30000},
        },
        "tenants": {"bench": {"weight": 1, "slo_class": "interactive"}},
        "api_keys": {hashlib.sha256(API_KEY.encode()).hexdigest(): "bench"},
        "replicas": [{"id": "r0", "http_url": f"http://127.0.0.1:{agent_http}",
                      "grpc_target": f"127.0.0.1:{agent_grpc}"}],
        "queue": {"max_requests": 1024, "max_tokens": 4_000_000},
    }
    for key, value in (extra or {}).items():
        cfg[key] = {**cfg.get(key, {}), **value} if isinstance(value, dict) else value
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))


async def one_request(session: aiohttp.ClientSession, url: str, body: bytes, headers: dict[str, str]) -> dict[str, Any]:
    t0 = time.perf_counter()
    first = None
    tokens = 0
    events = 0
    async with session.post(url, data=body, headers=headers) as resp:
        if resp.status != 200:
            await resp.read()
            return {"ok": False, "status": resp.status}
        async for line in resp.content:
            if not line.startswith(b"data: "):
                continue
            events += 1
            if line.startswith(b"data: [DONE]"):
                continue
            ev = json.loads(line[6:])
            ch = ev.get("choices")
            if ch and ch[0].get("text"):
                tokens += 1
                if first is None:
                    first = time.perf_counter()
    end = time.perf_counter()
    if first is None:
        return {"ok": False, "status": 200}
    return {"ok": True, "ttft_ms": (first - t0) * 1000.0, "e2e_ms": (end - t0) * 1000.0,
            "tpot_ms": (end - first) * 1000.0 / max(1, tokens - 1), "tokens": tokens, "events": events}


async def closed_loop(base: str, n: int, concurrency: int, prompt_tokens: int, output_tokens: int,
                      tag: str, stagger_ms: float = 0.0) -> list[dict[str, Any]]:
    """``n`` requests, ``concurrency`` at a time, each stream starts its next request when one ends.

    Stream ``i`` starts ``i * stagger_ms`` after the first, so the streams do not run in lockstep
    (equal lengths would otherwise keep every prefill batched with all the others).
    """
    url = f"{base}/v1/completions"
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"}
    prompt = make_prompt(prompt_tokens)
    counter = iter(range(n))
    out: list[dict[str, Any]] = []

    async def stream(session: aiohttp.ClientSession, k: int) -> None:
        await asyncio.sleep(k * stagger_ms / 1000.0)
        for i in counter:
            body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": output_tokens, "ignore_eos": True,
                               "stream": True, "stream_options": {"include_usage": True}}).encode()
            r = await one_request(session, url, body, {**headers, "x-request-id": f"{tag}-{i}"})
            out.append(r)

    conn = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=120)) as session:
        await asyncio.gather(*(stream(session, k) for k in range(concurrency)))
    return out


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in results if r["ok"]]
    ttft = [r["ttft_ms"] for r in ok]
    if not ttft:
        return {"requests": len(results), "ok": 0}
    return {
        "requests": len(results), "ok": len(ok),
        "ttft_ms": {"p50": pct(ttft, 50), "p90": pct(ttft, 90), "p99": pct(ttft, 99), "mean": statistics.fmean(ttft),
                    "stdev": statistics.stdev(ttft) if len(ttft) > 1 else 0.0},
        "tpot_ms_p50": pct([r["tpot_ms"] for r in ok], 50),
        "e2e_ms_p50": pct([r["e2e_ms"] for r in ok], 50),
        "events_per_request": statistics.fmean(r["events"] for r in ok),
    }


@dataclass(frozen=True)
class Load:
    """One closed-loop load (module docstring): streams, prompt and output tokens, engine time scale."""

    concurrency: int
    prompt_tokens: int
    output_tokens: int
    stagger_ms: float
    time_scale: float
    requests: int


LOADS = {
    # one client on an idle fleet: the added TTFT of the hop itself
    "single": Load(concurrency=1, prompt_tokens=200, output_tokens=16, stagger_ms=0.0, time_scale=1.0, requests=60),
    # short requests, engine 4x faster than real time (steps of a few ms): the request path's fixed cost
    "short": Load(concurrency=50, prompt_tokens=32, output_tokens=4, stagger_ms=2.0, time_scale=0.25, requests=600),
    # streamed requests: per-chunk relay cost
    "stream": Load(concurrency=50, prompt_tokens=200, output_tokens=64, stagger_ms=25.0, time_scale=1.0,
                   requests=300),
}


def _pinning(n_procs: int) -> list[set[int]] | None:
    """One core per server process (engine, agent, router, vllm-router), the client on the rest;
    None when the machine has fewer than ``n_procs + 1`` cores we may use."""
    try:
        cores = sorted(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return None
    if len(cores) < n_procs + 1:
        return None
    return [{c} for c in cores[:n_procs]] + [set(cores[n_procs:])]


def _start_py_spy(out_dir: Path, load: str, children: dict[str, Child]) -> list[subprocess.Popen[bytes]]:
    """py-spy (on PATH or beside python) sampling the router and the agent at 200 Hz, collapsed stacks
    (``--format raw``) in ``out_dir/<load>-<process>.txt``; [] when py-spy is not installed."""
    exe = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(exe).exists():
        print("py-spy not found: no profile", file=sys.stderr)
        return []
    out_dir.mkdir(parents=True, exist_ok=True)
    return [subprocess.Popen([exe, "record", "--pid", str(children[proc].popen.pid), "--rate", "200", "--nonblocking",
                              "--format", "raw", "-o", str(out_dir / f"{load}-{proc}.txt")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for proc in ("router", "agent") if proc in children]


def _stop_py_spy(spies: list[subprocess.Popen[bytes]]) -> None:
    """Stop the samplers (SIGINT: each writes its file) and wait for them (10 s at most each)."""
    for p in spies:
        p.send_signal(signal.SIGINT)
    for p in spies:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()


def run_load(name: str, load: Load, args: argparse.Namespace) -> dict[str, Any]:
    """Start a fleet (engine, agent, router, vllm-router) for ``load``, run the paths in interleaved
    rounds and return the load's report (per path: TTFT, requests/s, CPU per request)."""
    tmp = Path(tempfile.mkdtemp(prefix=f"fb-overhead-{name}-"))
    group = ProcessGroup(tmp / "logs")
    eport, ahttp, agrpc, rport, vport, vprom = (free_port() for _ in range(6))
    cfg_path = tmp / "fairbatch.yaml"
    write_router_config(cfg_path, ahttp, agrpc, json.loads(args.router_config) if args.router_config else None)
    ts = str(load.time_scale)
    pins = _pinning(4 if args.vllm_router else 3)
    children: dict[str, Child] = {}

    def pinned(i: int, argv: list[str]) -> list[str]:
        if pins is None or not shutil.which("taskset"):
            return argv
        return ["taskset", "-c", ",".join(map(str, sorted(pins[i])))] + argv

    requests = args.requests or load.requests
    try:
        if pins is not None:
            os.sched_setaffinity(0, pins[-1])
        children["engine"] = group.start("engine", pinned(0, script("fairbatch-loadgen") + [
            "sim-engine", "--port", str(eport), "--time-scale", ts, "--log-level", "WARNING"]))
        group.wait_http_ok(children["engine"], f"http://127.0.0.1:{eport}/health")
        children["agent"] = group.start("agent", pinned(1, script("fairbatch-agent") + [
            "serve", "--engine-url", f"http://127.0.0.1:{eport}", "--http-port", str(ahttp), "--grpc-port", str(agrpc),
            "--replica-id", "r0", "--profile", MODEL, "--config", str(cfg_path), "--time-scale", ts,
            "--log-level", "WARNING", *args.agent_arg]))
        group.wait_http_ok(children["agent"], f"http://127.0.0.1:{ahttp}/health")
        children["router"] = group.start("router", pinned(2, script("fairbatch-router") + [
            "--config", str(cfg_path), "--port", str(rport), "--time-scale", ts, "--log-level", "WARNING"]))
        group.wait_http_ok(children["router"], f"http://127.0.0.1:{rport}/health")
        paths = {"direct": f"http://127.0.0.1:{eport}", "agent": f"http://127.0.0.1:{ahttp}",
                 "router+agent": f"http://127.0.0.1:{rport}"}
        if args.vllm_router:
            children["vllm-router"] = group.start("vllm-router", pinned(3, [
                args.vllm_router, "--host", "127.0.0.1", "--port", str(vport),
                "--worker-urls", f"http://127.0.0.1:{eport}", "--policy", "round_robin", "--log-level", "warning",
                # its own metrics port (its default, 29000, may be taken by another process)
                "--prometheus-port", str(vprom)]))
            group.wait_http_ok(children["vllm-router"], f"http://127.0.0.1:{vport}/health", timeout_s=60)
            paths["vllm-router"] = f"http://127.0.0.1:{vport}"
        if args.paths:
            paths = {k: v for k, v in paths.items() if k in args.paths.split(",") or k == "direct"}
        # Through whom each path's traffic goes (their CPU is charged to that path).
        involved = {"direct": ["engine"], "agent": ["agent", "engine"], "router+agent": ["router", "agent", "engine"],
                    "vllm-router": ["vllm-router", "engine"]}

        def loop(base: str, n: int, tag: str) -> list[dict[str, Any]]:
            return asyncio.run(closed_loop(base, n, load.concurrency, load.prompt_tokens, load.output_tokens, tag,
                                           load.stagger_ms))

        for pname, base in paths.items():  # warm-up: connection pools, code paths, caches
            loop(base, max(args.warmup, load.concurrency), f"warm-{pname}")

        results: dict[str, list[dict[str, Any]]] = {n: [] for n in paths}
        cpu_busy: dict[str, dict[str, float]] = {n: {c: 0.0 for c in children} for n in paths}
        wall: dict[str, float] = dict.fromkeys(paths, 0.0)
        snaps: dict[str, float | None] = dict.fromkeys(paths, 0.0)  # the agent's budget snapshots per path
        agent_url = f"http://127.0.0.1:{ahttp}"
        per_round = [requests // args.rounds + (1 if r < requests % args.rounds else 0) for r in range(args.rounds)]
        t_all0 = time.monotonic()
        cpu_all0 = {c: cpu_s(ch.popen.pid) for c, ch in children.items()}
        for r, n in enumerate(per_round):
            for pname, base in paths.items():
                spies = _start_py_spy(args.py_spy, name, children) if args.py_spy and r == 0 and \
                    pname == "router+agent" else []
                snap0 = agent_snapshots(agent_url)
                before = {c: cpu_s(ch.popen.pid) for c, ch in children.items()}
                t0 = time.monotonic()
                results[pname] += loop(base, n, f"{pname}-{r}")
                _stop_py_spy(spies)
                wall[pname] += time.monotonic() - t0
                snap1 = agent_snapshots(agent_url)
                if snap0 is None or snap1 is None or snaps[pname] is None:
                    snaps[pname] = None
                else:
                    snaps[pname] += snap1 - snap0
                for c, ch in children.items():
                    cpu_busy[pname][c] += cpu_s(ch.popen.pid) - before[c]
                print(f"{name} round {r + 1}/{args.rounds} {pname}: {n} requests in {time.monotonic() - t0:.1f} s",
                      file=sys.stderr)
        t_all = time.monotonic() - t_all0
        cpu_all = {c: cpu_s(ch.popen.pid) - cpu_all0[c] for c, ch in children.items()}
    finally:
        group.stop()

    out: dict[str, Any] = {"load": asdict(load) | {"requests": requests}, "pinned": pins is not None and
                           bool(shutil.which("taskset")), "paths": {}}
    direct = summarize(results["direct"])
    for pname in paths:
        s = summarize(results[pname])
        n_ok = max(1, s["ok"])
        entry: dict[str, Any] = {**s, "wall_s": wall[pname], "req_per_s": s["ok"] / wall[pname] if wall[pname] else 0.0}
        if snaps[pname] is not None and wall[pname]:  # what the agent computed and pushed while this path ran
            entry["agent_budget_snapshots_per_s"] = snaps[pname] / wall[pname]
            entry["agent_budget_snapshots_per_request"] = snaps[pname] / n_ok
        if s["ok"] and direct.get("ok"):
            entry["added_ttft_ms"] = {q: s["ttft_ms"][q] - direct["ttft_ms"][q] for q in ("p50", "p99", "mean")}
            # standard error of the difference of the two means (independent samples)
            entry["added_ttft_ms"]["mean_stderr"] = (s["ttft_ms"]["stdev"] ** 2 / s["ok"]
                                                     + direct["ttft_ms"]["stdev"] ** 2 / direct["ok"]) ** 0.5
            entry["req_per_s_vs_direct"] = entry["req_per_s"] / max(1e-9, direct["ok"] / wall["direct"])
        cpu: dict[str, Any] = {}
        for proc in involved[pname]:
            if proc not in children:
                continue
            busy = cpu_busy[pname][proc]
            # Idle rate: CPU s per wall s while the load went to paths that do not go through this process
            # (direct, and the other hops): its background work only. Not the whole run minus this path:
            # the agent also carries the agent-only path, whose load would count as "idle" and be subtracted.
            apart = [q for q in paths if proc not in involved[q]]
            idle_s = sum(wall[q] for q in apart)
            if idle_s > 0:
                idle_rate = sum(cpu_busy[q][proc] for q in apart) / idle_s
            else:  # on every path (the engine): the rest of the run, warm-up and gaps included
                idle_s = t_all - sum(wall.values())
                idle_rate = (cpu_all[proc] - sum(cpu_busy[q][proc] for q in paths)) / idle_s if idle_s > 0 else 0.0
            cpu[proc] = {"cpu_s_per_1000": busy * 1000.0 / n_ok,
                         "net_cpu_s_per_1000": (busy - idle_rate * wall[pname]) * 1000.0 / n_ok,
                         "idle_cpu_frac": idle_rate}
        entry["cpu"] = cpu
        out["paths"][pname] = entry
    return out


def headline(loads: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue-17 figures from the loads' reports: one row per figure, one value per process.

    CPU is the net figure (idle rate subtracted). Per chunk: the marginal cost, (CPU per stream
    request - CPU per short request) / (events per stream request - events per short request), so
    the fixed per-request cost does not count as chunk cost.
    """
    def net(load: str, path: str, proc: str) -> float | None:
        try:
            return loads[load]["paths"][path]["cpu"][proc]["net_cpu_s_per_1000"]
        except KeyError:
            return None

    cols = (("vllm-router", "vllm-router"), ("router", "router+agent"), ("agent", "router+agent"))
    rows: list[dict[str, Any]] = []

    def row(figure: str, fn: Any) -> None:
        rows.append({"figure": figure, **{proc: fn(proc, path) for proc, path in cols}})

    if "stream" in loads:
        row("CPU s per 1000 streamed requests", lambda proc, path: net("stream", path, proc))
    if "short" in loads:
        row("CPU ms per short request", lambda proc, path: net("short", path, proc))
        row("short requests/s per core (1000 / CPU ms per request)",
            lambda proc, path: (1000.0 / v) if (v := net("short", path, proc)) else None)
    if "stream" in loads and "short" in loads:
        def per_chunk(proc: str, path: str) -> float | None:
            a, b = net("stream", path, proc), net("short", path, proc)
            try:
                ea = loads["stream"]["paths"][path]["events_per_request"]
                eb = loads["short"]["paths"][path]["events_per_request"]
            except KeyError:
                return None
            if a is None or b is None or ea <= eb:
                return None
            return (a - b) / (ea - eb) * 1000.0  # ms per request / events per request -> us per event
        row("CPU us per relayed chunk (marginal)", per_chunk)
    for load, label in (("short", "short requests"), ("stream", "streamed requests")):
        if load in loads:
            row(f"req/s through it / direct, {label}", lambda proc, path, load=load: None if proc == "agent" else
                loads[load]["paths"].get(path, {}).get("req_per_s_vs_direct"))
    for load, label in (("single", "one client"), ("stream", "50 streams")):
        if load in loads:
            for q in ("p50", "p99"):
                row(f"added TTFT {q} ms, {label}", lambda proc, path, load=load, q=q: None if proc == "agent" else
                    loads[load]["paths"].get(path, {}).get("added_ttft_ms", {}).get(q))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--loads", default="single,short,stream", help=f"comma-separated, of {', '.join(LOADS)}")
    p.add_argument("--requests", type=int, default=0, help="requests per path and load (0: the load's default)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds over the paths")
    p.add_argument("--warmup", type=int, default=16, help="untimed requests per path before the first round")
    p.add_argument("--paths", default="", help="only these paths (comma-separated; direct is always run)")
    p.add_argument("--vllm-router", default=None, metavar="PATH",
                   help="vllm-router executable (optional path; default: the one on PATH or beside python, if any)")
    p.add_argument("--no-vllm-router", action="store_true", help="do not run vllm-router even when installed")
    p.add_argument("--router-config", default="", help="JSON merged into the router YAML (e.g. admission settings)")
    p.add_argument("--agent-arg", action="append", default=[], help="extra agent flag (repeatable, e.g. "
                   "--agent-arg=--min-push-interval-ms=5)")
    p.add_argument("--out", type=Path, default=None, help="write the JSON here")
    p.add_argument("--py-spy", type=Path, default=None, metavar="DIR",
                   help="profile the router and the agent with py-spy during the first round of the router+agent "
                        "path of each load (collapsed stacks in DIR/<load>-<process>.txt)")
    args = p.parse_args(argv)
    if args.vllm_router is None and not args.no_vllm_router:
        beside = Path(sys.executable).parent / "vllm-router"
        args.vllm_router = shutil.which("vllm-router") or (str(beside) if beside.exists() else None)
    if args.no_vllm_router:
        args.vllm_router = None

    report: dict[str, Any] = {
        "config": {"loads": args.loads, "rounds": args.rounds, "warmup": args.warmup,
                   "vllm_router": args.vllm_router, "router_config": args.router_config, "agent_args": args.agent_arg,
                   "engine": f"sim {MODEL}",
                   "command": "python scripts/bench_router_overhead.py " + " ".join(argv if argv is not None
                                                                                   else sys.argv[1:])},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "cpu_model": _cpu_model(), "loadavg_start": os.getloadavg()},
        "loads": {},
    }
    for name in args.loads.split(","):
        report["loads"][name] = run_load(name, LOADS[name], args)
        print_table(name, report["loads"][name])
    report["machine"]["loadavg_end"] = os.getloadavg()
    report["headline"] = headline(report["loads"])
    print_headline(report["headline"])
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def print_table(name: str, load: dict[str, Any]) -> None:
    """One load's table: per path TTFT, added TTFT, requests/s and CPU per 1000 requests."""
    cfg = load["load"]
    print(f"\nload {name}: {cfg['concurrency']} streams, prompt {cfg['prompt_tokens']}, {cfg['output_tokens']} out, "
          f"engine time scale {cfg['time_scale']:g}, {cfg['requests']} requests per path, pinned: {load['pinned']}")
    hdr = (f"{'path':<14}{'ok':>6}{'TTFT p50':>10}{'TTFT p99':>10}{'+p50':>8}{'+p99':>8}{'+mean':>14}{'req/s':>8}"
           f"{'vs dir':>8}  CPU s / 1000 req (net of idle)")
    print(hdr)
    print("-" * len(hdr))
    for pname, e in load["paths"].items():
        if not e.get("ok"):
            print(f"{pname:<14}{0:>6}  (no successful request)")
            continue
        add = e.get("added_ttft_ms", {"p50": 0.0, "p99": 0.0, "mean": 0.0, "mean_stderr": 0.0})
        mean = f"{add['mean']:+.1f}±{add['mean_stderr']:.1f}"
        cpu = ", ".join(f"{p} {c['cpu_s_per_1000']:.2f} ({c['net_cpu_s_per_1000']:.2f})" for p, c in e["cpu"].items()
                        if p != "engine")
        if "agent" in e["cpu"] and "agent_budget_snapshots_per_request" in e:
            cpu += f"; agent pushes {e['agent_budget_snapshots_per_s']:.0f}/s, {e['agent_budget_snapshots_per_request']:.2f}/req"
        print(f"{pname:<14}{e['ok']:>6}{e['ttft_ms']['p50']:>10.1f}{e['ttft_ms']['p99']:>10.1f}{add['p50']:>+8.1f}"
              f"{add['p99']:>+8.1f}{mean:>14}{e['req_per_s']:>8.1f}{e.get('req_per_s_vs_direct', 1.0):>8.2f}"
              f"  {cpu or '-'}")


def print_headline(rows: list[dict[str, Any]]) -> None:
    """The issue-17 figures as a markdown table (pasted into docs/bench/)."""
    print("\n| figure | vllm-router (Rust) | fairbatch router | fairbatch agent (per hop) |")
    print("| --- | --- | --- | --- |")
    for r in rows:
        cells = ["" if r[k] is None else f"{r[k]:.2f}" for k in ("vllm-router", "router", "agent")]
        print(f"| {r['figure']} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    sys.exit(main())
