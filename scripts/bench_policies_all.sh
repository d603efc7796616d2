#!/usr/bin/env bash
# Regenerate docs/bench/*: one replica, llama-3-8b-a100, every batching policy on the three
# embedded traces (issue 4). Virtual time; about a minute on 2 cores.
#   <trace>.json/.png           `vllm serve` defaults on A100 (2048 tokens / 256 seqs), docs/design.md yardstick
#   <trace>-envelope.json/.png  same engine, seed 000's envelope yardstick, FairBatching on the seed envelope
#   <trace>-8192.json/.png      tuned engine (8192 tokens), docs/design.md yardstick
#   <trace>-tpot50[-envelope]   TPOT 50 ms under both yardsticks
#   azure-code-start183*        azure-code after its opening gap (--trace-start-s 183)
#   pd/, tb512/                 fairbatching-pd, and a 512-token vllm-default baseline
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(if [ -x .venv/bin/python ]; then echo .venv/bin/python; else echo python; fi)}
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
# TPOT 50 ms, the other end of issue 4's SLO range, under both yardsticks
declare -A RATES50=([azure-conv]="2 3 4 5 6 7 8" [azure-code]="0.3 0.6 0.9 1.2 1.5 1.8"
                    [mooncake-conv]="0.2 0.3 0.4 0.5 0.6 0.7 0.8 0.9")
for t in azure-conv azure-code mooncake-conv; do
  slo=${SLO[$t]/--tpot-ms 100/--tpot-ms 50}
  # shellcheck disable=SC2086
  bench --trace "$t" $slo --rates ${RATES50[$t]} --policies vllm-default fairbatching \
    --out "$OUT/$t-tpot50.json" --plot "$OUT/$t-tpot50.png"
  # shellcheck disable=SC2086
  bench --trace "$t" $slo --rates ${RATES50[$t]} --policies vllm-default fairbatching \
    --attainment envelope --seed-envelope --out "$OUT/$t-tpot50-envelope.json" --plot "$OUT/$t-tpot50-envelope.png"
done
# azure-code after its opening gap (63 requests in 0-39 s, nothing until 183 s)
for tpot in 100 50; do
  sfx=$([ "$tpot" = 100 ] && echo "" || echo "-tpot50")
  for y in tpot envelope; do
    extra=$([ "$y" = envelope ] && echo "--attainment envelope --seed-envelope" || echo "")
    ysfx=$([ "$y" = envelope ] && echo "-envelope" || echo "")
    # shellcheck disable=SC2086
    bench --trace azure-code --ttft-ms 1000 --tpot-ms "$tpot" --duration-s 300 --trace-start-s 183 \
      --rates 0.1 0.15 0.2 0.25 0.3 0.35 0.4 0.5 --policies vllm-default fairbatching $extra \
      --out "$OUT/azure-code-start183$sfx$ysfx.json" --plot "$OUT/azure-code-start183$sfx$ysfx.png"
  done
done
# FairBatching variants and baseline sensitivity (docs/bench/pd, docs/bench/tb512)
mkdir -p "$OUT/pd" "$OUT/tb512"
for cfg in "tpot100::--tpot-ms 100" "tpot50::--tpot-ms 50" "tpot50-envelope::--tpot-ms 50 --attainment envelope --seed-envelope"; do
  name=${cfg%%::*}; args=${cfg#*::}
  # shellcheck disable=SC2086
  bench --trace azure-code --ttft-ms 1000 --duration-s 300 --trace-start-s 183 --rates 0.1 0.15 0.2 0.25 0.3 0.35 0.4 0.5 \
    --policies vllm-default fairbatching fairbatching-pd $args --out "$OUT/pd/azure-code-start183-$name.json" | tee "$OUT/pd/azure-code-start183-$name.txt"
  # shellcheck disable=SC2086
  bench --trace azure-conv --ttft-ms 1000 --duration-s 300 --rates 2 3 4 5 6 6.5 7 7.5 8 \
    --policies vllm-default fairbatching fairbatching-pd $args --out "$OUT/pd/azure-conv-$name.json" | tee "$OUT/pd/azure-conv-$name.txt"
  # shellcheck disable=SC2086
  bench --trace mooncake-conv --ttft-ms 2500 --duration-s 600 --rates 0.2 0.3 0.4 0.5 0.6 0.7 0.8 0.9 \
    --policies vllm-default fairbatching fairbatching-pd $args --out "$OUT/pd/mooncake-conv-$name.json" | tee "$OUT/pd/mooncake-conv-$name.txt"
done
tb() { bench --policies vllm-default fairbatching --token-budget 512 --tpot-ms 100 "$@"; }
tb --trace azure-code --ttft-ms 1000 --duration-s 300 --trace-start-s 183 --rates 0.1 0.15 0.2 0.25 0.3 0.35 0.4 0.5 \
  --out "$OUT/tb512/azure-code-start183-tb512.json" | tee "$OUT/tb512/azure-code-start183-tb512.txt"
tb --trace azure-conv --ttft-ms 1000 --duration-s 300 --rates 2 3 4 5 6 6.5 7 7.5 8 \
  --out "$OUT/tb512/azure-conv-tb512.json" | tee "$OUT/tb512/azure-conv-tb512.txt"
tb --trace mooncake-conv --ttft-ms 2500 --duration-s 600 --rates 0.2 0.3 0.4 0.5 0.6 0.7 0.8 0.9 \
  --out "$OUT/tb512/mooncake-conv-tb512.json" | tee "$OUT/tb512/mooncake-conv-tb512.txt"
