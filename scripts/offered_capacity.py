"""Fleet capacities on the offered rate (requests in the window / window) instead of the rate label.

bench-fleet labels a point with the trace's long-run rate scaled (gaps included); the requests a
60 s window actually holds can differ, most at low rates where few windows are interleaved. This
reads every docs/evaluation/*.json (runs before bench-fleet wrote `offered_capacity_rps` itself), re-derives each policy's capacity with the same interpolation
(loadgen.bench_policies.capacity) on rate = requests / duration_s, prints a table and writes JSON.

    python scripts/offered_capacity.py [--dir docs/evaluation] [--out docs/evaluation/offered.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from loadgen.bench_policies import capacity
from loadgen.fleet.bench import offered_rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default="docs/evaluation")
    p.add_argument("--out", default="docs/evaluation/offered.json")
    args = p.parse_args()
    result = {}
    print(f"{'run':<42} {'policy':<18} {'label cap':>9} {'offered cap':>11} {'x RR (label)':>12} {'x RR (offered)':>14}")
    for path in sorted(Path(args.dir).glob("*.json")):
        d = json.loads(path.read_text())
        if "policies" not in d or "duration_s" not in d:
            continue
        run = {}
        for name, pol in d["policies"].items():
            rows = [r for r in pol.get("rows", []) if "requests" in r]
            if not rows:
                continue
            cap, bound = capacity(offered_rows(rows, d["duration_s"] - d.get("warmup_s", 0.0)), 0.9)
            run[name] = {"label_capacity_rps": pol["capacity_rps"], "offered_capacity_rps": round(cap, 2),
                         "offered_bound": bound}
        rr = run.get("round-robin")
        for name, v in run.items():
            if rr and rr["offered_capacity_rps"] > 0 and rr["label_capacity_rps"] > 0:
                v["x_round_robin_label"] = round(v["label_capacity_rps"] / rr["label_capacity_rps"], 2)
                v["x_round_robin_offered"] = round(v["offered_capacity_rps"] / rr["offered_capacity_rps"], 2)
            print(f"{path.stem:<42} {name:<18} {v['label_capacity_rps']:>9.1f} {v['offered_capacity_rps']:>11.1f} "
                  f"{v.get('x_round_robin_label', float('nan')):>12.2f} {v.get('x_round_robin_offered', float('nan')):>14.2f}")
        result[path.stem] = run
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
