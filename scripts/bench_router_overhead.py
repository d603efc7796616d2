"""Relay cost of the agent and the router: added TTFT and CPU per 1000 requests. Prints a table, writes JSON.

The same closed-loop load (``--concurrency`` streams, each sending its next request when the last
one ended; prompt ``--prompt-tokens``, ``--output-tokens`` out, ``ignore_eos``) is sent to one
simulated engine (``--time-scale 1``: real step times) through each path:

- ``direct``: client -> engine
- ``agent``: client -> agent -> engine
- ``router+agent``: client -> router -> agent -> engine (Reserve over gRPC, lease, relay)
- ``vllm-router`` (when ``--vllm-router PATH`` is given): client -> vllm-router (Rust,
  ``--policy round_robin``) -> engine

Paths are run in interleaved rounds (direct, agent, router+agent, vllm-router, direct, ...) so a
slow spell of a shared machine hits all of them. TTFT is measured by the client (send -> first
token chunk). "Added TTFT" is the path's percentile minus the direct path's percentile. CPU is
utime + stime of each process from ``/proc/<pid>/stat`` (all threads) before and after a path's
runs, per 1000 requests; the ``idle`` column is the same process's CPU rate while the load went
to another path (background work: budget pushes, engine /metrics scrapes, health checks), and
``net`` subtracts that rate times the path's wall time.

No timed asserts: this reports. Run:
``python scripts/bench_router_overhead.py --requests 320 --out docs/bench/router_overhead.json``
(vllm-router: ``python -m venv .venv-bench && .venv-bench/bin/pip install vllm-router==0.1.17``,
then add ``--vllm-router .venv-bench/bin/vllm-router``).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
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


def pct(xs: list[float], q: float) -> float:
    """Nearest-rank percentile ``q`` (0..100) of ``xs``."""
    s = sorted(xs)
    k = max(0, min(len(s) - 1, int(round(q / 100.0 * len(s) + 0.5)) - 1))
    return s[k]


def write_router_config(path: Path, agent_http: int, agent_grpc: int) -> None:
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
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))


async def one_request(session: aiohttp.ClientSession, url: str, body: bytes, headers: dict[str, str]) -> dict[str, Any]:
    t0 = time.perf_counter()
    first = None
    tokens = 0
    async with session.post(url, data=body, headers=headers) as resp:
        if resp.status != 200:
            await resp.read()
            return {"ok": False, "status": resp.status}
        async for line in resp.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
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
            "tpot_ms": (end - first) * 1000.0 / max(1, tokens - 1), "tokens": tokens}


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
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=320, help="requests per path (split over the rounds)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds over the paths")
    p.add_argument("--warmup", type=int, default=16, help="untimed requests per path before the first round")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=200)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--stagger-ms", type=float, default=60.0,
                   help="start offset between the streams (about one request's duration / concurrency)")
    p.add_argument("--vllm-router", default=None, metavar="PATH", help="vllm-router executable (optional path d)")
    p.add_argument("--out", type=Path, default=None, help="write the JSON here")
    args = p.parse_args(argv)

    tmp = Path(tempfile.mkdtemp(prefix="fb-overhead-"))
    group = ProcessGroup(tmp / "logs")
    eport, ahttp, agrpc, rport, vport = (free_port() for _ in range(5))
    cfg_path = tmp / "fairbatch.yaml"
    write_router_config(cfg_path, ahttp, agrpc)
    children: dict[str, Child] = {}
    try:
        children["engine"] = group.start("engine", script("fairbatch-loadgen") + [
            "sim-engine", "--port", str(eport), "--time-scale", "1", "--log-level", "WARNING"])
        group.wait_http_ok(children["engine"], f"http://127.0.0.1:{eport}/health")
        children["agent"] = group.start("agent", script("fairbatch-agent") + [
            "serve", "--engine-url", f"http://127.0.0.1:{eport}", "--http-port", str(ahttp), "--grpc-port", str(agrpc),
            "--replica-id", "r0", "--profile", MODEL, "--config", str(cfg_path), "--time-scale", "1",
            "--log-level", "WARNING"])
        group.wait_http_ok(children["agent"], f"http://127.0.0.1:{ahttp}/health")
        children["router"] = group.start("router", script("fairbatch-router") + [
            "--config", str(cfg_path), "--port", str(rport), "--time-scale", "1", "--log-level", "WARNING"])
        group.wait_http_ok(children["router"], f"http://127.0.0.1:{rport}/health")
        paths = {"direct": f"http://127.0.0.1:{eport}", "agent": f"http://127.0.0.1:{ahttp}",
                 "router+agent": f"http://127.0.0.1:{rport}"}
        if args.vllm_router:
            children["vllm-router"] = group.start("vllm-router", [
                args.vllm_router, "--host", "127.0.0.1", "--port", str(vport),
                "--worker-urls", f"http://127.0.0.1:{eport}", "--policy", "round_robin", "--log-level", "warning"])
            group.wait_http_ok(children["vllm-router"], f"http://127.0.0.1:{vport}/health", timeout_s=60)
            paths["vllm-router"] = f"http://127.0.0.1:{vport}"
        # Through whom each path's traffic goes (their CPU is charged to that path).
        involved = {"direct": ["engine"], "agent": ["agent", "engine"], "router+agent": ["router", "agent", "engine"],
                    "vllm-router": ["vllm-router", "engine"]}

        for name, base in paths.items():  # warm-up: connection pools, code paths, JIT-free but caches
            asyncio.run(closed_loop(base, args.warmup, args.concurrency, args.prompt_tokens, args.output_tokens,
                                    f"warm-{name}", args.stagger_ms))

        results: dict[str, list[dict[str, Any]]] = {n: [] for n in paths}
        cpu_busy: dict[str, dict[str, float]] = {n: {c: 0.0 for c in children} for n in paths}
        wall: dict[str, float] = dict.fromkeys(paths, 0.0)
        per_round = [args.requests // args.rounds + (1 if r < args.requests % args.rounds else 0)
                     for r in range(args.rounds)]
        t_all0 = time.monotonic()
        cpu_all0 = {c: cpu_s(ch.popen.pid) for c, ch in children.items()}
        for r, n in enumerate(per_round):
            for name, base in paths.items():
                before = {c: cpu_s(ch.popen.pid) for c, ch in children.items()}
                t0 = time.monotonic()
                results[name] += asyncio.run(closed_loop(base, n, args.concurrency, args.prompt_tokens,
                                                         args.output_tokens, f"{name}-{r}", args.stagger_ms))
                wall[name] += time.monotonic() - t0
                for c, ch in children.items():
                    cpu_busy[name][c] += cpu_s(ch.popen.pid) - before[c]
                print(f"round {r + 1}/{args.rounds} {name}: {n} requests in {time.monotonic() - t0:.1f} s",
                      file=sys.stderr)
        t_all = time.monotonic() - t_all0
        cpu_all = {c: cpu_s(ch.popen.pid) - cpu_all0[c] for c, ch in children.items()}
    finally:
        group.stop()

    report: dict[str, Any] = {
        "config": {"requests_per_path": args.requests, "rounds": args.rounds, "warmup": args.warmup,
                   "concurrency": args.concurrency, "prompt_tokens": args.prompt_tokens,
                   "output_tokens": args.output_tokens, "stagger_ms": args.stagger_ms, "engine": f"sim {MODEL} --time-scale 1",
                   "command": "python scripts/bench_router_overhead.py " + " ".join(argv if argv is not None
                                                                                   else sys.argv[1:])},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "cpu_model": _cpu_model(), "loadavg_end": os.getloadavg()},
        "paths": {},
    }
    direct = summarize(results["direct"])
    for name in paths:
        s = summarize(results[name])
        n_ok = max(1, s["ok"])
        entry: dict[str, Any] = {**s, "wall_s": wall[name]}
        if s["ok"] and direct.get("ok"):
            entry["added_ttft_ms"] = {q: s["ttft_ms"][q] - direct["ttft_ms"][q] for q in ("p50", "p99", "mean")}
            # standard error of the difference of the two means (independent samples)
            entry["added_ttft_ms"]["mean_stderr"] = (s["ttft_ms"]["stdev"] ** 2 / s["ok"]
                                                     + direct["ttft_ms"]["stdev"] ** 2 / direct["ok"]) ** 0.5
        cpu: dict[str, Any] = {}
        for proc in involved[name]:
            if proc not in children:
                continue
            busy = cpu_busy[name][proc]
            idle_s = t_all - wall[name]
            idle_rate = (cpu_all[proc] - busy) / idle_s if idle_s > 0 else 0.0  # CPU s per wall s when not loaded
            cpu[proc] = {"cpu_s_per_1000": busy * 1000.0 / n_ok,
                         "net_cpu_s_per_1000": (busy - idle_rate * wall[name]) * 1000.0 / n_ok,
                         "idle_cpu_frac": idle_rate}
        entry["cpu"] = cpu
        report["paths"][name] = entry

    print_table(report)
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


def print_table(report: dict[str, Any]) -> None:
    hdr = (f"{'path':<14}{'ok':>6}{'TTFT p50':>10}{'TTFT p99':>10}{'+p50':>8}{'+p99':>8}{'+mean':>14}{'TPOT p50':>10}"
           f"  CPU s / 1000 req (net of idle)")
    print(hdr)
    print("-" * len(hdr))
    for name, e in report["paths"].items():
        if not e.get("ok"):
            print(f"{name:<14}{0:>6}  (no successful request)")
            continue
        add = e.get("added_ttft_ms", {"p50": 0.0, "p99": 0.0, "mean": 0.0, "mean_stderr": 0.0})
        mean = f"{add['mean']:+.1f}±{add['mean_stderr']:.1f}"
        cpu = ", ".join(f"{p} {c['cpu_s_per_1000']:.1f} ({c['net_cpu_s_per_1000']:.1f})" for p, c in e["cpu"].items()
                        if p != "engine")
        print(f"{name:<14}{e['ok']:>6}{e['ttft_ms']['p50']:>10.1f}{e['ttft_ms']['p99']:>10.1f}{add['p50']:>+8.1f}"
              f"{add['p99']:>+8.1f}{mean:>14}{e['tpot_ms_p50']:>10.2f}  {cpu or '-'}")


if __name__ == "__main__":
    sys.exit(main())
