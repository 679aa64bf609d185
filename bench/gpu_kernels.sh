#!/usr/bin/env bash
# Kernel figures on the H200 in one device call (after gpu-wheels.sh staged MLX CUDA in /tmp/mlxsite):
# the kernels' gpu tests, the host / GPU split of chained calls (bench/host_cost.py), bench/kernels.py
# (every op at ROWS, 8K/128K/1M, chain43) and, with STEP=1, the parallel prefill test and the 4-layer
# step. About 6 minutes (10 with STEP=1). Writes under $OUT.
# Usage on the device machine:  bash bench/gpu_kernels.sh      (env: TESTS=-k expr, REPS, ROWS, STEP)
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=/tmp/mlxsite:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
TESTS=${TESTS:-}
{
  nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv
  echo "== gpu tests"
  timeout 200 python3 -m pytest tests/kernels/test_cuda.py -q -p no:cacheprovider ${TESTS:+-k "$TESTS"} 2>&1 | tail -8
  echo "== host vs GPU per call (compiled chains; host = mx.async_eval time)"
  timeout 120 python3 bench/host_cost.py --reps "${REPS:-10}" \
    --cases compressor_rows:8:8192,indexer_rows:8:131072,indexer_rows:8:1048576,sparse_attention_rows:8:131072 \
    2>&1 | tee "$OUT/host_cost.jsonl"
  echo "== kernels"
  timeout 280 python3 bench/kernels.py --reps "${REPS:-10}" --rows "${ROWS:-1,2,4,8}" --out "$OUT" 2>&1
  if [ "${STEP:-0}" = 1 ]; then
    echo "== parallel prefill vs token-by-token decode on the GPU (f32 tiny model, TF32 off: tests/conftest.py)"
    timeout 120 python3 -m pytest tests/model/test_prefill.py -q -p no:cacheprovider 2>&1 | tail -4
    echo "== step"
    timeout 200 python3 bench/step.py --rows 1,8 --contexts 4096,131072 --arms fast,reference \
      --out "$OUT/step.json" 2>&1 | tail -16
  fi
} 2>&1 | tee "$OUT/gpu_kernels.log"
