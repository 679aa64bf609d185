#!/usr/bin/env bash
# Session 18, on the device machine after gpu-wheels.sh staged MLX CUDA. PART (space-separated, in order):
#   t1    gpu tests: test_cuda.py + test_cuda_indexer.py (attention, indexer, dispatch, precompile)
#   t2    gpu tests: test_cuda_inplace.py, test_cuda_hc.py, test_upload.py, test_cuda_lists.py
#   hc    gpu tests: test_cuda_hc.py (the hc_pre_mix kernel: Sinkhorn one thread per element, x's loads batched)
#   ncu   GPU time per kernel, host-independent (ncu, clocks locked to base, caches warm): chain43 (8 rows, 8K,
#         linked by `after`) and the compressor's chains (1 and 8 rows), this tree vs $OLD's kernels/cuda
#         (`git archive 5cde372 kernels/cuda | tar -x -C old_kernels`: before a0d667c and the hc change);
#         hc_pre_mix (V4-Flash: 8 rows, hc_mult 4, hidden 4096, 20 Sinkhorn rounds) likewise
#   hcstep bench/step.py (fast, 8 rows, 4K), this tree vs the same tree with $OLD's kernels/cuda/hc.py only,
#         ROUNDS (default "1 2") alternated
#   figs  bench/kernels.py --rows 8 (chains of 10, chain43) and bench/step.py (fast, reference; 1 and 8 rows)
source "$(dirname "$0")/gpu_prelude.sh"
HC='import mlx.core as mx
from kernels.cuda.hc import hc_pre_mix_cuda
m, h = mx.random.normal((8, 24)), mx.random.normal((8, 4, 4096)).astype(mx.bfloat16)
s, b = mx.random.normal((3,)), mx.random.normal((24,))
for _ in range(12):
    mx.eval(hc_pre_mix_cuda(m, s, b, h, iters=20, eps=1e-6))'
durations() {  # $1 tag, $2 tree, $3 kernel regex, $4 skip, $5 count, the rest: the python command
  local tag=$1 tree=$2 rx=$3 sk=$4 n=$5; shift 5
  (cd "$tree" && PYTHONPATH=/tmp/mlxsite:$tree timeout 150 $NCU --metrics gpu__time_duration.sum --csv \
    --cache-control none --clock-control base -k "regex:$rx" --launch-skip "$sk" --launch-count "$n" "$@" \
    > "$OUT/ncu/$tag.csv" 2>&1)
  echo "$tag: $(grep -c gpu__time_duration "$OUT/ncu/$tag.csv") launches"
}
for part in ${PART:-t1}; do
  case "$part" in
    t1) echo "== gpu tests: attention, indexer"
        pyt 560 tests/kernels/test_cuda.py tests/kernels/test_cuda_indexer.py ;;
    t2) echo "== gpu tests: in-place compressor, hc, upload, lists"
        pyt 560 tests/kernels/test_cuda_inplace.py tests/kernels/test_cuda_hc.py tests/kernels/test_upload.py \
          tests/kernels/test_cuda_lists.py ;;
    hc) echo "== gpu tests: hc"
        pyt 200 tests/kernels/test_cuda_hc.py ;;
    ncu)
      rm -rf /tmp/old; cp -r "$PWD" /tmp/old; cp "${OLD:-old_kernels}"/kernels/cuda/*.py /tmp/old/kernels/cuda/
      for t in new old; do
        tree=$PWD; [ $t = old ] && tree=/tmp/old
        durations "chain43_$t" "$tree" dsv4 450 300 python3 bench/profile_kernels.py --chain43 --link after --reps 4
        for r in 1 8; do
          durations "comp${r}_$t" "$tree" dsv4 25 20 python3 bench/profile_kernels.py --case "compressor_rows:$r:8192" \
            --reps 2 --chain 10
        done
        durations "hc_$t" "$tree" hc_pre_mix 2 10 python3 -c "$HC"
      done
      tar czf "$OUT/ncu18.tgz" -C "$OUT" ncu && rm -rf "$OUT/ncu" ;;  # one file back (the tool caps the count)
    hcstep)
      rm -rf /tmp/oldhc; cp -r "$PWD" /tmp/oldhc; cp "${OLD:-old_kernels}"/kernels/cuda/hc.py /tmp/oldhc/kernels/cuda/
      for r in ${ROUNDS:-1 2}; do
        for t in new old; do
          tree=$PWD; [ $t = old ] && tree=/tmp/oldhc
          echo "== round $r, hc $t"
          (cd "$tree" && PYTHONPATH=/tmp/mlxsite:$tree timeout 100 python3 bench/step.py --rows 8 --contexts 4096 \
            --arms fast --out "$OUT/step_hc_${t}_$r.json" 2>&1 | grep -E "^ +4096")
        done
      done ;;
    figs)
      echo "== kernels, 8 rows (chains of 10 calls), chain43"
      timeout 280 python3 bench/kernels.py --reps 5 --rows 8 --out "$OUT" 2>&1 | tail -14
      echo "== step"
      timeout 170 python3 bench/step.py --rows 1,8 --contexts 4096 --arms fast,reference \
        --out "$OUT/step.json" 2>&1 | tail -9 ;;
  esac
done
