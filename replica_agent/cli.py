"""``fairbatch-agent``: the replica agent sidecar (docs/architecture.md "Agent").

``fairbatch-agent calibrate LOG`` fits the batch-time model a, b, c from a per-step log
(replica_agent/calibrate.py) and prints R², max and mean relative error.

``fairbatch-agent serve ...`` runs, in one asyncio process, the HTTP reverse proxy in front of the
engine (aiohttp), the AdmissionService gRPC server (grpc.aio), the engine /metrics scraper and the
lease-expiry task. SIGTERM/SIGINT drain it (replica_agent/drainer.py: no new work, the requests in
flight finish for up to ``--drain-grace-s``, the rest are handed over to the routers' migration),
then it exits 0; a second signal stops it at once.

``fairbatch-agent drain [--url URL] [--wait]`` asks a running agent to drain (``POST /drain`` with
``FAIRBATCH_AGENT_TOKEN``): the Helm chart's preStop hook.

Secrets come from the environment only: ``FAIRBATCH_AGENT_TOKEN`` (the routers' token) and
``FAIRBATCH_ENGINE_API_KEY`` (sent to the engine), or from the files that ``FAIRBATCH_AGENT_TOKEN_FILE`` /
``FAIRBATCH_ENGINE_API_KEY_FILE`` name (fairbatch_common/secrets.py; the Helm chart mounts its Secrets as
files); an unreadable file exits with status 2, in ``serve`` and in ``drain``.

Plugin mode (``--plugin-export unix:PATH``, replica_agent/plugin_mode.py): the agent also binds the
UNIX datagram socket PATH, which the vLLM scheduler plugin (``FAIRBATCH_PLUGIN_EXPORT=unix:PATH``)
feeds every step, and computes PAB from the engine state those records carry; their step times
teach the online time model (replica_agent/policy/calibration.py; proxy mode learns from token gaps). With ``--no-proxy`` it does not relay requests (the HTTP port
serves only /metrics and /health): the router's replica entry then has ``http_url`` = vLLM itself
and ``grpc_target`` = this agent.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import os
import signal
import sys
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

import aiohttp
from aiohttp import web

from replica_agent.admission_server import expire_leases_loop, start_grpc_server
from fairbatch_common.aio import watch_file
from replica_agent.calibrate import calibrate, format_fit
from replica_agent.agent import Agent, AgentConfig
from fairbatch_common.clock import Clock
from replica_agent.engine_metrics import MetricsScraper
from replica_agent.plugin_mode import PluginExportReader, parse_export_target
from replica_agent.policy.pab import SloClass
from replica_agent.policy.calibration import CalibratorConfig
from replica_agent.policy.time_model import TimeModel
from replica_agent.policy.profiles import DEFAULT_PROFILE, DEFAULT_VARIANT, load_profile, vllm_serve_batch_defaults
from replica_agent.proxy import Proxy, ProxyConfig, make_session
from fairbatch_common.http_guard import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_MAX_BODY_BYTES,
    make_runner,
)
from fairbatch_common.runtime import hold_grpc_aio, run, setup_logging
from fairbatch_common.secrets import SecretFileError, env_secret
from fairbatch_common.telemetry import make_tracer
from fairbatch_common.config_schema import ConfigError, load_agent_section

log = logging.getLogger("replica_agent")

AGENT_TOKEN_ENV = "FAIRBATCH_AGENT_TOKEN"  # shared secret with the routers (HTTP header and gRPC metadata)
ENGINE_API_KEY_ENV = "FAIRBATCH_ENGINE_API_KEY"  # sent to the engine as a bearer key (vLLM --api-key)


def parse_slo_class(text: str) -> SloClass:
    """``NAME:TTFT_MS:TPOT_MS`` -> SloClass.

    Raises:
        argparse.ArgumentTypeError: on a malformed value.
    """
    parts = text.split(":")
    if len(parts) != 3 or not parts[0]:
        raise argparse.ArgumentTypeError(f"expected NAME:TTFT_MS:TPOT_MS, got {text!r}")
    try:
        return SloClass(parts[0], float(parts[1]), float(parts[2]))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"bad SLO class {text!r}: {e}") from e


def parse_coefficients(text: str) -> TimeModel:
    """``A,B,C`` (ms, ms/token, ms/token) -> TimeModel.

    Raises:
        argparse.ArgumentTypeError: on a malformed value.
    """
    try:
        a, b, c = (float(x) for x in text.split(","))
        return TimeModel(a, b, c)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected A,B,C with a >= 0, b > 0, c >= 0; got {text!r}: {e}") from e


def load_stall_timeouts(path: Path) -> dict[str, float]:
    """``slo_classes.<name>.stall_timeout_ms`` (simulated ms) of a router YAML, for the classes that set one.

    Raises:
        ConfigError: as :func:`load_slo_classes`.
    """
    section = load_agent_section(path)
    return {name: c.stall_timeout_ms for name, c in section.slo_classes.items() if c.stall_timeout_ms is not None}


def load_slo_classes(path: Path) -> list[SloClass]:
    """The ``slo_classes`` of a router YAML, validated by the router's own models
    (:class:`~fairbatch_common.config_schema.AgentSection`); the agent plans with ttft_ms and tpot_ms.

    Raises:
        ConfigError: unreadable file, YAML syntax error, no ``slo_classes``, or an invalid class; the
            message is ``<file>:<line>: <field.path>: <reason>``, as the router's.
    """
    return [SloClass(name, c.ttft_ms, c.tpot_ms) for name, c in load_agent_section(path).slo_classes.items()]


def reload_slo_classes(agent: Agent, proxy: Proxy, path: Path, flag_classes: Sequence[SloClass]) -> bool:
    """Re-read ``slo_classes`` from ``path`` and apply them (``--slo-class`` flags still override the
    file's class of the same name); an invalid file is refused, logged and counted, and the running
    classes kept (``fairbatch_agent_config_last_reload_success`` 1 or 0, and its timestamp). Returns True
    when applied."""
    try:
        by_name = {c.name: c for c in load_slo_classes(path)}
        by_name.update({c.name: c for c in flag_classes})
        stalls = load_stall_timeouts(path)
        agent.set_slo_classes(tuple(by_name.values()))
    except (ConfigError, ValueError) as exc:
        agent.metrics.observe_reload(False)
        log.error("slo_classes reload refused, keeping the running classes: %s", exc)
        return False
    proxy.set_class_stall_ms(tuple(stalls.items()))
    agent.metrics.observe_reload(True)
    log.info("slo_classes reloaded from %s: %s", path,
             ", ".join(f"{c.name}({c.ttft_ms:g}/{c.tpot_ms:g} ms)" for c in agent.config.slo_classes))  # fmt: skip
    return True


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser with the ``serve`` subcommand."""
    p = argparse.ArgumentParser(
        prog="fairbatch-agent",
        description="fairbatch replica agent: proxies one vLLM replica, tracks every request against its "
        "latency envelope and serves the Prefill Admission Budget (PAB) per SLO class over gRPC.",
    )
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser(
        "serve",
        help="run the proxy + gRPC admission server",
        description="Run the HTTP proxy in front of the engine and the AdmissionService gRPC server. "
        "All times (SLOs, intervals, TTLs) are simulated ms: one lasts --time-scale wall ms.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    s.add_argument("--engine-url", required=True, help="engine base URL, e.g. http://127.0.0.1:8000")
    s.add_argument("--host", default="127.0.0.1",
                   help=f"address to listen on (HTTP and gRPC); any but a loopback address needs {AGENT_TOKEN_ENV} "
                        f"(or {AGENT_TOKEN_ENV}_FILE, a file holding it), the token the routers send (else the agent refuses to start)")
    s.add_argument("--http-port", type=int, default=8101, help="HTTP proxy port")
    s.add_argument("--grpc-port", type=int, default=9101, help="gRPC AdmissionService port")
    s.add_argument("--replica-id", default="r0", help="replica id reported in budget snapshots")
    s.add_argument("--profile", default=DEFAULT_PROFILE, help="GPU profile for a, b, c and the fallback KV capacity")
    s.add_argument("--variant", default=DEFAULT_VARIANT, help="fit variant of the profile")
    s.add_argument("--coefficients", type=parse_coefficients, default=None, metavar="A,B,C",
                   help="time-model coefficients in ms (overrides the profile's)")
    s.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="the engine's vLLM --max-num-batched-tokens (default: vllm serve's default on the "
                        "profile's GPU), for the predicted end of each in-flight prefill")
    s.add_argument("--max-num-seqs", type=int, default=None,
                   help="the engine's vLLM --max-num-seqs (default: vllm serve's default on the profile's GPU; "
                        "0 = no cap): PAB counts the wait for a free sequence slot")
    s.add_argument("--kv-capacity-tokens", type=int, default=None,
                   help="KV capacity in tokens (default: engine's cache_config_info, else the profile's)")
    s.add_argument("--config", type=Path, default=None,
                   help="router YAML; only its slo_classes are read (reloaded on SIGHUP and when the file changes)")
    s.add_argument("--reload-poll-s", type=float, default=2.0,
                   help="wall seconds between checks of --config for changes (default 2; 0 = only on SIGHUP)")
    s.add_argument("--slo-class", type=parse_slo_class, action="append", default=[], metavar="NAME:TTFT_MS:TPOT_MS",
                   help="an SLO class (repeatable); default default:1000:100 when neither this nor --config is given")
    s.add_argument("--default-slo-class", default=None,
                   help="class of requests without x-fairbatch-slo-class (default: the first class)")
    s.add_argument("--margin-frac", type=float, default=0.1,
                   help="PAB horizon margin as a share of the TTFT: H = ttft - min(margin * ttft, cap * tpot)")
    s.add_argument("--margin-cap-tpots", type=float, default=1.0,
                   help="the horizon margin is at most this many TPOTs of the class (inf = the share alone, as "
                        "releases before 2026-12-07)")
    s.add_argument("--push-interval-ms", type=float, default=100.0, help="WatchBudget pushes at least this often")
    s.add_argument("--min-push-interval-ms", type=float, default=5.0,
                   help="at most one change-triggered snapshot per this many ms (changes in between coalesce; 0 = "
                        "one per change)")
    s.add_argument("--ttl-ms", type=float, default=1000.0, help="snapshot TTL given to routers")
    s.add_argument("--lease-ttl-ms", type=float, default=5000.0, help="a lease lapses if its request never arrives")
    s.add_argument("--metrics-interval-ms", type=float, default=50.0, help="engine /metrics scrape period")
    s.add_argument("--metrics-stale-ms", type=float, default=None,
                   help="engine metrics older than this make the agent unhealthy; also the scrape timeout "
                        "(default: max(5 x --metrics-interval-ms, --ttl-ms))")
    s.add_argument("--time-scale", type=float, default=1.0, help="wall ms per simulated ms")
    s.add_argument("--otlp-endpoint", default=None,
                   help="OTLP collector for spans (before OTEL_EXPORTER_OTLP_ENDPOINT; protocol from "
                        "OTEL_EXPORTER_OTLP_PROTOCOL: grpc or http/protobuf; off when neither is set: a no-op "
                        "tracer, trace context passed on)")
    s.add_argument("--otlp-sample-ratio", type=float, default=1.0,
                   help="share of root traces recorded when exporting (children follow their parent), 0..1")
    s.add_argument("--max-connections", type=int, default=1024, help="bound of pooled upstream connections")
    s.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help="largest request body in bytes (default 4 MiB); a larger Content-Length is refused with 413")
    s.add_argument("--body-timeout-s", type=float, default=DEFAULT_BODY_TIMEOUT_S,
                   help="wall seconds a request body may take to arrive (default 10), else 408")
    s.add_argument("--header-timeout-s", type=float, default=DEFAULT_HEADER_TIMEOUT_S,
                   help="wall seconds a client has to send a request's head (from the connection's start, or the "
                        "first byte of a next request on a kept-alive connection; default 10), else 408 and the "
                        "connection closed")
    s.add_argument("--stall-timeout-s", type=float, default=None,
                   help="wall seconds without a byte from the engine before a request is given up as stalled "
                        "(default: per SLO class, max(1 s, 4 x ttft + 20 x tpot) in simulated time)")
    s.add_argument("--slo-in-body", action="store_true",
                   help="also pass each request's SLO to vLLM as vllm_xargs {fairbatch_ttft_ms, fairbatch_tpot_ms} "
                        "(for the FairBatching scheduler plugin; re-encodes the request body)")
    s.add_argument("--plugin-export", default=None, metavar="unix:PATH",
                   help="plugin mode: bind this UNIX datagram socket and compute PAB from the per-step engine "
                        "state the vLLM scheduler plugin exports there (FAIRBATCH_PLUGIN_EXPORT=unix:PATH)")
    s.add_argument("--plugin-stale-ms", type=float, default=500.0,
                   help="plugin mode: without a record for this long while the engine is busy, fall back to "
                        "proxy-mode state (status_detail and fairbatch_agent_plugin_export_stale say so)")
    s.add_argument("--no-proxy", action="store_true",
                   help="plugin mode only: do not relay HTTP (the router sends requests to vLLM directly; the HTTP "
                        "port serves /metrics and /health only)")
    s.add_argument("--time-model-forgetting", type=float, default=0.995,
                   help="online time model: weight of a step seen k steps ago is this^k (memory 1/(1-x) steps)")
    s.add_argument("--time-model-margin-quantile", type=float, default=0.97,
                   help="plan with the point model x this quantile of measured/predicted step time (always on)")
    s.add_argument("--time-model-max-margin", type=float, default=2.0, help="cap of the planning margin")
    s.add_argument("--time-model-initial-margin", type=float, default=1.0,
                   help="planning margin until --time-model-min-samples steps are seen")
    s.add_argument("--time-model-min-samples", type=int, default=16, help="steps before the margin is learned")
    s.add_argument("--time-model-refit-every", type=int, default=4,
                   help="steps between two solves of the time model (counted in observations' weight: proxy mode "
                        "observes a step once per decoding stream, each with weight 1/streams; a solve costs "
                        "~50-90 us, an observation ~3 us; the fleet simulation refits every 4 steps too)")
    s.add_argument("--time-model-window", type=int, default=256, help="steps of relative errors the margin is taken over")
    s.add_argument("--time-model-prior-weight", type=float, default=1.0,
                   help="the profile's coefficients count as this many steps in the online fit (ridge prior)")
    s.add_argument("--no-proxy-step-estimates", action="store_true",
                   help="proxy mode: do not learn step times from relayed token gaps (keep the profile's model)")
    s.add_argument("--drain-grace-s", type=float, default=30.0,
                   help="on SIGTERM or POST /drain: wall seconds the requests in flight may run on before they are "
                        "handed over to another replica (routers continue the streams; default 30)")
    s.add_argument("--drain-handover-s", type=float, default=5.0,
                   help="wall seconds after the hand-over before the drain ends anyway (default 5)")
    s.add_argument("--log-level", default="INFO")
    d = sub.add_parser(
        "drain",
        help="ask a running agent to drain (POST /drain; the Helm chart's preStop hook)",
        description="POST /drain to an agent (the token from FAIRBATCH_AGENT_TOKEN or the file "
        "FAIRBATCH_AGENT_TOKEN_FILE names). The agent stops taking new "
        "work, lets its requests in flight run for its --drain-grace-s, hands the rest over to the routers, "
        "then exits 0. With --wait this command returns when the drain is done. Exit status 0 when the agent "
        "accepted (or was already gone with --wait), 2 when the token file cannot be read, 1 otherwise.",
    )
    d.add_argument("--url", default="http://127.0.0.1:8001", help="the agent's HTTP address")
    d.add_argument("--wait", action="store_true", help="return only when the drain is done")
    d.add_argument("--timeout-s", type=float, default=600.0, help="give up waiting after this many wall seconds")
    d.add_argument("--log-level", default="WARNING")
    c = sub.add_parser(
        "calibrate",
        help="fit a, b, c of the batch-time model from a per-step log",
        description="Least-squares fit of batch_ms = a + b*new_tokens + c*context_tokens (FairBatching, arXiv 2510.14392) from a "
        "per-step log: JSON lines or CSV with new_tokens, context_tokens, measured_ms (the simulator writes "
        "one with --step-log). Prints the coefficients, R^2 and the max and mean relative error.",
    )
    c.add_argument("log", type=Path, help="step log (JSONL or CSV)")
    c.add_argument("--log-level", default="WARNING")
    return p



def _step_tokens(gpu: str, flag: int | None) -> int:
    """The engine's token budget per step: the flag, else ``vllm serve``'s default on ``gpu``
    (replica_agent/policy/profiles.py), else 2048 (vLLM's smallest default) for a GPU it does not know."""
    if flag is not None:
        if flag < 1:
            raise ValueError(f"--max-num-batched-tokens must be >= 1, got {flag}")
        return flag
    try:
        return vllm_serve_batch_defaults(gpu).max_num_batched_tokens
    except KeyError:
        return 2048


def _seq_cap(gpu: str, flag: int | None) -> int | None:
    """The engine's cap on running requests: the flag (0 = none), else ``vllm serve``'s default on
    ``gpu``, else None (a GPU it does not know: no cap assumed)."""
    if flag is not None:
        if flag < 0:
            raise ValueError(f"--max-num-seqs must be >= 0, got {flag}")
        return flag or None
    try:
        return vllm_serve_batch_defaults(gpu).max_num_seqs
    except KeyError:
        return None


def config_from_args(args: argparse.Namespace) -> AgentConfig:
    """AgentConfig from parsed ``serve`` arguments.

    Raises:
        ValueError, KeyError: on an unknown profile, unreadable config or inconsistent classes.
    """
    profile = load_profile(args.profile, args.variant)
    classes: list[SloClass] = []
    if args.config is not None:
        classes.extend(load_slo_classes(args.config))
    by_name = {c.name: c for c in classes}
    for c in args.slo_class:  # flags override the file's class of the same name
        by_name[c.name] = c
    classes = list(by_name.values()) or [SloClass("default", 1000.0, 100.0)]
    default = args.default_slo_class or classes[0].name
    plugin = args.plugin_export is not None
    if plugin:
        parse_export_target(args.plugin_export)
        if args.time_scale != 1.0:
            raise ValueError("--plugin-export needs --time-scale 1 (the plugin's records are in wall-clock ms)")
    if args.no_proxy and not plugin:
        raise ValueError("--no-proxy needs --plugin-export (nothing else would track the engine's requests)")
    return AgentConfig(
        replica_id=args.replica_id,
        time_model=args.coefficients or profile.time_model,
        slo_classes=tuple(classes),
        default_slo_class=default,
        margin_frac=args.margin_frac,
        margin_cap_tpots=args.margin_cap_tpots,
        kv_capacity_tokens=args.kv_capacity_tokens,
        profile_kv_capacity_tokens=profile.kv_capacity_tokens,
        push_interval_ms=args.push_interval_ms,
        min_push_interval_ms=args.min_push_interval_ms,
        ttl_ms=args.ttl_ms,
        lease_ttl_ms=args.lease_ttl_ms,
        metrics_interval_ms=args.metrics_interval_ms,
        metrics_stale_ms=args.metrics_stale_ms,
        plugin_mode=plugin,
        plugin_stale_ms=args.plugin_stale_ms,
        proxy_tracking=not args.no_proxy,
        max_num_batched_tokens=_step_tokens(profile.gpu, args.max_num_batched_tokens),
        max_num_seqs=_seq_cap(profile.gpu, args.max_num_seqs),
        calibration=CalibratorConfig(
            forgetting=args.time_model_forgetting, prior_weight=args.time_model_prior_weight,
            margin_quantile=args.time_model_margin_quantile, window=args.time_model_window,
            min_samples=args.time_model_min_samples, initial_margin=args.time_model_initial_margin,
            max_margin=args.time_model_max_margin, refit_every=args.time_model_refit_every),
        proxy_step_estimates=not args.no_proxy_step_estimates,
    )


def is_loopback_host(host: str) -> bool:
    """True when listening on ``host`` reaches this machine only: ``localhost`` or an address of
    127.0.0.0/8 or ``::1``. Any other name, the empty string and ``0.0.0.0`` / ``::`` (every interface)
    are not loopback."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:
        return False


def token_refusal(host: str, environ: Mapping[str, str]) -> str | None:
    """The one-line error for an agent asked to listen on a non-loopback ``host`` without a router
    token in ``environ`` (``FAIRBATCH_AGENT_TOKEN``, or the file ``FAIRBATCH_AGENT_TOKEN_FILE`` names),
    else None. Without a token the agent serves any caller, including a forged ``x-fairbatch-admit``
    that skips the router's admission and quotas. An unreadable token file raises
    :class:`~fairbatch_common.secrets.SecretFileError` (on loopback too: a file named is meant to be read)."""
    if env_secret(environ, AGENT_TOKEN_ENV) or is_loopback_host(host):
        return None
    return (f"fairbatch-agent: refusing to serve on --host {host or '(every interface)'} without a router token: "
            f"set {AGENT_TOKEN_ENV} (or {AGENT_TOKEN_ENV}_FILE), the token the routers send, "
            "or listen on --host 127.0.0.1")


async def _fetch_max_model_len(
    agent: Agent, session: aiohttp.ClientSession, engine_url: str, api_key: str | None = None
) -> None:
    """Read ``max_model_len`` from the engine's /v1/models (retries every second until it answers)."""
    url = engine_url.rstrip("/") + "/v1/models"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    while True:
        try:
            async with session.get(url, headers=headers, timeout=aiohttp.ClientTimeout(total=2.0)) as resp:
                if resp.status == 200:
                    data = await resp.json()
                    models = data.get("data") or []
                    n = int(models[0].get("max_model_len") or 0) if models else 0
                    agent.max_prompt_tokens = n
                    return
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError, AttributeError, TypeError):
            pass
        await asyncio.sleep(1.0)


async def serve(args: argparse.Namespace) -> None:
    """Run the agent until SIGTERM/SIGINT."""
    clock = Clock(args.time_scale)
    agent = Agent(config_from_args(args), clock, lease_id_prefix=uuid.uuid4().hex[:12])
    proxy_cfg = ProxyConfig(engine_url=args.engine_url, max_connections=args.max_connections,
                            slo_in_body=args.slo_in_body, max_body_bytes=args.max_body_bytes,
                            body_timeout_s=args.body_timeout_s, stall_timeout_s=args.stall_timeout_s,
                            class_stall_ms=tuple(load_stall_timeouts(args.config).items()) if args.config else (),
                            agent_token=env_secret(os.environ, AGENT_TOKEN_ENV),
                            engine_api_key=env_secret(os.environ, ENGINE_API_KEY_ENV),
                            drain_grace_s=args.drain_grace_s, drain_handover_s=args.drain_handover_s)
    session = make_session(proxy_cfg)
    tracer = make_tracer("fairbatch-agent", args.otlp_endpoint, args.otlp_sample_ratio)
    proxy = Proxy(agent, proxy_cfg, session, tracer)
    if args.no_proxy:  # the router talks to vLLM directly; keep the agent's own endpoints
        app = web.Application()
        app.router.add_get("/health", proxy.health)
        app.router.add_get("/metrics", proxy.metrics)
        proxy.add_drain_routes(app)
    else:
        app = proxy.app()
    # handler cancellation: a client that leaves cancels its handler, which closes the upstream request,
    # so the engine aborts it at once (in prefill too)
    runner = make_runner(app, header_timeout_s=args.header_timeout_s)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.http_port)
    await site.start()
    reader = None
    if args.plugin_export:
        reader = PluginExportReader(parse_export_target(args.plugin_export), agent.on_plugin_datagram)
        await reader.start()
    grpc_server, grpc_port = await start_grpc_server(agent, args.host, args.grpc_port, proxy_cfg.agent_token)
    scrape_timeout_s = max(0.5, clock.to_wall_s(agent.config.stale_after_ms))
    scraper = MetricsScraper(
        proxy.pool, args.engine_url, clock, agent.config.metrics_interval_ms, agent.on_engine_metrics,
        timeout_s=scrape_timeout_s,
    )
    tasks = [
        asyncio.create_task(scraper.run(), name="metrics-scraper"),
        asyncio.create_task(expire_leases_loop(agent), name="lease-expiry"),
        asyncio.create_task(_fetch_max_model_len(agent, session, args.engine_url, proxy_cfg.engine_api_key), name="max-model-len"),
    ]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    drainer = proxy.drainer

    def on_stop_signal() -> None:  # the first drains, a second stops at once
        if not drainer.start():
            stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_stop_signal)
    if args.config is not None:
        hup = asyncio.Event()
        loop.add_signal_handler(signal.SIGHUP, hup.set)
        tasks.append(asyncio.create_task(watch_file(
            args.config, args.reload_poll_s, hup, lambda _: reload_slo_classes(agent, proxy, args.config, args.slo_class),
        ), name="config-watch"))
    log.info(
        "agent %s: http %s:%d%s grpc %s:%d engine %s plugin export %s classes %s",
        agent.config.replica_id, args.host, args.http_port, " (no proxy)" if args.no_proxy else "",
        args.host, grpc_port, args.engine_url, args.plugin_export or "-",
        ", ".join(f"{c.name}({c.ttft_ms:g}/{c.tpot_ms:g} ms)" for c in agent.config.slo_classes),
    )
    try:
        waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(drainer.done.wait())]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        if drainer.done.is_set():
            await asyncio.sleep(_DRAIN_FLUSH_S)  # the hand-over events and a waiting POST /drain's answer go out
    finally:
        log.info("stopping")
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if reader is not None:
            reader.close()
        await grpc_server.stop(grace=2.0)
        await runner.cleanup()
        await proxy.pool.close()  # proxy mode: already closed by the app's cleanup; --no-proxy: the scrape's
        await session.close()


_DRAIN_FLUSH_S = 0.2


async def request_drain(url: str, token: str | None, wait: bool, timeout_s: float) -> int:
    """``POST {url}/drain`` (``?wait=1`` with ``wait``): 0 when the agent accepted it (with ``wait``: the
    drain finished, or the agent was already gone: connection refused), 1 on an error answer or a
    timeout (the reason on stderr)."""
    headers = {"x-fairbatch-token": token} if token else {}
    target = url.rstrip("/") + "/drain" + ("?wait=1" if wait else "")
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
            async with session.post(target, headers=headers) as resp:
                body = await resp.text()
                if resp.status in (200, 202):
                    print(body)
                    return 0
                print(f"fairbatch-agent drain: {target} answered {resp.status}: {body[:200]}", file=sys.stderr)
                return 1
    except aiohttp.ClientConnectorError:
        if wait:  # nothing listens: the agent is gone (drained and exited)
            return 0
        print(f"fairbatch-agent drain: nothing answers at {url}", file=sys.stderr)
        return 1
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        if wait and isinstance(e, aiohttp.ServerDisconnectedError):  # exited as it answered
            return 0
        print(f"fairbatch-agent drain: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging(args.log_level)
    if args.command == "calibrate":
        try:
            print(format_fit(calibrate(args.log)))
        except (ValueError, OSError) as e:
            parser.error(str(e))
        return 0
    if args.command == "drain":
        try:
            token = env_secret(os.environ, AGENT_TOKEN_ENV)
        except SecretFileError as e:  # names the variable and the path, never the content
            print(f"fairbatch-agent drain: {e}", file=sys.stderr)
            return 2
        return run(request_drain(args.url, token, args.wait, args.timeout_s))
    if args.command == "serve":
        try:
            config_from_args(args)  # fail fast with a readable message
        except ConfigError as e:  # the file, not the flags: no usage line (as the router says it)
            print(f"fairbatch-agent: invalid config: {e}", file=sys.stderr)
            return 2
        except (ValueError, KeyError, OSError) as e:
            parser.error(str(e))
        try:
            refused = token_refusal(args.host, os.environ)
            env_secret(os.environ, ENGINE_API_KEY_ENV)  # serve() reads both again; fail here, before any port
        except SecretFileError as e:  # names the variable and the path, never the content
            print(f"fairbatch-agent: {e}", file=sys.stderr)
            return 2
        if refused is not None:
            print(refused, file=sys.stderr)
            return 2
        hold_grpc_aio()
        run(serve(args))
        return 0
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
