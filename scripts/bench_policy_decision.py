"""Benchmark: wall time of one batch-formation decision per policy (a command, not a timed test).

Builds a seeded random replica state with N running requests (decodes with contexts of 200-8000
tokens and slacks of -50..+2000 ms, plus a few unfinished chunked prefills) and W waiting
prompts, then times ``form_batch`` with ``timeit`` (best of R repeats of L loops each).
Target (issue 4): FairBatching <= 200 us per decision at 256 running requests.

Run: ``.venv/bin/python scripts/bench_policy_decision.py [--running 256] [--waiting 32] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import timeit
from collections.abc import Sequence

from replica_agent.policy.batching import POLICIES, SchedRequest, SchedState, make_policy
from replica_agent.policy.profiles import load_profile


def make_state(n_running: int, n_waiting: int, seed: int = 0) -> SchedState:
    """A seeded random state at now = 100 000 ms (see the module docstring)."""
    rng = random.Random(seed)
    now = 100_000.0
    running = []
    for i in range(n_running):
        prompt = rng.randint(200, 8000)
        if i % 32 == 31:  # an unfinished chunked prefill
            running.append(SchedRequest(f"p{i}", prompt, computed_tokens=prompt // 2, max_tokens=200,
                                        arrival_ms=now - rng.uniform(0, 400), ttft_ms=1000, tpot_ms=50))
            continue
        out = rng.randint(1, 150)
        slack = rng.uniform(-50, 2000)
        arrival = now + slack - 1000 - 50 * out
        running.append(SchedRequest(f"d{i}", prompt, computed_tokens=prompt + out - 1, tokens_out=out,
                                    max_tokens=400, arrival_ms=arrival, ttft_ms=1000, tpot_ms=50))
    waiting = [SchedRequest(f"w{i}", rng.randint(50, 8000), arrival_ms=now - rng.uniform(0, 900),
                            ttft_ms=1000, tpot_ms=50) for i in range(n_waiting)]
    return SchedState(now_ms=now, running=running, waiting=waiting, max_num_batched_tokens=8192,
                      max_num_seqs=512, kv_free_blocks=20_000, block_size=16,
                      time_model=load_profile("llama-3-8b-a100").time_model)


def main(argv: Sequence[str] | None = None) -> int:
    """Print a table (policy, running, waiting, us per decision, batch size) and optionally write JSON."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--running", type=int, nargs="+", default=[64, 256, 512])
    p.add_argument("--waiting", type=int, default=32)
    p.add_argument("--loops", type=int, default=200)
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args(argv)
    rows = []
    print(f"{'policy':<14} {'running':>7} {'waiting':>7} {'us/decision':>11} {'batch items':>11}")
    for name in sorted(POLICIES):
        policy = make_policy(name)
        for n in args.running:
            state = make_state(n, args.waiting)
            batch = policy.form_batch(state)
            best = min(timeit.repeat(lambda: policy.form_batch(state), number=args.loops, repeat=args.repeat))
            us = best / args.loops * 1e6
            rows.append({"policy": name, "running": n, "waiting": args.waiting, "us_per_decision": round(us, 1),
                         "batch_items": len(batch)})
            print(f"{name:<14} {n:>7} {args.waiting:>7} {us:>11.1f} {len(batch):>11}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "python": sys.version.split()[0]}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
