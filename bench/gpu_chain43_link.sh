#!/usr/bin/env bash
# chain43 linked by data (`after`: every layer's ops wait for the previous layer's output, as in the
# model) vs by mx.depends (no CUDA-graph edge: compressors and indexers of all layers may run at once):
# where the data-linked step's GPU time goes (ncu, each kernel's duration in one step) and the
# host / total split per MLX_MAX_OPS_PER_BUFFER. After gpu-wheels.sh staged MLX CUDA; writes under $OUT.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=/tmp/mlxsite:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 bench/provenance.py
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv
# our kernels only (-k), past the warm-up evals: ~147 launches per step
timeout 200 /usr/local/cuda/bin/ncu --metrics gpu__time_duration.sum --csv --cache-control none \
  --clock-control none -k regex:dsv4 --launch-skip 600 --launch-count 300 \
  python3 bench/profile_kernels.py --chain43 --link after --reps 3 > "$OUT/ncu_chain43_after.csv" 2>&1
python3 bench/ncu_sum.py "$OUT/ncu_chain43_after.csv"
for ops in ${OPS:-100 40 20}; do
  MLX_MAX_OPS_PER_BUFFER=$ops timeout 120 python3 bench/host_cost.py --reps 10 --cases "" --no-chain43 \
    --chain43-variants depends:,after: 2>&1 | grep chain43 | sed "s/^/ops=$ops /"
done
