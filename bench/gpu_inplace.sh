#!/usr/bin/env bash
# The in-place compressor (kernels/cuda/compressor_inplace.py) on the H200, after gpu-wheels.sh staged MLX
# CUDA in /tmp/mlxsite. One device call per PART (each fits the 600 s limit):
#   PART=tests   the in-place gpu tests + the indexer / attention / dispatch / precompile gpu tests (`after`)
#   PART=engine  the model in place vs functional (gpu test), the state arrays' strides, and the engine
#                tests (worker, pipelined decode) with the in-place compressor (the default since
#                session 9; DSV4_INPLACE_COMPRESSOR=1 is kept explicit here)
#   PART=bench   bench/kernels.py at 8 rows (chain43 first: in place vs functional compressor) and the
#                4-layer step (fast / fast_pipe, each with the in-place and the functional compressor)
# Writes under $OUT.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=/tmp/mlxsite:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PART=${PART:-tests}
{
  python3 bench/provenance.py
  for part in $PART; do
  case "$part" in
    tests)
      echo "== in-place compressor gpu tests"
      timeout 200 python3 -m pytest tests/kernels/test_cuda_inplace.py -q -p no:cacheprovider 2>&1 | tail -6
      echo "== indexer / attention / dispatch / precompile gpu tests"
      timeout 330 python3 -m pytest tests/kernels/test_cuda.py tests/kernels/test_cuda_indexer.py -q -p no:cacheprovider \
        -k "indexer_matches or sparse_attention_matches or dispatch or precompile or compressor" 2>&1 | tail -6
      ;;
    engine)
      echo "== the model in place vs functional (gpu test) and the state arrays' strides"
      timeout 150 python3 -m pytest tests/kernels/test_cuda_inplace.py -k tiny_model -q -p no:cacheprovider 2>&1 | tail -4
      timeout 60 python3 bench/gpu_inplace_model.py --strides 2>&1 | grep -i score | head -8
      echo "== engine tests on the GPU with the in-place compressor (DSV4_INPLACE_COMPRESSOR=1)"
      DSV4_INPLACE_COMPRESSOR=1 timeout 240 python3 -m pytest tests/service/test_worker.py \
        tests/service/test_pipeline.py -q -p no:cacheprovider 2>&1 | tail -6
      ;;
    bench)
      echo "== kernels, 8 rows"
      timeout 330 python3 bench/kernels.py --reps "${REPS:-10}" --rows 8 --out "$OUT" 2>&1 | tail -24
      echo "== step"
      timeout 240 python3 bench/step.py --rows 1,8 --contexts 4096,131072 \
        --arms fast,fast_functional,fast_pipe,fast_pipe_functional --out "$OUT/step.json" 2>&1 | tail -12
      ;;
    *) echo "PART must be tests, engine or bench" ;;
  esac
  done
} 2>&1 | tee "$OUT/gpu_inplace-${PART// /-}.log"
