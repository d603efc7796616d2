"""``fairbatch-loadgen demo --scenario FILE``: a multi-tenant fairness run (issue 5, item 5; seed 001 section 13).

A scenario file (``loadgen/scenarios/*.yaml``) names the fleet, the SLO classes, the tenants with
their contract (weight, class, min_share, quotas: copied into the router YAML) and their load::

    name: weights-3-1
    replicas: 2            # simulated engine + agent pairs
    routers: 1             # router copies; > 1 (or redis: true) starts a private redis-server
    time_scale: 2.0        # wall s per simulated s
    duration_s: 40         # simulated seconds of arrivals
    slo_classes: {interactive: {ttft_ms: 2000, tpot_ms: 100, priority: 0, sheddable: false, max_queue_ms: 20000}}
    tenants:
      acme: {weight: 3, slo_class: interactive,
             load: {rate_rps: 12, prompt_tokens: 400, output_tokens: 64}}
      beta: {weight: 1, slo_class: interactive, load: {rate_rps: 12, prompt_tokens: 400, output_tokens: 64,
             long_prompt_tokens: 20000, long_every: 50}}

Arrivals are Poisson (seeded) per tenant; with several routers each tenant's requests alternate
between them. The report is the replay report (loadgen/report.py) plus fairness figures:
``jain_index`` (Jain over served tokens / weight among backlogged tenants, DESIGN.md section 2) and
``per_tenant.<name>.{slo_attainment, share, weighted_service, max_wait_ms, starved}``. ``share`` is
the tenant's part of all served tokens (prompt + output of completed requests). ``max_wait_ms`` is
the longest TTFT of a completed request (an upper bound of its wait in the router queue: the client
cannot see the queue). ``starved`` counts requests that waited longer than their class's
``max_queue_ms`` (TTFT above it, or a 429 queue-timeout). A tenant is backlogged when it was
refused or offered more tokens than it was served.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import math
import random
import secrets
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from loadgen.demo import ReplicaPorts
from loadgen.procs import ProcessGroup, free_port, script
from loadgen.replay import ReplayConfig, ReplayResult, TenantSpec, replay
from loadgen.report import build_report, default_console, print_report, write_report
from loadgen.stats import OK, REJECTED, RequestRecord, Slo
from loadgen.traces import TraceRequest

_CONTRACT_KEYS = ("weight", "slo_class", "min_share", "max_concurrency", "tokens_per_minute", "requests_per_minute")


@dataclass(frozen=True, slots=True)
class TenantLoad:
    """A tenant's offered load.

    Attributes:
        rate_rps: mean arrivals per simulated second (Poisson).
        prompt_tokens: prompt length of a normal request (tokens).
        output_tokens: max_tokens of every request.
        long_prompt_tokens: prompt length of the occasional long request (0 = none).
        long_every: every n-th request of the tenant is long (0 = none).
        start_s: first arrival not before this (simulated s).
    """

    rate_rps: float
    prompt_tokens: int = 256
    output_tokens: int = 64
    long_prompt_tokens: int = 0
    long_every: int = 0
    start_s: float = 0.0


def tenant_trace(load: TenantLoad, duration_s: float, rng: random.Random) -> list[TraceRequest]:
    """Poisson arrivals of ``load`` over ``duration_s`` simulated seconds (times in ms)."""
    out: list[TraceRequest] = []
    t = load.start_s * 1000.0
    i = 0
    while load.rate_rps > 0:
        t += rng.expovariate(load.rate_rps) * 1000.0
        if t >= duration_s * 1000.0:
            break
        i += 1
        long = load.long_every > 0 and load.long_prompt_tokens > 0 and i % load.long_every == 0
        out.append(TraceRequest(t, load.long_prompt_tokens if long else load.prompt_tokens, load.output_tokens))
    return out


def jain(values: Sequence[float]) -> float | None:
    """Jain's index (sum x)^2 / (n * sum x^2), in 1/n..1; None without values."""
    if not values:
        return None
    sq = sum(v * v for v in values)
    return (sum(values) ** 2) / (len(values) * sq) if sq > 0 else 1.0


def fairness(
    records: Sequence[RequestRecord],
    weights: Mapping[str, float],
    slos: Mapping[str, Slo],
    max_queue_ms: Mapping[str, float],
    offered_tokens: Mapping[str, int],
) -> dict[str, Any]:
    """Fairness figures of one run (PURE). See the module docstring for the definitions."""
    served: dict[str, int] = {t: 0 for t in weights}
    per: dict[str, dict[str, Any]] = {}
    for t in weights:
        mine = [r for r in records if r.tenant == t]
        ok = [r for r in mine if r.outcome == OK]
        served[t] = sum(r.prompt_tokens + r.output_tokens for r in ok)
        ttfts = [r.ttft_ms for r in ok if r.ttft_ms is not None]
        met = 0
        for r in ok:
            tp = r.tpot_ms
            if r.ttft_ms is not None and r.ttft_ms <= slos[t].ttft_ms and (tp is None or tp <= slos[t].tpot_ms):
                met += 1
        starved = sum(1 for x in ttfts if x > max_queue_ms[t])
        starved += sum(1 for r in mine if r.outcome == REJECTED and r.reason == "queue-timeout")
        refused = sum(1 for r in mine if r.outcome == REJECTED)
        per[t] = {
            "requests": len(mine),
            "slo_attainment": met / len(mine) if mine else None,
            "served_tokens": served[t],
            "max_wait_ms": max(ttfts) if ttfts else None,
            "starved": starved,
            "backlogged": refused > 0 or offered_tokens.get(t, 0) > 1.02 * served[t],
        }
    total = sum(served.values())
    for t in weights:
        per[t]["share"] = served[t] / total if total else 0.0
        per[t]["weighted_service"] = served[t] / weights[t]
    backlogged = [t for t in weights if per[t]["backlogged"]]
    pool = backlogged if len(backlogged) >= 2 else list(weights)
    return {
        "jain_index": jain([per[t]["weighted_service"] for t in pool]),
        "jain_tenants": pool,
        "per_tenant": per,
    }


def load_scenario(path: str | Path) -> dict[str, Any]:
    """Read and check a scenario file (ValueError naming the field when something is missing)."""
    doc = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: a scenario is a mapping")
    for key in ("slo_classes", "tenants"):
        if not isinstance(doc.get(key), dict) or not doc[key]:
            raise ValueError(f"{path}: {key}: required mapping")
    for name, t in doc["tenants"].items():
        if "load" not in t:
            raise ValueError(f"{path}: tenants.{name}.load: required")
        if t.get("slo_class") not in doc["slo_classes"]:
            raise ValueError(f"{path}: tenants.{name}.slo_class: unknown class {t.get('slo_class')!r}")
    return doc


def router_yaml(doc: Mapping[str, Any], replicas: Sequence[ReplicaPorts], keys: Mapping[str, str],
                redis_url: str | None) -> dict[str, Any]:
    """The router YAML of a scenario."""
    cfg: dict[str, Any] = {
        "model": doc.get("profile", "llama-3-8b-a100"),
        "slo_classes": doc["slo_classes"],
        "tenants": {n: {k: v for k, v in t.items() if k in _CONTRACT_KEYS} for n, t in doc["tenants"].items()},
        "api_keys": {hashlib.sha256(k.encode()).hexdigest(): n for n, k in keys.items()},
        "replicas": [{"id": r.replica_id, "http_url": f"http://127.0.0.1:{r.agent_http_port}",
                      "grpc_target": f"127.0.0.1:{r.agent_grpc_port}"} for r in replicas],
        "queue": doc.get("queue", {"max_requests": 4096, "max_tokens": 8_000_000}),
    }
    if "fairness" in doc:
        cfg["fairness"] = doc["fairness"]
    if redis_url:
        cfg["redis_url"] = redis_url
    return cfg


def _merge(results: Sequence[ReplayResult], scale: float) -> ReplayResult:
    records = [r for res in results for r in res.records]
    records.sort(key=lambda r: r.arrival_ms)
    errors: dict[str, str] = {}
    for res in results:
        errors.update(res.error_samples)
    return ReplayResult(records, max(r.duration_s for r in results), max(r.wall_s for r in results), scale,
                        results[0].model, errors)


async def _replay_all(plans: Sequence[tuple[list[TraceRequest], ReplayConfig]]) -> list[ReplayResult]:
    # the replays share one start instant: each waits for its own arrival times from now
    return list(await asyncio.gather(*(replay(trace, cfg) for trace, cfg in plans)))


def run_scenario(path: str | Path, out: str | None = None, keep_logs: str | None = None,
                 max_wall_s: float = 900.0, console: Any = None) -> dict[str, Any]:
    """Start the fleet of the scenario, replay every tenant's load, report, stop. Returns the report."""
    console = console or default_console()
    doc = load_scenario(path)
    name = doc.get("name", Path(path).stem)
    scale = float(doc.get("time_scale", 2.0))
    duration_s = float(doc.get("duration_s", 30.0))
    profile = doc.get("profile", "llama-3-8b-a100")
    n_routers = int(doc.get("routers", 1))
    rng = random.Random(int(doc.get("seed", 0)))
    tenants = doc["tenants"]
    keys = {n: f"fb-{n}-{secrets.token_urlsafe(12)}" for n in tenants}
    traces = {n: tenant_trace(TenantLoad(**t["load"]), duration_s, rng) for n, t in tenants.items()}
    tmp = Path(tempfile.mkdtemp(prefix="fairbatch-scenario-"))
    work = Path(keep_logs) if keep_logs else tmp
    work.mkdir(parents=True, exist_ok=True)
    group = ProcessGroup(work / "logs")
    redis_proc: subprocess.Popen[bytes] | None = None
    try:
        redis_url = None
        if n_routers > 1 or doc.get("redis"):
            binary = shutil.which("redis-server")
            if binary is None:
                raise RuntimeError("this scenario needs redis-server (apt-get install -y redis-server)")
            rport = free_port()
            redis_proc = subprocess.Popen([binary, "--port", str(rport), "--bind", "127.0.0.1", "--save", "",
                                           "--appendonly", "no"], stdout=subprocess.DEVNULL)
            redis_url = f"redis://127.0.0.1:{rport}/0"
        replicas = [ReplicaPorts(f"r{i}", free_port(), free_port(), free_port()) for i in range(int(doc.get("replicas", 2)))]
        cfg_path = work / "fairbatch.yaml"
        cfg_path.write_text(yaml.safe_dump(router_yaml(doc, replicas, keys, redis_url), sort_keys=False))
        ts = str(scale)
        for i, r in enumerate(replicas):
            c = group.start(f"engine-{r.replica_id}", script("fairbatch-loadgen") + [
                "sim-engine", "--port", str(r.engine_port), "--profile", profile, "--time-scale", ts, "--seed", str(i)])
            group.wait_http_ok(c, f"http://127.0.0.1:{r.engine_port}/health")
        first_class = next(iter(doc["slo_classes"]))
        for r in replicas:
            c = group.start(f"agent-{r.replica_id}", script("fairbatch-agent") + [
                "serve", "--engine-url", f"http://127.0.0.1:{r.engine_port}", "--http-port", str(r.agent_http_port),
                "--grpc-port", str(r.agent_grpc_port), "--replica-id", r.replica_id, "--profile", profile,
                "--config", str(cfg_path), "--default-slo-class", first_class, "--time-scale", ts])
            group.wait_http_ok(c, f"http://127.0.0.1:{r.agent_http_port}/health")
        urls = []
        for i in range(n_routers):
            port = free_port()
            c = group.start(f"router-{i}", script("fairbatch-router") + [
                "--config", str(cfg_path), "--port", str(port), "--time-scale", ts, "--router-id", f"router-{i}"])
            urls.append(f"http://127.0.0.1:{port}")
            group.wait_http_ok(c, f"{urls[-1]}/health")
        plans = []
        for n, trace in traces.items():
            for i, url in enumerate(urls):
                part = trace[i::len(urls)]
                if part:
                    plans.append((part, ReplayConfig(target=url, tenants=[TenantSpec(n, 1.0, keys[n])], model=profile,
                                                      time_scale=scale, max_wall_s=max_wall_s, progress=False)))
        console.print(f"scenario {name}: {len(replicas)} replicas, {n_routers} router(s), "
                      f"{sum(len(t) for t in traces.values())} requests over {duration_s:g} s (time scale {scale:g})")
        from replica_agent.runtime import run

        result = _merge(run(_replay_all(plans)), scale)
    finally:
        group.stop()
        if redis_proc is not None:
            redis_proc.kill()
            redis_proc.wait(timeout=10)
        shutil.rmtree(tmp, ignore_errors=True)
    slos = {n: Slo(doc["slo_classes"][t["slo_class"]]["ttft_ms"], doc["slo_classes"][t["slo_class"]]["tpot_ms"])
            for n, t in tenants.items()}
    report = build_report(result, slos, {"scenario": name, "duration_s": duration_s, "routers": n_routers,
                                         "target": "router", "tenants": {n: t.get("weight", 1) for n, t in tenants.items()}})
    fair = fairness(
        result.records, {n: float(t.get("weight", 1.0)) for n, t in tenants.items()}, slos,
        {n: float(doc["slo_classes"][t["slo_class"]].get("max_queue_ms", 30000)) for n, t in tenants.items()},
        {n: sum(r.prompt_tokens + r.output_tokens for r in traces[n]) for n in tenants},
    )
    report["jain_index"] = fair["jain_index"]
    report["jain_tenants"] = fair["jain_tenants"]
    for n, figs in fair["per_tenant"].items():
        report["per_tenant"].setdefault(n, {}).update(figs)
    print_report(report, console)
    print_fairness(report, console)
    if out:
        console.print(f"report written to {write_report(report, out)}")
    return report


def fairness_table(report: Mapping[str, Any]) -> str:
    """The fairness table as plain text (one row per tenant)."""
    rows = [f"{'tenant':<10} {'weight':>6} {'share':>7} {'slo_att':>8} {'ttft_p99':>9} {'max_wait':>9} "
            f"{'starved':>7} {'rejected':<30}"]
    weights = report.get("tenants", {})
    for n, f in sorted(report["per_tenant"].items()):
        p99 = (f.get("ttft_ms") or {}).get("p99")
        att = f.get("slo_attainment")
        mw = f.get("max_wait_ms")
        rows.append(
            f"{n:<10} {weights.get(n, 1):>6} {f.get('share', 0):>7.3f} "
            f"{(att if att is not None else float('nan')):>8.3f} "
            f"{(p99 if p99 is not None else float('nan')):>9.0f} {(mw if mw is not None else float('nan')):>9.0f} "
            f"{f.get('starved', 0):>7} {str(f.get('rejected', {})):<30}"
        )
    j = report.get("jain_index")
    rows.append(f"jain_index = {j:.3f} over {report.get('jain_tenants')}" if j is not None else "jain_index = n/a")
    return "\n".join(rows)


def print_fairness(report: Mapping[str, Any], console: Any) -> None:
    """Print :func:`fairness_table`."""
    console.print(fairness_table(report), markup=False, highlight=False)


def main(argv: list[str] | None = None) -> int:
    """``demo --scenario FILE [--out PATH] [--keep-logs DIR]``; returns the exit status."""
    p = argparse.ArgumentParser(prog="fairbatch-loadgen demo", description="Run a multi-tenant fairness scenario.")
    p.add_argument("command", nargs="?", default="demo", choices=["demo"])
    p.add_argument("--scenario", required=True, metavar="FILE", help="scenario YAML (loadgen/scenarios/*.yaml)")
    p.add_argument("--out", default=None, help="report JSON path (default out/scenario-<name>.json)")
    p.add_argument("--keep-logs", default=None, metavar="DIR", help="keep children's logs and the YAML here")
    p.add_argument("--max-wall-s", type=float, default=900.0, help="wall-clock limit of the replay")
    args = p.parse_args(argv)
    out = args.out or f"out/scenario-{Path(args.scenario).stem}.json"
    try:
        run_scenario(args.scenario, out, args.keep_logs, args.max_wall_s)
    except (ValueError, RuntimeError, FileNotFoundError) as exc:
        print(f"fairbatch-loadgen demo: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
