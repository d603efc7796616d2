"""``fairbatch-loadgen demo --scenario FILE``: a multi-tenant fairness run (issue 5, item 5; docs/design.md section 2).

A scenario file (``loadgen/scenarios/*.yaml``) names the fleet, the SLO classes, the tenants with
their contract (weight, class, min_share, quotas: copied into the router YAML) and their load::

    name: weights-3-1
    replicas: 2            # simulated engine + agent pairs
    routers: 1             # router copies; > 1 (or redis: true) starts a private redis-server
    time_scale: 2.0        # wall s per simulated s
    duration_s: 40         # simulated seconds of arrivals
    share_window_s: [8, 40]  # contention window for shares and Jain (first-token times, simulated s)
    slowdown_alone_s: 6    # > 0: replay each tenant's first 6 s alone afterwards (slowdown baseline)
    slo_classes: {interactive: {ttft_ms: 2000, tpot_ms: 100, priority: 0, sheddable: false, max_queue_ms: 20000}}
    tenants:
      acme: {weight: 3, slo_class: interactive,
             load: {rate_rps: 12, prompt_tokens: 400, output_tokens: 64}}
      beta: {weight: 1, slo_class: interactive, load: {rate_rps: 12, prompt_tokens: 400, output_tokens: 64,
             long_prompt_tokens: 20000, long_every: 50}}

Arrivals are Poisson (seeded) per tenant; with several routers each tenant's requests alternate
between them. The report is the replay report (loadgen/report.py) plus fairness figures
(:func:`fairness`):

- ``share``: the tenant's part of the tokens (prompt + output of completed requests) whose first
  token came inside the contention window ``share_window_s: [start, end]`` (simulated s; default
  ``[min(5, duration/6), duration]``). A saturation scenario picks the window in which every
  tenant waits in the router queue: PAB lets each replica hold up to one TTFT horizon of admitted
  work, served FIFO by the engine, so the router's order only shows once that is full; and once
  the arrivals stop every backlog is eventually served, so the whole-run share
  (``share_whole_run``) tends to the offered ratio whatever the weights.
- ``backlogged``: refused anything that arrived in the window, had a request still waiting past
  its TTFT target when the window closed, or offered in it more than 1.05x the tokens it was
  served in it. ``jain_index``: Jain over served tokens / weight among the
  backlogged tenants (``jain_tenants``; docs/design.md section 2). ``jain_maxmin``: Jain over every
  tenant's service / its weighted max-min fair service (:func:`maxmin_fair` of the window's
  service over the window's offered tokens; ``fair_share``): 1 when each tenant that asked less
  than its part got all it asked and the rest was split by weight.
- ``max_wait_ms``: the longest TTFT of a completed request (an upper bound of its wait in the
  router queue: the client cannot see the queue). ``starved``: requests that waited longer than
  their class's ``max_queue_ms`` (TTFT above it, or a 429 queue-timeout).
- ``slowdown`` (docs/design.md section 2): mean completion time (arrival to last token) in the shared
  run / in a run of the tenant alone with the same load, when ``slowdown_alone_s`` > 0: after the
  shared run each tenant replays the first ``slowdown_alone_s`` seconds of its own trace on the
  idle fleet (``alone_mean_completion_ms``).
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


def maxmin_fair(capacity: float, demands: Mapping[str, float], weights: Mapping[str, float]) -> dict[str, float]:
    """Weighted max-min fair split of ``capacity`` among ``demands`` (water-filling; PURE).

    A tenant that asks for less than its weighted part gets its demand; what it leaves is shared
    by the others in proportion to their weights.
    """
    alloc = {t: 0.0 for t in demands}
    left = capacity
    active = {t for t, d in demands.items() if d > 0}
    while active and left > 1e-9:
        wsum = sum(weights[t] for t in active)
        capped = {t for t in active if demands[t] - alloc[t] <= left * weights[t] / wsum + 1e-9}
        if not capped:
            for t in active:
                alloc[t] += left * weights[t] / wsum
            break
        for t in capped:
            left -= demands[t] - alloc[t]
            alloc[t] = demands[t]
        active -= capped
    return alloc


def mean_completion_ms(records: Sequence[RequestRecord]) -> float | None:
    """Mean arrival -> last token of the completed requests (simulated ms), None without any."""
    e2e = [r.token_times_ms[-1] - r.arrival_ms for r in records if r.outcome == OK and r.token_times_ms]
    return sum(e2e) / len(e2e) if e2e else None


def _in_window(x: float | None, window: tuple[float, float]) -> bool:
    return x is not None and window[0] <= x < window[1]


def fairness(
    records: Sequence[RequestRecord],
    weights: Mapping[str, float],
    slos: Mapping[str, Slo],
    max_queue_ms: Mapping[str, float],
    window_ms: tuple[float, float] | None = None,
) -> dict[str, Any]:
    """Fairness figures of one run (PURE). See the module docstring for the definitions.

    Args:
        window_ms: the contention window (simulated ms from the start) in which shares, backlog and
            the Jain indices are measured; None: the whole run.
    """
    window = window_ms or (float("-inf"), float("inf"))
    per: dict[str, dict[str, Any]] = {}
    served: dict[str, int] = {}
    offered: dict[str, int] = {}
    for t in weights:
        mine = [r for r in records if r.tenant == t]
        ok = [r for r in mine if r.outcome == OK]
        ttfts = [r.ttft_ms for r in ok if r.ttft_ms is not None]
        met = 0
        for r in ok:
            tp = r.tpot_ms
            if r.ttft_ms is not None and r.ttft_ms <= slos[t].ttft_ms and (tp is None or tp <= slos[t].tpot_ms):
                met += 1
        starved = sum(1 for x in ttfts if x > max_queue_ms[t])
        starved += sum(1 for r in mine if r.outcome == REJECTED and r.reason == "queue-timeout")
        # service in the window: tokens of completed requests whose first token came in it
        served[t] = sum(r.prompt_tokens + r.output_tokens for r in ok
                        if r.token_times_ms and _in_window(r.token_times_ms[0], window))
        arrived = [r for r in mine if _in_window(r.arrival_ms, window)]
        offered[t] = sum(r.prompt_tokens + (r.expected_output_tokens or r.output_tokens) for r in arrived)
        refused = sum(1 for r in arrived if r.outcome == REJECTED)
        # still queued past its TTFT target when the window closed
        late = any(r.arrival_ms < window[1] and r.token_times_ms
                   and r.token_times_ms[0] >= max(window[1], r.arrival_ms + slos[t].ttft_ms) for r in ok)
        per[t] = {
            "requests": len(mine),
            "slo_attainment": met / len(mine) if mine else None,
            "served_tokens": sum(r.prompt_tokens + r.output_tokens for r in ok),
            "window_served_tokens": served[t],
            "window_offered_tokens": offered[t],
            "mean_completion_ms": mean_completion_ms(ok),
            "max_wait_ms": max(ttfts) if ttfts else None,
            "starved": starved,
            "backlogged": refused > 0 or late or offered[t] > 1.05 * served[t],
        }
    total = sum(served.values())
    total_all = sum(per[t]["served_tokens"] for t in weights)
    fair = maxmin_fair(float(total), {t: float(offered[t]) for t in weights}, weights)
    for t in weights:
        per[t]["share"] = served[t] / total if total else 0.0
        per[t]["share_whole_run"] = per[t]["served_tokens"] / total_all if total_all else 0.0
        per[t]["weighted_service"] = served[t] / weights[t]
        per[t]["fair_share"] = fair[t] / total if total else 0.0
    backlogged = [t for t in weights if per[t]["backlogged"]]
    normalised = [served[t] / fair[t] for t in weights if fair[t] > 0]
    return {
        "jain_index": jain([per[t]["weighted_service"] for t in backlogged]),
        "jain_tenants": backlogged,
        "jain_maxmin": jain(normalised),
        "share_window_ms": list(window_ms) if window_ms else None,
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
    alone: dict[str, list[RequestRecord]] = {}
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
        alone_s = float(doc.get("slowdown_alone_s", 0) or 0)
        console.print(f"scenario {name}: {len(replicas)} replicas, {n_routers} router(s), "
                      f"{sum(len(t) for t in traces.values())} requests over {duration_s:g} s (time scale {scale:g}); "
                      f"the replay takes about {duration_s * scale:.0f} wall s plus its drain"
                      + (f", then a {alone_s:g} s slowdown baseline per tenant (about "
                         f"{alone_s * scale * len(traces):.0f} wall s in all)" if alone_s > 0 else ""))
        from fairbatch_common.runtime import run

        result = _merge(run(_replay_all(plans)), scale)
        for n, trace in traces.items():  # the slowdown baseline: each tenant alone on the idle fleet
            part = [r for r in trace if r.arrival_ms < alone_s * 1000.0]
            if not part:
                continue
            console.print(f"slowdown baseline: {n} alone, {len(part)} requests over {alone_s:g} s")
            alone_plans = [(part[i::len(urls)], ReplayConfig(target=url, tenants=[TenantSpec(n, 1.0, keys[n])],
                                                             model=profile, time_scale=scale, max_wall_s=max_wall_s,
                                                             progress=False))
                           for i, url in enumerate(urls) if part[i::len(urls)]]
            alone[n] = _merge(run(_replay_all(alone_plans)), scale).records
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
    window = doc.get("share_window_s", [min(5.0, duration_s / 6.0), duration_s])
    fair = fairness(
        result.records, {n: float(t.get("weight", 1.0)) for n, t in tenants.items()}, slos,
        {n: float(doc["slo_classes"][t["slo_class"]].get("max_queue_ms", 30000)) for n, t in tenants.items()},
        (float(window[0]) * 1000.0, float(window[1]) * 1000.0),
    )
    for key in ("jain_index", "jain_tenants", "jain_maxmin", "share_window_ms"):
        report[key] = fair[key]
    for n, figs in fair["per_tenant"].items():
        report["per_tenant"].setdefault(n, {}).update(figs)
        figs = report["per_tenant"][n]
        base = mean_completion_ms(alone.get(n, []))
        figs["alone_mean_completion_ms"] = base
        figs["slowdown"] = (figs["mean_completion_ms"] / base
                            if base and figs.get("mean_completion_ms") is not None else None)
    report["slowdown_alone_s"] = float(doc.get("slowdown_alone_s", 0) or 0) or None
    print_report(report, console)
    print_fairness(report, console)
    if out:
        console.print(f"report written to {write_report(report, out)}")
    return report


def fairness_table(report: Mapping[str, Any]) -> str:
    """The fairness table as plain text (one row per tenant)."""
    def num(x: Any, fmt: str) -> str:
        return format(x, fmt) if isinstance(x, (int, float)) else "-"

    rows = [f"{'tenant':<10} {'weight':>6} {'share':>6} {'fair':>6} {'whole':>6} {'slo_att':>7} {'ttft_p99':>9} "
            f"{'max_wait':>9} {'starved':>7} {'slowdown':>8}  rejected"]
    weights = report.get("tenants", {})
    for n, f in sorted(report["per_tenant"].items()):
        rows.append(
            f"{n:<10} {weights.get(n, 1):>6} {num(f.get('share'), '.3f'):>6} {num(f.get('fair_share'), '.3f'):>6} "
            f"{num(f.get('share_whole_run'), '.3f'):>6} {num(f.get('slo_attainment'), '.3f'):>7} "
            f"{num((f.get('ttft_ms') or {}).get('p99'), '.0f'):>9} {num(f.get('max_wait_ms'), '.0f'):>9} "
            f"{f.get('starved', 0):>7} {num(f.get('slowdown'), '.2f'):>8}  {dict(f.get('rejected') or {})}"
        )
    w = report.get("share_window_ms")
    if w:
        rows.append(f"share/fair: served tokens with first token in [{w[0] / 1000:g}, {w[1] / 1000:g}) s; "
                    "fair = weighted max-min split of that service; whole = whole run")
    j = report.get("jain_index")
    rows.append(f"jain_index = {j:.3f} over backlogged {report.get('jain_tenants')}" if j is not None
                else "jain_index = n/a (no backlogged tenant)")
    jm = report.get("jain_maxmin")
    if jm is not None:
        rows.append(f"jain_maxmin = {jm:.3f} (service / weighted max-min fair service, all tenants)")
    return "\n".join(rows)


def print_fairness(report: Mapping[str, Any], console: Any) -> None:
    """Print :func:`fairness_table`."""
    console.print(fairness_table(report), markup=False, highlight=False)


def main(argv: list[str] | None = None) -> int:
    """``demo --scenario FILE [--out PATH] [--keep-logs DIR]``; returns the exit status."""
    p = argparse.ArgumentParser(
        prog="fairbatch-loadgen demo",
        usage="fairbatch-loadgen demo --scenario FILE [--out PATH] [--keep-logs DIR] [--max-wall-s S]",
        description="Run a multi-tenant fairness scenario.",
    )
    p.add_argument("command", nargs="?", default="demo", choices=["demo"], help=argparse.SUPPRESS)
    p.add_argument("--scenario", required=True, metavar="FILE", help="scenario YAML (loadgen/scenarios/*.yaml)")
    p.add_argument("--out", default=None, help="report JSON path (default out/scenario-<name>.json)")
    p.add_argument("--keep-logs", default=None, metavar="DIR", help="keep children's logs and the YAML here")
    p.add_argument("--max-wall-s", type=float, default=900.0, help="wall-clock limit of the replay")
    p.add_argument("--no-progress", action="store_true",
                   help="accepted for symmetry with the trace demo; scenarios print no progress bar")
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
