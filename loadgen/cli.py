"""``fairbatch-loadgen``: trace replay, the local demo fleet, and the simulated engine.

Subcommands:
  replay      replay a real trace against a router or an engine, print and write the report
  demo        start engines + agents + router on loopback, replay through the router
  sim-engine  the vLLM-compatible simulated engine (flags: ``sim-engine --help``)
  bench-policies  batching policies on one replica in virtual time (flags: ``bench-policies --help``)
  bench-fleet     routing policies on a simulated fleet in virtual time (flags: ``bench-fleet --help``)
  bench-autoscale a ramping rate on an autoscaled fleet: PAB vs num-waiting vs a fixed peak fleet
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from loadgen.traces import EMBEDDED_TRACES

_TRACE_HELP = (
    f"embedded trace name ({', '.join(sorted(EMBEDDED_TRACES))}) or a path to an Azure 2023 CSV / Mooncake JSONL"
)


# Subcommands with their own argument parser: name -> (module with main(argv), one-line help).
_DELEGATED = {
    "sim-engine": ("loadgen.sim.server", "the vLLM-compatible simulated engine (see sim-engine --help)"),
    "bench-policies": ("loadgen.bench_policies",
                       "sweep arrival rate per batching policy on one replica in virtual time (see bench-policies --help)"),
    "bench-fleet": ("loadgen.fleet.bench",
                    "fleet-scale routing comparison (16-256 simulated replicas, virtual time; see bench-fleet --help)"),
    "bench-autoscale": ("loadgen.fleet.autoscale_bench",
                        "autoscaling on PAB vs vllm:num_requests_waiting vs a fixed peak fleet, ramping rate"),
}


def _positive(text: str) -> float:
    v = float(text)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return v


def _add_window_flags(p: argparse.ArgumentParser, duration_default: float | None, rate_default: float,
                      time_default: float) -> None:
    p.add_argument("--trace", default="azure-conv", help=_TRACE_HELP + " (default: %(default)s)")
    p.add_argument("--duration-s", type=_positive, default=duration_default,
                   help="window of the trace to replay, trace seconds before rate scaling (default: %(default)s"
                        + ("; None = whole trace)" if duration_default is None else ")"))
    p.add_argument("--start-s", type=float, default=0.0, help="start of the window, trace seconds (default: 0)")
    p.add_argument("--rate-scale", type=_positive, default=rate_default,
                   help="arrival-rate multiplier: 2 = twice the trace's rate (default: %(default)s)")
    p.add_argument("--time-scale", type=_positive, default=time_default,
                   help="wall seconds per simulated second: gaps are stretched by it and measured latencies "
                        "divided by it; must match the servers' --time-scale (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the tenant draw (default: 0)")
    p.add_argument("--out", help="write the report JSON here")
    p.add_argument("--request-timeout-s", type=_positive, default=600.0,
                   help="limit per request, simulated seconds (default: %(default)s)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``fairbatch-loadgen``."""
    parser = argparse.ArgumentParser(
        prog="fairbatch-loadgen",
        description="Replay real LLM traces against fairbatch (or any vLLM-compatible server) and report "
                    "TTFT/TPOT/ITL, SLO attainment and goodput; run a local demo fleet; run the simulated engine.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{replay,demo,sim-engine,bench-policies,bench-fleet,bench-autoscale}")

    rp = sub.add_parser(
        "replay",
        help="replay a trace against --target and report",
        description="Send each trace request at its (scaled) arrival time as a streaming request to --target; "
                    "timestamp every token; print the report and optionally write it as JSON. Latencies are "
                    "reported in simulated ms (wall / --time-scale).",
    )
    rp.add_argument("--target", required=True, help="base URL, e.g. http://127.0.0.1:8000 (router or engine)")
    _add_window_flags(rp, duration_default=60.0, rate_default=1.0, time_default=1.0)
    rp.add_argument("--endpoint", choices=("completions", "chat"), default="completions",
                    help="/v1/completions or /v1/chat/completions (default: %(default)s)")
    rp.add_argument("--prompt-format", choices=("text", "tokens"), default="text",
                    help="prompt as a text of exactly N simulator tokens, or as N token ids (completions only; "
                         "default: %(default)s)")
    rp.add_argument("--model", help="model field of the requests (default: first id of GET /v1/models)")
    rp.add_argument("--tenants", help="weighted tenants, e.g. acme:3,beta:1 (default: the --config tenants, "
                                      "else one tenant 'default')")
    rp.add_argument("--api-key", action="append", default=[], metavar="TENANT=KEY",
                    help="API key of a tenant, sent as Authorization: Bearer (repeatable)")
    rp.add_argument("--config", help="router YAML: tenants -> slo_class -> ttft_ms/tpot_ms for SLO attainment")
    rp.add_argument("--ttft-ms", type=_positive, help="TTFT target for every tenant, simulated ms "
                                                     "(overrides --config; default 500 without a config)")
    rp.add_argument("--tpot-ms", type=_positive, help="TPOT target for every tenant, simulated ms "
                                                     "(overrides --config; default 50 without a config)")
    rp.add_argument("--max-concurrency", type=int, default=4096,
                    help="requests in flight at most (default: %(default)s)")
    rp.add_argument("--max-wall-s", type=_positive, default=None,
                    help="wall-clock limit of the whole replay; unfinished requests count as failed "
                         "(default: none)")

    dp = sub.add_parser(
        "demo",
        help="local fleet (engines + agents + router) on loopback, replay through the router",
        description="Start N simulated engines, N replica agents and one router on free loopback ports (two "
                    "tenants acme:3 and beta:1 in class 'interactive', random API keys), replay the trace through "
                    "the router, print the report, write the JSON, stop everything.",
    )
    dp.add_argument("--replicas", type=int, default=4, help="engine + agent pairs (default: %(default)s)")
    dp.add_argument("--engine", choices=("sim", "vllm"), default="sim",
                    help="sim: simulated engines (default); vllm: real vLLM CPU replicas with a tiny model "
                         "(needs .venv-vllm; time scale forced to 1; see loadgen/vllm_fleet.py)")
    _add_window_flags(dp, duration_default=180.0, rate_default=7.0, time_default=4.0)
    dp.set_defaults(out="out/demo-report.json")
    dp.add_argument("--profile", default="llama-3-8b-a100",
                    help="GPU profile of engines and agents (default: %(default)s)")
    dp.add_argument("--ttft-ms", type=_positive, default=500.0,
                    help="TTFT target of class interactive, simulated ms (default: %(default)s)")
    dp.add_argument("--tpot-ms", type=_positive, default=50.0,
                    help="TPOT target of class interactive, simulated ms (default: %(default)s)")
    dp.add_argument("--scenario", metavar="FILE",
                    help="run a multi-tenant fairness scenario instead (loadgen/scenarios/*.yaml; its own flags: "
                         "--out, --keep-logs, --max-wall-s)")
    dp.add_argument("--engine-time-model", metavar="FILE|policy", default=None,
                    help="the simulated engines' own step time: a JSON file (docs/engine-time-model.md), a shipped "
                         "profile name, or 'policy' = the profile's time model the agents plan with (default: the "
                         "profile's shipped file, loadgen/data/engine_time/<profile>.json)")
    dp.add_argument("--keep-logs", metavar="DIR", help="keep the children's logs and the router YAML in DIR")
    dp.add_argument("--startup-timeout-s", type=_positive, default=60.0,
                    help="wall seconds to wait for each /health (default: %(default)s)")
    dp.add_argument("--max-wall-s", type=_positive, default=900.0,
                    help="wall-clock limit of the replay (default: %(default)s)")

    for name, (_, help_text) in _DELEGATED.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def _cmd_replay(args: argparse.Namespace) -> int:
    from loadgen.replay import ReplayConfig, parse_api_keys, resolve_tenants
    from loadgen.report import replay_to_report
    from loadgen.traces import load_trace, resolve_trace, select

    tenants, slos, slo_source = resolve_tenants(
        args.tenants, parse_api_keys(args.api_key), args.config, args.ttft_ms, args.tpot_ms
    )
    if args.api_key and any(t.api_key is None for t in tenants):
        missing = ", ".join(t.name for t in tenants if t.api_key is None)
        print(f"warning: no --api-key for tenant(s) {missing}; sent without Authorization", file=sys.stderr)
    reqs = select(load_trace(resolve_trace(args.trace)), args.duration_s, args.rate_scale, args.start_s)
    if not reqs:
        print(f"no requests in the selected window of {args.trace}", file=sys.stderr)
        return 2
    cfg = ReplayConfig(
        target=args.target,
        tenants=tenants,
        endpoint=args.endpoint,
        prompt_format=args.prompt_format,
        model=args.model,
        seed=args.seed,
        time_scale=args.time_scale,
        max_concurrency=args.max_concurrency,
        request_timeout_s=args.request_timeout_s,
        max_wall_s=args.max_wall_s,
        progress=not args.no_progress,
    )
    meta = {
        "trace": args.trace,
        "rate_scale": args.rate_scale,
        "duration_s": args.duration_s,
        "start_s": args.start_s,
        "time_scale": args.time_scale,
        "target": args.target,
        "endpoint": args.endpoint,
        "prompt_format": args.prompt_format,
        "tenants": {t.name: t.weight for t in tenants},
        "slo_source": slo_source,
    }
    replay_to_report(reqs, cfg, slos, meta, args.out)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``fairbatch-loadgen``; returns (and, as a script, exits with) the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["demo"] and any(a == "--scenario" or a.startswith("--scenario=") for a in argv):
        from loadgen.scenario import main as scenario_main

        return int(scenario_main(argv[1:]) or 0)
    if argv and argv[0] in _DELEGATED:
        import importlib

        module = importlib.import_module(_DELEGATED[argv[0]][0])
        return int(module.main(argv[1:]) or 0)
    args = build_parser().parse_args(argv)
    try:
        if args.command == "replay":
            return _cmd_replay(args)
        if args.command == "demo":
            from loadgen.demo import main_from_args

            return main_from_args(args)
    except (ValueError, FileNotFoundError, KeyError) as e:
        print(f"fairbatch-loadgen {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 2


if __name__ == "__main__":
    sys.exit(main())
