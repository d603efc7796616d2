#!/usr/bin/env bash
# Regenerate docs/evaluation/*.json/.png (issue 7): bench-fleet sweeps at 16 and 64 simulated
# replicas on the three embedded traces, both profiles. Engines run `vllm serve`'s own batch
# defaults for the profile's GPU (A100: 2048 tokens / 256 seqs; H100: 8192 / 1024).
# Usage: scripts/bench_fleet_all.sh [RUN ...]  (RUN = <trace>-<replicas>[-70b]; default: all)
# Wall time on 2 shared cores: ~2-5 min per 16-replica run, ~10-25 min per 64-replica run, ~15 min
# for the 256-replica run (three policies only).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(if [ -x .venv/bin/python ]; then echo .venv/bin/python; else echo python; fi)}
OUT=${OUT:-docs/evaluation}
mkdir -p "$OUT"
P70=llama-2-70b-h100-tp4
declare -A ARGS=(
  [azure-conv-16]="--trace azure-conv --replicas 16 --rates 68 79 90 96 102 107 113 119 125 131 137 143 149 155 161 167"
  [azure-code-16]="--trace azure-code --replicas 16 --rates 16 24 32 40 50 60 72 84 90 96 102"
  [mooncake-conv-16]="--trace mooncake-conv --replicas 16 --ttft-ms 2500 --rates 5 8 11 14 16 18 20 22 24"
  [azure-conv-16-70b]="--trace azure-conv --replicas 16 --profile $P70 --rates 74 86 99 105 111 117 123 130 136 142 148 154 160 166"
  [azure-code-16-70b]="--trace azure-code --replicas 16 --profile $P70 --rates 16 24 32 40 50 60 72 84 90 96 102"
  [mooncake-conv-16-70b]="--trace mooncake-conv --replicas 16 --profile $P70 --ttft-ms 2500 --rates 5 8 11 14 16 18 20 22 24 26 28 30 32 34"
  [azure-conv-64]="--trace azure-conv --replicas 64 --rates 361 429 452 474 497 520 545 570 595"
  [azure-code-64]="--trace azure-code --replicas 64 --rates 96 128 160 200 240 280 330 380 410 440"
  [mooncake-conv-64]="--trace mooncake-conv --replicas 64 --ttft-ms 2500 --rates 32 44 56 64 72 80 88 96 104 112 120"
  [azure-conv-64-70b]="--trace azure-conv --replicas 64 --profile $P70 --rates 394 468 493 517 542 567 591 615"
  [azure-code-64-70b]="--trace azure-code --replicas 64 --profile $P70 --rates 200 240 280 330 380 410 440"
  [mooncake-conv-64-70b]="--trace mooncake-conv --replicas 64 --profile $P70 --ttft-ms 2500 --rates 56 64 72 80 88 96 104"
  [azure-conv-16-300s]="--trace azure-conv --replicas 16 --duration-s 300 --policies round-robin least-outstanding
                        pab+fairbatching --rates 107 113 119 125 131 137"
  [azure-conv-16-sample2]="--trace azure-conv --replicas 16 --seed 1 --window-offset 0.5
                           --rates 68 79 90 96 102 107 113 119 125 131 137 143 149 155 161 167"
  [azure-code-16-sample2]="--trace azure-code --replicas 16 --seed 1 --window-offset 0.5 --rates 16 24 32 40 50 60 72 84 90 96 102"
  [mooncake-conv-16-sample2]="--trace mooncake-conv --replicas 16 --seed 1 --window-offset 0.5 --ttft-ms 2500
                              --rates 5 8 11 14 16 18 20 22 24 26 28"
  [azure-code-256]="--trace azure-code --replicas 256 --policies round-robin least-outstanding pab+fairbatching
                    --rates 1000 1150 1300 1450 1600 1750 1900"
  [mooncake-conv-256]="--trace mooncake-conv --replicas 256 --ttft-ms 2500
                       --policies round-robin least-outstanding static-queue-cap pab+fairbatching
                       --rates 200 230 260 290 320 350 380"
  [azure-conv-256]="--trace azure-conv --replicas 256 --policies round-robin least-outstanding pab+fairbatching
                    --rates 1750 1850 1950 2050 2150"
)
ORDER=(azure-conv-16 azure-code-16 mooncake-conv-16 azure-conv-16-70b azure-code-16-70b mooncake-conv-16-70b
       azure-code-64 mooncake-conv-64 azure-conv-64 azure-conv-64-70b azure-code-64-70b mooncake-conv-64-70b azure-code-256
       mooncake-conv-256 azure-conv-256
       azure-conv-16-300s azure-conv-16-sample2 azure-code-16-sample2 mooncake-conv-16-sample2)
RUNS=("$@")
[ ${#RUNS[@]} -gt 0 ] || RUNS=("${ORDER[@]}")
for run in "${RUNS[@]}"; do
  name=${run%-70b}
  [ "$name" = "$run" ] || name="$name-$P70"
  echo "== $run" >&2
  # shellcheck disable=SC2086
  "$PY" -m loadgen.fleet.bench ${ARGS[$run]} --jobs "${JOBS:-2}" --out "$OUT/$name.json" --plot "$OUT/$name.png"
done
