"""The agent's decision work under the stream load of scripts/bench_router_overhead.py, in one process.

No sockets, no engine: the same calls the agent's servers make, driven on a simulated clock. 50
streams of 200-token prompts and 64 output tokens (closed loop: a stream sends its next request when
the last ended); every 15 ms an engine step gives every decode one token (``Agent.request_tokens``:
the tracker and the online time model); a budget push every 7 ms (``compute_budget`` and the
protobuf, what one WatchBudget stream costs at the 5 ms minimum interval under this load); the inline
admission and the arrival per request (``Agent.reserve``, ``request_arrived``); the engine's
/metrics page parsed every 50 ms (the lines the agent reads, with running, KV usage and the
inter-token count moving). CPU is ``time.process_time`` per part, per 1000 requests; each part's
figure is the least over the repeats (the one least disturbed by other processes on a shared machine).

This is the part of the agent's CPU that its own Python decides (the rest is aiohttp, the event
loop and system calls per relayed chunk): run it from two checkouts for an A/B that the machine's
load does not drown. Run: ``python scripts/bench_agent_decisions.py --out agent_decisions.json``.
"""

from __future__ import annotations

import argparse
import inspect
import json
import platform
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from replica_agent.admission_server import snapshot_pb  # noqa: E402
from replica_agent.agent import Agent, AgentConfig  # noqa: E402
from fairbatch_common.clock import Clock  # noqa: E402
from replica_agent.engine_metrics import parse_engine_metrics  # noqa: E402
from replica_agent.policy.calibration import CalibratorConfig  # noqa: E402
from replica_agent.policy.pab import SloClass  # noqa: E402
from replica_agent.policy.profiles import load_profile  # noqa: E402

PAGE = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="llama-3-8b-a100"} RUNNING
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="llama-3-8b-a100"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="llama-3-8b-a100"} KVUSE
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",engine="0",num_gpu_blocks="29205"} 1.0
# HELP vllm:num_preemptions Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{engine="0",model_name="llama-3-8b-a100"} 0.0
# HELP vllm:prefix_cache_queries Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="llama-3-8b-a100"} 0.0
# HELP vllm:prefix_cache_hits Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="llama-3-8b-a100"} 0.0
# HELP vllm:inter_token_latency_seconds Histogram of inter-token latency in seconds.
# TYPE vllm:inter_token_latency_seconds histogram
vllm:inter_token_latency_seconds_bucket{engine="0",le="0.01",model_name="llama-3-8b-a100"} 0.0
vllm:inter_token_latency_seconds_bucket{engine="0",le="+Inf",model_name="llama-3-8b-a100"} ITLCOUNT
vllm:inter_token_latency_seconds_count{engine="0",model_name="llama-3-8b-a100"} ITLCOUNT
vllm:inter_token_latency_seconds_sum{engine="0",model_name="llama-3-8b-a100"} 12.5
"""

PARTS = ("admit", "tokens", "push", "scrape")


def run(n_requests: int, seed: int, streams: int = 50, tokens: int = 64, step_ms: float = 15.0,
        push_ms: float = 7.0, scrape_ms: float = 50.0) -> dict[str, float]:
    """One run; CPU s per 1000 requests, per part and in all."""
    prof = load_profile("llama-3-8b-a100")
    cfg = AgentConfig(replica_id="r0", time_model=prof.time_model, slo_classes=(SloClass("interactive", 2000.0, 200.0),),
                      default_slo_class="interactive", kv_capacity_tokens=400_000, metrics_stale_ms=1e12,
                      calibration=CalibratorConfig(refit_every=4))  # the agent CLI's default
    agent = Agent(cfg, Clock(1.0))
    # an older checkout's parser takes no memo: the scraper's memo when there is one
    memo: dict | None = {} if "memo" in inspect.signature(parse_engine_metrics).parameters else None
    rng = random.Random(seed)
    cpu = dict.fromkeys(PARTS, 0.0)
    pt = time.process_time
    now = next_push = next_scrape = 0.0
    active: dict[str, int] = {}
    started = done = step = 0
    t0 = pt()
    while done < n_requests:
        c0 = pt()
        while len(active) < streams and started < n_requests:
            key = f"q{started}"
            started += 1
            lease = agent.reserve("interactive", 200, tokens, key, now, 0.0, answer_budget=False)
            agent.request_arrived(key, "interactive", 200, tokens, now, 0.0, lease.lease_id)
            active[key] = 0
        c1 = pt()
        now += step_ms
        step += 1
        for key in list(active):
            agent.request_tokens(key, now + rng.uniform(0.0, 0.5), 1)
            active[key] += 1
            if active[key] >= tokens:
                agent.request_done(key, now, "ok")
                del active[key]
                done += 1
        c2 = pt()
        while next_push <= now:
            snapshot_pb(agent, agent.compute_budget(next_push))
            next_push += push_ms
        c3 = pt()
        while next_scrape <= now:
            page = PAGE.replace("RUNNING", f"{len(active)}.0").replace("ITLCOUNT", f"{step * streams}.0").replace(
                "KVUSE", f"{0.01 * (step % 7):.2f}")
            m, missing = parse_engine_metrics(page, memo) if memo is not None else parse_engine_metrics(page)
            agent.on_engine_metrics(m, missing, "", now)
            next_scrape += scrape_ms
        c4 = pt()
        for part, dt in zip(PARTS, (c1 - c0, c2 - c1, c3 - c2, c4 - c3), strict=True):
            cpu[part] += dt
    k = 1000.0 / n_requests
    out = {part: v * k for part, v in cpu.items()}
    out["all"] = (pt() - t0) * k
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=1500, help="requests per repeat")
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--out", type=Path, default=None, help="write the JSON here")
    args = p.parse_args(argv)
    runs = [run(args.requests, seed) for seed in range(1, args.repeats + 1)]
    best = {part: min(r[part] for r in runs) for part in (*PARTS, "all")}
    print(f"agent decision work, stream load in process: {args.requests} requests x {args.repeats} repeats")
    print(f"{'part':10s} {'CPU s / 1000 req (least)':>26s} {'all repeats':>30s}")
    for part in (*PARTS, "all"):
        print(f"{part:10s} {best[part]:26.3f}   " + " ".join(f"{r[part]:.3f}" for r in runs))
    if args.out:
        args.out.write_text(json.dumps({"command": "python scripts/bench_agent_decisions.py " + " ".join(
            argv if argv is not None else sys.argv[1:]), "python": platform.python_version(),
            "least_cpu_s_per_1000": best, "runs": runs}, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
