"""Clients that stop reading their streams, beside a tenant that reads (issue 30 item 7's figure).

Starts 2 simulated engines + 2 real agents + one router on loopback (time scale 1: simulated ms = wall
ms; class ``interactive`` TTFT 500 ms / TPOT 50 ms, so its stall timeout is max(1 s, 4 x 500 + 20 x 50)
= 3 s), then runs the same measured load twice: tenant ``beta`` sends ``--rate`` streams/s for
``--duration-s`` s (``--prompt-tokens`` / ``--max-tokens`` each, read as they come), once alone and once
with ``--stalled`` streams of tenant ``stall`` opened at ``--stall-at-s`` over raw sockets that never read
(``n`` 4 x 2,000 tokens with 20 logprobs each: megabytes per stream, far beyond the relay's 256 KiB and
the kernels' socket buffers). Before issue 30 such clients held both engines for minutes and most of the
other tenant's requests were refused ``slo-infeasible``; now the router cuts each one its class's stall
timeout after its send buffer filled, and its engine request is aborted.

Reports per run: beta's requests, answered 200, refused (by status), SLO attainment (TTFT and mean TPOT
within the class's targets, every request counted), TTFT p50 / p99; and for the stalled run the seconds
from the first stalled stream to the last one cut (the agents' ``client_disconnect`` count reaching
``--stalled``) and the engines' running requests afterwards.

    .venv/bin/python scripts/stalled_readers.py --stalled 50 --rate 10 --duration-s 60 --out out/stalled.json
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import socket
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadgen.procs import ProcessGroup, free_port, script  # noqa: E402
from loadgen.sim.tokenizer import make_prompt  # noqa: E402

MODEL = "llama-3-8b-a100"
KEYS = {"beta": "sk-stalled-beta", "stall": "sk-stalled-stall"}
TTFT_MS, TPOT_MS = 500.0, 50.0


def write_config(path: Path, replicas: list[dict[str, str]]) -> None:
    cfg = {
        "model": MODEL,
        "slo_classes": {"interactive": {"ttft_ms": TTFT_MS, "tpot_ms": TPOT_MS, "priority": 0, "sheddable": True,
                                        "max_queue_ms": 2000}},
        "tenants": {t: {"weight": 1, "slo_class": "interactive"} for t in KEYS},
        "api_keys": {hashlib.sha256(k.encode()).hexdigest(): t for t, k in KEYS.items()},
        "replicas": replicas,
    }
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5.0) as resp:
        return resp.read().decode()


def sample_sum(page: str, prefix: str) -> float:
    """Sum of the samples whose line starts with ``prefix`` (a metric name with its labels' start)."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in page.splitlines() if line.startswith(prefix))


async def beta_stream(s: aiohttp.ClientSession, url: str, i: int, prompt_tokens: int, max_tokens: int) -> dict:
    """One streamed request of tenant beta: status, TTFT and mean TPOT (ms), tokens."""
    body = {"model": MODEL, "prompt": f"{i:04d}" + make_prompt(prompt_tokens)[4:], "max_tokens": max_tokens,
            "stream": True}
    t0 = time.monotonic()
    out: dict = {"status": 0, "ttft_ms": None, "tpot_ms": None, "tokens": 0}
    try:
        async with s.post(f"{url}/v1/completions", json=body,
                          headers={"Authorization": f"Bearer {KEYS['beta']}"}) as resp:
            out["status"] = resp.status
            if resp.status != 200:
                await resp.read()
                return out
            first = last = None
            async for line in resp.content:
                if line.startswith(b"data: {") and b'"text"' in line:
                    last = time.monotonic()
                    first = first or last
                    out["tokens"] += 1
            if first is not None:
                out["ttft_ms"] = (first - t0) * 1000.0
                if out["tokens"] > 1:
                    out["tpot_ms"] = (last - first) * 1000.0 / (out["tokens"] - 1)
    except (aiohttp.ClientError, asyncio.TimeoutError):
        out["status"] = -1
    return out


async def open_stalled(url: str, n: int) -> list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    """``n`` streamed requests of tenant ``stall`` over sockets with a 4 KiB receive buffer that are
    never read."""
    parts = urlsplit(url)
    body = json.dumps({"model": MODEL, "prompt": "tell me a long story", "max_tokens": 2000, "n": 4,
                       "logprobs": 20, "stream": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEYS['stall']}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    conns = []
    for _ in range(n):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (parts.hostname, parts.port))
        reader, writer = await asyncio.open_connection(sock=sock)
        writer.write(head + body)
        conns.append((reader, writer))
    return conns


def summary(results: list[dict]) -> dict:
    ok = [r for r in results if r["status"] == 200]
    met = [r for r in ok if r["ttft_ms"] is not None and r["ttft_ms"] <= TTFT_MS
           and (r["tpot_ms"] is None or r["tpot_ms"] <= TPOT_MS)]
    refused: dict[str, int] = {}
    for r in results:
        if r["status"] != 200:
            refused[str(r["status"])] = refused.get(str(r["status"]), 0) + 1
    ttfts = sorted(r["ttft_ms"] for r in ok if r["ttft_ms"] is not None)
    return {
        "requests": len(results), "ok": len(ok), "refused_by_status": refused,
        "slo_attainment": round(len(met) / len(results), 4) if results else None,
        "ttft_p50_ms": round(statistics.median(ttfts), 1) if ttfts else None,
        "ttft_p99_ms": round(ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))], 1) if ttfts else None,
    }


async def run(a: argparse.Namespace, router_url: str, agent_urls: list[str], engine_urls: list[str],
              stalled: int) -> dict:
    """One measured run: beta's load, with ``stalled`` stalled streams opened at ``a.stall_at_s``."""
    before = sum(sample_sum(scrape(u + "/metrics"), 'fairbatch_agent_requests_finished_total{outcome="client_disconnect"')
                 for u in agent_urls)
    tasks: list[asyncio.Task] = []
    timeline: dict = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=a.duration_s + 120)) as s:

        async def load() -> None:
            t0 = time.monotonic()
            for i in range(int(a.rate * a.duration_s)):
                await asyncio.sleep(max(0.0, t0 + i / a.rate - time.monotonic()))
                tasks.append(asyncio.create_task(beta_stream(s, router_url, i, a.prompt_tokens, a.max_tokens)))

        async def stall() -> list:
            if not stalled:
                return []
            await asyncio.sleep(a.stall_at_s)
            t = time.monotonic()
            conns = await open_stalled(router_url, stalled)
            while True:  # every stalled stream cut and its engine request aborted (agents' count)
                pages = [await asyncio.to_thread(scrape, u + "/metrics") for u in agent_urls]
                cut = sum(sample_sum(p, 'fairbatch_agent_requests_finished_total{outcome="client_disconnect"')
                          for p in pages) - before
                if cut >= stalled or time.monotonic() - t > a.duration_s + 60:
                    timeline["all_cut_after_s"] = round(time.monotonic() - t, 1) if cut >= stalled else None
                    timeline["cut"] = cut
                    break
                await asyncio.sleep(0.25)
            return conns

        _, conns = await asyncio.gather(load(), stall())
        results = await asyncio.gather(*tasks)
        for _, w in conns:
            w.close()
    running = [sample_sum(scrape(u + "/metrics"), "vllm:num_requests_running") for u in engine_urls]
    return {"stalled": stalled, **summary(results), **timeline, "engines_running_after": running}


async def main_async(a: argparse.Namespace) -> dict:
    tmp = Path(a.logs or tempfile.mkdtemp(prefix="stalled-"))
    group = ProcessGroup(tmp / "logs")
    ports = [(free_port(), free_port(), free_port()) for _ in range(2)]
    replicas = [{"id": f"r{i}", "http_url": f"http://127.0.0.1:{h}", "grpc_target": f"127.0.0.1:{g}"}
                for i, (_, h, g) in enumerate(ports)]
    cfg_path = tmp / "fairbatch.yaml"
    write_config(cfg_path, replicas)
    rport = free_port()
    router_url = f"http://127.0.0.1:{rport}"
    try:
        for i, (e, h, g) in enumerate(ports):
            c = group.start(f"engine{i}", script("fairbatch-loadgen") + [
                "sim-engine", "--port", str(e), "--time-scale", "1.0"])
            group.wait_http_ok(c, f"http://127.0.0.1:{e}/health", timeout_s=60.0)
            c = group.start(f"agent{i}", script("fairbatch-agent") + [
                "serve", "--engine-url", f"http://127.0.0.1:{e}", "--http-port", str(h), "--grpc-port", str(g),
                "--replica-id", f"r{i}", "--profile", MODEL, "--config", str(cfg_path), "--time-scale", "1.0"])
            group.wait_http_ok(c, f"http://127.0.0.1:{h}/health", timeout_s=60.0)
        c = group.start("router", script("fairbatch-router") + [
            "--config", str(cfg_path), "--port", str(rport), "--time-scale", "1.0"])
        group.wait_http_ok(c, f"{router_url}/health")
        while len(json.loads(scrape(f"{router_url}/health")).get("replicas_usable", [])) < 2:
            await asyncio.sleep(0.1)
        agents = [f"http://127.0.0.1:{h}" for _, h, _ in ports]
        engines = [f"http://127.0.0.1:{e}" for e, _, _ in ports]
        runs = [await run(a, router_url, agents, engines, 0)]
        await asyncio.sleep(2.0)
        runs.append(await run(a, router_url, agents, engines, a.stalled))
    finally:
        group.stop()
    return {"rate": a.rate, "duration_s": a.duration_s, "prompt_tokens": a.prompt_tokens, "max_tokens": a.max_tokens,
            "slo_ms": {"ttft": TTFT_MS, "tpot": TPOT_MS, "stall_timeout": max(1000.0, 4 * TTFT_MS + 20 * TPOT_MS)},
            "runs": runs, "logs": str(tmp)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stalled", type=int, default=50, help="streams that are never read")
    p.add_argument("--stall-at-s", type=float, default=10.0, help="seconds into the load when they are opened")
    p.add_argument("--rate", type=float, default=10.0, help="beta's streams per second")
    p.add_argument("--duration-s", type=float, default=60.0)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=100)
    p.add_argument("--logs", default=None)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    report = asyncio.run(main_async(a))
    text = json.dumps(report, indent=2)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
