#!/usr/bin/env bash
# Session 9 on the H200 (after gpu-wheels.sh staged MLX CUDA in /tmp/mlxsite). PART (several allowed):
#   verify   the in-place compressor gpu tests, precompile / dispatch, engine + CLI tests, chain43 host / total
#   inplace  the in-place compressor gpu tests (36, incl. the model in place vs functional)
#   idx      the indexer gpu tests; bench/kernels.py for the indexer (1, 8 rows) and chain43
#   attn     the attention gpu tests; `wide` at 256 vs 512 threads (host_cost)
#   phases   per-block start / end and the indexer segment's phases (bench/phases.py)
#   ab       short-row attention: dsplit vs split-K + combine, in the data-linked chain43 and per call
#   upload   kernels/upload.py: its gpu test, the engine tests, memloc, step.py with / without it
#   check11  upload + engine tests, phases (session 11)
#   attn11   attention gpu tests, phases and kernels.py after the combine change (session 11)
#   memloc   bench/memloc.py (managed vs device memory for the small inputs) + dsplit's outer phases
#   prof     chain43 (data-linked) per-kernel GPU time (ncu) + host / total, linked by data and by depends
#   inc14    kernels' code in include files vs inline (code at 8d24928, reverted: no measured gain): host / total
#            of chain43 and the ops (2 rounds); commit
#            size 16; the select's histograms by plain atomics (phases, segment + merge) (session 14)
#   final14  bench/kernels.py --rows 8 (chains of 10), indexer + attention in chains of 21 (session 14)
#   step14   bench/step.py (fast, reference); phases of the select's histograms, plain vs MATCH.ANY (session 14)
#   dense14  indexer gpu tests, phases, bench/kernels.py --rows 8 (chains of 10; indexer + attention in 21)
#   step14b  bench/step.py (fast, reference), 1 and 8 rows, 4K and 128K
#   rep14    bench/kernels.py: indexer + attention at 8 rows, 128K, and chain43 (a repeat) (session 14)
#   final16a every gpu-marked kernel test file; bench/kernels.py indexer + attention, 8 rows, 128K, chains of 10,
#            linked by `after` then by `data` (--link) (session 16)
#   final16b bench/kernels.py --rows 8 (chains of 10, chain43), indexer + attention at 128K / 1M in chains of 21
#   link16   the indexer's merge select, main vs $NEW (a dir holding kernels/cuda/*.py to swap in, e.g. the uint4
#            dsv4_pick_bin): bench/phases.py, two rounds; then bench/kernels.py indexer 8 rows 128K, chained by
#            `after` vs `data` (--link), chains of 10 and 21, two rounds (session 16)
#   idx15    indexer gpu tests (+ test_cuda_lists); phases (8 / 1 rows 128K, 8 rows 1M; VARIANTS, default base);
#            bench/kernels.py indexer + attention at 8 rows, 128K and 1M, chains of 10 and 21 (session 15)
#   idx15b   phases of the indexer (base vs kthfloor vs rawsel); bench/kernels.py indexer + attention, 8 rows, 128K,
#            chains of 10 and 21
#   final15  every gpu-marked kernels test file (as kgpu), then bench/kernels.py indexer + attention, 8 rows, 128K
#   kgpu     every gpu-marked test file (test_cuda, test_cuda_inplace, test_cuda_hc, test_upload), no -x (one call)
#   tests    every gpu test (tests/kernels, tests/model, tests/service on the GPU)
#   idx12    indexer: the segment's scoring-loop variants (bulk copies, stages) and the merge's list loads (phases),
#            the indexer gpu tests (session 12)
#   final12  every gpu-marked test file; the indexer's phases (session 12)
#   ab12     attention gpu tests; bench/kernels.py for the indexer and attention at 8 rows (session 12)
#   idx13    indexer: the segment under __launch_bounds__ (phases variants); host / total of the indexer and
#            attention at 128K per MLX commit size (OPS, each in its own process) (session 13)
#   idx13c   the indexer gpu tests (segment launch-bounded up to SEG_BOUNDED_MAX); phases base vs nobounds
#            (VARIANTS, CASES: e.g. VARIANTS=base,matchany CASES=indexer:8:131072,indexer:8:1048576);
#            host / total of the ops at 128K and chain43 per MLX commit size (OPS) (session 13)
#   ops13    bench/step.py (fast arm) per MLX commit size (OPS), interleaved (session 13)
#   final13  bench/kernels.py --rows 8, bench/step.py (fast, reference) under the product's commit size (8), then
#            host / total of the ops and chain43 with MLX_MAX_OPS_PER_BUFFER=100 and 8 (session 13)
#   ab13     bench/kernels.py (indexer, attention; 8 rows, 128K and 1M) with MLX_MAX_OPS_PER_BUFFER 100 and 8 (session 13)
#   step13   bench/step.py (fast, 1 and 8 rows, 4K) with MLX_MAX_OPS_PER_BUFFER 100 and 8, two rounds (session 13)
#   bench    bench/kernels.py --rows 8 and bench/step.py (fast, fast_functional, reference, fast_pipe)
# Writes under $OUT.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=/tmp/mlxsite:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 bench/provenance.py
# every gpu-marked kernel test file
KTESTS="tests/kernels/test_cuda.py tests/kernels/test_cuda_indexer.py tests/kernels/test_cuda_inplace.py
  tests/kernels/test_cuda_hc.py tests/kernels/test_upload.py tests/kernels/test_cuda_lists.py"
ktests() {  # KTESTS under a timeout of $1 s: failures' lines, the 3 slowest
  timeout "$1" python3 -m pytest $KTESTS -m gpu -q --tb=line -rf -p no:cacheprovider --durations=3 2>&1 | tail -12
}
kernels14() {  # bench/kernels.py --rows 8 (chains of 10), then indexer + attention at 128K / 1M in chains of 21
  echo "== kernels, 8 rows (chains of 10 calls)"
  timeout "$1" python3 bench/kernels.py --reps 5 --rows 8 --out "$OUT" 2>&1 | tail -"$2"
  echo "== indexer + attention, 8 rows, 128K and 1M, chains of 21 calls (a step's CSA layers)"
  mkdir -p "$OUT/chain21"
  timeout "$3" python3 bench/kernels.py --reps 5 --rows 8 --ctxs 131072,1048576 --chain 21 \
    --ops indexer_rows,sparse_attention_rows --no-chain43 --out "$OUT/chain21" 2>&1 | tail -7
}
step14() {  # bench/step.py, fast and reference, 1 and 8 rows, 4K and 128K
  echo "== step"
  timeout 200 python3 bench/step.py --rows 1,8 --contexts 4096,131072 --arms fast,reference \
    --out "$OUT/step.json" 2>&1 | tail -9
}
for part in ${PART:-inplace}; do
  case "$part" in
    inplace)
      echo "== in-place compressor gpu tests"
      timeout 330 python3 -m pytest tests/kernels/test_cuda_inplace.py -q -p no:cacheprovider 2>&1 | tail -5 ;;
    verify)
      echo "== in-place compressor gpu tests"
      timeout 250 python3 -m pytest tests/kernels/test_cuda_inplace.py -q -p no:cacheprovider -x 2>&1 | tail -4
      echo "== precompile / dispatch gpu tests"
      timeout 100 python3 -m pytest tests/kernels/test_cuda.py tests/kernels/test_cuda_indexer.py -q -p no:cacheprovider -k "precompile or dispatch" 2>&1 | tail -3
      echo "== engine tests (the in-place compressor is the default) + the CLI"
      timeout 150 python3 -m pytest tests/service/test_worker.py tests/service/test_pipeline.py tests/model/test_cli.py \
        -q -p no:cacheprovider 2>&1 | tail -4
      echo "== chain43 host / total (data-linked, depends-linked)"
      timeout 90 python3 bench/host_cost.py --reps 10 --cases "" --no-chain43 --chain43-variants after:,depends: 2>&1 \
        | grep chain43 ;;
    idx)
      echo "== indexer gpu tests"
      timeout 240 python3 -m pytest tests/kernels/test_cuda.py tests/kernels/test_cuda_indexer.py -q -p no:cacheprovider -x -k indexer 2>&1 | tail -3
      echo "== indexer + chain43, bench/kernels.py"
      timeout 220 python3 bench/kernels.py --reps 6 --rows 1,8 --ops indexer_rows --out "$OUT" 2>&1 | tail -12 ;;
    attn)
      echo "== attention gpu tests"
      timeout 240 python3 -m pytest tests/kernels/test_cuda.py tests/kernels/test_cuda_indexer.py -q -p no:cacheprovider -x -k "attention or dispatch" 2>&1 | tail -3
      echo "== wide: 256 vs 512 threads (per call, chain43)"
      for wt in 256 512 256 512; do
        timeout 100 python3 bench/host_cost.py --reps 10 --wide-threads $wt --no-chain43 --chain43-variants after: \
          --cases "sparse_attention_rows:8:131072,sparse_attention_rows:1:131072" 2>&1 | grep -v trivial
      done ;;
    phases)
      echo "== kernel phases (globaltimer / clock64 probes)"
      timeout 200 python3 bench/phases.py --out "$OUT" 2>&1 | tail -12 ;;
    ab)
      echo "== short rows: dsplit (DSPLIT_CHUNKS 3, the default) vs split-K + combine (0); HCA cases per call"
      for dc in 3 0; do
        timeout 150 python3 bench/host_cost.py --reps 10 --dsplit-chunks $dc --no-chain43 --chain43-variants after: \
          --cases "compressor_rows:128:8:8192,sparse_attention_rows:128:8:8192,sparse_attention_rows:8:8192" 2>&1 \
          | grep -v trivial
      done ;;
    upload)
      echo "== upload gpu test + engine tests on the GPU (rows' arrays and tokens uploaded)"
      timeout 200 python3 -m pytest tests/kernels/test_upload.py tests/service/test_worker.py tests/service/test_pipeline.py \
        -q -p no:cacheprovider 2>&1 | tail -4
      echo "== memloc"
      timeout 150 python3 bench/memloc.py --reps 8 --out "$OUT" 2>&1 | tail -20
      echo "== step: uploaded vs host-built rows' arrays"
      timeout 230 python3 bench/step.py --rows 1,8 --contexts 4096 --reps 12 \
        --arms fast,fast_noupload,fast_pipe,fast_pipe_noupload --out "$OUT/step.json" 2>&1 | tail -11 ;;
    check11)
      echo "== upload + engine tests on the GPU"
      timeout 200 python3 -m pytest tests/kernels/test_upload.py tests/service/test_worker.py tests/service/test_pipeline.py \
        -q -p no:cacheprovider 2>&1 | tail -4
      echo "== phases with the rows' arrays in device memory"
      timeout 150 python3 bench/phases.py --out "$OUT" \
        --cases indexer:8:131072,indexer:1:131072,attention:8:131072,attention:8:8192,outer:128:8:8192,outer:0:8:8192,sliding:8:8192 \
        2>&1 | tail -8 ;;
    attn11)
      echo "== attention gpu tests (combine: the splits' (m, l) read at once)"
      timeout 200 python3 -m pytest tests/kernels/test_cuda.py tests/kernels/test_cuda_indexer.py -q -p no:cacheprovider -x -k "attention or dispatch" 2>&1 | tail -3
      echo "== combine's span"
      timeout 60 python3 bench/phases.py --out "$OUT" --cases attention:8:131072,attention:1:1048576 2>&1 | tail -3
      echo "== attention + chain43, bench/kernels.py"
      timeout 200 python3 bench/kernels.py --reps 6 --rows 8 --ops sparse_attention_rows --out "$OUT" 2>&1 | tail -8 ;;
    memloc)
      echo "== where small inputs live: read latency, a scale read per call, ops with the batch in device memory"
      timeout 330 python3 bench/memloc.py --reps 10 --out "$OUT" 2>&1 | tail -20
      echo "== dsplit outside its loop"
      timeout 120 python3 bench/phases.py --cases outer:128:8:8192,outer:0:8:8192,outer:128:1:8192 --out "$OUT" \
        2>&1 | tail -4 ;;
    idx12)
      echo "== indexer gpu tests"
      timeout 150 python3 -m pytest tests/kernels/test_cuda.py tests/kernels/test_cuda_indexer.py -q -p no:cacheprovider -k indexer 2>&1 | tail -3
      echo "== segment variants (span, phases) and the merge's loads in flight"
      timeout 300 python3 bench/phases.py --out "$OUT" --reps 5 --cases indexer:8:131072,indexer:1:131072,indexer:8:1048576 \
        --seg-variants "${VARIANTS:-base,bulk,st5,bulk5,compute,load}" --merge-ur "${URS:-16,1}" 2>&1 | tail -4 ;;
    idx12b)
      echo "== indexer gpu tests"
      timeout 150 python3 -m pytest tests/kernels/test_cuda.py tests/kernels/test_cuda_indexer.py -q -p no:cacheprovider -k indexer 2>&1 | tail -3
      echo "== phases: indexer (segment variants, merge phases), wide"
      timeout 200 python3 bench/phases.py --out "$OUT" --reps 5 --seg-variants "${VARIANTS:-base,compute}" \
        --cases indexer:8:131072,indexer:1:131072,indexer:8:1048576,attention:8:131072,attention:8:8192 2>&1 | tail -5
      echo "== indexer, bench/kernels.py, 8 rows"
      timeout 200 python3 bench/kernels.py --reps 6 --rows 8 --ops indexer_rows --out "$OUT" --no-chain43 2>&1 | tail -5 ;;
    final12)
      echo "== every gpu-marked test"
      timeout 540 python3 -m pytest tests/kernels/test_cuda.py tests/kernels/test_cuda_indexer.py tests/kernels/test_cuda_inplace.py \
        tests/kernels/test_cuda_hc.py tests/kernels/test_upload.py -m gpu -q -p no:cacheprovider --durations=3 2>&1 | tail -8
      echo "== phases: indexer, wide"
      timeout 100 python3 bench/phases.py --out "$OUT" --reps 5 \
        --cases indexer:8:131072,indexer:1:131072,indexer:8:1048576 2>&1 | tail -3 ;;
    ab12)
      echo "== attention gpu tests (wide: a k-step's PV fragments loaded first)"
      timeout 150 python3 -m pytest tests/kernels/test_cuda.py tests/kernels/test_cuda_indexer.py -q -p no:cacheprovider -k "attention" 2>&1 | tail -3
      echo "== indexer + attention, bench/kernels.py, 8 rows"
      timeout 300 python3 bench/kernels.py --reps 6 --rows 8 --ops indexer_rows,sparse_attention_rows --out "$OUT" \
        --no-chain43 2>&1 | tail -9 ;;
    idx13)
      echo "== segment variants: base, bounds, compute"
      timeout 300 python3 bench/phases.py --out "$OUT" --reps 5 --cases indexer:8:131072,indexer:1:131072,indexer:8:1048576 \
        --seg-variants "${VARIANTS:-base,bounds,compute}" --merge-ur 16 2>&1 | tail -4
      for ops in ${OPS:-100 4 100 4}; do
        echo "== host / total, MLX_MAX_OPS_PER_BUFFER=$ops"
        MLX_MAX_OPS_PER_BUFFER=$ops timeout 90 python3 bench/host_cost.py --reps 10 --no-chain43 \
          --cases "indexer_rows:8:131072,sparse_attention_rows:8:131072" 2>&1 | grep -v trivial
      done ;;
    idx13c)
      echo "== indexer gpu tests"
      timeout 200 python3 -m pytest tests/kernels/test_cuda.py tests/kernels/test_cuda_indexer.py -q -p no:cacheprovider -k indexer 2>&1 | tail -3
      echo "== phases: the segment as planned (base) vs without a launch bound"
      timeout 120 python3 bench/phases.py --out "$OUT" --reps 5 --seg-variants "${VARIANTS:-base,nobounds}" \
        --cases "${CASES:-indexer:8:131072,indexer:1:131072}" 2>&1 | tail -3
      for ops in ${OPS:-100 4 8}; do
        echo "== host / total, MLX_MAX_OPS_PER_BUFFER=$ops"
        MLX_MAX_OPS_PER_BUFFER=$ops timeout 100 python3 bench/host_cost.py --reps 10 \
          --cases "indexer_rows:8:131072,sparse_attention_rows:8:131072,compressor_rows:8:131072" 2>&1 | grep -v trivial
      done ;;
    ops13)
      for r in 1 2; do for ops in ${OPS:-100 4}; do
        echo "== step, MLX_MAX_OPS_PER_BUFFER=$ops (round $r)"
        MLX_MAX_OPS_PER_BUFFER=$ops timeout 140 python3 bench/step.py --rows 1,8 --contexts 4096,131072 --arms fast \
          --reps 10 --out "$OUT/step-ops$ops-r$r.json" 2>&1 | grep -E "^ +[0-9]|ms"
      done; done ;;
    final13)
      echo "== kernels, 8 rows"
      timeout 330 python3 bench/kernels.py --reps "${REPS:-5}" --rows 8 --out "$OUT" 2>&1 | tail -24
      echo "== step"
      timeout 160 python3 bench/step.py --rows 1,8 --contexts 4096,131072 --arms fast,reference \
        --out "$OUT/step.json" 2>&1 | tail -9
      for ops in 100 8; do
        echo "== host / total, MLX_MAX_OPS_PER_BUFFER=$ops"
        MLX_MAX_OPS_PER_BUFFER=$ops timeout 80 python3 bench/host_cost.py --reps 10 \
          --cases "indexer_rows:8:131072,sparse_attention_rows:8:131072" 2>&1 | grep -v trivial
      done ;;
    ab13)
      for ops in 100 8; do
        echo "== kernels, MLX_MAX_OPS_PER_BUFFER=$ops"
        MLX_MAX_OPS_PER_BUFFER=$ops timeout 170 python3 bench/kernels.py --reps 4 --rows 8 --ctxs 131072,1048576 \
          --ops indexer_rows,sparse_attention_rows --no-chain43 --out "$OUT/ops$ops" 2>&1 | tail -7
      done ;;
    step13)
      for r in 1 2; do for ops in 100 8; do
        echo "== step, MLX_MAX_OPS_PER_BUFFER=$ops (round $r)"
        MLX_MAX_OPS_PER_BUFFER=$ops timeout 50 python3 bench/step.py --rows 1,8 --contexts 4096 --arms fast \
          --reps 10 --out "$OUT/step13-ops$ops-r$r.json" 2>&1 | grep -E "^ +[0-9]"
      done; done ;;
    prof)
      OPS=100 timeout 330 bash bench/gpu_chain43_link.sh 2>&1 | tail -14 ;;
    inc14)
      # the kernels' code in include files (kernels/cuda/include.py) vs inline (DSV4_CUDA_INCLUDE=0): host / total
      # of chain43 and the ops at 128K, each setting in its own process, two rounds; commit size 16 once
      for r in 1 2; do for inc in 0 1; do
        echo "== host / total, DSV4_CUDA_INCLUDE=$inc, round $r"
        DSV4_CUDA_INCLUDE=$inc timeout 100 python3 bench/host_cost.py --reps 10 \
          --cases "indexer_rows:8:131072,sparse_attention_rows:8:131072" 2>&1 | grep -v "pad=0"
      done; done
      echo "== host / total, include, MLX_MAX_OPS_PER_BUFFER=16"
      MLX_MAX_OPS_PER_BUFFER=16 timeout 80 python3 bench/host_cost.py --reps 10 --cases "" 2>&1 | grep -v trivial
      echo "== phases: select histograms by plain shared atomics (base, since session 14) vs MATCH.ANY (segment + merge)"
      timeout 150 python3 bench/phases.py --out "$OUT" --reps 5 --seg-variants base,matchany \
        --cases indexer:8:131072,indexer:8:1048576 2>&1 | tail -3 ;;
    final14)
      kernels14 330 24 160 ;;
    step14)
      step14
      echo "== phases: select histograms by plain shared atomics (base) vs MATCH.ANY (segment + merge)"
      timeout 120 python3 bench/phases.py --out "$OUT" --reps 5 --seg-variants base,matchany \
        --cases indexer:8:131072,indexer:1:131072,indexer:8:1048576 2>&1 | tail -3 ;;
    dense14)
      echo "== indexer gpu tests (dense segments at 128K)"
      timeout 200 python3 -m pytest tests/kernels/test_cuda.py tests/kernels/test_cuda_indexer.py -q -p no:cacheprovider -k indexer 2>&1 | tail -3
      echo "== phases: indexer, 8 and 1 rows, 128K"
      timeout 100 python3 bench/phases.py --out "$OUT" --reps 5 --cases indexer:8:131072,indexer:1:131072 2>&1 | tail -3
      kernels14 250 16 120 ;;
    step14b)
      step14 ;;
    link16)
      rm -rf /tmp/new; cp -r "$PWD" /tmp/new; cp "${NEW:-pick_kernels}"/kernels/cuda/*.py /tmp/new/kernels/cuda/
      for r in 1 2; do
        echo "== round $r, phases, main"
        timeout 100 python3 bench/phases.py --out "$OUT/ph-main-r$r" --reps 5 \
          --cases indexer:8:131072,indexer:8:1048576 2>&1 | tail -2
        echo "== round $r, phases, new"
        (cd /tmp/new && PYTHONPATH=/tmp/mlxsite:/tmp/new timeout 100 python3 bench/phases.py --out "$OUT/ph-new-r$r" \
          --reps 5 --cases indexer:8:131072,indexer:8:1048576 2>&1 | tail -2)
      done
      for r in 1 2; do for ch in 10 21; do for l in after data; do
        echo "== round $r, chains of $ch, indexer linked by $l"
        mkdir -p "$OUT/$l-c$ch-r$r"
        timeout 80 python3 bench/kernels.py --reps 5 --rows 8 --ctxs 131072 --chain $ch --link $l \
          --ops indexer_rows --no-chain43 --out "$OUT/$l-c$ch-r$r" 2>&1 | tail -1
      done; done; done ;;
    idx15)
      echo "== indexer gpu tests (+ the dense segments' compact lists)"
      timeout 200 python3 -m pytest tests/kernels/test_cuda.py tests/kernels/test_cuda_indexer.py tests/kernels/test_cuda_lists.py -q --tb=line \
        -p no:cacheprovider -k indexer 2>&1 | tail -8
      echo "== phases: indexer, 8 and 1 rows at 128K, 8 rows at 1M; variants ${VARIANTS:-base}"
      timeout 200 python3 bench/phases.py --out "$OUT" --reps 5 --seg-variants "${VARIANTS:-base}" \
        --cases indexer:8:131072,indexer:1:131072,indexer:8:1048576 2>&1 | tail -4
      for ch in 10 21; do
        echo "== kernels, indexer + attention, 8 rows, 128K and 1M, chains of $ch"
        mkdir -p "$OUT/chain$ch"
        timeout 150 python3 bench/kernels.py --reps 5 --rows 8 --ctxs 131072,1048576 --chain $ch \
          --ops indexer_rows,sparse_attention_rows --no-chain43 --out "$OUT/chain$ch" 2>&1 | tail -5
      done ;;
    final16a)
      echo "== every gpu-marked test (kernels: test_cuda, test_cuda_inplace, test_cuda_hc, test_upload, test_cuda_lists)"
      ktests 380
      for l in after data; do
        echo "== kernels, indexer + attention, 8 rows, 128K (chains of 10), linked by $l"
        mkdir -p "$OUT/$l"
        timeout 90 python3 bench/kernels.py --reps 5 --rows 8 --ctxs 131072 --ops indexer_rows,sparse_attention_rows \
          --no-chain43 --link $l --out "$OUT/$l" 2>&1 | tail -3
      done ;;
    final16b) kernels14 330 14 160 ;;
    final15)
      echo "== every gpu-marked test (kernels: test_cuda, test_cuda_inplace, test_cuda_hc, test_upload, test_cuda_lists)"
      ktests 380
      echo "== kernels, indexer + attention, 8 rows, 128K (chains of 10)"
      timeout 90 python3 bench/kernels.py --reps 5 --rows 8 --ctxs 131072 --ops indexer_rows,sparse_attention_rows \
        --no-chain43 --out "$OUT" 2>&1 | tail -4 ;;
    idx15b)
      echo "== phases: indexer, 8 and 1 rows at 128K, 8 rows at 1M; variants base, kthfloor, rawsel"
      timeout 200 python3 bench/phases.py --out "$OUT" --reps 5 --seg-variants base,kthfloor,rawsel \
        --cases indexer:8:131072,indexer:1:131072,indexer:8:1048576 2>&1 | tail -4
      for ch in 10 21; do
        echo "== kernels, indexer + attention, 8 rows, 128K, chains of $ch"
        mkdir -p "$OUT/chain$ch"
        timeout 100 python3 bench/kernels.py --reps 5 --rows 8 --ctxs 131072 --chain $ch \
          --ops indexer_rows,sparse_attention_rows --no-chain43 --out "$OUT/chain$ch" 2>&1 | tail -3
      done ;;
    tests)
      echo "== all gpu tests"
      timeout 580 python3 -m pytest tests -m gpu -q -p no:cacheprovider -x 2>&1 | tail -8 ;;
    kgpu)
      echo "== every gpu-marked test (kernels: test_cuda, test_cuda_inplace, test_cuda_hc)"
      timeout 545 python3 -m pytest $KTESTS -m gpu -q -p no:cacheprovider --durations=5 2>&1 | tail -14 ;;
    bench)
      echo "== kernels, 8 rows"
      timeout 330 python3 bench/kernels.py --reps "${REPS:-10}" --rows 8 --out "$OUT" 2>&1 | tail -24
      echo "== step"
      timeout 240 python3 bench/step.py --rows 1,8 --contexts 4096,131072 \
        --arms fast,fast_functional,reference,fast_pipe --out "$OUT/step.json" 2>&1 | tail -16 ;;
  esac
done 2>&1 | tee "$OUT/session${SESSION:-10}-${PART// /-}.log"
