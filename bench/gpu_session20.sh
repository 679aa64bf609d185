#!/usr/bin/env bash
# Session 20, on the device machine after gpu-wheels.sh staged MLX CUDA. PART (space-separated, in order):
#   tests gpu tests of what merged this session: the indexer's and HCA compressor's workspaces
#         (test_cuda_workspace.py), the indexer, the in-place compressor + pair, precompile, the tiny model
#         (in place vs functional; the hc kernel's decode, with the fused RMSNorm of next/rmsnorm-fast)
#   wsab  chain43's wall time with and without the workspaces (`--drop ws`), alternated ROUNDS (default 3) times
#   tlstep/commitstep/figs/t1/t2 as in gpu_session19.sh
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=/tmp/mlxsite:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 bench/provenance.py
pyt() {  # pytest of the gpu-marked tests in files $2.., under a timeout of $1 s
  local t=$1; shift
  timeout "$t" python3 -m pytest "$@" -m gpu -q --tb=short -rf -p no:cacheprovider --durations=3 2>&1 | tail -14
}
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
    *) PART=$part bash bench/gpu_session19.sh ;;
  esac
done
