#!/usr/bin/env bash
# Session 21 (branch next/idx-ids), on the device machine after gpu-wheels.sh staged MLX CUDA. PART, in order:
#   tests gpu tests of the indexer's workspace rows (ticket, histogram, keys; the output the ids alone):
#         test_cuda_workspace.py, test_cuda_indexer.py, precompile, the tiny model (in place, hc kernel)
#   idsab chain43 and the indexer at 8K (8 and 1 rows), bench/host_cost.py, this tree vs $OLD
#         (`git archive main | tar -x -C old_tree`: keys in the output, slice + reshape), a process each,
#         alternated ROUNDS (default 3) times
#   kfigs/tlstep/carve as in gpu_session20.sh
# One PART a device call, output into $OUT (`> $OUT/x.log`): on a fresh machine `tests` alone takes ~3 min of
# kernel JIT and ROUNDS=3 of idsab ~4 min, so "tests idsab" in one call ran past the 600 s limit (session 21).
source "$(dirname "$0")/gpu_prelude.sh"
CASES=indexer_rows:8:8192,indexer_rows:1:8192
for part in ${PART:-tests}; do
  case "$part" in
    tests)
      echo "== gpu tests: indexer workspace rows, indexer, precompile, tiny model"
      pyt 500 tests/kernels/test_cuda_workspace.py tests/kernels/test_cuda_indexer.py tests/kernels/test_cuda_hc.py \
        tests/kernels/test_cuda.py::test_precompile_tiny tests/kernels/test_cuda_inplace.py ;;
    idsab)
      for r in $(seq "${ROUNDS:-3}"); do
        for tree in "$PWD" "$PWD/${OLD:-old_tree}"; do
          (cd "$tree" && PYTHONPATH=/tmp/mlxsite:$tree timeout 100 python3 bench/host_cost.py --reps 20 --cases "$CASES" \
            --no-chain43 --chain43-variants after: 2>&1 | grep -v trivial | sed "s|^|$(basename "$tree") |")
        done
      done ;;
    *) PART=$part bash bench/gpu_session20.sh ;;
  esac
done
