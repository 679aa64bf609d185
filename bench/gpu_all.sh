#!/usr/bin/env bash
# One device call for every GPU figure of the closing note (after gpu-wheels.sh staged MLX CUDA in
# /tmp/mlxsite): gpu tests, the decode step (bf16 fast vs reference; mxfp8/mxfp4), 1 vs 2 GPUs.
# The kernel benchmark has its own call (about 6 minutes): bench/gpu_kernels.sh.
# Usage on the device machine (nvidia-h200-x2):  bash bench/gpu_all.sh   (writes under $OUT)
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=/tmp/mlxsite:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
log="$OUT/all.log"
# mlx.launch's entry point (pip --target leaves no console script on PATH); `timeout` needs a program.
launch=(python3 -c "import sys; from mlx._distributed_utils.launch import main; sys.argv[0]='mlx.launch'; sys.exit(main())")
{
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
  python3 -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device())"
  echo "== gpu tests"; timeout 100 python3 -m pytest tests/kernels/test_cuda.py tests/kernels/test_cuda_indexer.py -q -p no:cacheprovider 2>&1 | tail -4
  echo "== step bf16"; timeout 170 python3 bench/step.py --out "$OUT/step_bf16.json" 2>&1 | tail -20
  echo "== step mxfp"; timeout 100 python3 bench/step.py --quantize mxfp --rows 1,8 --contexts 4096 \
      --out "$OUT/step_mxfp.json" 2>&1 | tail -8
  echo "== distributed"; timeout 150 "${launch[@]}" --backend nccl -n 2 --env NCCL_NVLS_ENABLE=0 -- \
      python3 bench/distributed_step.py --backend nccl --out "$OUT/distributed_step.json" 2>&1 | tail -20
} 2>&1 | tee "$log"
