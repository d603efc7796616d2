"""Large request bodies and the event loop (issue 30, item 8): what a token-id or long-text prompt costs.

Two parts, each printed as a table and written to ``--out`` as JSON:

1. ``checks``: wall ms of the router's per-request body checks, in this process: decode and validate
   the body and count its prompt (router/server.py ``price_body`` where it exists, else what the router
   did before: fairbatch_common/api_schema.py ``validate_request`` then router/tokens.py
   ``estimate_prompt_tokens`` + ``prompt_is_exact``), best of ``--repeat``, for token-id prompts of
   10,000 / 30,000 / 200,000 ids and a 1 MB text prompt; ``on_loop`` says whether the router runs them
   on its event loop (before) or in a worker thread for bodies of 64 KiB and more (after).
2. ``fleet``: a simulated engine + agent + router started as processes on loopback; for each case a
   request is sent ``--repeat`` times while a prober asks the router's ``/health`` back to back; per case
   the request's status and latency (ms, client side) and the ``/health`` latencies meanwhile (max, p99).
   Cases: a 200,000-id prompt (refused: over the 32,768-token context), a 30,000-id prompt served
   (``max_tokens`` 1), a 1 MB text prompt (refused: its estimate is over twice the context), and
   ``/health`` alone (the baseline).

Run it from the tree to measure, before and after a change, with the same interpreter (the processes
it starts run ``python -m`` from the current directory, so the current directory picks their code):

    cd <tree> && PYTHONPATH=$PWD <venv>/bin/python <this script> --out large_bodies.json

The figures depend on the machine and its load (they say so: ``load_avg`` in the JSON); a benchmark,
never a test.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from fairbatch_common.api_schema import validate_request
from loadgen.procs import ProcessGroup, free_port, script
from router.tokens import estimate_prompt_tokens, prompt_is_exact

MODEL = "llama-3-8b-a100"
API_KEY = "sk-bench"


def _bodies() -> dict[str, bytes]:
    rng = random.Random(7)
    out = {}
    for n in (10_000, 30_000, 200_000):
        ids = [rng.randrange(0, 128_000) for _ in range(n)]
        out[f"ids-{n}"] = json.dumps({"model": MODEL, "prompt": ids, "max_tokens": 1}).encode()
    out["text-1MB"] = json.dumps({"model": MODEL, "prompt": "lorem ipsum " * 83_334, "max_tokens": 1}).encode()
    return out


def bench_checks(bodies: dict[str, bytes], repeat: int) -> list[dict[str, Any]]:
    """Best-of-``repeat`` wall ms of validate + count, per body."""
    try:
        from router.server import price_body
    except ImportError:  # before: validate on the loop, then count
        price_body = None
    try:
        from fairbatch_common.http_guard import OFF_LOOP_BYTES
    except ImportError:
        OFF_LOOP_BYTES = None
    rows = []
    for name, raw in bodies.items():
        best = float("inf")
        for _ in range(repeat):
            t0 = time.perf_counter()
            if price_body is not None:
                price_body(raw, False, 32_768, 4.0, 0)
            else:
                valid = validate_request(raw, False, 32_768)
                estimate_prompt_tokens(valid.body, False, 4.0)
                prompt_is_exact(valid.body, False)
            best = min(best, time.perf_counter() - t0)
        rows.append({"body": name, "bytes": len(raw), "checks_ms": round(best * 1000, 2),
                     "on_loop": OFF_LOOP_BYTES is None or len(raw) < OFF_LOOP_BYTES})
    return rows


def _start_fleet(tmp: Path) -> tuple[ProcessGroup, str]:
    group = ProcessGroup(tmp / "logs")
    eport, hport, gport, rport = free_port(), free_port(), free_port(), free_port()
    cfg = {
        "model": MODEL,
        "slo_classes": {"interactive": {"ttft_ms": 1000, "tpot_ms": 100, "sheddable": False, "max_queue_ms": 8000}},
        "tenants": {"acme": {"weight": 1, "slo_class": "interactive"}},
        "api_keys": {hashlib.sha256(API_KEY.encode()).hexdigest(): "acme"},
        "replicas": [{"id": "r0", "http_url": f"http://127.0.0.1:{hport}", "grpc_target": f"127.0.0.1:{gport}"}],
    }
    path = tmp / "fairbatch.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    try:
        e = group.start("engine", script("fairbatch-loadgen") + ["sim-engine", "--port", str(eport),
                                                                   "--time-scale", "0.2"])
        group.wait_http_ok(e, f"http://127.0.0.1:{eport}/health")
        a = group.start("agent", script("fairbatch-agent") + [
            "serve", "--engine-url", f"http://127.0.0.1:{eport}", "--http-port", str(hport), "--grpc-port",
            str(gport), "--replica-id", "r0", "--profile", MODEL, "--config", str(path), "--time-scale", "0.2"])
        group.wait_http_ok(a, f"http://127.0.0.1:{hport}/health")
        r = group.start("router", script("fairbatch-router") + ["--config", str(path), "--port", str(rport),
                                                                  "--time-scale", "0.2"])
        url = f"http://127.0.0.1:{rport}"
        group.wait_http_ok(r, f"{url}/health")
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # the first budget snapshot (and the context length) are in
            import urllib.request

            with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
                if json.loads(resp.read()).get("replicas_usable"):
                    break
            time.sleep(0.1)
    except BaseException:
        group.stop()
        raise
    return group, url


async def _probe(session: aiohttp.ClientSession, url: str, stop: asyncio.Event, out: list[float]) -> None:
    while not stop.is_set():
        t0 = time.perf_counter()
        async with session.get(url + "/health") as r:
            await r.read()
        out.append((time.perf_counter() - t0) * 1000)


async def bench_fleet(url: str, bodies: dict[str, bytes], repeat: int) -> list[dict[str, Any]]:
    """Per case: status, request ms (median, max) and /health ms while it ran (p99, max)."""
    cases = [("health-alone", None), ("ids-200000-refused", bodies["ids-200000"]),
             ("ids-30000-served", bodies["ids-30000"]), ("text-1MB-refused", bodies["text-1MB"])]
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    rows = []
    async with aiohttp.ClientSession() as probe_s, aiohttp.ClientSession() as req_s:
        for name, raw in cases:
            lat, health, statuses = [], [], set()
            for _ in range(repeat):
                stop = asyncio.Event()
                samples: list[float] = []
                prober = asyncio.create_task(_probe(probe_s, url, stop, samples))
                await asyncio.sleep(0.05)
                samples.clear()
                t0 = time.perf_counter()
                if raw is None:
                    await asyncio.sleep(0.2)
                else:
                    async with req_s.post(url + "/v1/completions", data=raw, headers=headers) as r:
                        await r.read()
                        statuses.add(r.status)
                lat.append((time.perf_counter() - t0) * 1000)
                stop.set()
                await prober
                health.extend(samples)
            health.sort()
            rows.append({
                "case": name, "status": sorted(statuses), "request_ms_median": round(statistics.median(lat), 1),
                "request_ms_max": round(max(lat), 1), "health_probes": len(health),
                "health_ms_p99": round(health[min(len(health) - 1, int(0.99 * len(health)))], 1),
                "health_ms_max": round(health[-1], 1),
            })
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    load = os.getloadavg()
    bodies = _bodies()
    checks = bench_checks(bodies, args.repeat)
    print(f"{'body':<12} {'bytes':>9} {'checks ms':>10} {'on loop':>8}")
    for row in checks:
        print(f"{row['body']:<12} {row['bytes']:>9} {row['checks_ms']:>10.2f} {str(row['on_loop']):>8}")
    with tempfile.TemporaryDirectory() as tmp:
        group, url = _start_fleet(Path(tmp))
        try:
            fleet = asyncio.run(bench_fleet(url, bodies, args.repeat))
        finally:
            group.stop()
    print(f"{'case':<20} {'status':>8} {'req ms med':>10} {'req ms max':>10} {'/health p99':>11} {'/health max':>11}")
    for row in fleet:
        print(f"{row['case']:<20} {','.join(map(str, row['status'])):>8} {row['request_ms_median']:>10.1f} "
              f"{row['request_ms_max']:>10.1f} {row['health_ms_p99']:>11.1f} {row['health_ms_max']:>11.1f}")
    result = {"python": platform.python_version(), "cpus": os.cpu_count(), "load_avg_before": load,
              "load_avg_after": os.getloadavg(),
              "repeat": args.repeat, "checks": checks, "fleet": fleet}
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
