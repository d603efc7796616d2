#!/usr/bin/env bash
# Regenerate docs/bench/*: one replica, llama-3-8b-a100, every batching policy on the three
# embedded traces (issue 4). Virtual time; about a minute on 2 cores.
#   <trace>.json/.png           `vllm serve` defaults on A100 (2048 tokens / 256 seqs), DESIGN yardstick
#   <trace>-envelope.json/.png  same engine, seed 000's envelope yardstick, FairBatching on the seed envelope
#   <trace>-8192.json/.png      tuned engine (8192 tokens), DESIGN yardstick
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
OUT=${OUT:-docs/bench}
mkdir -p "$OUT"
bench() { "$PY" -m loadgen.bench_policies --profile llama-3-8b-a100 --jobs "${JOBS:-2}" "$@"; }
declare -A SLO=([azure-conv]="--ttft-ms 1000 --tpot-ms 100 --duration-s 300"
                [azure-code]="--ttft-ms 1000 --tpot-ms 100 --duration-s 300"
                [mooncake-conv]="--ttft-ms 2500 --tpot-ms 100 --duration-s 600")
# rates (req/s) around the capacities; far past them fcfs / prefill-first queues grow without bound
# and a point takes minutes
declare -A RATES=([azure-conv]="4 5 6 6.5 7 7.5 8 9"
                  [azure-code]="0.3 0.6 0.9 1.2 1.5 1.8"
                  [mooncake-conv]="0.3 0.5 0.6 0.7 0.8 0.9 1.0")
# prefill-first livelocks on Mooncake from 0.9 req/s (decodes starved while 12k-token prefills are
# preempted and recomputed forever); run_virtual stops such a run and the row records the error
declare -A POLICIES=([azure-conv]="vllm-default fairbatching fcfs prefill-first"
                     [azure-code]="vllm-default fairbatching fcfs prefill-first"
                     [mooncake-conv]="vllm-default fairbatching fcfs prefill-first")
for t in azure-conv azure-code mooncake-conv; do
  # shellcheck disable=SC2086
  bench --trace "$t" ${SLO[$t]} --rates ${RATES[$t]} --policies ${POLICIES[$t]} \
    --out "$OUT/$t.json" --plot "$OUT/$t.png" | tee "$OUT/$t.txt"
  # shellcheck disable=SC2086
  bench --trace "$t" ${SLO[$t]} --rates ${RATES[$t]} --policies vllm-default fairbatching \
    --attainment envelope --seed-envelope --out "$OUT/$t-envelope.json" --plot "$OUT/$t-envelope.png"
  # shellcheck disable=SC2086
  bench --trace "$t" ${SLO[$t]} --rates ${RATES[$t]} --policies vllm-default fairbatching \
    --max-num-batched-tokens 8192 --out "$OUT/$t-8192.json" --plot "$OUT/$t-8192.png"
done
