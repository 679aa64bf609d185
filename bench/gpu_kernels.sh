#!/usr/bin/env bash
# Kernel figures on the H200 in one device call (after gpu-wheels.sh staged MLX CUDA in /tmp/mlxsite):
# the kernels' gpu tests, bench/kernels.py (every op, rows 1/2/4/8, 8K/128K/1M, chain43), and the
# 4-layer step (fast vs fast with per-op mx.compile). About 10 minutes. Writes under $OUT.
# Usage on the device machine:  bash bench/gpu_kernels.sh      (env: TESTS=-k expr, REPS, ROWS)
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=/tmp/mlxsite:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
TESTS=${TESTS:-}
{
  nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv
  echo "== gpu tests"
  timeout 170 python3 -m pytest tests/kernels/test_cuda.py -q -p no:cacheprovider ${TESTS:+-k "$TESTS"} 2>&1 | tail -8
  echo "== parallel prefill vs token-by-token decode on the GPU (f32 tiny model, TF32 off: tests/conftest.py)"
  timeout 120 python3 -m pytest tests/model/test_prefill.py -q -p no:cacheprovider -k "chunks0 or blocks" 2>&1 | tail -4
  echo "== kernels"
  timeout 280 python3 bench/kernels.py --reps "${REPS:-10}" --rows "${ROWS:-1,2,4,8}" --out "$OUT" 2>&1
  echo "== prefill (parallel vs token-serial, 4-layer V4-Flash dims)"
  timeout 150 python3 bench/prefill.py --tokens 512 --chunk 256 --out "$OUT/prefill.json" 2>&1 | tail -2
  echo "== step"
  timeout 200 python3 bench/step.py --rows 1,8 --contexts 4096,131072 --arms fast,fast_opc \
    --out "$OUT/step.json" 2>&1 | tail -16
} 2>&1 | tee "$OUT/gpu_kernels.log"
