"""How much of a trace needs most of its TTFT target for its prefill alone, on an idle replica (issue 27).

For each request, the prefill time on an idle replica of the engine model (chunked at ``vllm serve``'s
``max_num_batched_tokens`` for the profile's GPU, each chunk one step of the engine's own mean step time,
loadgen/sim/engine_time.py, over the chunk and the prefix already computed), and the share of requests
and of tokens (prompt + output) whose idle prefill exceeds a fraction of the TTFT target. Those requests
can meet their TTFT only on a replica that gives them most of its steps at once, so they bound what
any placement can gain at the per-token floor (docs/evaluation.md, "Where we win").

Prints a table; writes JSON with ``--out``.

Usage::

    python scripts/idle_prefill_share.py --out docs/evaluation/headline/idle-prefill-share.json
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

from loadgen.fleet.bench import trace_rows
from loadgen.sim.engine_time import EngineTimeModel, load_engine_time_model
from loadgen.traces import arrival_granularity_ms
from replica_agent.policy.profiles import load_profile, vllm_serve_batch_defaults
from replica_agent.policy.time_model import StepFeatures

CASES = (
    ("azure-code", "llama-3-8b-a100", None),
    ("azure-code", "llama-2-70b-h100-tp4", None),
    ("azure-code", "llama-2-70b-h100-tp4", "llama-2-70b-h100-tp4-splitwise"),
    ("azure-conv", "llama-3-8b-a100", None),
)
"""(trace, profile, engine-time model; None = the profile's shipped one): the headline's conditions."""


def idle_prefill_ms(engine: EngineTimeModel, prompt_tokens: int, chunk_tokens: int) -> float:
    """Mean time (ms) to prefill ``prompt_tokens`` alone, in chunks of at most ``chunk_tokens``, each chunk
    one step over the tokens computed before it.

    Raises:
        ValueError: ``chunk_tokens`` < 1.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    t, done = 0.0, 0
    while done < prompt_tokens:
        c = min(chunk_tokens, prompt_tokens - done)
        t += engine.mean_ms(StepFeatures.from_items([(c, done)]))
        done += c
    return t


def shares(trace: str, profile: str, engine_spec: str | None, ttft_ms: float,
           fractions: Sequence[float]) -> dict[str, object]:  # fmt: skip
    """The shares of requests and tokens of ``trace`` whose idle prefill exceeds each fraction of ``ttft_ms``."""
    kept, _, _ = trace_rows(trace, arrival_granularity_ms(trace), 0)
    engine = load_engine_time_model(engine_spec, profile)
    if engine is None:
        raise ValueError(f"no engine-time model for {profile}")
    chunk = vllm_serve_batch_defaults(load_profile(profile).gpu).max_num_batched_tokens
    times = [idle_prefill_ms(engine, max(1, r.prompt_tokens), chunk) for r in kept]
    tokens = [r.prompt_tokens + r.output_tokens for r in kept]
    total = sum(tokens)
    out: dict[str, object] = {"trace": trace, "profile": profile, "engine": engine.name, "chunk_tokens": chunk,
                              "requests": len(kept), "ttft_ms": ttft_ms, "over": {}}  # fmt: skip
    for f in fractions:
        sel = [i for i, t in enumerate(times) if t > f * ttft_ms]
        out["over"][f"{f:g}"] = {"requests": round(len(sel) / len(kept), 4),  # type: ignore[index]
                                 "tokens": round(sum(tokens[i] for i in sel) / total, 4)}
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ttft-ms", type=float, default=1000.0, help="TTFT target (ms; default 1000, the headline's)")
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.5, 1.0], help="fractions of the TTFT target")
    ap.add_argument("--out", default=None, help="JSON file to write")
    args = ap.parse_args(argv)
    rows = [shares(t, p, e, args.ttft_ms, args.fractions) for t, p, e in CASES]
    print("| trace | profile | engine | " + " | ".join(f"> {f:g} x TTFT: requests / tokens" for f in args.fractions) + " |")
    print("| --- | --- | --- | " + " | ".join("---" for _ in args.fractions) + " |")
    for r in rows:
        cells = " | ".join(f"{100 * r['over'][f'{f:g}']['requests']:.1f} % / {100 * r['over'][f'{f:g}']['tokens']:.1f} %"  # type: ignore[index]
                           for f in args.fractions)
        print(f"| {r['trace']} | {r['profile']} | {r['engine']} | {cells} |")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(rows, fh, indent=1)
            fh.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
