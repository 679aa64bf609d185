#!/usr/bin/env bash
# Session 20, on the device machine after gpu-wheels.sh staged MLX CUDA. PART (space-separated, in order):
#   tests gpu tests of what merged this session: the indexer's and HCA compressor's workspaces
#         (test_cuda_workspace.py), the indexer, the in-place compressor + pair, precompile, the tiny model
#         (in place vs functional; the hc kernel's decode, with the fused RMSNorm of next/rmsnorm-fast)
#   wsab  chain43's wall time with and without the workspaces (`--drop ws`), alternated ROUNDS (default 3) times
#   tl128 bench/timeline.py for the indexer at 128K (1 and 8 rows): GPU busy, gaps and graph launches a call
#   ops128 bench/host_cost.py, indexer at 128K (8 rows), back to back, under MLX_MAX_OPS_PER_BUFFER $OPS
#         (default "8 16 32"), a process each
#   kfigs bench/kernels.py --rows 8 --block 2 (warm figures + the cold ones) and chain43
#   carve the indexer at 128K / 1M with DSV4_IDX_CARVE 0 / 1 (segment + merge padded to one shared-memory carveout),
#         a process each, alternated twice; the timeline at 8 rows 128K with it; the indexer gpu tests with it
#   tlstep/commitstep/figs/t1/t2 as in gpu_session19.sh
source "$(dirname "$0")/gpu_prelude.sh"
for part in ${PART:-tests}; do
  case "$part" in
    tests)
      echo "== gpu tests: workspaces, indexer, in-place compressor + pair, precompile, tiny model"
      pyt 540 tests/kernels/test_cuda_workspace.py tests/kernels/test_cuda_indexer.py \
        tests/kernels/test_cuda_inplace.py tests/kernels/test_cuda_pair.py tests/kernels/test_cuda_hc.py \
        tests/kernels/test_cuda.py ;;
    wsab)
      v=""; for r in $(seq "${ROUNDS:-3}"); do v="$v,after:,after:ws"; done
      timeout 240 python3 bench/host_cost.py --cases "" --no-chain43 --reps 20 --chain43-variants "${v#,}" 2>&1 \
        | grep chain43 ;;
    tl128)
      mkdir -p "$OUT/tl"
      timeout 200 python3 bench/timeline.py --out "$OUT/tl" --cases indexer_rows:1:131072,indexer_rows:8:131072 2>&1 \
        | grep -v "^USDT\|^STAGE\|UserWarning\|_warn_once" | cut -c1-400
      cp "$OUT/tl/timeline.json" "$OUT/timeline128.json"; rm -rf "$OUT/tl" ;;
    ops128)
      for ops in ${OPS:-8 16 32}; do
        MLX_MAX_OPS_PER_BUFFER=$ops timeout 100 python3 bench/host_cost.py --no-chain43 --reps 20 \
          --cases indexer_rows:8:131072,indexer_rows:8:131072 --chain43-variants after: 2>&1 | grep -v trivial
      done ;;
    kfigs) timeout 420 python3 bench/kernels.py --reps 5 --rows 8 --block 2 --out "$OUT" 2>&1 | tail -17 ;;
    carve)
      for r in 1 2; do for c in 0 1; do
        DSV4_IDX_CARVE=$c timeout 100 python3 bench/host_cost.py --no-chain43 --reps 20 --cases \
          indexer_rows:8:131072,indexer_rows:8:131072,indexer_rows:1:131072,indexer_rows:8:1048576 2>&1 \
          | grep -v trivial | sed "s/^/carve=$c /"
      done; done
      mkdir -p "$OUT/tl"
      DSV4_IDX_CARVE=1 timeout 100 python3 bench/timeline.py --out "$OUT/tl" --cases indexer_rows:8:131072 2>&1 \
        | grep -E "^== |gpu_per_eval|gap" | cut -c1-200
      rm -rf "$OUT/tl"
      DSV4_IDX_CARVE=1 pyt 200 tests/kernels/test_cuda_indexer.py ;;
    *) PART=$part bash bench/gpu_session19.sh ;;
  esac
done
