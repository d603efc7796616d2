"""Cost of reading the engine's /metrics in the agent: the whole page vs only the lines it reads.

The agent parses the engine's page every ``--metrics-interval-ms`` (Helm default 50 ms) on its event
loop. The page is a real vLLM 0.32.0 capture (tests/data/vllm-0.32.0-cpu-metrics.txt, 624 lines);
a GPU build with more label sets is larger. Prints a table and writes JSON.

    .venv/bin/python scripts/bench_engine_metrics.py [--page PATH] [--repeat 200] [--out out/bench-engine-metrics.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from replica_agent.engine_metrics import parse_engine_metrics, wanted_lines

REPO = Path(__file__).resolve().parents[1]


def timed_ms(fn, repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1e3)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--page", default=str(REPO / "tests" / "data" / "vllm-0.32.0-cpu-metrics.txt"))
    p.add_argument("--repeat", type=int, default=200)
    p.add_argument("--interval-ms", type=float, default=50.0, help="scrape period, for the CPU share column")
    p.add_argument("--out", default="out/bench-engine-metrics.json")
    args = p.parse_args()
    page = Path(args.page).read_text()
    cases = {
        "whole page (prometheus_client)": lambda: list(text_string_to_metric_families(page)),
        "wanted_lines filter": lambda: wanted_lines(page),
        "parse_engine_metrics (filter + parse)": lambda: parse_engine_metrics(page),
    }
    rows = []
    print(f"page: {args.page} ({len(page)} bytes, {page.count(chr(10))} lines, "
          f"{len(wanted_lines(page).splitlines())} wanted)")
    print(f"{'case':<40} {'p50 ms':>8} {'p99 ms':>8} {'CPU share at ' + str(int(args.interval_ms)) + ' ms':>20}")
    for name, fn in cases.items():
        ms = sorted(timed_ms(fn, args.repeat))
        p50, p99 = statistics.median(ms), ms[min(len(ms) - 1, int(0.99 * len(ms)))]
        share = p50 / args.interval_ms
        rows.append({"case": name, "p50_ms": round(p50, 4), "p99_ms": round(p99, 4), "cpu_share": round(share, 4)})
        print(f"{name:<40} {p50:>8.3f} {p99:>8.3f} {share:>19.1%}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"page": args.page, "bytes": len(page), "interval_ms": args.interval_ms,
                               "rows": rows}, indent=2) + "\n")
    print(f"written {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
