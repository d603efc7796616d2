"""``fairbatch-loadgen demo``: a whole local fleet on loopback, a trace replayed through it.

Starts N simulated engines, N replica agents (one in front of each engine) and one router, all
with the same ``--time-scale``, on free 127.0.0.1 ports; writes the router YAML (two tenants,
``acme`` weight 3 and ``beta`` weight 1, both in SLO class ``interactive``; random API keys
stored as sha256); waits for every ``/health``; replays the trace through the router in this
process; prints the report and writes its JSON. Everything started is stopped on the way out,
also on Ctrl-C or an error.
"""

from __future__ import annotations

import hashlib
import secrets
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console

from loadgen.demo_setup import DEMO_TENANTS, SLO_CLASS, DemoOptions
from loadgen.procs import ProcessGroup, free_port, script
from loadgen.replay import ReplayConfig, TenantSpec
from loadgen.report import default_console, replay_to_report
from loadgen.stats import Slo
from loadgen.sim.engine_time import POLICY, describe_engine, engine_label, load_engine_time_model
from loadgen.traces import load_trace, resolve_trace, select


@dataclass(frozen=True, slots=True)
class ReplicaPorts:
    """Loopback ports of one replica."""

    replica_id: str
    engine_port: int
    agent_http_port: int
    agent_grpc_port: int


def router_config(
    replicas: list[ReplicaPorts], api_keys: dict[str, str], slo: Slo, model: str
) -> dict[str, Any]:
    """The router YAML document (architecture.md format) for the demo fleet.

    Args:
        replicas: ports of each replica (the router talks to the agents).
        api_keys: tenant -> clear API key (stored as sha256 hex).
        slo: targets of the ``interactive`` class (simulated ms).
        model: served model name.
    """
    return {
        "model": model,
        "slo_classes": {
            SLO_CLASS: {
                "ttft_ms": slo.ttft_ms,
                "tpot_ms": slo.tpot_ms,
                "priority": 0,
                "sheddable": True,
                "max_queue_ms": max(2000.0, 4 * slo.ttft_ms),
            }
        },
        "tenants": {name: {"weight": w, "slo_class": SLO_CLASS} for name, w in DEMO_TENANTS},
        "api_keys": {hashlib.sha256(key.encode()).hexdigest(): tenant for tenant, key in api_keys.items()},
        "replicas": [
            {
                "id": r.replica_id,
                "http_url": f"http://127.0.0.1:{r.agent_http_port}",
                "grpc_target": f"127.0.0.1:{r.agent_grpc_port}",
            }
            for r in replicas
        ],
        "queue": {"max_requests": 1024, "max_tokens": 4_000_000},
        "admission": {"bytes_per_token": 4.0, "reserve_timeout_ms": 200},
        "telemetry": {"otlp_endpoint": None, "service_name": "fairbatch-router"},
    }


def run_demo(opts: DemoOptions, console: Console | None = None) -> dict[str, Any]:
    """Start the fleet, replay, report, stop the fleet. Returns the report document.

    Raises:
        RuntimeError: when a child does not become healthy (its log tail is printed first).
        ValueError, FileNotFoundError: bad options or trace.
    """
    console = console or default_console()
    if opts.replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {opts.replicas}")
    engine_time = load_engine_time_model(opts.engine_time_model, opts.profile)
    if engine_time is None:
        engine_time_flag = POLICY
    elif engine_time.name.startswith("shipped:"):
        engine_time_flag = engine_time.name.removeprefix("shipped:")
    else:
        engine_time_flag = str(Path(engine_time.name).resolve())
    trace_path = resolve_trace(opts.trace)
    reqs = select(load_trace(trace_path), opts.duration_s, opts.rate_scale, opts.start_s)
    if not reqs:
        raise ValueError(f"no requests in {opts.duration_s} s of {opts.trace} from {opts.start_s} s")

    tmp = Path(tempfile.mkdtemp(prefix="fairbatch-demo-"))
    work = Path(opts.keep_logs) if opts.keep_logs else tmp
    work.mkdir(parents=True, exist_ok=True)
    api_keys = {name: f"fb-{name}-{secrets.token_urlsafe(18)}" for name, _ in DEMO_TENANTS}
    slo = Slo(opts.ttft_ms, opts.tpot_ms)
    replicas = [ReplicaPorts(f"r{i}", free_port(), free_port(), free_port()) for i in range(opts.replicas)]
    router_port = free_port()
    config_path = work / "fairbatch.yaml"
    config_path.write_text(
        "# written by fairbatch-loadgen demo; API keys are random per run, stored as sha256\n"
        + yaml.safe_dump(router_config(replicas, api_keys, slo, opts.profile), sort_keys=False)
    )
    scale = str(opts.time_scale)
    group = ProcessGroup(work / "logs")
    try:
        with console.status("starting the fleet") as status:
            engines = [
                group.start(
                    f"engine-{r.replica_id}",
                    script("fairbatch-loadgen")
                    + ["sim-engine", "--host", "127.0.0.1", "--port", str(r.engine_port), "--profile", opts.profile,
                       "--time-scale", scale, "--seed", str(opts.seed + i),
                       "--engine-time-model", engine_time_flag],
                )
                for i, r in enumerate(replicas)
            ]
            for r, c in zip(replicas, engines, strict=True):
                status.update(f"waiting for {c.name}")
                group.wait_http_ok(c, f"http://127.0.0.1:{r.engine_port}/health", opts.startup_timeout_s)
            agents = [
                group.start(
                    f"agent-{r.replica_id}",
                    script("fairbatch-agent")
                    + ["serve", "--engine-url", f"http://127.0.0.1:{r.engine_port}", "--host", "127.0.0.1",
                       "--http-port", str(r.agent_http_port), "--grpc-port", str(r.agent_grpc_port),
                       "--replica-id", r.replica_id, "--profile", opts.profile, "--config", str(config_path),
                       "--default-slo-class", SLO_CLASS, "--time-scale", scale],
                )
                for r in replicas
            ]
            for r, c in zip(replicas, agents, strict=True):
                status.update(f"waiting for {c.name}")
                group.wait_http_ok(c, f"http://127.0.0.1:{r.agent_http_port}/health", opts.startup_timeout_s)
            router = group.start(
                "router",
                script("fairbatch-router")
                + ["--config", str(config_path), "--host", "127.0.0.1", "--port", str(router_port),
                   "--time-scale", scale],
            )
            status.update("waiting for the router")
            group.wait_http_ok(router, f"http://127.0.0.1:{router_port}/health", opts.startup_timeout_s)
        console.print(
            f"fleet up: {opts.replicas} x ({opts.profile} engine + agent; engine step time "
            f"{engine_label(engine_time)}), router on 127.0.0.1:{router_port}, "
            f"time scale {opts.time_scale}; replaying {len(reqs)} requests "
            f"({opts.duration_s:g} s of {opts.trace} at rate x{opts.rate_scale:g}); arrivals span about "
            f"{max(r.arrival_ms for r in reqs) / 1000.0 * opts.time_scale:.0f} wall s, then the last requests finish",
            soft_wrap=True,  # one line, however wide the terminal: rich would break it mid-phrase
        )
        cfg = ReplayConfig(
            target=f"http://127.0.0.1:{router_port}",
            tenants=[TenantSpec(name, float(w), api_keys[name]) for name, w in DEMO_TENANTS],
            model=opts.profile,
            seed=opts.seed,
            time_scale=opts.time_scale,
            request_timeout_s=opts.request_timeout_s,
            max_wall_s=opts.max_wall_s,
            progress=opts.progress,
        )
        meta = {
            "trace": opts.trace,
            "rate_scale": opts.rate_scale,
            "duration_s": opts.duration_s,
            "start_s": opts.start_s,
            "time_scale": opts.time_scale,
            "target": "router",
            "endpoint": "completions",
            "fleet": {"replicas": opts.replicas, "profile": opts.profile},
            "engine_time_model": describe_engine(engine_time),
            "tenants": {name: w for name, w in DEMO_TENANTS},
            "slo_source": "demo",
        }
        doc = replay_to_report(reqs, cfg, {name: slo for name, _ in DEMO_TENANTS}, meta, opts.out, console)
        dead = [c for c in group.children if c.popen.poll() is not None]
        for c in dead:
            console.print(f"[red]{c.name} exited during the run (code {c.popen.returncode}); log tail:[/red]")
            console.print(c.log_tail(), markup=False)
        if opts.keep_logs:
            console.print(f"logs and config kept in {work}")
        return doc
    except RuntimeError as e:
        console.print("[red]demo failed:[/red]")
        console.print(str(e), markup=False, highlight=False)
        raise
    finally:
        group.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def main_from_args(args: Any) -> int:
    """Entry from the CLI's parsed ``demo`` arguments. Returns the process exit code."""
    opts = DemoOptions(
        replicas=args.replicas,
        trace=args.trace,
        duration_s=args.duration_s,
        start_s=args.start_s,
        rate_scale=args.rate_scale,
        time_scale=args.time_scale,
        profile=args.profile,
        ttft_ms=args.ttft_ms,
        tpot_ms=args.tpot_ms,
        out=args.out,
        keep_logs=args.keep_logs,
        seed=args.seed,
        startup_timeout_s=args.startup_timeout_s,
        max_wall_s=args.max_wall_s,
        request_timeout_s=args.request_timeout_s,
        progress=not args.no_progress,
        engine_time_model=getattr(args, "engine_time_model", None),
    )
    def on_sigterm(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # unwinds through run_demo's finally, which stops the fleet

    engine = getattr(args, "engine", "sim")
    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        if engine == "vllm":
            from loadgen.vllm_fleet import run_vllm_demo

            run_vllm_demo(opts)
        else:
            run_demo(opts)
    except RuntimeError as e:
        if engine == "vllm":  # run_demo prints its own failure with the log tail
            print(f"demo failed: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted; fleet stopped", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0
