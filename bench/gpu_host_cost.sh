#!/usr/bin/env bash
# Host vs GPU share of chained calls under MLX's graph-commit settings, each in its own process
# (MLX reads these env vars once). After gpu-wheels.sh staged MLX CUDA in /tmp/mlxsite. Writes $OUT.
# Usage on the device machine:  bash bench/gpu_host_cost.sh        (env: REPS, SETTINGS)
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=/tmp/mlxsite:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SETTINGS=${SETTINGS:-"default|MLX_MAX_MB_PER_BUFFER=1000000|MLX_MAX_MB_PER_BUFFER=1000000 MLX_MAX_OPS_PER_BUFFER=400|MLX_USE_CUDA_GRAPHS=0"}
IFS='|' read -ra SET <<< "$SETTINGS"
for s in "${SET[@]}"; do
  echo "== $s"
  if [ "$s" = default ]; then e=(); else read -ra e <<< "$s"; fi
  env "${e[@]}" timeout 150 python3 bench/host_cost.py --reps "${REPS:-20}" 2>&1 | tee -a "$OUT/host_cost.jsonl"
done
