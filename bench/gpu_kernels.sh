#!/usr/bin/env bash
# Kernel figures on the H200 (after gpu-wheels.sh staged MLX CUDA in /tmp/mlxsite), in two device calls
# that each fit the 600 s limit (a call past it loses its remaining output and ~10 minutes of budget):
#   bash bench/gpu_kernels.sh          the kernels' gpu tests, the host / GPU split of chained calls
#                                      (bench/host_cost.py), bench/kernels.py (every op at ROWS, 8K/128K/1M,
#                                      chain43): at most 170 + 90 + 290 s (+ ~25 s of install)
#   STEP=1 bash bench/gpu_kernels.sh   the parallel prefill test, the mHC kernel's tests and the 4-layer step
#                                      (fast, reference, fast + mHC kernel): at most 150 + 90 + 240 s
# Writes under $OUT.  Env: TESTS=-k expr, REPS, ROWS, STEP.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=/tmp/mlxsite:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
TESTS=${TESTS:-}
{
  nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv
  if [ "${STEP:-0}" != 1 ]; then
    echo "== gpu tests"
    timeout 170 python3 -m pytest tests/kernels/test_cuda.py -q -p no:cacheprovider ${TESTS:+-k "$TESTS"} 2>&1 | tail -8
    echo "== host vs GPU per call (compiled chains; host = mx.async_eval time)"
    timeout 90 python3 bench/host_cost.py --reps "${REPS:-8}" --wide-heads 64,32 \
      --cases compressor_rows:8:8192,indexer_rows:8:8192,indexer_rows:8:131072,indexer_rows:8:1048576,sparse_attention_rows:8:131072 \
      2>&1 | tee "$OUT/host_cost.jsonl"
    echo "== kernels"
    timeout 290 python3 bench/kernels.py --reps "${REPS:-8}" --rows "${ROWS:-1,2,4,8}" --out "$OUT" 2>&1
  else
    echo "== parallel prefill vs token-by-token decode on the GPU (f32 tiny model, TF32 off: tests/conftest.py)"
    timeout 150 python3 -m pytest tests/model/test_prefill.py -q -p no:cacheprovider 2>&1 | tail -4
    echo "== the mHC pre-mix kernel (opt-in until this passes)"
    timeout 90 python3 -m pytest tests/kernels/test_cuda_hc.py -q -p no:cacheprovider 2>&1 | tail -4
    echo "== step"
    timeout 240 python3 bench/step.py --rows 1,8 --contexts 4096,131072 --arms fast,reference,fast_hc \
      --out "$OUT/step.json" 2>&1 | tail -16
  fi
} 2>&1 | tee "$OUT/gpu_kernels.log"
