#!/usr/bin/env bash
# Kernel figures on the H200 (after gpu-wheels.sh staged MLX CUDA in /tmp/mlxsite), in device calls that
# each fit the 600 s limit (a call past it loses its remaining output and ~10 minutes of budget):
#   PART=tests   bash bench/gpu_kernels.sh   the kernel gpu tests (the three ops, the mHC kernel): ~400 s
#                                            for all 128 on the H200 (session 6), at most 540
#   PART=host    bash bench/gpu_kernels.sh   the host / GPU split of chained calls (bench/host_cost.py:
#                                            indexer paths, wide heads, chain43): at most 150 s
#   PART=kernels bash bench/gpu_kernels.sh   bench/kernels.py (chain43 first, then every op at ROWS,
#                                            8K/128K/1M): ~170 s, at most 420
#   PART=step    bash bench/gpu_kernels.sh   the parallel prefill test, the engine tests (an import error
#                                            there: the device's Python lacks a server package) and the
#                                            4-layer step (fast, reference, fast without the mHC kernel):
#                                            ~180 s, at most 150 + 120 + 240
# PART=host and PART=kernels fit in one call together (PART="host kernels").
# Writes under $OUT.  Env: PART (default tests), TESTS=-k expr, CASES (host_cost's), REPS, ROWS.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=/tmp/mlxsite:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
TESTS=${TESTS:-}
PART=${PART:-tests}
{
  nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv
  python3 bench/provenance.py  # the code that ran (the device's .git can be stale)
  for part in $PART; do
  case "$part" in
    tests)
      echo "== gpu tests"
      timeout 540 python3 -m pytest tests/kernels/test_cuda.py tests/kernels/test_cuda_indexer.py tests/kernels/test_cuda_hc.py -q -p no:cacheprovider \
        ${TESTS:+-k "$TESTS"} 2>&1 | tail -12
      ;;
    host)
      echo "== host vs GPU per call (compiled chains; host = mx.async_eval time)"
      timeout 150 python3 bench/host_cost.py --reps "${REPS:-8}" --wide-heads 64,32 --indexer-paths \
        --cases "${CASES:-compressor_rows:8:8192,indexer_rows:8:8192,indexer_rows:8:131072,indexer_rows:8:1048576,sparse_attention_rows:8:131072}" \
        2>&1 | tee "$OUT/host_cost.jsonl"
      ;;
    kernels)
      echo "== kernels"
      timeout 420 python3 bench/kernels.py --reps "${REPS:-10}" --rows "${ROWS:-1,2,4,8}" --out "$OUT" 2>&1
      ;;
    step)
      echo "== parallel prefill vs token-by-token decode on the GPU (f32 tiny model, TF32 off: tests/conftest.py)"
      timeout 150 python3 -m pytest tests/model/test_prefill.py -q -p no:cacheprovider 2>&1 | tail -4
      echo "== engine on the GPU (start-up precompile incl. the mHC kernel, batched decode)"
      timeout 120 python3 -m pytest tests/service/test_worker.py -q -p no:cacheprovider 2>&1 | tail -4
      echo "== step"
      timeout 240 python3 bench/step.py --rows 1,8 --contexts 4096,131072 --arms fast,reference,fast_nohc \
        --out "$OUT/step.json" 2>&1 | tail -20
      ;;
    *) echo "PART must be tests, host, kernels or step (or several, space-separated)" ;;
  esac
  done
} 2>&1 | tee "$OUT/gpu_kernels-${PART// /-}.log"
