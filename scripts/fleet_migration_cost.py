"""What a replica failure costs the fleet (issue 29 item 6): one rate, the fleet simulation run three
times: without a fault, with one replica killed mid-window (kill -9 of engine and agent: its streams
are continued elsewhere by the router's migration, their prompt + generated tokens re-prefilled there;
loadgen/fleet/sim.py "Faults and migration"), and with the same kill but ``max_migrations`` 0 (the
streams it cut fail: the old behaviour).

Prints per run: SLO attainment (per request and per token), refused share, failed requests, the
migrations by outcome and the added gap per migrated stream; writes the two rows (bench-fleet's
row format) to ``--out``.

    .venv/bin/python scripts/fleet_migration_cost.py --trace azure-code --replicas 16 --rate 60 \\
        --duration-s 60 --warmup-s 20 --kill-at-s 30 --out migration-cost.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loadgen.fleet.bench import headline_setup, run_point, trace_rows  # noqa: E402
from loadgen.sim.engine_time import load_engine_time_model  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", default="azure-code")
    p.add_argument("--replicas", type=int, default=16)
    p.add_argument("--profile", default="llama-3-8b-a100")
    p.add_argument("--policy", default="pab+fairbatching")
    p.add_argument("--rate", type=float, default=60.0, help="req/s")
    p.add_argument("--ttft-ms", type=float, default=1000.0)
    p.add_argument("--tpot-ms", type=float, default=100.0)
    p.add_argument("--duration-s", type=float, default=60.0)
    p.add_argument("--warmup-s", type=float, default=20.0)
    p.add_argument("--drain-s", type=float, default=60.0)
    p.add_argument("--kill-at-s", type=float, default=30.0, help="simulated s at which replica --kill-replica dies")
    p.add_argument("--kill-replica", type=int, default=0)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    kept, native, _ = trace_rows(a.trace, 0.0, 0)  # azure-code: no timestamp quantisation to undo
    setup = headline_setup(kept, native, a.replicas, a.profile, a.ttft_ms, a.tpot_ms, a.duration_s, a.drain_s,
                           a.warmup_s, load_engine_time_model(None, a.profile))  # fmt: skip
    rows = {}
    kill = ((a.kill_at_s * 1000.0, a.kill_replica),)
    runs = (("no fault", (), 3), (f"r{a.kill_replica} killed at {a.kill_at_s:g} s", kill, 3),
            (f"r{a.kill_replica} killed, no migration", kill, 0))
    for name, faults, max_migrations in runs:
        row = run_point(dataclasses.replace(setup, faults=faults, max_migrations=max_migrations), a.policy, a.rate)
        rows[name] = row
        print(f"{name:>24}: attainment {row['slo_attainment']:.4f} (tokens {row['token_slo_attainment']:.4f}), "
              f"refused {row['refused_share']:.4f}, failed {row['failed']}, migrations {row['migrations']}, "
              f"added gap p50 {row['migration_added_ms_p50']} ms p99 {row['migration_added_ms_p99']} ms, "
              f"wall {row['wall_s']} s", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps({"trace": a.trace, "replicas": a.replicas, "policy": a.policy,
                                           "rate_rps": a.rate, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
