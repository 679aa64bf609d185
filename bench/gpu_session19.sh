#!/usr/bin/env bash
# Session 19, on the device machine after gpu-wheels.sh staged MLX CUDA. PART (space-separated, in order):
#   attn  gpu attention tests (every launch plan, dispatch, precompile) on this tree, then on a copy with
#         $EPI's kernels/cuda (`git archive next/dsplit-epilogue kernels/cuda | tar -x -C old_epi`)
#   ncu   GPU time per attention kernel in chain43 (8 rows, 8K, linked by `after`; ncu, clocks locked to base,
#         caches warm): this tree, $EPI's kernels and $OLD's (`git archive main kernels/cuda | tar -x -C old_kernels`)
#   pair  gpu tests of the CSA compressor pair (test_cuda_pair.py), the in-place compressor and precompile
#   ncupair GPU time per kernel in chain43 (all custom kernels, ncu as above): the CSA compressors as one
#         dispatch (compressor_pair_rows_inplace) vs two (`--drop pair`), this tree
#   wallpair chain43's wall time per step, the same two arms alternated twice in one process (bench/host_cost.py)
#   timeline the CUDA API calls, GPU activities and idle gaps of chained calls at 1 and 8 rows (bench/timeline.py,
#         CUPTI through torch.profiler: the device has no nsys); traces tarred as timeline19.tgz
#   tlstep  bench/timeline.py for chain43 and the 4-layer decode step (bench/step.py's model, 4K, 1 and 8 rows)
#   commitstep the 4-layer decode step's timeline (wall, GPU busy, graph launches and their API time) under
#         MLX_MAX_OPS_PER_BUFFER $OPS (default "8 32 100"), each in its own process, ROUNDS (default 2) alternated
#   head  the output head's f32 matmul at 1-8 rows, x @ W.T vs (W @ x.T).T, against the floor (bench/head_matmul.py)
#   ws    (branch next/idx-workspace) gpu tests of the indexer's workspace form, the indexer, precompile and the
#         tiny model, then chain43's wall time with and without the workspace (`--drop ws`) alternated twice
#   t1/t2/figs as in gpu_session18.sh
source "$(dirname "$0")/gpu_prelude.sh"
tree_with() {  # $1 dir name under /tmp, $2 kernels source: a copy of this tree with those kernels/cuda
  rm -rf "/tmp/$1"; cp -r "$PWD" "/tmp/$1"; cp "$2"/kernels/cuda/*.py "/tmp/$1/kernels/cuda/"
}
ATTN="sparse_attention or precompile or dispatch"
for part in ${PART:-attn}; do
  case "$part" in
    attn)
      echo "== gpu attention tests: this tree"
      timeout 300 python3 -m pytest tests/kernels/test_cuda.py -m gpu -k "$ATTN" -q --tb=short -rf \
        -p no:cacheprovider 2>&1 | tail -12
      if [ -d "${EPI:-old_epi}" ]; then
        tree_with epi "${EPI:-old_epi}"
        echo "== gpu attention tests: ${EPI:-old_epi} kernels"
        (cd /tmp/epi && PYTHONPATH=/tmp/mlxsite:/tmp/epi timeout 300 python3 -m pytest tests/kernels/test_cuda.py \
          -m gpu -k "$ATTN" -q --tb=short -rf -p no:cacheprovider 2>&1 | tail -12)
      fi ;;
    ncu)
      tree_with old "${OLD:-old_kernels}"; tree_with epi "${EPI:-old_epi}"
      for t in new epi old; do
        tree=$PWD; [ $t != new ] && tree=/tmp/$t
        (cd "$tree" && PYTHONPATH=/tmp/mlxsite:$tree timeout 150 $NCU --metrics gpu__time_duration.sum --csv \
          --cache-control none --clock-control base -k "regex:attn" --launch-skip 128 --launch-count 192 \
          python3 bench/profile_kernels.py --chain43 --link after --reps 4 > "$OUT/ncu/chain43_$t.csv" 2>&1)
        echo "chain43_$t: $(grep -c gpu__time_duration "$OUT/ncu/chain43_$t.csv") launches"
        python3 bench/ncu_sum.py "$OUT/ncu/chain43_$t.csv" | head -6
      done
      tar czf "$OUT/ncu19.tgz" -C "$OUT" ncu && rm -rf "$OUT/ncu" ;;
    pair)
      echo "== gpu tests: compressor pair, in-place compressor, precompile"
      timeout 400 python3 -m pytest tests/kernels/test_cuda_pair.py tests/kernels/test_cuda_inplace.py \
        tests/kernels/test_cuda.py -k "pair or inplace or readers or precompile" -m gpu -q --tb=short -rf \
        -p no:cacheprovider 2>&1 | tail -12 ;;
    ncupair)
      for t in pair two; do
        drop=""; n=252; [ $t = two ] && { drop=pair; n=294; }  # 2 steps: 126 launches a step, or 147
        timeout 150 $NCU --metrics gpu__time_duration.sum --csv --cache-control none --clock-control base \
          -k "regex:dsv4" --launch-skip $n --launch-count $n python3 bench/profile_kernels.py --chain43 --link after \
          --drop "$drop" --reps 4 > "$OUT/ncu/chain43_$t.csv" 2>&1
        python3 bench/ncu_sum.py "$OUT/ncu/chain43_$t.csv" | head -9
      done
      tar czf "$OUT/ncu19pair.tgz" -C "$OUT" ncu && rm -rf "$OUT/ncu"; mkdir -p "$OUT/ncu" ;;
    wallpair)
      timeout 300 python3 bench/host_cost.py --cases "" --no-chain43 --reps 20 \
        --chain43-variants after:,after:pair,after:,after:pair 2>&1 | grep chain43 ;;
    timeline)
      mkdir -p "$OUT/tl"
      timeout 300 python3 bench/timeline.py --out "$OUT/tl" --cases compressor_rows:1:8192,compressor_rows:8:8192,\
indexer_rows:1:8192,indexer_rows:8:8192,sparse_attention_rows:1:131072,sparse_attention_rows:8:131072 2>&1 \
        | grep -v "^USDT\|^STAGE"
      cp "$OUT/tl/timeline.json" "$OUT/timeline.json"; tar czf "$OUT/timeline19.tgz" -C "$OUT" tl && rm -rf "$OUT/tl" ;;
    tlstep)  # the same for chain43 and the 4-layer decode step at 1 and 8 rows
      mkdir -p "$OUT/tl"
      timeout 400 python3 bench/timeline.py --out "$OUT/tl" --cases chain43 --step 1,8 --evals 3 2>&1 \
        | grep -v "^USDT\|^STAGE\|UserWarning\|_warn_once"
      cp "$OUT/tl/timeline.json" "$OUT/timeline_step.json"; tar czf "$OUT/timeline19step.tgz" -C "$OUT" tl && rm -rf "$OUT/tl" ;;
    head) timeout 200 python3 bench/head_matmul.py --out "$OUT" 2>&1 ;;
    commitstep)
      for r in $(seq "${ROUNDS:-2}"); do
        for ops in ${OPS:-8 32 100}; do
          echo "== round $r, MLX_MAX_OPS_PER_BUFFER=$ops"
          MLX_MAX_OPS_PER_BUFFER=$ops timeout 150 python3 bench/timeline.py --out "/tmp/tl_$ops" --cases "" \
            --step 1,8 --evals 3 2>&1 | grep -E "^== |gpu_per_eval|cudaGraphLaunch" | cut -c1-160
        done
      done ;;
    ws)
      echo "== gpu tests: indexer workspace, indexer, precompile, tiny model"
      timeout 400 python3 -m pytest tests/kernels/test_cuda_workspace.py tests/kernels/test_cuda_indexer.py \
        tests/kernels/test_cuda.py tests/kernels/test_cuda_inplace.py -k "workspace or indexer or precompile or tiny" \
        -m gpu -q --tb=short -rf -p no:cacheprovider 2>&1 | tail -12
      timeout 200 python3 bench/host_cost.py --cases "" --no-chain43 --reps 20 \
        --chain43-variants after:,after:ws,after:,after:ws 2>&1 | grep chain43 ;;
    t1|t2|figs) PART=$part bash bench/gpu_session18.sh ;;
  esac
done
# stepab: bench/step.py (8 rows, 4K, fast and reference) on this tree and on $PREV (a whole tree:
# `git archive f77d29e | tar -x -C prev_tree`, before compressor_pair), alternated: new, prev, new
if [[ " ${PART:-} " == *" stepab "* ]]; then
  for t in new prev new; do
    tree=$PWD; [ $t = prev ] && tree=$PWD/${PREV:-prev_tree}
    echo "== step, $t"
    (cd "$tree" && PYTHONPATH=/tmp/mlxsite:$tree timeout 120 python3 bench/step.py --rows 8 --contexts 4096 \
      --arms fast,reference --out "$OUT/step_${t}.json" 2>&1 | grep -E "^ +4096")
  done
fi
