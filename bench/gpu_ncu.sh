#!/usr/bin/env bash
# Nsight Compute detail (--set full: throughput, warp stalls, occupancy) of kernels in fast-path cases,
# after gpu-wheels.sh staged MLX CUDA. Usage on the device machine:
#   bash bench/gpu_ncu.sh <kernel-regex>@<op:rows:ctx> ...     e.g. idx_merge@indexer_rows:8:131072
# Writes $OUT/ncu/<kernel>_<case>.txt.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=/tmp/mlxsite:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/ncu"
for kc in "$@"; do
  k=${kc%@*}; c=${kc#*@}
  timeout 200 /usr/local/cuda/bin/ncu --set full -k "regex:$k" --launch-skip 5 --launch-count 1 \
    python3 bench/profile_kernels.py --case "$c" --reps 2 > "$OUT/ncu/${k}_${c//:/_}.txt" 2>&1
  grep -E "Duration|Registers Per|Achieved Occupancy|Memory Throughput|Compute \(SM\) Throughput" \
    "$OUT/ncu/${k}_${c//:/_}.txt" | head -8
done
