"""Real ``vllm serve`` replicas (CPU build, tiny local model) behind real agents and a router.

Used by the ``vllm`` tests (tests/vllm/) and by ``fairbatch-loadgen demo --engine vllm``
(:func:`run_vllm_demo`). The vLLM processes run from a separate venv made by
``scripts/make-vllm-env.sh`` (``make vllm-env``): this module never imports vllm or torch; it starts
``<venv>/bin/vllm serve`` as a child of a :class:`~loadgen.procs.ProcessGroup`, like the other
children, so :meth:`ProcessGroup.stop` ends them too.

Paths (environment variables override):
- ``FAIRBATCH_VLLM_VENV``: the vLLM venv (default ``<repo>/.venv-vllm``);
- ``FAIRBATCH_TINY_MODEL``: the tiny model folder (default ``<repo>/.cache/tiny-llama``);
- ``FAIRBATCH_VLLM_CACHE``: ``VLLM_CACHE_ROOT`` of the replicas (default ``<repo>/.cache/vllm``).

Facts this relies on (vLLM 0.32.0 CPU, see docs/vllm.md): start-up takes 55-115 s on a 2-core
machine (``--enforce-eager`` skips torch.compile), about 3.1 GiB RSS per replica; two replicas on
one host must bind different cores (``VLLM_CPU_OMP_THREADS_BIND``); the KV block size is 128.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from loadgen.demo_setup import DEMO_TENANTS, SLO_CLASS, DemoOptions
from loadgen.procs import Child, ProcessGroup, free_port, script

REPO_ROOT = Path(__file__).resolve().parent.parent
SERVED_MODEL_NAME = "tiny-llama"
MAX_MODEL_LEN = 1024
STARTUP_TIMEOUT_S = 400.0
"""Bound of one replica's start-up (seen: 55 s alone with --enforce-eager, ~2x with two at once)."""

CPU_TINY_COEFFICIENTS = (8.0, 0.02, 0.001)
"""Time model (a ms, b ms/new token, c ms/context token) of the tiny model on one CPU core: a decode
step is ~4 ms at batch 1 and ~9 ms at batch 16 with vLLM's engine overhead; kept conservative
because the cores are shared with the agents, the router and the client."""

SLO_TTFT_MS = 2000.0
SLO_TPOT_MS = 200.0
"""The ``interactive`` class used with CPU replicas (generous: CPU steps are slower than a GPU's)."""

VLLM_ENV_VARS = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache per replica
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "VLLM_LOGGING_LEVEL": "INFO",
    "TOKENIZERS_PARALLELISM": "false",
}


def vllm_venv() -> Path:
    """The vLLM venv: ``$FAIRBATCH_VLLM_VENV``, else ``<repo>/.venv-vllm``."""
    return Path(os.environ.get("FAIRBATCH_VLLM_VENV") or REPO_ROOT / ".venv-vllm")


def tiny_model_dir() -> Path:
    """The tiny model folder: ``$FAIRBATCH_TINY_MODEL``, else ``<repo>/.cache/tiny-llama``."""
    return Path(os.environ.get("FAIRBATCH_TINY_MODEL") or REPO_ROOT / ".cache" / "tiny-llama")


def vllm_cache_root() -> Path:
    """``VLLM_CACHE_ROOT`` for the replicas: ``$FAIRBATCH_VLLM_CACHE``, else ``<repo>/.cache/vllm``."""
    return Path(os.environ.get("FAIRBATCH_VLLM_CACHE") or REPO_ROOT / ".cache" / "vllm")


def vllm_missing_reason() -> str | None:
    """Why real vLLM replicas cannot start here (None when they can): venv or model missing."""
    venv = vllm_venv()
    if not (venv / "bin" / "vllm").exists():
        shown = venv.name if venv == REPO_ROOT / ".venv-vllm" else str(venv)
        return f"{shown} not found; run `make vllm-env`"
    model = tiny_model_dir()
    if not (model / "config.json").exists():
        return f"tiny model {model} not found; run `make vllm-env`"
    return None


def omp_core(index: int, ncores: int | None = None) -> int:
    """Core for replica ``index``: ``index % nproc`` (workaround 3: the default binds all to core 0)."""
    n = ncores or os.cpu_count() or 1
    return index % n


def vllm_env(core: int, cache_root: Path | None = None) -> dict[str, str]:
    """Environment of one ``vllm serve`` (added to the parent's)."""
    env = dict(VLLM_ENV_VARS)
    env["VLLM_CACHE_ROOT"] = str(cache_root or vllm_cache_root())
    env["VLLM_CPU_OMP_THREADS_BIND"] = str(core)
    env["OMP_NUM_THREADS"] = "1"
    return env


VLLM_NICE = 10
"""Nice value of the CPU ``vllm serve`` processes. On a 2-core machine two CPU replicas' engine cores and
workers keep both cores busy, and at nice 0 they starved the code under test: the agents' main threads
got 0-24 ms of CPU per second of load while runnable (``/proc/PID/schedstat``), their event loops stalled
for up to 12 s (asyncio debug), and Reserve calls took up to 16 s. At nice 10 the agents, the router and
the test client run first; vLLM takes every cycle they leave. On a GPU node vLLM does not spin the host's
CPU like this, and the agent sidecar gets its own CPU request (deploy/helm)."""


def vllm_serve_argv(
    port: int,
    *,
    model_dir: Path | None = None,
    host: str = "127.0.0.1",
    served_model_name: str = SERVED_MODEL_NAME,
    max_model_len: int = MAX_MODEL_LEN,
    num_gpu_blocks_override: int | None = None,
    enforce_eager: bool = True,
    extra_args: Sequence[str] = (),
    nice: int = VLLM_NICE,
) -> list[str]:
    """argv of ``vllm serve`` for the tiny model (CPU, float32), run through ``nice -n nice`` when
    ``nice > 0`` and ``nice`` is installed (it execs: the process keeps its pid)."""
    prefix = ["nice", "-n", str(nice)] if nice > 0 and shutil.which("nice") else []
    argv = [
        *prefix, str(vllm_venv() / "bin" / "vllm"), "serve", str(model_dir or tiny_model_dir()),
        "--host", host, "--port", str(port),
        "--dtype", "float32",
        "--max-model-len", str(max_model_len),
        "--served-model-name", served_model_name,
        "--disable-uvicorn-access-log",
        "--enable-request-id-headers",  # X-Request-Id echoed in the engine's response headers
        "--enable-log-requests",  # the engine log names every request id (router, agent, engine share it)
    ]
    if enforce_eager:
        argv.append("--enforce-eager")
    if num_gpu_blocks_override is not None:
        argv += ["--num-gpu-blocks-override", str(num_gpu_blocks_override)]
    argv += list(extra_args)
    return argv


def wait_vllm_ready(group: ProcessGroup, child: Child, base_url: str, timeout_s: float = STARTUP_TIMEOUT_S) -> float:
    """Wait until ``/health`` and ``/v1/models`` answer 200; return the seconds waited.

    Raises:
        RuntimeError: the process exited or ``timeout_s`` passed (message holds its log tail).
    """
    t0 = time.monotonic()
    group.wait_http_ok(child, base_url.rstrip("/") + "/health", timeout_s)
    group.wait_http_ok(child, base_url.rstrip("/") + "/v1/models", max(5.0, timeout_s - (time.monotonic() - t0)))
    return time.monotonic() - t0


@dataclass(slots=True)
class VllmReplica:
    """One real replica: ``vllm serve`` + its agent, all on loopback.

    Attributes:
        replica_id: id in the router's YAML and the agent's snapshots.
        core: CPU core its OpenMP threads bind to.
        num_gpu_blocks_override: ``--num-gpu-blocks-override`` (None: vLLM sizes the KV cache).
        engine_port, agent_http_port, agent_grpc_port: loopback ports.
        engine, agent: the started children (None before start).
        startup_s: seconds until the engine answered.
    """

    replica_id: str
    core: int
    num_gpu_blocks_override: int | None = None
    engine_port: int = field(default_factory=free_port)
    agent_http_port: int = 0
    agent_grpc_port: int = 0
    engine: Child | None = None
    agent: Child | None = None
    startup_s: float = 0.0

    @property
    def engine_url(self) -> str:
        return f"http://127.0.0.1:{self.engine_port}"

    @property
    def agent_url(self) -> str:
        return f"http://127.0.0.1:{self.agent_http_port}"

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.agent_grpc_port}"


@dataclass(slots=True)
class VllmFleet:
    """A started fleet of real vLLM replicas, their agents and (optionally) a router."""

    group: ProcessGroup
    work_dir: Path
    config_path: Path
    api_keys: dict[str, str]
    replicas: list[VllmReplica]
    router: Child | None = None
    router_port: int = 0
    startup_s: float = 0.0

    @property
    def router_url(self) -> str:
        return f"http://127.0.0.1:{self.router_port}"

    def replica(self, replica_id: str) -> VllmReplica:
        return next(r for r in self.replicas if r.replica_id == replica_id)

    def stop(self) -> None:
        self.group.stop(grace_s=10.0)


def fleet_config(
    replicas: Sequence[VllmReplica],
    api_keys: dict[str, str],
    *,
    ttft_ms: float = SLO_TTFT_MS,
    tpot_ms: float = SLO_TPOT_MS,
    tenants: Sequence[tuple[str, int]] = (("acme", 3), ("beta", 1)),
    max_queue_ms: float = 20000.0,
    model: str = SERVED_MODEL_NAME,
) -> dict[str, Any]:
    """Router YAML (docs/architecture.md) for a vLLM fleet: class ``interactive``, model ``model``."""
    return {
        "model": model,
        "slo_classes": {
            "interactive": {
                "ttft_ms": ttft_ms, "tpot_ms": tpot_ms, "priority": 0, "sheddable": True, "max_queue_ms": max_queue_ms,
            },
        },
        "tenants": {name: {"weight": w, "slo_class": "interactive"} for name, w in tenants},
        "api_keys": {hashlib.sha256(k.encode()).hexdigest(): t for t, k in api_keys.items()},
        "replicas": [
            {"id": r.replica_id, "http_url": r.agent_url, "grpc_target": r.grpc_target} for r in replicas
        ],
        "queue": {"max_requests": 1024, "max_tokens": 4_000_000},
        "admission": {"bytes_per_token": 4.0, "reserve_timeout_ms": 500},
    }


CPU_METRICS_STALE_MS = 5000.0
"""``--metrics-stale-ms`` of the agents of a CPU fleet (the agent's own default: 1000 ms, its snapshot TTL).

Two vLLM replicas on 2 shared cores (engines at nice 10): with 32 requests on r1, the idle r0's API server
answered ``/metrics`` in 15 ms at the median, 1.8 s at p90 and 6.8 s at p99 (14 of 74 polls over 1 s;
5 ms unloaded), so its agent, which counts metrics older than the staleness as unhealthy (the scrape
timeout is the same figure), left placement 19 times in 60 s, once for about 15 s: the router then had
no replica for new work (CI: a 429 ``queue-timeout`` after 30 s). With 5000 ms the same run left it twice.
On a GPU node each replica's API server has its own cores; the agent's default stays. A dead engine is
still caught at once (connection refused is an error, not staleness); a hung one within this figure."""


def agent_argv(r: VllmReplica, config_path: Path, extra_args: Sequence[str] = (),
               coefficients: Sequence[float] = CPU_TINY_COEFFICIENTS) -> list[str]:
    """argv of the agent in front of ``r``'s engine; no ``--kv-capacity-tokens``: it reads
    ``vllm:cache_config_info`` (num_gpu_blocks * block_size). ``coefficients``: its time model's
    prior (a ms, b ms/new token, c ms/context token). ``--metrics-stale-ms``: :data:`CPU_METRICS_STALE_MS`
    (``extra_args`` may give another)."""
    a, b, c = coefficients
    return script("fairbatch-agent") + [
        "serve", "--engine-url", r.engine_url, "--host", "127.0.0.1",
        "--http-port", str(r.agent_http_port), "--grpc-port", str(r.agent_grpc_port),
        "--replica-id", r.replica_id, "--coefficients", f"{a},{b},{c}",
        "--config", str(config_path), "--default-slo-class", "interactive",
        "--metrics-stale-ms", f"{CPU_METRICS_STALE_MS:g}", *extra_args,
    ]


def start_vllm_fleet(
    work_dir: Path,
    blocks: Sequence[int | None] = (None, None),
    *,
    api_keys: dict[str, str] | None = None,
    with_router: bool = True,
    config_overrides: dict[str, Any] | None = None,
    agent_args: Sequence[str] = (),
    router_args: Sequence[str] = (),
    startup_timeout_s: float = STARTUP_TIMEOUT_S,
    log: Any = None,
    model_dir: Path | None = None,
    served_model_name: str = SERVED_MODEL_NAME,
    max_model_len: int = MAX_MODEL_LEN,
    engine_args: Sequence[str] = (),
    engine_env: Any = None,
    per_replica_agent_args: Any = None,
    coefficients: Sequence[float] = CPU_TINY_COEFFICIENTS,
) -> VllmFleet:
    """Start ``len(blocks)`` vLLM replicas (``blocks[i]``: ``--num-gpu-blocks-override`` or None),
    one agent each and the router; wait for every /health. The engines start at once (each binds
    its own core) and are waited for together.

    Args:
        work_dir: folder for the YAML and ``logs/<child>.log``.
        blocks: one entry per replica.
        api_keys: tenant -> clear key (default: random keys for acme and beta).
        with_router: start the router too.
        config_overrides: top-level keys replacing those of :func:`fleet_config`.
        agent_args, router_args: extra CLI flags.
        startup_timeout_s: bound of the engines' start-up.
        log: callable(str) for progress lines (default: print to stderr).
        model_dir, served_model_name, max_model_len: the engines' model (default: the tiny model).
        engine_args: extra ``vllm serve`` flags of every engine (e.g. ``--scheduler-cls ...``).
        engine_env: callable(VllmReplica) -> dict of extra environment of that engine (None: none).
        per_replica_agent_args: callable(VllmReplica) -> extra agent flags of that replica (None: none).
        coefficients: the agents' time-model prior (a, b, c in ms).

    Raises:
        RuntimeError: vLLM env missing, or a child did not become healthy (all children stopped).
    """
    reason = vllm_missing_reason()
    if reason:
        raise RuntimeError(f"cannot start real vLLM replicas: {reason}")
    say = log or (lambda s: print(s, file=sys.stderr, flush=True))
    work_dir.mkdir(parents=True, exist_ok=True)
    keys = api_keys or {name: f"fb-{name}-{secrets.token_urlsafe(12)}" for name in ("acme", "beta")}
    replicas = [VllmReplica(f"r{i}", omp_core(i), n) for i, n in enumerate(blocks)]
    config_path = work_dir / "fairbatch.yaml"
    group = ProcessGroup(work_dir / "logs")
    fleet = VllmFleet(group, work_dir, config_path, keys, replicas)
    cache_root = vllm_cache_root()
    cache_root.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    try:
        for r in replicas:
            r.engine = group.start(
                f"vllm-{r.replica_id}",
                vllm_serve_argv(r.engine_port, model_dir=model_dir, served_model_name=served_model_name,
                                max_model_len=max_model_len, num_gpu_blocks_override=r.num_gpu_blocks_override,
                                extra_args=engine_args),
                env={**vllm_env(r.core, cache_root), **(engine_env(r) if engine_env else {})},
            )
        say(f"starting {len(replicas)} vLLM replica(s) ({served_model_name}, CPU, --enforce-eager); this takes 1-2 min")
        for r in replicas:
            assert r.engine is not None
            wait_vllm_ready(group, r.engine, r.engine_url, max(10.0, startup_timeout_s - (time.monotonic() - t0)))
            r.startup_s = time.monotonic() - t0
            say(f"vLLM {r.replica_id} ready on {r.engine_url} after {r.startup_s:.0f} s")
        # Agent and router ports are picked only now: vLLM's start-up opens ports of its own
        # (ZMQ, torch.distributed), and a port picked earlier may be taken by then.
        for r in replicas:
            r.agent_http_port, r.agent_grpc_port = free_port(), free_port()
        cfg = fleet_config(replicas, keys, model=served_model_name)
        cfg.update(config_overrides or {})
        config_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        for r in replicas:
            extra = [*agent_args, *(per_replica_agent_args(r) if per_replica_agent_args else ())]
            r.agent = group.start(f"agent-{r.replica_id}", agent_argv(r, config_path, extra, coefficients))
        for r in replicas:
            assert r.agent is not None
            group.wait_http_ok(r.agent, r.agent_url + "/health", 60.0)
        if with_router:
            fleet.router_port = free_port()
            fleet.router = group.start(
                "router", script("fairbatch-router") + [
                    "--config", str(config_path), "--host", "127.0.0.1", "--port", str(fleet.router_port),
                    *router_args,
                ],
            )
            group.wait_http_ok(fleet.router, fleet.router_url + "/health", 60.0)
    except BaseException:
        group.stop(grace_s=10.0)
        raise
    fleet.startup_s = time.monotonic() - t0
    say(f"fleet up in {fleet.startup_s:.0f} s: {len(replicas)} x (vLLM + agent)"
        + (f", router on {fleet.router_url}" if with_router else ""))
    return fleet


# ---- small HTTP helpers (stdlib; used by tests and the demo) ---------------------------------

def http_get_text(url: str, timeout_s: float = 30.0) -> str:
    """GET ``url`` and return the body (raises urllib errors)."""
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        return resp.read().decode("utf-8", errors="replace")


def parse_prometheus(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Tiny Prometheus text parser: sample name -> [(labels, value)] (no escapes inside labels needed)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    return out


def metric_value(samples: dict[str, list[tuple[dict[str, str], float]]], name: str, **labels: str) -> float | None:
    """Sum of the samples of ``name`` whose labels include ``labels`` (None when there is none)."""
    vals = [v for lab, v in samples.get(name, []) if all(lab.get(k) == w for k, w in labels.items())]
    return sum(vals) if vals else None


# ---- demo --------------------------------------------------------------------------------------

DEMO_MAX_PROMPT_TOKENS = 600
DEMO_MAX_OUTPUT_TOKENS = 200
"""Trace lengths are clipped so prompt + output fit ``--max-model-len 1024`` of the tiny model."""


def run_vllm_demo(opts: Any, console: Any = None) -> dict[str, Any]:
    """``fairbatch-loadgen demo --engine vllm``: the demo of loadgen/demo.py with real vLLM replicas.

    Takes the same :class:`loadgen.demo_setup.DemoOptions` (``replicas``, ``trace``, ``duration_s``,
    ``start_s``, ``rate_scale``, ``out``, ``keep_logs``, ``seed``, ``max_wall_s``,
    ``request_timeout_s``, ``progress``). ``time_scale`` is forced to 1 (a real engine runs in wall
    time); ``profile`` is ignored (the agents use :data:`CPU_TINY_COEFFICIENTS` and the engine's KV
    capacity); the SLO of class ``interactive`` is ``ttft_ms``/``tpot_ms`` when the caller changed
    them from the simulated demo's defaults, else :data:`SLO_TTFT_MS`/:data:`SLO_TPOT_MS`. Prompt
    and output lengths are clipped to :data:`DEMO_MAX_PROMPT_TOKENS`/:data:`DEMO_MAX_OUTPUT_TOKENS`.
    Suggested CPU load: ``--duration-s 60 --rate-scale 0.5`` on 2 replicas.

    Raises:
        RuntimeError: vLLM env missing or a child did not start (log tail in the message).
    """
    from loadgen.replay import ReplayConfig, TenantSpec
    from loadgen.report import default_console, replay_to_report
    from loadgen.stats import Slo
    from loadgen.traces import TraceRequest, load_trace, resolve_trace, select

    console = console or default_console()
    defaults = DemoOptions()
    ttft = opts.ttft_ms if opts.ttft_ms != defaults.ttft_ms else SLO_TTFT_MS
    tpot = opts.tpot_ms if opts.tpot_ms != defaults.tpot_ms else SLO_TPOT_MS
    if opts.replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {opts.replicas}")
    window = select(load_trace(resolve_trace(opts.trace)), opts.duration_s, opts.rate_scale, opts.start_s)
    reqs = [
        TraceRequest(
            r.arrival_ms, min(r.prompt_tokens, DEMO_MAX_PROMPT_TOKENS), min(r.output_tokens, DEMO_MAX_OUTPUT_TOKENS)
        )
        for r in window
    ]
    if not reqs:
        raise ValueError(f"no requests in {opts.duration_s} s of {opts.trace} from {opts.start_s} s")
    tmp = Path(tempfile.mkdtemp(prefix="fairbatch-vllm-demo-"))
    work = Path(opts.keep_logs) if opts.keep_logs else tmp
    api_keys = {name: f"fb-{name}-{secrets.token_urlsafe(18)}" for name, _ in DEMO_TENANTS}
    fleet: VllmFleet | None = None
    try:
        slo_class = {"ttft_ms": ttft, "tpot_ms": tpot, "priority": 0, "sheddable": True,
                     "max_queue_ms": max(20000.0, 4 * ttft)}
        tenants = {n: {"weight": w, "slo_class": SLO_CLASS} for n, w in DEMO_TENANTS}
        fleet = start_vllm_fleet(
            work, [None] * opts.replicas, api_keys=api_keys,
            config_overrides={"slo_classes": {SLO_CLASS: slo_class}, "tenants": tenants},
            log=lambda line: console.print(line, markup=False, highlight=False),
        )
        console.print(
            f"replaying {len(reqs)} requests ({opts.duration_s:g} s of {opts.trace} at rate x{opts.rate_scale:g}, "
            f"prompts <= {DEMO_MAX_PROMPT_TOKENS}, outputs <= {DEMO_MAX_OUTPUT_TOKENS} tokens) "
            f"through {fleet.router_url}",
            markup=False, highlight=False,
        )
        cfg = ReplayConfig(
            target=fleet.router_url,
            tenants=[TenantSpec(name, float(w), api_keys[name]) for name, w in DEMO_TENANTS],
            model=SERVED_MODEL_NAME,
            seed=opts.seed,
            time_scale=1.0,
            request_timeout_s=opts.request_timeout_s,
            max_wall_s=opts.max_wall_s,
            progress=opts.progress,
        )
        meta = {
            "trace": opts.trace,
            "rate_scale": opts.rate_scale,
            "duration_s": opts.duration_s,
            "start_s": opts.start_s,
            "time_scale": 1.0,
            "target": "router",
            "endpoint": "completions",
            "engine": "vllm",
            "fleet": {
                "replicas": opts.replicas, "engine": "vllm-cpu 0.32.0", "model": "tiny-llama (random weights)",
                "startup_s": round(fleet.startup_s, 1), "coefficients_ms": list(CPU_TINY_COEFFICIENTS),
                "clip": {"prompt_tokens": DEMO_MAX_PROMPT_TOKENS, "output_tokens": DEMO_MAX_OUTPUT_TOKENS},
            },
            "tenants": {name: w for name, w in DEMO_TENANTS},
            "slo_source": "demo",
        }
        doc = replay_to_report(reqs, cfg, {name: Slo(ttft, tpot) for name, _ in DEMO_TENANTS}, meta, opts.out, console)
        for c in fleet.group.children:
            if c.popen.poll() is not None:
                console.print(f"{c.name} exited during the run (code {c.popen.returncode}); log tail:", markup=False)
                console.print(c.log_tail(), markup=False, highlight=False)
        if opts.keep_logs:
            console.print(f"logs and config kept in {work}", markup=False)
        return doc
    finally:
        if fleet is not None:
            fleet.stop()
        shutil.rmtree(tmp, ignore_errors=True)
