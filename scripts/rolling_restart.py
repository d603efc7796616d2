"""Rolling restart of a simulated fleet under load (issue 29 item 3's figures).

Starts N simulated engines + N real agents + one router on loopback (time scale 1: simulated ms =
wall ms), sends a steady stream load (``--rate`` streams/s for ``--duration-s`` s, each ``--max-tokens``
tokens, greedy: the simulated engine's every token is ``" tok"``), and from ``--start-s`` on restarts
the replicas one at a time: SIGTERM to the agent (it drains: no new work, ``--grace-s`` for its
streams, then hands the rest over to the router's migration, and exits), then SIGTERM to its engine,
then both started again on the same ports; the next one once the router sees every replica usable.

Prints and writes (``--out``) a JSON report: requests, failed ones (HTTP status, error event, no
``[DONE]``), streams whose token count is not ``max_tokens`` or whose finish_reason is not ``length``,
the router's ``fairbatch_router_stream_migrations_total`` by cause and outcome, the added time per
migration (``fairbatch_router_stream_migration_added_seconds`` sum / count), the agents' exit codes and
each replica's restart time (SIGTERM to usable again).

    .venv/bin/python scripts/rolling_restart.py --replicas 4 --rate 20 --duration-s 60 --max-tokens 200

``--fault`` picks another failure under the same load, at ``--start-s``, of the replica with the most open
streams at that moment (issue 29's
"done when"): ``kill-engine`` / ``kill-agent`` (SIGKILL to its process group; the replica stays dead, the
other replicas carry the load), ``stop-engine`` (SIGSTOP for ``--stop-s``, past the class's stall
timeout of 6 s, then SIGCONT). The default, ``drain``, is the rolling restart above.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import re
import signal
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadgen.procs import ProcessGroup, free_port, script  # noqa: E402
from loadgen.sim.tokenizer import make_prompt  # noqa: E402

MODEL = "llama-3-8b-a100"
KEY = "sk-rolling-acme"


def write_config(path: Path, replicas: list[dict[str, str]]) -> None:
    cfg = {
        "model": MODEL,
        "slo_classes": {"interactive": {"ttft_ms": 1000, "tpot_ms": 100, "priority": 0, "sheddable": False,
                                        "max_queue_ms": 8000}},
        "tenants": {"acme": {"weight": 1, "slo_class": "interactive"}},
        "api_keys": {hashlib.sha256(KEY.encode()).hexdigest(): "acme"},
        "replicas": replicas,
        "queue": {"max_requests": 1024, "max_tokens": 4_000_000},
    }
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))


def usable(router_url: str) -> list[str]:
    try:
        with urllib.request.urlopen(f"{router_url}/health", timeout=1.0) as resp:
            return list(json.loads(resp.read()).get("replicas_usable", []))
    except (OSError, ValueError):
        return []


LIVE: dict[str, int] = {}
"""Streams open now, by the replica the router first put them on (``--fault`` picks the busiest)."""


async def one_stream(s: aiohttp.ClientSession, url: str, i: int, prompt_tokens: int, max_tokens: int) -> dict:
    body = {"model": MODEL, "prompt": f"{i:04d}" + make_prompt(prompt_tokens)[4:], "max_tokens": max_tokens,
            "stream": True, "stream_options": {"include_usage": True}}
    out: dict = {"status": 0, "tokens": 0, "finish": [], "error": None, "done": False, "ids": 0, "text_ok": True,
                 "replica": None, "t0": time.monotonic(), "t1": None}
    ids: set[str] = set()
    try:
        async with s.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}) as resp:
            out["status"] = resp.status
            out["replica"] = rid = resp.headers.get("x-fairbatch-replica") or "-"
            LIVE[rid] = LIVE.get(rid, 0) + 1
            if resp.status != 200:
                out["error"] = (await resp.text())[:200]
                return out
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue
                payload = line[6:].strip()
                if payload == b"[DONE]":
                    out["done"] = True
                    continue
                ev = json.loads(payload)
                if "error" in ev:
                    out["error"] = ev["error"]
                    continue
                ids.add(ev["id"])
                for ch in ev.get("choices") or ():
                    if ch.get("text"):
                        out["tokens"] += 1
                        out["text_ok"] &= ch["text"] == " tok"
                    if ch.get("finish_reason") is not None:
                        out["finish"].append(ch["finish_reason"])
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        out["error"] = f"{type(e).__name__}: {e}"
    out["ids"] = len(ids)
    out["t1"] = time.monotonic()
    if out["replica"] is not None:
        LIVE[out["replica"]] -= 1
    return out


def metric_lines(text: str, name: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line.startswith(name):
            key, value = line.rsplit(" ", 1)
            out[key[len(name):]] = float(value)
    return out


async def main_async(a: argparse.Namespace) -> dict:
    tmp = Path(a.logs or tempfile.mkdtemp(prefix="rolling-"))
    group = ProcessGroup(tmp / "logs")
    ports = [(free_port(), free_port(), free_port()) for _ in range(a.replicas)]
    replicas = [{"id": f"r{i}", "http_url": f"http://127.0.0.1:{h}", "grpc_target": f"127.0.0.1:{g}"}
                for i, (_, h, g) in enumerate(ports)]
    cfg_path = tmp / "fairbatch.yaml"
    write_config(cfg_path, replicas)
    argv: dict[str, list[str]] = {}
    for i, (e, h, g) in enumerate(ports):
        argv[f"engine{i}"] = script("fairbatch-loadgen") + ["sim-engine", "--port", str(e), "--time-scale", "1.0"]
        argv[f"agent{i}"] = script("fairbatch-agent") + [
            "serve", "--engine-url", f"http://127.0.0.1:{e}", "--http-port", str(h), "--grpc-port", str(g),
            "--replica-id", f"r{i}", "--profile", MODEL, "--config", str(cfg_path), "--time-scale", "1.0",
            "--drain-grace-s", str(a.grace_s)]
    children = {}
    starts: dict[str, int] = {}

    def start(name: str, health: str) -> None:
        n = starts[name] = starts.get(name, -1) + 1
        children[name] = group.start(f"{name}.{n}", argv[name])
        group.wait_http_ok(children[name], health, timeout_s=60.0)

    rport = free_port()
    router_url = f"http://127.0.0.1:{rport}"
    report: dict = {}
    try:
        for i, (e, h, _) in enumerate(ports):
            start(f"engine{i}", f"http://127.0.0.1:{e}/health")
            start(f"agent{i}", f"http://127.0.0.1:{h}/health")
        children["router"] = group.start("router", script("fairbatch-router") + [
            "--config", str(cfg_path), "--port", str(rport), "--time-scale", "1.0"])
        group.wait_http_ok(children["router"], f"{router_url}/health")
        while len(usable(router_url)) < a.replicas:
            await asyncio.sleep(0.1)
        tasks: list[asyncio.Task] = []
        exit_codes: list[int | None] = []
        restart_s: list[float] = []
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=a.duration_s + 120)) as s:

            async def load() -> None:
                t0 = time.monotonic()
                n = int(a.rate * a.duration_s)
                for i in range(n):
                    await asyncio.sleep(max(0.0, t0 + i / a.rate - time.monotonic()))
                    tasks.append(asyncio.create_task(one_stream(s, router_url, i, a.prompt_tokens, a.max_tokens)))

            async def roll() -> None:
                await asyncio.sleep(a.start_s)
                for i, (e, h, _) in enumerate(ports):
                    t = time.monotonic()
                    agent = children[f"agent{i}"].popen
                    os.kill(agent.pid, signal.SIGTERM)
                    while agent.poll() is None:
                        await asyncio.sleep(0.05)
                    exit_codes.append(agent.returncode)
                    engine = children[f"engine{i}"].popen
                    engine.terminate()
                    while engine.poll() is None:
                        await asyncio.sleep(0.05)
                    await asyncio.to_thread(start, f"engine{i}", f"http://127.0.0.1:{e}/health")
                    await asyncio.to_thread(start, f"agent{i}", f"http://127.0.0.1:{h}/health")
                    while len(usable(router_url)) < a.replicas:
                        await asyncio.sleep(0.05)
                    restart_s.append(round(time.monotonic() - t, 2))

            async def fault() -> None:
                """One failure of r0 (``--fault``), timed from the start of the load."""
                await asyncio.sleep(a.start_s)
                fault_at.append(time.monotonic())
                # the replica with the most open streams (the placement can leave one idle at this load)
                victim.append(max((f"r{i}" for i in range(a.replicas)), key=lambda r: LIVE.get(r, 0)))
                idx = victim[0][1:]
                pgid = children[f"agent{idx}" if a.fault == "kill-agent" else f"engine{idx}"].popen.pid
                if a.fault in ("kill-engine", "kill-agent"):
                    os.killpg(pgid, signal.SIGKILL)
                else:
                    os.killpg(pgid, signal.SIGSTOP)
                    await asyncio.sleep(a.stop_s)
                    os.killpg(pgid, signal.SIGCONT)

            fault_at: list[float] = []
            victim: list[str] = []
            t_load = time.monotonic()
            await asyncio.gather(load(), roll() if a.fault == "drain" else fault())
            results = await asyncio.gather(*tasks)
            wall = time.monotonic() - t_load
            async with s.get(f"{router_url}/metrics") as r:
                metrics = await r.text()
        failed = [r for r in results if r["status"] != 200 or r["error"] is not None or not r["done"]]
        wrong = [r for r in results if r not in failed and (r["tokens"] != a.max_tokens or r["finish"] != ["length"]
                                                               or r["ids"] != 1 or not r["text_ok"])]
        mig = metric_lines(metrics, "fairbatch_router_stream_migrations_total")
        added_sum = sum(metric_lines(metrics, "fairbatch_router_stream_migration_added_seconds_sum").values())
        added_n = sum(metric_lines(metrics, "fairbatch_router_stream_migration_added_seconds_count").values())
        per_replica: dict[str, int] = {}
        for r in results:
            per_replica[str(r["replica"])] = per_replica.get(str(r["replica"]), 0) + 1
        # streams the router had put on the victim and that were still open when the fault came (the ones it cut)
        open_at_fault = sum(1 for r in results if victim and r["replica"] == victim[0] and r["t0"] < fault_at[0] < r["t1"])
        report = {
            "fault": a.fault, "requests_per_replica": dict(sorted(per_replica.items())),
            "victim": victim[0] if victim else None, "open_on_victim_at_fault": open_at_fault if victim else None, "replicas": a.replicas, "rate": a.rate, "duration_s": a.duration_s, "max_tokens": a.max_tokens,
            "grace_s": a.grace_s, "requests": len(results), "failed": len(failed), "wrong_tokens_or_finish": len(wrong),
            "failed_examples": [str(r["error"])[:160] for r in failed[:3]],
            "migrations": {re.sub(r"[{}\"]", "", k): v for k, v in mig.items()},
            "migration_added_s_mean": round(added_sum / added_n, 3) if added_n else None,
            "agent_exit_codes": exit_codes, "restart_s": restart_s, "wall_s": round(wall, 1), "logs": str(tmp),
        }
    finally:
        group.stop()
    return report


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--rate", type=float, default=20.0, help="streams per second")
    p.add_argument("--duration-s", type=float, default=60.0)
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--grace-s", type=float, default=1.0, help="the agents' --drain-grace-s")
    p.add_argument("--start-s", type=float, default=5.0, help="seconds into the load before the first restart")
    p.add_argument("--fault", choices=("drain", "kill-engine", "kill-agent", "stop-engine"), default="drain",
                   help="drain: restart every replica in turn (drain first); else one failure at --start-s of the "
                        "replica with the most open streams")
    p.add_argument("--stop-s", type=float, default=15.0, help="stop-engine: seconds the engine stays stopped")
    p.add_argument("--logs", default=None, help="folder for the logs and the YAML (default: a temp dir)")
    p.add_argument("--out", default=None, help="write the JSON report here")
    a = p.parse_args()
    report = asyncio.run(main_async(a))
    text = json.dumps(report, indent=2)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    return 0 if report.get("failed") == 0 and report.get("wrong_tokens_or_finish") == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
