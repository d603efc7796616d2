"""Command-line flags shared by the benchmarks (bench-policies, bench-fleet): engine settings and
the trace's arrival spread, with the defaults resolved from the profile and the trace."""

from __future__ import annotations

import argparse

from loadgen.sim.engine_time import EngineTimeModel, load_engine_time_model
from loadgen.traces import arrival_granularity_ms
from replica_agent.policy.profiles import ServeBatchDefaults, load_profile, vllm_serve_batch_defaults


def add_engine_and_trace_args(p: argparse.ArgumentParser) -> None:
    """Add ``--max-num-batched-tokens``, ``--max-num-seqs`` and ``--arrival-spread-ms`` (all default None)."""
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="engine token cap per iteration, every policy (default: what `vllm serve` uses on the "
                        "profile's GPU: 2048 on A100, 8192 on H100)")  # fmt: skip
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="engine cap on running requests (default: `vllm serve`'s: 256 on A100, 1024 on H100)")
    p.add_argument("--arrival-spread-ms", type=float, default=None,
                   help="spread each arrival uniformly over this many ms (undo timestamp quantisation; default: "
                        "the trace's known granularity, 3000 for mooncake-conv, else 0)")  # fmt: skip


def resolve_engine_and_trace_args(args: argparse.Namespace, variant: str = "all_batches") -> ServeBatchDefaults:
    """Fill the None defaults of :func:`add_engine_and_trace_args` in place; returns `vllm serve`'s defaults.

    Reads ``args.profile`` (GPU of the profile) and ``args.trace`` (known timestamp granularity).

    Raises:
        KeyError: for an unknown profile or GPU.
    """
    serve = vllm_serve_batch_defaults(load_profile(args.profile, variant).gpu)
    batch = serve.resolve(args.max_num_batched_tokens, args.max_num_seqs)
    args.max_num_batched_tokens, args.max_num_seqs = batch.max_num_batched_tokens, batch.max_num_seqs
    if args.arrival_spread_ms is None:
        args.arrival_spread_ms = arrival_granularity_ms(args.trace)
    return serve


def add_engine_time_arg(p: argparse.ArgumentParser) -> None:
    """Add ``--engine-time-model FILE|policy`` (default None: the profile's shipped file)."""
    p.add_argument("--engine-time-model", metavar="FILE|policy", default=None,
                   help="the simulated engine's own step time: a JSON file (docs/engine-time-model.md), a shipped "
                        "profile name, or 'policy' = the policy's time model (an oracle engine); default: the "
                        "profile's shipped file loadgen/data/engine_time/<profile>.json, 'policy' when it has none")  # fmt: skip


def resolve_engine_time(args: argparse.Namespace) -> EngineTimeModel | None:
    """The engine time model of ``args.engine_time_model`` for ``args.profile`` (None = the policy's model).

    Raises:
        ValueError, FileNotFoundError: see :func:`loadgen.sim.engine_time.load_engine_time_model`.
    """
    return load_engine_time_model(args.engine_time_model, args.profile)
