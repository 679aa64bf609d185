#!/usr/bin/env bash
# Kernel iteration on the H200 (after gpu-wheels.sh staged MLX CUDA in /tmp/mlxsite): the kernels' gpu
# tests, then bench/kernels.py and the 4-layer step with MLX's CUDA graphs on (default) and off, and
# with small graphs (MLX_MAX_OPS_PER_BUFFER). Writes under $OUT.   Usage: bash bench/gpu_kernels.sh
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=/tmp/mlxsite:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
TESTS=${TESTS:-}
ROWS=${ROWS:-1,8}
{
  which nsys ncu nvcc 2>/dev/null; nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv
  echo "== gpu tests"; timeout 200 python3 -m pytest tests/kernels/test_cuda.py -q -p no:cacheprovider ${TESTS:+-k "$TESTS"} 2>&1 | tail -6
  for g in 1 0; do
    echo "== kernels, MLX_USE_CUDA_GRAPHS=$g"
    MLX_USE_CUDA_GRAPHS=$g timeout 200 python3 bench/kernels.py --rows "$ROWS" --out "$OUT/graphs$g" 2>&1 | tail -27
  done
  echo "== kernels, MLX_MAX_OPS_PER_BUFFER=16"
  MLX_MAX_OPS_PER_BUFFER=16 timeout 100 python3 bench/kernels.py --rows 8 --ctxs 131072 --out "$OUT/ops16" 2>&1 | tail -8
  for g in 1 0; do
    echo "== step, MLX_USE_CUDA_GRAPHS=$g"
    MLX_USE_CUDA_GRAPHS=$g timeout 100 python3 bench/step.py --rows 1,8 --contexts 4096 --out "$OUT/step_graphs$g.json" 2>&1 | tail -6
  done
} 2>&1 | tee "$OUT/gpu_kernels.log"
