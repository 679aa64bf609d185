#!/usr/bin/env bash
# A/B of an indexer device-code change on the H200, side by side in one call (after gpu-wheels.sh staged
# MLX CUDA): the indexer gpu tests on the working tree, then bench/host_cost.py for the indexer at 8 rows
# (8K / 128K / 1M), alternating the working tree (new) and a copy whose kernels/cuda/indexer_src.py is
# $OLD (old; e.g. `git show HEAD:kernels/cuda/indexer_src.py > old_indexer_src.py.txt`, untracked so it
# travels), twice; then bench/kernels.py's indexer rows for the new code. Writes $OUT/indexer_ab.log.
# $OLD may be a directory holding an old kernels/cuda/ (e.g. `git archive a530145 kernels/cuda | tar -x -C
# old_kernels`): all its files replace the copy's.
set -u
cd "$(dirname "$0")/.."
OLD=${OLD:-old_indexer_src.py.txt}
bash /tmp/mlxw/install.sh >/dev/null 2>&1
export PYTHONPATH=/tmp/mlxsite:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
rm -rf /tmp/old; cp -r "$PWD" /tmp/old
if [ -d "$OLD" ]; then cp "$OLD"/kernels/cuda/*.py /tmp/old/kernels/cuda/; else cp "$OLD" /tmp/old/kernels/cuda/indexer_src.py; fi
C=indexer_rows:8:8192,indexer_rows:8:131072,indexer_rows:8:1048576
{ timeout 150 python3 -m pytest tests/kernels/test_cuda.py tests/kernels/test_cuda_indexer.py tests/kernels/test_cuda_lists.py -q -p no:cacheprovider \
    -k indexer 2>&1 | tail -3
for _ in 1 2; do
  echo "== new"; timeout 60 python3 bench/host_cost.py --reps 10 --cases $C --no-chain43 2>&1 | grep indexer
  echo "== old"; (cd /tmp/old && PYTHONPATH=/tmp/mlxsite:/tmp/old timeout 60 python3 bench/host_cost.py --reps 10 \
    --cases $C --no-chain43 2>&1 | grep indexer)
done
echo "== kernels.py new"; timeout 100 python3 bench/kernels.py --ops indexer_rows --rows 8 --ctxs 131072,1048576 \
  --no-chain43 --reps 10 --out "$OUT" 2>&1 | grep -E "^indexer_rows +8"
} 2>&1 | tee "$OUT/indexer_ab.log"
