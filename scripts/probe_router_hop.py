"""Where the router's hop spends its time at one client: stage timestamps of one streamed request.

The router, a fake agent (tests/integration/fake_agents.py: a gRPC budget stream and an SSE
upstream) and an aiohttp client in one uvloop process. ``--requests`` streamed requests through the
router, ``--gap-ms`` apart, alternate with as many sent straight to the fake agent. Each router stage
is stamped by wrapping its method (a probe, not production code): handler entered, ``_serve_placed``
entered (auth, body, validation, prompt estimate, quota done), ``_forward`` entered (placement
done), ``Exchange.start`` (upstream headers built), and the fake agent's handler entered; plus the
duration of the body read, the validation and the prompt estimate. Prints medians (ms after the
client's send) and writes them as JSON with ``--out``.

Run: ``python scripts/probe_router_hop.py --out probe.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "integration"))

import uvloop  # noqa: E402

from fake_agents import API_KEY, PROMPT, FakeAdmission, FakeUpstream, LoopbackFleet  # noqa: E402
from fairbatch_common import upstream as upstream_mod  # noqa: E402
from fairbatch_common.clock import Clock  # noqa: E402
from router import server as server_mod  # noqa: E402
from router.config import RouterConfig, hash_api_key  # noqa: E402
from router.server import Router  # noqa: E402

STAGES = ("handler", "placed", "forward", "upstream_start")


class Probe:
    """Stamps (perf_counter s) per stage and durations (s) per wrapped call."""

    def __init__(self) -> None:
        self.stamps: dict[str, list[float]] = {}
        self.durations: dict[str, list[float]] = {}

    def stamp_async(self, owner: Any, name: str, key: str) -> None:
        f = getattr(owner, name)

        @functools.wraps(f)
        async def g(*a: Any, **k: Any) -> Any:
            self.stamps.setdefault(key, []).append(time.perf_counter())
            return await f(*a, **k)

        setattr(owner, name, g)

    def time_call(self, owner: Any, name: str, key: str, is_async: bool) -> None:
        f: Callable[..., Any] = getattr(owner, name)
        if is_async:
            @functools.wraps(f)
            async def ga(*a: Any, **k: Any) -> Any:
                t = time.perf_counter()
                try:
                    return await f(*a, **k)
                finally:
                    self.durations.setdefault(key, []).append(time.perf_counter() - t)
            setattr(owner, name, ga)
        else:
            @functools.wraps(f)
            def gs(*a: Any, **k: Any) -> Any:
                t = time.perf_counter()
                try:
                    return f(*a, **k)
                finally:
                    self.durations.setdefault(key, []).append(time.perf_counter() - t)
            setattr(owner, name, gs)


async def run(requests: int, gap_ms: float, warmup: int) -> dict[str, Any]:
    probe = Probe()
    probe.stamp_async(server_mod.Router, "_handle_generate", "handler")
    probe.stamp_async(server_mod.Router, "_serve_placed", "placed")
    probe.stamp_async(server_mod.Router, "_forward", "forward")
    probe.stamp_async(upstream_mod.Exchange, "start", "upstream_start")
    probe.time_call(server_mod, "read_body", "read_body", True)
    probe.time_call(server_mod, "validate_request", "validate_request", False)
    probe.time_call(server_mod, "estimate_prompt_tokens", "estimate_prompt_tokens", False)
    probe.time_call(server_mod, "prompt_decision", "prompt_decision", False)
    fleet = LoopbackFleet()
    up = FakeUpstream("r0")
    seen: list[float] = []
    handle = up.handle

    async def stamped(request: Any) -> Any:
        seen.append(time.perf_counter())
        return await handle(request)

    up.handle = stamped  # type: ignore[method-assign]
    http_url, target = await fleet.start_replica(FakeAdmission("r0", 400.0), up)
    config = RouterConfig.model_validate({
        "model": "sim-model",
        "slo_classes": {"interactive": {"ttft_ms": 500, "tpot_ms": 50, "max_queue_ms": 3000}},
        "tenants": {"acme": {"weight": 1, "slo_class": "interactive"}},
        "api_keys": {hash_api_key(API_KEY): "acme"},
        "replicas": [{"id": "r0", "http_url": http_url, "grpc_target": target}],
        "admission": {"bytes_per_token": 4.0},
    })
    await fleet.serve_router(Router(config, Clock(1.0), "probe"))
    await fleet.wait_fresh({"r0"})
    assert fleet.session is not None
    body = json.dumps({"model": "sim-model", "prompt": PROMPT, "max_tokens": 4, "stream": True}).encode()
    headers = {"Authorization": f"Bearer {API_KEY}"}
    sent: list[float] = []
    reached: list[float] = []
    direct: list[float] = []

    async def one(base: str, via_router: bool) -> None:
        n = len(seen)
        t0 = time.perf_counter()
        async with fleet.session.post(base + "/v1/completions", data=body, headers=headers) as resp:  # type: ignore[union-attr]
            await resp.read()
            if resp.status != 200 or len(seen) <= n:
                raise RuntimeError(f"request failed: {resp.status}")
        if via_router:
            sent.append(t0)
            reached.append(seen[n])
        else:
            direct.append((seen[n] - t0) * 1e3)

    try:
        for _ in range(warmup):
            await one(fleet.url, True)
            await one(http_url, False)
        k0 = {key: len(v) for key, v in probe.stamps.items()}
        d0 = {key: len(v) for key, v in probe.durations.items()}
        sent.clear()
        reached.clear()
        direct.clear()
        for i in range(2 * requests):
            await asyncio.sleep(gap_ms / 1000.0)
            await one(fleet.url, True) if i % 2 == 0 else await one(http_url, False)
    finally:
        await fleet.stop()
    out: dict[str, Any] = {"requests": requests, "gap_ms": gap_ms, "stages_ms_after_send": {}, "durations_us": {}}
    for key in STAGES:
        marks = probe.stamps[key][k0.get(key, 0):]
        out["stages_ms_after_send"][key] = statistics.median((m - s) * 1e3 for m, s in zip(marks, sent, strict=True))
    out["stages_ms_after_send"]["agent_reached"] = statistics.median((r - s) * 1e3 for r, s in zip(reached, sent, strict=True))
    out["direct_agent_reached_ms"] = statistics.median(direct)
    for key, v in probe.durations.items():
        out["durations_us"][key] = statistics.median(v[d0.get(key, 0):]) * 1e6
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=150, help="requests through the router (as many direct)")
    p.add_argument("--gap-ms", type=float, default=20.0, help="wall ms between two requests")
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--out", type=Path, default=None, help="write the JSON here")
    args = p.parse_args(argv)
    res = uvloop.run(run(args.requests, args.gap_ms, args.warmup))
    print(f"one client, {args.requests} streamed requests {args.gap_ms:g} ms apart (medians)")
    for key, ms in res["stages_ms_after_send"].items():
        print(f"  {key:22s} {ms:7.3f} ms after the client's send")
    print(f"  {'direct to the agent':22s} {res['direct_agent_reached_ms']:7.3f} ms")
    for key, us in sorted(res["durations_us"].items()):
        print(f"  {key:22s} {us:7.1f} us")
    if args.out:
        args.out.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
