#!/usr/bin/env bash
# Per-kernel GPU time of each fast-path case under nsys (after gpu-wheels.sh staged MLX CUDA):
# the wall time per call (compiled chain) beside the kernels' summed time per call.
# Usage on the device machine:  bash bench/gpu_profile.sh [case ...]   (writes under $OUT)
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=/tmp/mlxsite:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/prof"
NSYS=$(command -v nsys || ls /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2>/dev/null | head -1)
cases=("$@")
[ ${#cases[@]} -gt 0 ] || cases=(compressor_rows:8:8192 indexer_rows:8:8192 indexer_rows:8:131072
  indexer_rows:8:1048576 sparse_attention_rows:8:8192 sparse_attention_rows:8:131072 chain43)
echo "nsys: ${NSYS:-none}"
for c in "${cases[@]}"; do
  if [ "$c" = chain43 ]; then a=(--chain43 --reps 10); else a=(--case "$c" --reps 20); fi
  tag=${c//:/_}
  if [ -n "$NSYS" ]; then
    timeout 120 "$NSYS" profile -t cuda -o "/tmp/p_$tag" --force-overwrite true \
      python3 bench/profile_kernels.py "${a[@]}" 2>&1 | grep '^{' | tee -a "$OUT/prof/wall.jsonl"
    timeout 60 "$NSYS" stats -q -r cuda_gpu_kern_sum,cuda_api_sum --format csv -o "$OUT/prof/$tag" \
      "/tmp/p_$tag.nsys-rep" >/dev/null 2>&1
  else  # ncu: each kernel's duration (replayed alone), past the warm-up launches
    timeout 120 python3 bench/profile_kernels.py "${a[@]}" | tee -a "$OUT/prof/wall.jsonl"
    if [ "$c" = chain43 ]; then sk=(--launch-skip 1000 --launch-count 300); else sk=(--launch-skip 40 --launch-count 40); fi
    timeout 150 /usr/local/cuda/bin/ncu --metrics gpu__time_duration.sum --csv --cache-control none \
      --clock-control none "${sk[@]}" python3 bench/profile_kernels.py "${a[@]}" --reps 3 > "$OUT/prof/$tag.csv" 2>&1
  fi
done
ls "$OUT/prof"
