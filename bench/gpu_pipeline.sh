#!/usr/bin/env bash
# Pipelined decode on the H200 (after gpu-wheels.sh staged MLX CUDA in /tmp/mlxsite): the engine tests
# on the GPU (tests/service/test_worker.py, test_pipeline.py), then the HTTP load test on the embedded
# tiny model with and without --no-pipeline, one server each. Writes under $OUT.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=/tmp/mlxsite:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
{
  python3 bench/provenance.py
  echo "== engine tests on the GPU (pipelined decode is the default)"
  timeout 150 python3 -m pytest tests/service/test_worker.py tests/service/test_pipeline.py -q -p no:cacheprovider 2>&1 | tail -4
  for arm in pipeline no-pipeline; do
    echo "== serve, tiny model, $arm"
    args=(); [ "$arm" = no-pipeline ] && args=(--server-args=--no-pipeline)
    timeout 120 python3 bench/serve.py --concurrency 1,8 --output-len 64 --prompts-per-concurrency 4 "${args[@]}" \
      --out "$OUT/serve-tiny-$arm.json" 2>&1 | tail -3
  done
} 2>&1 | tee "$OUT/gpu_pipeline.log"
