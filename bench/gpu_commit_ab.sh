#!/usr/bin/env bash
# A/B of MLX's CUDA-graph commit size (MLX_MAX_OPS_PER_BUFFER, read once per process; 100 on sm_90)
# for the decode step and chain43: settings interleaved over ROUNDS rounds, each run in its own
# process, so host drift hits every setting alike. After gpu-wheels.sh staged MLX CUDA in /tmp/mlxsite.
# Usage on the device machine:  bash bench/gpu_commit_ab.sh   (env: OPS, ROUNDS, OUT)
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=/tmp/mlxsite:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for r in $(seq "${ROUNDS:-2}"); do
  for ops in ${OPS:-100 25 12}; do
    echo "== round $r ops $ops"
    MLX_MAX_OPS_PER_BUFFER=$ops timeout 90 python3 bench/step.py --rows 1,8 --contexts 4096 --arms fast --reps 15 \
      --out "$OUT/step-ops$ops-r$r.json" 2>&1 | grep -E "^ +[0-9]"
    MLX_MAX_OPS_PER_BUFFER=$ops timeout 60 python3 bench/host_cost.py --reps 10 --cases "" 2>&1 | grep chain43
  done
done 2>&1 | tee "$OUT/commit_ab.log"
