"""Admission under backlog (issue 18): five scenarios on simulated fleets in real time. Prints a table, writes JSON.

Every scenario starts its own fleet on loopback with the project's console scripts (``sim-engine``
with profile llama-3-8b-a100 at time scale 1, one ``fairbatch-agent`` per engine, one
``fairbatch-router``), as the integration tests do, sends real HTTP and stops the fleet. Prompts are
token ids (exact counts); every request asks ``max_tokens`` output tokens and the simulated engine
produces exactly that many.

- ``burst``: 1 replica, class TTFT 1000 ms / TPOT 100 ms, not sheddable, max queue 30 s; 60 prompts
  of 1000 tokens, 100 output tokens, streamed, sent at once: first straight to the agent (its
  default class is the same), then through the router. Makespan = first send to last byte.
  Target: router makespan <= 1.15 x direct, 60 of 60 served.
- ``ties``: 4 identical idle replicas, 200 requests sent one after another (each after the previous
  answered; 100-token prompts, 8 tokens out). Target: no replica above 40 %.
- ``weights``: 1 replica, tenants A (weight 3) and B (weight 1), loose class (TTFT 20 s, TPOT 200 ms,
  not sheddable), 32 requests outstanding each (closed loop: each answered request is replaced),
  prompts 1000 tokens, 100 out, ``--weights-s`` of load. Token shares = prompt + completion tokens
  delivered inside the window [2 s, stop] while both tenants had requests outstanding (a prompt at
  its first token, completion tokens spread from the first token to the end: ``delivered_in``;
  the JSON also keeps the first method, whole requests that ended inside it). Run with the
  defaults (start window 4 steps, contention cap 32 per replica), with the cap off
  (``contention_max_inflight: 0``) and with both off, to show what the knobs do and cost.
  Target: shares within 0.05 of 0.75 / 0.25.
- ``sizes``: as ``weights`` with equal weights, tenant A's prompts 4000 tokens, B's 500. Weighted
  service = (prompt + 2 x completion tokens) / weight (the VTC cost). Target: A/B within 0.9-1.1,
  Jain's index >= 0.95.
- ``infeasible``: 1 replica; tenant ``jobs`` (class batch: TTFT 20 s, priority 1, not sheddable)
  keeps 48 prompts of 4000 tokens outstanding (1000 out); tenant ``chat`` (class interactive: TTFT
  500 ms, sheddable, priority 0) sends a 2000-token prompt every 300 ms from its own process (a
  user's client; in this process the 48 batch streams' parsing added tens of ms of loop lag).
  Reported: how many chat requests were refused ``slo-infeasible``, the time from send to that 429,
  and which were refused at arrival and which were queued and then refused. Target: within 50 ms.
- ``starve``: 1 replica; band 0 tenant ``hi`` keeps 48 requests outstanding (1000 tokens, 100 out,
  TTFT 2 s), band 1 tenant ``lo`` (``min_share: 0``, TTFT 5 s, max queue 20 s) sends one request
  every 500 ms. Starved = ``lo`` requests refused ``queue-timeout``. Target: 0.

- ``drain`` (issue 25): 2 small replicas (``sim-engine --num-gpu-blocks 2000 --block-size 16
  --max-num-seqs 16 --max-num-batched-tokens 2048``), tenant acme on class bulk (TTFT 1 s, TPOT
  100 ms, priority 1, not sheddable, max queue 60 s) sends 200 distinct 1,000-token prompts at once
  (200 out), streamed and not; "two classes": tenant beta's interactive streams (TTFT 500 ms,
  sheddable; 200-token prompts, 20 out) arrive at t = 2-4 s. Each variant runs ``--drain-runs``
  times on a fresh fleet. Reported per variant: runs that served all 200, served counts, makespans,
  the longest time the router's queue depth stood still while it was not empty (sampled every
  0.5 s) and the router's stall watchdog (``fairbatch_router_dispatch_stalled_seconds``, its largest
  sample). Target: 200 of 200 in every run. Before the fix: 72 served, then 30-45 s of nothing.

Run: ``.venv/bin/python scripts/bench_backlog.py --out docs/bench/backlog.json`` (about 3 minutes
on 2 cores); ``--only burst,ties`` runs a subset. No timed asserts: this reports.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import itertools
import json
import math
import platform
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loadgen.procs import ProcessGroup, free_port, script  # noqa: E402

PROFILE = "llama-3-8b-a100"


@dataclass
class Fleet:
    """A started fleet: agent URLs and the router URL."""

    group: ProcessGroup
    agent_urls: list[str]
    router_url: str
    keys: dict[str, str]


def start_fleet(work: Path, n: int, classes: dict[str, Any], tenants: dict[str, Any], default_class: str,
                admission: dict[str, Any] | None = None, seed: int | None = None,
                engine_args: list[str] | None = None) -> Fleet:
    """Start ``n`` engines + agents and a router with these classes and tenants (waits for health).

    ``engine_args``: extra ``sim-engine`` arguments (e.g. ``--num-gpu-blocks 2000``) for every engine."""
    keys = {t: f"key-{t}" for t in tenants}
    ports = [(free_port(), free_port(), free_port()) for _ in range(n)]
    router_port = free_port()
    doc: dict[str, Any] = {
        "model": PROFILE,
        "slo_classes": classes,
        "tenants": tenants,
        "api_keys": {hashlib.sha256(k.encode()).hexdigest(): t for t, k in keys.items()},
        "replicas": [{"id": f"r{i}", "http_url": f"http://127.0.0.1:{h}", "grpc_target": f"127.0.0.1:{g}"}
                     for i, (_, h, g) in enumerate(ports)],
        "queue": {"max_requests": 4096, "max_tokens": 40_000_000},
    }
    if admission:
        doc["admission"] = admission
    if seed is not None:
        doc["placement"] = {"seed": seed}
    cfg = work / "fairbatch.yaml"
    cfg.write_text(yaml.safe_dump(doc, sort_keys=False))
    group = ProcessGroup(work / "logs")
    try:
        engines = [group.start(f"engine-r{i}", script("fairbatch-loadgen") + [
            "sim-engine", "--host", "127.0.0.1", "--port", str(e), "--profile", PROFILE, "--time-scale", "1",
            "--seed", str(i)] + list(engine_args or [])) for i, (e, _, _) in enumerate(ports)]
        for (e, _, _), c in zip(ports, engines, strict=True):
            group.wait_http_ok(c, f"http://127.0.0.1:{e}/health", 60)
        agents = [group.start(f"agent-r{i}", script("fairbatch-agent") + [
            "serve", "--engine-url", f"http://127.0.0.1:{e}", "--host", "127.0.0.1", "--http-port", str(h),
            "--grpc-port", str(g), "--replica-id", f"r{i}", "--profile", PROFILE, "--config", str(cfg),
            "--default-slo-class", default_class, "--time-scale", "1"]) for i, (e, h, g) in enumerate(ports)]
        for (_, h, _), c in zip(ports, agents, strict=True):
            group.wait_http_ok(c, f"http://127.0.0.1:{h}/health", 60)
        router = group.start("router", script("fairbatch-router") + [
            "--config", str(cfg), "--host", "127.0.0.1", "--port", str(router_port), "--time-scale", "1"])
        group.wait_http_ok(router, f"http://127.0.0.1:{router_port}/health", 60)
    except BaseException:
        group.stop()
        raise
    return Fleet(group, [f"http://127.0.0.1:{h}" for _, h, _ in ports], f"http://127.0.0.1:{router_port}", keys)


async def wait_usable(fleet: Fleet, n: int, timeout_s: float = 30.0) -> None:
    """Wait until the router has a fresh budget from ``n`` replicas."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            async with s.get(fleet.router_url + "/health") as r:
                if len((await r.json()).get("replicas_usable", [])) >= n:
                    return
            await asyncio.sleep(0.1)
    raise RuntimeError("router has no fresh budgets")


@dataclass
class Result:
    """One request's outcome as the client saw it (wall seconds from the scenario's start)."""

    tenant: str
    status: int
    reason: str = ""
    replica: str = ""
    sent_s: float = 0.0
    first_s: float | None = None
    end_s: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0


async def send(session: aiohttp.ClientSession, url: str, headers: dict[str, str], tenant: str, prompt: int,
               out: int, stream: bool, t0: float) -> Result:
    """One completion request with ``prompt`` token ids; returns what the client saw."""
    body = {"model": PROFILE, "prompt": distinct_prompt(prompt), "max_tokens": out, "stream": stream}
    res = Result(tenant, 0, sent_s=time.monotonic() - t0, prompt_tokens=prompt)
    async with session.post(url + "/v1/completions", json=body, headers=headers) as r:
        res.status = r.status
        res.reason = r.headers.get("x-fairbatch-reason", "")
        res.replica = r.headers.get("x-fairbatch-replica", "")
        if stream and r.status == 200:
            async for line in r.content:
                if line.startswith(b"data: ") and b'"text"' in line:
                    if res.first_s is None:
                        res.first_s = time.monotonic() - t0
                    res.completion_tokens += 1
        else:
            raw = await r.read()
            if r.status == 200:
                res.completion_tokens = int(json.loads(raw).get("usage", {}).get("completion_tokens", 0))
                res.first_s = time.monotonic() - t0
    res.end_s = time.monotonic() - t0
    return res


_PROMPT_IDS = itertools.count(1000)
CHAT_CLIENT_FIRST_ID = 1_000_000
"""First prompt id of the ``--chat-client`` process (its own range: the ids never meet the scenario's)."""


def distinct_prompt(tokens: int, ids: Iterator[int] = _PROMPT_IDS) -> list[int]:
    """``tokens`` token ids that share no prefix block with any other prompt of the run (its first id,
    from ``ids``, is its own): the engines cache prompt prefixes as vLLM does, and identical prompts
    would all hit."""
    return [next(ids)] + [7] * (tokens - 1)


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile (0 <= q <= 100); nan for no values."""
    if not values:
        return math.nan
    v = sorted(values)
    return v[max(0, min(len(v) - 1, math.ceil(q / 100 * len(v)) - 1))]


# ---------------------------------------------------------------- scenarios


async def burst_once(url: str, headers: dict[str, str]) -> dict[str, Any]:
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as s:
        t0 = time.monotonic()
        results = await asyncio.gather(*[send(s, url, headers, "acme", 1000, 100, True, t0) for _ in range(60)])
    ok = [r for r in results if r.status == 200 and r.completion_tokens == 100]
    ttft = [r.first_s * 1000 for r in ok if r.first_s is not None]
    return {"served": len(ok), "refused": dict(Counter(r.reason or str(r.status) for r in results if r.status != 200)),
            "makespan_s": max(r.end_s for r in results), "ttft_p95_ms": pct(ttft, 95), "ttft_max_ms": max(ttft, default=math.nan)}


async def scenario_burst(work: Path, lease_mode: str | None = None) -> dict[str, Any]:
    classes = {"std": {"ttft_ms": 1000, "tpot_ms": 100, "priority": 0, "sheddable": False, "max_queue_ms": 30000}}
    fleet = start_fleet(work, 1, classes, {"acme": {"weight": 1, "slo_class": "std"}}, "std",
                        {"lease_mode": lease_mode} if lease_mode else None)
    try:
        await wait_usable(fleet, 1)
        direct = await burst_once(fleet.agent_urls[0], {"x-fairbatch-slo-class": "std"})
        await asyncio.sleep(1.0)
        routed = await burst_once(fleet.router_url, {"Authorization": f"Bearer {fleet.keys['acme']}"})
    finally:
        fleet.group.stop()
    ratio = routed["makespan_s"] / direct["makespan_s"]
    return {"direct": direct, "router": routed, "makespan_ratio": ratio,
            "target_met": ratio <= 1.15 and routed["served"] == 60}


async def scenario_ties(work: Path) -> dict[str, Any]:
    classes = {"std": {"ttft_ms": 1000, "tpot_ms": 100, "priority": 0, "sheddable": False, "max_queue_ms": 30000}}
    fleet = start_fleet(work, 4, classes, {"acme": {"weight": 1, "slo_class": "std"}}, "std")
    try:
        await wait_usable(fleet, 4)
        h = {"Authorization": f"Bearer {fleet.keys['acme']}"}
        counts: Counter[str] = Counter()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
            t0 = time.monotonic()
            for _ in range(200):
                r = await send(s, fleet.router_url, h, "acme", 100, 8, False, t0)
                counts[r.replica or f"status-{r.status}"] += 1
    finally:
        fleet.group.stop()
    top = max(counts.values()) / 200
    return {"per_replica": dict(sorted(counts.items())), "max_share": top, "target_met": top <= 0.40}


async def closed_loop(session: aiohttp.ClientSession, url: str, key: str, tenant: str, n: int, prompt: int, out: int,
                      t0: float, stop_s: float, results: list[Result]) -> None:
    """``n`` concurrent streams, each sending its next request when the last one ended, until ``stop_s``."""
    h = {"Authorization": f"Bearer {key}"}

    async def one() -> None:
        while time.monotonic() - t0 < stop_s:
            results.append(await send(session, url, h, tenant, prompt, out, True, t0))

    await asyncio.gather(*[one() for _ in range(n)])


def delivered_in(r: Result, lo: float, hi: float, w_prompt: float, w_completion: float) -> float:
    """Service one request delivered inside the window [lo, hi] (s): its prompt when its first token
    came inside it, and its completion tokens spread evenly from the first token to the end, the
    share that falls inside. ``w_prompt`` / ``w_completion``: the cost per token (VTC weights, or 1
    and 1 for plain tokens).

    Counting each request whole when it ends (the benchmark's first method) leaves out what is in
    flight at the window's end: with 32 requests of 4,000-token prompts in flight that is a third
    of a 23 s window's service, and which tenant holds it moved the sizes ratio between 1.05 and
    1.44 from run to run on the same code.
    """
    if r.status != 200 or r.first_s is None:
        return 0.0
    out = w_prompt * r.prompt_tokens if lo <= r.first_s <= hi else 0.0
    span = r.end_s - r.first_s
    if r.completion_tokens and span > 0:
        overlap = max(0.0, min(hi, r.end_s) - max(lo, r.first_s))
        out += w_completion * r.completion_tokens * overlap / span
    elif r.completion_tokens and lo <= r.end_s <= hi:
        out += w_completion * r.completion_tokens
    return out


async def scenario_weights(work: Path, seconds: float, admission: dict[str, Any] | None,
                           prompts: tuple[int, int] = (1000, 1000), weights: tuple[float, float] = (3, 1)) -> dict[str, Any]:
    classes = {"loose": {"ttft_ms": 20000, "tpot_ms": 200, "priority": 0, "sheddable": False, "max_queue_ms": 600000}}
    tenants = {"A": {"weight": weights[0], "slo_class": "loose"}, "B": {"weight": weights[1], "slo_class": "loose"}}
    fleet = start_fleet(work, 1, classes, tenants, "loose", admission)
    try:
        await wait_usable(fleet, 1)
        results: list[Result] = []
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300),
                                         connector=aiohttp.TCPConnector(limit=0)) as s:
            t0 = time.monotonic()
            await asyncio.gather(*[closed_loop(s, fleet.router_url, fleet.keys[t], t, 32, p, 100, t0, seconds, results)
                                   for t, p in zip(("A", "B"), prompts, strict=True)])
    finally:
        fleet.group.stop()
    # both saturate from the first send until they stop sending (stop_s); skip the first 2 s (the
    # first requests of both are admitted together) and count requests ending in between
    # (and the service delivered inside the window, :func:`delivered_in`: the figure the targets use)
    lo, hi = 2.0, seconds
    done = [r for r in results if r.status == 200 and lo <= r.end_s <= hi]
    ended_tok = {t: sum(r.prompt_tokens + r.completion_tokens for r in done if r.tenant == t) for t in ("A", "B")}
    tok = {t: sum(delivered_in(r, lo, hi, 1.0, 1.0) for r in results if r.tenant == t) for t in ("A", "B")}
    total = sum(tok.values()) or 1
    shares = {t: v / total for t, v in tok.items()}
    ended_shares = {t: v / (sum(ended_tok.values()) or 1) for t, v in ended_tok.items()}
    # weighted service (VTC cost w_prefill * prompt + w_decode * completion, 1 and 2, over the weight)
    w = dict(zip(("A", "B"), weights, strict=True))
    service = {t: sum(delivered_in(r, lo, hi, 1.0, 2.0) for r in results if r.tenant == t) / w[t] for t in w}
    ended_service = {t: sum(r.prompt_tokens + 2 * r.completion_tokens for r in done if r.tenant == t) / w[t]
                     for t in w}  # fmt: skip
    x = list(service.values())
    jain = sum(x) ** 2 / (len(x) * sum(v * v for v in x)) if any(x) else math.nan
    ttft = [r.first_s - r.sent_s for r in done if r.first_s is not None]
    adm = admission or {}
    return {"start_window_steps": adm.get("start_window_steps", 4.0),
            "contention_max_inflight": adm.get("contention_max_inflight", 32), "prompts": list(prompts),
            "weights": list(weights), "tokens": tok, "shares": shares, "weighted_service": service,
            "service_ratio_a_over_b": service["A"] / service["B"] if service["B"] else math.nan, "jain": jain,
            "counted": "service delivered inside the window (delivered_in)",
            "ended_in_window": {"tokens": ended_tok, "shares": ended_shares, "weighted_service": ended_service,
                                "service_ratio_a_over_b": (ended_service["A"] / ended_service["B"]
                                                           if ended_service["B"] else math.nan)},
            "tokens_per_s": total / (hi - lo), "ttft_p50_ms": pct(ttft, 50) * 1000, "ttft_p95_ms": pct(ttft, 95) * 1000,
            "requests_ok": sum(1 for r in results if r.status == 200)}


async def chat_client(url: str, key: str, seconds: float, period_s: float) -> list[dict[str, Any]]:
    """The ``infeasible`` scenario's chat tenant: a 2000-token prompt every ``period_s`` for ``seconds``.

    Runs in its own process (``--chat-client``), as a user's client would: in the scenario's process
    its event loop also parsed the 48 batch streams, and that loop lag (tens of ms) was counted as
    refusal latency. Returns one dict per request: status, reason, the refusal's kind (``arrival``:
    refused when it arrived; ``queued``: queued, then refused at its last dispatch time) and the
    client-measured latency from send to the end of the answer (ms).
    """
    out: list[dict[str, Any]] = []
    h = {"Authorization": f"Bearer {key}"}
    ids = itertools.count(CHAT_CLIENT_FIRST_ID)

    async def one(s: aiohttp.ClientSession) -> None:
        body = {"model": PROFILE, "prompt": distinct_prompt(2000, ids), "max_tokens": 16, "stream": True}
        t = time.monotonic()
        first: float | None = None
        raw = b""
        async with s.post(url + "/v1/completions", json=body, headers=h) as r:
            if r.status == 200:
                async for line in r.content:  # SSE: the first "data:" event with text is the first token
                    if first is None and line.startswith(b"data: {") and b'"text":"' in line.replace(b" ", b"") \
                            and b'"text":""' not in line.replace(b" ", b""):
                        first = time.monotonic()
            else:
                raw = await r.read()
        end = time.monotonic()
        lat = (end - t) * 1000
        kind = ""
        if r.status == 429:
            kind = "queued" if b"while queued" in raw else "arrival"
        out.append({"status": r.status, "reason": r.headers.get("x-fairbatch-reason", ""), "kind": kind,
                    "sent_s": t - t0, "latency_ms": lat,
                    "ttft_ms": ((first if first is not None else end) - t) * 1000 if r.status == 200 else None})

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as s:
        t0 = time.monotonic()
        tasks = []
        while time.monotonic() - t0 < seconds:
            tasks.append(asyncio.create_task(one(s)))
            await asyncio.sleep(period_s)
        await asyncio.gather(*tasks)
    return out


async def scenario_infeasible(work: Path, seconds: float) -> dict[str, Any]:
    classes = {
        "interactive": {"ttft_ms": 500, "tpot_ms": 50, "priority": 0, "sheddable": True, "max_queue_ms": 2000},
        "batch": {"ttft_ms": 20000, "tpot_ms": 200, "priority": 1, "sheddable": False, "max_queue_ms": 600000},
    }
    tenants = {"chat": {"weight": 1, "slo_class": "interactive"}, "jobs": {"weight": 1, "slo_class": "batch"}}
    fleet = start_fleet(work, 1, classes, tenants, "interactive")
    try:
        await wait_usable(fleet, 1)
        jobs: list[Result] = []
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300),
                                         connector=aiohttp.TCPConnector(limit=0)) as s:
            t0 = time.monotonic()
            loop_task = asyncio.create_task(
                closed_loop(s, fleet.router_url, fleet.keys["jobs"], "jobs", 48, 4000, 1000, t0, seconds, jobs))
            await asyncio.sleep(3.0)  # let the batch work saturate the replica
            proc = await asyncio.create_subprocess_exec(
                sys.executable, __file__, "--chat-client", fleet.router_url, fleet.keys["chat"], str(seconds - 5.0),
                stdout=asyncio.subprocess.PIPE)
            raw, _ = await proc.communicate()
            chat = json.loads(raw)
            await loop_task
    finally:
        fleet.group.stop()
    refused = [r for r in chat if r["reason"] == "slo-infeasible"]
    lat = [r["latency_ms"] for r in refused]
    by_kind = {k: sorted(round(r["latency_ms"], 1) for r in refused if r["kind"] == k) for k in ("arrival", "queued")}
    ok = [r for r in chat if r["status"] == 200]
    ttft_ok = [r["ttft_ms"] for r in ok]  # client-measured: send -> first streamed token
    return {"chat_sent": len(chat), "chat_ok": len(ok), "slo_infeasible": len(refused),
            "refused_at_arrival": len(by_kind["arrival"]), "refused_while_queued": len(by_kind["queued"]),
            "other_refusals": dict(Counter(r["reason"] or str(r["status"]) for r in chat
                                           if r["status"] != 200 and r["reason"] != "slo-infeasible")),
            "refusal_ms": sorted(round(v, 1) for v in lat), "refusal_ms_p50": pct(lat, 50),
            "refusal_ms_at_arrival": by_kind["arrival"], "refusal_ms_while_queued": by_kind["queued"],
            "refusal_ms_max": max(lat, default=math.nan),
            "chat_ok_ttft_p95_ms": pct(ttft_ok, 95), "chat_ok_late": sum(1 for v in ttft_ok if v > 500),
            "chat_requests": [{k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()} for r in chat],
            "jobs_ok": sum(1 for r in jobs if r.status == 200),
            "target_met": bool(refused) and max(lat) <= 50.0}


async def scenario_starve(work: Path, seconds: float) -> dict[str, Any]:
    classes = {
        "hi": {"ttft_ms": 2000, "tpot_ms": 100, "priority": 0, "sheddable": False, "max_queue_ms": 60000},
        "lo": {"ttft_ms": 5000, "tpot_ms": 200, "priority": 1, "sheddable": False, "max_queue_ms": 20000},
    }
    tenants = {"hi": {"weight": 1, "slo_class": "hi"}, "lo": {"weight": 1, "slo_class": "lo", "min_share": 0}}
    fleet = start_fleet(work, 1, classes, tenants, "hi")
    try:
        await wait_usable(fleet, 1)
        hi: list[Result] = []
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300),
                                         connector=aiohttp.TCPConnector(limit=0)) as s:
            t0 = time.monotonic()
            loop_task = asyncio.create_task(
                closed_loop(s, fleet.router_url, fleet.keys["hi"], "hi", 48, 1000, 100, t0, seconds, hi))
            h = {"Authorization": f"Bearer {fleet.keys['lo']}"}
            tasks = []
            while time.monotonic() - t0 < seconds - 21:
                tasks.append(asyncio.create_task(send(s, fleet.router_url, h, "lo", 1000, 100, True, t0)))
                await asyncio.sleep(0.5)
            lo = list(await asyncio.gather(*tasks))
            await loop_task
    finally:
        fleet.group.stop()
    wait = [(r.first_s - r.sent_s) * 1000 for r in lo if r.first_s is not None]
    starved = sum(1 for r in lo if r.reason == "queue-timeout")
    return {"lo_sent": len(lo), "lo_ok": sum(1 for r in lo if r.status == 200), "lo_starved": starved,
            "lo_ttft_p95_ms": pct(wait, 95), "lo_ttft_max_ms": max(wait, default=math.nan),
            "hi_ok": sum(1 for r in hi if r.status == 200), "target_met": starved == 0}


DRAIN_ENGINE = ["--num-gpu-blocks", "2000", "--block-size", "16", "--max-num-seqs", "16",
                "--max-num-batched-tokens", "2048"]  # fmt: skip
DRAIN_CLASSES = {
    "bulk": {"ttft_ms": 1000, "tpot_ms": 100, "priority": 1, "sheddable": False, "max_queue_ms": 60000},
    "interactive": {"ttft_ms": 500, "tpot_ms": 50, "priority": 0, "sheddable": True, "max_queue_ms": 2000},
}


async def router_gauges(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """The router's queue depth and stall watchdog from its /metrics page."""
    async with session.get(url + "/metrics") as r:
        text = await r.text()
    out = {}
    for line in text.splitlines():
        for name in ("fairbatch_router_queue_depth", "fairbatch_router_dispatch_stalled_seconds"):
            if line.startswith(name + " "):
                out[name] = float(line.rsplit(" ", 1)[1])
    return out


async def drain_once(work: Path, stream: bool, two_classes: bool) -> dict[str, Any]:
    """One run of the ``drain`` scenario on a fresh fleet (module docstring)."""
    tenants = {"acme": {"weight": 1, "slo_class": "bulk"}, "beta": {"weight": 1, "slo_class": "interactive"}}
    fleet = start_fleet(work, 2, DRAIN_CLASSES, tenants, "bulk", engine_args=DRAIN_ENGINE)
    try:
        await wait_usable(fleet, 2)
        ha = {"Authorization": f"Bearer {fleet.keys['acme']}"}
        hb = {"Authorization": f"Bearer {fleet.keys['beta']}"}
        samples: list[tuple[float, float, float]] = []  # (s, queue depth, stalled s)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=150),
                                         connector=aiohttp.TCPConnector(limit=0)) as s:
            t0 = time.monotonic()

            async def watch() -> None:
                while True:
                    g = await router_gauges(s, fleet.router_url)
                    samples.append((time.monotonic() - t0, g.get("fairbatch_router_queue_depth", math.nan),
                                    g.get("fairbatch_router_dispatch_stalled_seconds", math.nan)))
                    await asyncio.sleep(0.5)

            async def interactive() -> list[Result]:
                await asyncio.sleep(2.0)
                tasks = []
                for _ in range(8):
                    tasks.append(asyncio.create_task(send(s, fleet.router_url, hb, "beta", 200, 20, True, t0)))
                    await asyncio.sleep(0.25)
                return list(await asyncio.gather(*tasks))

            w = asyncio.create_task(watch())
            others = asyncio.create_task(interactive()) if two_classes else None
            bulk = await asyncio.gather(*[send(s, fleet.router_url, ha, "acme", 1000, 200, stream, t0)
                                          for _ in range(200)])
            inter = await others if others is not None else []
            w.cancel()
    finally:
        fleet.group.stop()
    still, longest = 0.0, 0.0  # longest time the depth stood still while requests waited
    for (t1, d1, _), (t2, d2, _) in itertools.pairwise(samples):
        still = still + (t2 - t1) if d1 == d2 and d1 > 0 else 0.0
        longest = max(longest, still)
    served = sum(1 for r in bulk if r.status == 200 and r.completion_tokens == 200)
    return {"served": served, "refused": dict(Counter(r.reason or str(r.status) for r in bulk if r.status != 200)),
            "makespan_s": round(max(r.end_s for r in bulk), 2), "queue_still_max_s": round(longest, 2),
            "watchdog_max_s": max((x[2] for x in samples), default=math.nan),
            "interactive": dict(Counter(r.reason or str(r.status) for r in inter))}


async def scenario_drain(work: Path, runs: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for two in (False, True):
        for stream in (False, True):
            name = f"{'two classes' if two else 'one class'}, {'stream' if stream else 'non-stream'}"
            res = []
            for k in range(runs):
                d = work / f"{int(two)}{int(stream)}-{k}"
                d.mkdir(parents=True, exist_ok=True)
                res.append(await drain_once(d, stream, two))
                print(f"  drain {name} run {k + 1}/{runs}: {res[-1]['served']}/200 served, "
                      f"makespan {res[-1]['makespan_s']} s", flush=True)
            out[name] = {"runs": res, "all_served": sum(1 for r in res if r["served"] == 200),
                         "makespan_s": [r["makespan_s"] for r in res],
                         "queue_still_max_s": max(r["queue_still_max_s"] for r in res),
                         "watchdog_max_s": max(r["watchdog_max_s"] for r in res)}
    out["target_met"] = all(v["all_served"] == runs for k, v in out.items() if isinstance(v, dict))
    out["runs_per_variant"] = runs
    return out


def table(doc: dict[str, Any]) -> str:
    """The report as a fixed-width table."""
    rows = [("scenario", "measured", "target", "met")]
    sc = doc["scenarios"]
    if "burst" in sc:
        b = sc["burst"]
        rows.append(("burst direct", f"{b['direct']['served']}/60 served, makespan {b['direct']['makespan_s']:.2f} s, "
                     f"TTFT p95 {b['direct']['ttft_p95_ms']:.0f} ms, max {b['direct']['ttft_max_ms']:.0f} ms", "", ""))
        rows.append(("burst router", f"{b['router']['served']}/60 served, makespan {b['router']['makespan_s']:.2f} s "
                     f"({b['makespan_ratio']:.3f}x), TTFT p95 {b['router']['ttft_p95_ms']:.0f} ms, refused "
                     f"{b['router']['refused']}", "<= 1.15x, 60/60", str(b["target_met"])))
    if "ties" in sc:
        t = sc["ties"]
        rows.append(("ties", " / ".join(f"{k} {v}" for k, v in t["per_replica"].items())
                     + f" (max {t['max_share']:.1%})", "<= 40 %", str(t["target_met"])))
    for key in ("weights", "weights_no_cap", "weights_off"):
        if key in sc:
            w = sc[key]
            met = abs(w["shares"]["A"] - 0.75) <= 0.05 and abs(w["shares"]["B"] - 0.25) <= 0.05
            rows.append((key, f"window {w['start_window_steps']:g} steps, cap {w['contention_max_inflight']}: shares A "
                         f"{w['shares']['A']:.3f} / B {w['shares']['B']:.3f}, {w['tokens_per_s']:.0f} tok/s, TTFT p50 "
                         f"{w['ttft_p50_ms']:.0f} p95 {w['ttft_p95_ms']:.0f} ms", "0.75/0.25 +-0.05", str(met)))
    if "sizes" in sc:
        w = sc["sizes"]
        met = 0.9 <= w["service_ratio_a_over_b"] <= 1.1 and w["jain"] >= 0.95
        rows.append(("sizes", f"equal weights, prompts {w['prompts'][0]} vs {w['prompts'][1]}: weighted service ratio "
                     f"{w['service_ratio_a_over_b']:.3f}, Jain {w['jain']:.3f}, {w['tokens_per_s']:.0f} tok/s",
                     "0.9-1.1, Jain >= 0.95", str(met)))
    if "infeasible" in sc:
        i = sc["infeasible"]
        rows.append(("infeasible", f"{i['slo_infeasible']}/{i['chat_sent']} chat refused slo-infeasible in "
                     f"p50 {i['refusal_ms_p50']:.1f} / max {i['refusal_ms_max']:.1f} ms ({i['refused_at_arrival']} at arrival, "
                     f"{i['refused_while_queued']} while queued); {i['chat_ok']} ok "
                     f"({i['chat_ok_late']} late), other {i['other_refusals']}", "<= 50 ms", str(i["target_met"])))
    if "starve" in sc:
        s = sc["starve"]
        rows.append(("starve", f"lo {s['lo_ok']}/{s['lo_sent']} ok, {s['lo_starved']} starved, TTFT p95 "
                     f"{s['lo_ttft_p95_ms']:.0f} max {s['lo_ttft_max_ms']:.0f} ms; hi {s['hi_ok']} ok", "0 starved",
                     str(s["target_met"])))
    if "drain" in sc:
        d = sc["drain"]
        for name, v in d.items():
            if isinstance(v, dict):
                rows.append((f"drain {name}", f"{v['all_served']}/{d['runs_per_variant']} runs served 200/200; "
                             f"makespan {min(v['makespan_s']):.1f}-{max(v['makespan_s']):.1f} s; queue still <= "
                             f"{v['queue_still_max_s']:.1f} s; watchdog max {v['watchdog_max_s']:.1f} s",
                             "every run 200/200", str(v["all_served"] == d["runs_per_variant"])))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join("  ".join(c.ljust(widths[i]) for i, c in enumerate(r)) for r in rows)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    only = set(args.only.split(",")) if args.only else {"burst", "ties", "weights", "sizes", "infeasible", "starve",
                                                         "drain"}  # fmt: skip
    doc: dict[str, Any] = {"profile": PROFILE, "time_scale": 1.0, "python": platform.python_version(), "scenarios": {}}
    with tempfile.TemporaryDirectory(prefix="fairbatch-backlog-") as tmp0:
        tmp = args.work_dir or tmp0
        work = Path(tmp)
        runs: list[tuple[str, Any]] = []
        if "burst" in only:
            runs.append(("burst", lambda d: scenario_burst(d, args.lease_mode)))
        if "ties" in only:
            runs.append(("ties", lambda d: scenario_ties(d)))
        if "weights" in only:
            runs.append(("weights", lambda d: scenario_weights(d, args.weights_s, None)))
            runs.append(("weights_no_cap", lambda d: scenario_weights(d, args.weights_s, {"contention_max_inflight": 0})))
            runs.append(("weights_off", lambda d: scenario_weights(
                d, args.weights_s, {"contention_max_inflight": 0, "start_window_steps": 0})))
        if "sizes" in only:
            runs.append(("sizes", lambda d: scenario_weights(d, args.weights_s, None, (4000, 500), (1, 1))))
        if "infeasible" in only:
            runs.append(("infeasible", lambda d: scenario_infeasible(d, args.infeasible_s)))
        if "starve" in only:
            runs.append(("starve", lambda d: scenario_starve(d, args.starve_s)))
        if "drain" in only:
            runs.append(("drain", lambda d: scenario_drain(d, args.drain_runs)))
        for name, run in runs:
            d = work / name
            d.mkdir(parents=True, exist_ok=True)
            print(f"running {name} ...", flush=True)
            doc["scenarios"][name] = await run(d)
    return doc


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="backlog.json", help="JSON report path (default: %(default)s)")
    p.add_argument("--only", default="", help="comma-separated subset: burst,ties,weights,sizes,infeasible,starve,drain")
    p.add_argument("--drain-runs", type=int, default=3, help="runs of each drain variant (issue 25 asks 10)")
    p.add_argument("--weights-s", type=float, default=25.0, help="seconds of load in the weights scenario")
    p.add_argument("--infeasible-s", type=float, default=15.0, help="seconds of load in the infeasible scenario")
    p.add_argument("--starve-s", type=float, default=45.0, help="seconds of load in the starve scenario")
    p.add_argument("--work-dir", default="", help="keep each scenario's config and process logs here "
                   "(default: a temporary directory, removed at the end)")
    p.add_argument("--lease-mode", choices=["inline", "reserve"], default=None,
                   help="the burst scenario's admission.lease_mode (default: the router's default)")
    p.add_argument("--chat-client", nargs=3, metavar=("URL", "KEY", "SECONDS"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.chat_client:  # the infeasible scenario's chat tenant, in its own process (JSON on stdout)
        url, key, secs = args.chat_client
        print(json.dumps(asyncio.run(chat_client(url, key, float(secs), 0.3))))
        return 0
    doc = asyncio.run(main_async(args))
    print(table(doc))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=2, default=str))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
