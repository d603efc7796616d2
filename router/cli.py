"""``fairbatch-router``: the SLO-aware router (OpenAI-compatible HTTP front door), and optionally the
endpoint picker of a Kubernetes inference gateway (``--ext-proc-port``, router/ext_proc.py).

Example::

    fairbatch-router --config fairbatch.yaml --host 127.0.0.1 --port 8080 --time-scale 1.0
    fairbatch-router --config fairbatch.yaml --host 0.0.0.0 --port 8080 --ext-proc-port 9002

A broken config prints ``file:line: field.path: reason`` and exits with status 2. SIGTERM/SIGINT:
stop accepting connections, let running requests (streams) finish within ``--drain-s`` wall
seconds, then close.

Hot reload: SIGHUP, or a change of the file's mtime/size (checked every ``--reload-poll-s`` wall
seconds; 0 = SIGHUP only), reloads the YAML without dropping requests. An invalid new file is
refused (logged, ``fairbatch_router_config_reloads_total{result="invalid"}``,
``fairbatch_router_config_last_reload_success`` 0) and the running configuration kept.

Secrets come from the environment only: ``FAIRBATCH_AGENT_TOKEN`` (sent to the agents) and
``FAIRBATCH_REDIS_PASSWORD`` (the password of ``redis_url``'s Redis), or from the files that
``FAIRBATCH_AGENT_TOKEN_FILE`` / ``FAIRBATCH_REDIS_PASSWORD_FILE`` name (fairbatch_common/secrets.py; the
Helm chart mounts its Secrets as files); an unreadable file exits with status 2.

gRPC's C core reads ``GRPC_EXPERIMENTS`` once, when ``grpc`` is first imported: this module sets it,
before any import of grpc, to :data:`GRPC_EXPERIMENTS_DEFAULT` unless the environment sets it.
"""

from __future__ import annotations

import os

GRPC_EXPERIMENTS_DEFAULT = "-event_engine_listener"
"""The gRPC server's TCP listener of the C core's own I/O manager instead of the EventEngine one (the
core's default in grpcio 1.85): measured 0.08 ms of CPU less per ext_proc stream in every run
(docs/bench/ext_proc_pick.md, scripts/bench_grpc_floor.py; as we read it, one thread hop less per
event). The router's only gRPC server is the picker's; its clients are unaffected.
``GRPC_EXPERIMENTS=""`` in the environment keeps gRPC's defaults."""

os.environ.setdefault("GRPC_EXPERIMENTS", GRPC_EXPERIMENTS_DEFAULT)  # before the first `import grpc`

import argparse  # noqa: E402
import asyncio  # noqa: E402
import logging  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
from collections.abc import Mapping  # noqa: E402

from aiohttp import web  # noqa: E402

from fairbatch_common.clock import Clock  # noqa: E402
from fairbatch_common.aio import watch_file  # noqa: E402
from fairbatch_common.http_guard import make_runner  # noqa: E402
from fairbatch_common.runtime import hold_grpc_aio, run, setup_logging  # noqa: E402
from fairbatch_common.secrets import SecretFileError, env_secret  # noqa: E402
from router.config import ConfigError, RouterConfig, load_config  # noqa: E402
from router.server import Router  # noqa: E402

log = logging.getLogger("router")

AGENT_TOKEN_ENV = "FAIRBATCH_AGENT_TOKEN"  # shared secret with the agents (from a Secret in the chart)
REDIS_PASSWORD_ENV = "FAIRBATCH_REDIS_PASSWORD"  # password of redis_url's Redis (from a Secret in the chart)


def secrets_from_env(environ: Mapping[str, str]) -> dict[str, str | None]:
    """The :class:`~router.server.Router` keyword arguments that come from the environment, never from
    the YAML or a flag (neither is secret): ``agent_token`` (``FAIRBATCH_AGENT_TOKEN``) and
    ``redis_password`` (``FAIRBATCH_REDIS_PASSWORD``); an empty variable counts as unset. Each may
    instead be in the file that ``<NAME>_FILE`` names (:func:`~fairbatch_common.secrets.env_secret`:
    one trailing newline stripped; the plain variable wins); an unreadable file raises
    :class:`~fairbatch_common.secrets.SecretFileError`."""
    return {"agent_token": env_secret(environ, AGENT_TOKEN_ENV),
            "redis_password": env_secret(environ, REDIS_PASSWORD_ENV)}


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser."""
    p = argparse.ArgumentParser(
        prog="fairbatch-router",
        description=(
            "SLO-aware router and admission controller in front of fairbatch replica agents. "
            "Places each prompt on the replica with the most Prefill Admission Budget (PAB) "
            "headroom, queues it (bounded) when none fits, and relays the answer unchanged."
        ),
        epilog="All SLOs, TTLs and queue timeouts are simulated ms (see --time-scale).",
    )
    p.add_argument("--config", required=True, metavar="PATH", help="router YAML (slo_classes, tenants, api_keys, replicas, ...)")
    p.add_argument("--otlp-endpoint", default=None,
                   help="OTLP collector for spans (before the YAML's telemetry.otlp_endpoint and "
                        "OTEL_EXPORTER_OTLP_ENDPOINT; protocol from OTEL_EXPORTER_OTLP_PROTOCOL: grpc or http/protobuf)")
    p.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="listen port (default 8080)")
    p.add_argument(
        "--time-scale", type=float, default=1.0, metavar="S",
        help="wall ms per simulated ms (default 1.0 = real time)",
    )
    p.add_argument(
        "--router-id", default=None,
        help="name sent to agents in WatchBudget/Reserve (default: router-<hostname>-<pid>)",
    )
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="log level")
    p.add_argument(
        "--reload-poll-s", type=float, default=2.0,
        help="wall seconds between checks of the config file for changes (default 2; 0 = only on SIGHUP)",
    )
    p.add_argument(
        "--drain-s", type=float, default=30.0,
        help="on SIGTERM, wall seconds running requests get to finish (default 30)",
    )
    p.add_argument(
        "--ext-proc-port", type=int, default=None, metavar="N",
        help="also serve the Envoy ext_proc endpoint picker of a Gateway API Inference Extension InferencePool "
             "on this gRPC port, on the same core as the HTTP front door (router/ext_proc.py; default: off)",
    )
    p.add_argument("--ext-proc-host", default=None, help="listen address of the picker (default: --host)")
    p.add_argument("--ext-proc-max-streams", type=int, default=10_000, metavar="N",
                   help="most open ext_proc streams, one per request in the gateway (default 10000)")
    p.add_argument("--ext-proc-fallbacks", type=int, default=2, metavar="N",
                   help="fallback endpoints listed after the picked one, for the proxy's retries (default 2)")
    return p


async def watch_config(router: Router, path: str, poll_s: float, hup: asyncio.Event) -> None:
    """Reload ``path`` on SIGHUP (``hup``) or when its mtime/size changes (polled every ``poll_s``
    wall seconds; 0 = never polled). One reload at a time; runs until cancelled."""

    def reload(signalled: bool) -> None:
        log.info("reloading config %s (%s)", path, "SIGHUP" if signalled else "file changed")
        router.reload(path)

    await watch_file(path, poll_s, hup, reload)


async def serve(
    config: RouterConfig, host: str, port: int, clock: Clock, router_id: str, drain_s: float,
    config_path: str | None = None, reload_poll_s: float = 2.0, otlp_endpoint: str | None = None,
    ext_proc: tuple[str, int, int, int] | None = None, secrets: Mapping[str, str | None] | None = None,
) -> None:
    """Run the router until SIGTERM/SIGINT, then drain (bounded by ``drain_s`` wall seconds);
    reload ``config_path`` on SIGHUP or when it changes. ``ext_proc``: (host, port, max streams,
    fallbacks) of the endpoint picker (router/ext_proc.py), drained first on shutdown. ``secrets``:
    :func:`secrets_from_env`'s answer (None: read from ``os.environ`` here)."""
    if secrets is None:
        secrets = secrets_from_env(os.environ)
    router = Router(config, clock, router_id, otlp_endpoint=otlp_endpoint, **secrets)
    app = router.build_app()
    runner = make_runner(app, shutdown_timeout=drain_s, header_timeout_s=config.http.header_timeout_s)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=1024)
    await site.start()
    metrics_runner = None
    if config.http.metrics_port is not None:
        metrics_runner = make_runner(router.build_metrics_app(), header_timeout_s=config.http.header_timeout_s)
        await metrics_runner.setup()
        await web.TCPSite(metrics_runner, host, config.http.metrics_port).start()
        log.info("metrics and detailed health on http://%s:%d", host, config.http.metrics_port)
    log.info("fairbatch-router %s listening on http://%s:%d (%s, time scale %g)",
             router_id, host, port,
             f"{len(config.replicas)} replicas" if config.discovery.mode == "static"
             else f"{config.discovery.mode} discovery", clock.scale)
    picker = None
    if ext_proc is not None:
        from router.ext_proc import start_ext_proc  # the picker's stubs (xds-protos) only when asked for

        p_host, p_port, p_streams, p_fallbacks = ext_proc
        picker = await start_ext_proc(router, p_host, p_port, p_streams, p_fallbacks)
        log.info("ext_proc endpoint picker on %s:%d (gRPC health: liveness, readiness)", p_host, picker[2])
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # pragma: no cover - non-Unix
            pass
    hup = asyncio.Event()
    watcher: asyncio.Task[None] | None = None
    if config_path is not None:
        try:
            loop.add_signal_handler(signal.SIGHUP, hup.set)
        except (NotImplementedError, RuntimeError, AttributeError):  # pragma: no cover - non-Unix
            pass
        watcher = asyncio.create_task(watch_config(router, config_path, reload_poll_s, hup), name="config-watch")
    try:
        await stop.wait()
        log.info("shutting down: draining requests for up to %.1f s", drain_s)
    finally:
        if watcher is not None:
            watcher.cancel()
        if picker is not None:
            from router.ext_proc import stop_ext_proc

            await stop_ext_proc(picker[0], picker[1], drain_s)
        await runner.cleanup()
        if metrics_runner is not None:
            await metrics_runner.cleanup()
        log.info("stopped")




def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit status (2 for a bad config or bad arguments)."""
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level)
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"fairbatch-router: invalid config: {exc}", file=sys.stderr)
        return 2
    try:
        clock = Clock(args.time_scale)
    except ValueError as exc:
        print(f"fairbatch-router: {exc}", file=sys.stderr)
        return 2
    try:
        secrets = secrets_from_env(os.environ)
    except SecretFileError as exc:  # names the variable and the path, never the content
        print(f"fairbatch-router: {exc}", file=sys.stderr)
        return 2
    router_id = args.router_id or f"router-{socket.gethostname()}-{os.getpid()}"
    hold_grpc_aio()
    ext_proc = None
    if args.ext_proc_port is not None:
        ext_proc = (args.ext_proc_host or args.host, args.ext_proc_port, max(1, args.ext_proc_max_streams),
                    max(0, args.ext_proc_fallbacks))
    run(serve(config, args.host, args.port, clock, router_id, args.drain_s, args.config, args.reload_poll_s,
              args.otlp_endpoint, ext_proc, secrets))
    return 0


if __name__ == "__main__":
    sys.exit(main())
