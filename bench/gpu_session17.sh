#!/usr/bin/env bash
# Session 17, on the device machine after gpu-wheels.sh staged MLX CUDA. PART (default ncu):
#   ncu   why one 8-row in-place compressor call (ratio 4, D 512) costs ~10 us more than a 1-row call (session
#         16's lead): each launch's GPU duration (ncu gpu__time_duration) at 1 and 8 rows, ratios 4 and 128, then
#         the launches in detail (--set full)
#   rt    compressor_inplace with its reads issued before its writes: the in-place gpu tests and the tiny-model
#         decode; ncu durations as `ncu`; bench/kernels.py (chain43 + the compressor at 8 rows, 8K) with these
#         kernels and with $OLD's kernels/cuda (e.g. `git archive <rev> kernels/cuda | tar -x -C old_kernels`)
#   ab    rt's bench/kernels.py A/B alone, ROUNDS (e.g. "1 2 3") alternated, at 1 and 8 rows (the compressor's
#         8 single-row calls vs one 8-row call); OLD as in rt (session 18: `git archive 5cde372 kernels/cuda`)
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=/tmp/mlxsite:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/ncu"
python3 bench/provenance.py
durations() {  # compressor_inplace's GPU duration (ns) per launch under ncu, per case
  for c in "$@"; do
    echo "== $c: compressor_inplace launches, GPU duration (ns)"
    timeout 120 /usr/local/cuda/bin/ncu --metrics gpu__time_duration.sum --csv -k "regex:compressor_inplace" \
      --launch-skip 5 --launch-count 6 python3 bench/profile_kernels.py --case "$c" --reps 2 \
      > "$OUT/ncu/dur_${c//:/_}.csv" 2>&1
    grep gpu__time_duration "$OUT/ncu/dur_${c//:/_}.csv" | awk -F'","' '{printf "%s ", $NF} END {print ""}'
  done
}
ab() {  # bench/kernels.py (chain43 + the compressor at 8K, rows $1), these kernels vs $OLD's, ROUNDS alternated
  rm -rf /tmp/old; cp -r "$PWD" /tmp/old; cp "${OLD:-old_kernels}"/kernels/cuda/*.py /tmp/old/kernels/cuda/
  for r in ${ROUNDS:-1}; do
    echo "== round $r, this tree: chain43 + compressor, rows $1, 8K"
    timeout 80 python3 bench/kernels.py --reps 5 --rows "$1" --ctxs 8192 --ops compressor_rows --out "$OUT/new$r" \
      2>&1 | grep -E "chain43 \(|$2"
    echo "== round $r, OLD"
    (cd /tmp/old && PYTHONPATH=/tmp/mlxsite:/tmp/old timeout 80 python3 bench/kernels.py --reps 5 --rows "$1" \
      --ctxs 8192 --ops compressor_rows --out "$OUT/old$r" 2>&1 | grep -E "chain43 \(|$2")
  done
}
case "${PART:-ncu}" in
  ncu)
    durations compressor_rows:1:8192 compressor_rows:8:8192 compressor_rows:128:8:8192 compressor_rows:128:1:8192
    echo "== detail"
    bash bench/gpu_ncu.sh compressor_inplace@compressor_rows:8:8192 compressor_inplace@compressor_rows:1:8192 ;;
  rt)
    echo "== in-place compressor gpu tests, tiny-model decode"
    timeout 200 python3 -m pytest tests/kernels/test_cuda_inplace.py tests/kernels/test_cuda_hc.py -k "inplace or tiny" \
      -m gpu -q --tb=short -rf -p no:cacheprovider 2>&1 | tail -8
    durations compressor_rows:8:8192 compressor_rows:128:8:8192
    ab 8 "^compressor_rows .*rows 8" ;;
  ab) ab 1,8 "^compressor_rows " ;;
esac
