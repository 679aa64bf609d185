#!/usr/bin/env bash
# The GPU set on the lent machine, one device call each PART (each under the 10-minute call limit), after
# `bash ../shared/tools/gpu-wheels.sh` staged MLX's CUDA build in /tmp/mlxsite (see that script's header).
#
#   PART=prefill prefill's gpu tests, 2K arms fast / mlx_dequant / idx_ops / sync_build, 16K + 64K, CUDA prefill
#                against CUDA decode
#   PART=graphs  the step at rows 1 and 8, 4K, arms fast / hc_one, under MLX's CUDA graphs every 100 nodes, no
#                graphs, and one graph a step (one process each), CUPTI kernels, busy time and the CUDA API's host time
#   PART=replay  the CUDA graph step's pieces (kernels/graph, the glue kernels behind DSV4_GRAPH_GLUE): their gpu
#                tests, the layer numerics with the glue kernels, the step at rows 1 and 8 with arms fast /
#                graph_glue (CUPTI)
#   PART=graph   the decode graphs: their gpu tests (runtime, a kernel past 48 KiB of shared memory, the replayed step
#                against MLX's and through the Engine), (REPLAY=1) tools/graph_replay.py at 43 layers, then bench/step.py at rows
#                1 and 8, 4K, arms fast / graph (CUPTI; GRAPH_ARMS=fast,graph,graph_dag: the launches as a
#                dependency graph too); SKIP_TESTS=1: no tests first; TESTS_AFTER="paths": those
#                gpu tests after the step, in the time left
#   PART=graphhttp bench/serve.py at 1 and 8 streams against `serve --decode-graphs on` (full depth)
#   PART=profile the engine thread under cProfile while serving 1 and 8 streams (graphs on): slow iterations,
#                top functions (DSV4_ENGINE_PROFILE, service/engine/engine_profile.py)
#   PART=grouped the skinny kernels' 9..64 rows in one launch of 8-row groups (a group a block, or each block
#                running them in turn) against the 8-row launches (gpu test)
#   PART=short   bench/prefill.py at 32 tokens (1, 2, 8 prompts), arms fast / slices / group_loop (the 8-row groups
#                a block, a launch each, run in turn by each block)
#   PART=fwd32   a 32-token forward (1 and 8 prompts): GPU busy, idle and longest gaps (CUPTI), arms fast / group_loop
#   PART=prefillenv a 32-token prompt's forward plain, with the glue kernels, with managed weights and pools, both,
#                with the pooling kernel (DSV4_POOLED_KERNEL=1)
#   PART=poolkeep one stream's TTFT with the device pool's free bytes given back or kept (DSV4_POOL_KEEP), then the step
#   PART=restart a graph server restarted over warm caches, addresses by DLPack then by kernel (RESTART_ARMS="store
#                store": the plans stored, then loaded); prefill at 32 tokens
#   PART=inplace the in-place slot writes: their gpu test, then graph servers with DSV4_PREFILL_STATE_INPLACE=0 and 1
#                (1 and 8 streams: TTFT's prefill and first step, refreshes, pools moved)
#   PART=correct the prefill's gpu tests (a headless forward's state), then a graph server's canary every 2 s beside
#                8 streams (its checks and failures): run first
#   PART=p59     issue 59's acceptance in one call: one graph server's cells (1 and 8 streams, 8 at 4 requests/s, 7
#                beside a 16K prompt), then bench/step.py's graph step (POOLED=1: with DSV4_POOLED_KERNEL=1)
#   PART=ttft    bench/serve.py at 1 and 8 streams, arrivals at 4 requests/s, against the graph engine: TTFT median,
#                p99 and first wave (issue 59)
#   PART=graphab  bench/serve.py at 1 and 8 streams against --decode-graphs off, then on (cubins warm), one call
#   PART=graphpace 8 streams against the graph engine, prefill paced (auto) or whole forwards, two servers
#   PART=startup tools/startup_profile.py twice (cold, then warm): where the warm-up goes, MLX's kernel cache
#   PART=spec    bench/spec_decode.py: one user's tok/s with speculation, drafts forced (issue 61's bench arm)
#   PART=agree   8 layers: tools/graph_agree.py's greedy tokens with graphs on, off with the glue kernels, and off
#                (AGREE_ARMS="on off nopipe": those arms; nopipe: on with DSV4_GRAPH_PIPELINE=0; each server
#                --max-state-gib AGREE_STATE_GIB (10), compared with the first arm; AGREE_PARALLEL=1: all started at once;
#                AGREE_MODEL: the servers' model flags, "" the tiny model: the flow checked on a CPU with AGREE_ARMS="off glue")
#   PART=verify  8 layers, one cold call: graph_agree's greedy tokens, graphs with host pipelining against the MLX
#                step (which fills MLX's kernel cache), then both restarted from the caches: ready times, tokens
#   PART=http    bench/serve.py at 1 and 8 streams against `serve --load-format dummy --model flash --experts 32`
#                (with the engine thread's host ms a step by phase)
#   PART=dispatch the decode dispatch's gpu tests (matmul, pair, in-place, indexer, workspace, plans) + numerics
#   PART=now     the step (rows 1 and 8, 4K and 64K, CUPTI), then 8 streams through the service: issue 29's figures
#   PART=http90  the engine's step at 8 rows, then bench/serve.py at 8 streams (issue 29's 90%), one call
#   PART=ncu     prefill at 2K (CUPTI: the top kernels), then Nsight Compute on a 2-layer forward's tile GEMMs
#   PART=moe     prefill's MoE end in one launch: gpu tests (+ CUDA prefill against CUDA decode), 2K (1 and 4
#                prompts; the composed end was the arm moe_composed up to 8312596), 4 x 2K in one 8,192-token forward, 16K + 64K (SHORT=1: the A/B only)
#   PART=numerics the layer-by-layer numerics (every fast path against the references), then the skinny kernels' tests
#   PART=skinny  the decode step's weight products and mHC pre-mix each alone against the copy (bench/matmuls.py),
#                then the step at rows 1 and 8 (4K, CUPTI); their gpu tests are PART=numerics
#   PART=roofline the replayed step (arm graph) at rows 1 and 8, 4K, with its CUPTI traces kept, then bench/roofline.py:
#                each kernel class's bytes a step (the step's plan) against its GPU time and the copy (issue 60)
#   PART=ncu_skinny Nsight Compute on the routed experts' skinny kernels at 8 rows and on the pre-mix
#   PART=itl     bench/serve.py: 7 streams while a 16K prompt prefills (the streams' ITL p99 during it)
#   PART=long64  a 64K prompt beside 7 streams (1,024 tokens each), the streams' ITL during its prefill
#   PART=prefix  bench/prefix_turn.py against the same: a 16K conversation's second turn, cache on vs off
#   PART=tests   the gpu-marked kernel tests (tests/kernels)                        ~7 min on a fresh H200
#   PART=pytest  the gpu-marked tests in PYTEST_PATHS (PYTEST_S seconds at most)
#   PART=tests2  the gpu-marked model, engine and end-to-end tests
#   PART=step    bench/step.py: the full-depth decode step (43 layers, mxfp8 + mxfp4, 32 experts), rows 1-8, 4K
#                and 64K, fast vs mlx_mm, against the release-precision byte floor, with the CUPTI profile
#   PART=serve   bench/serve.py: the HTTP load test on the tiny model (with and without --no-pipeline)
#   PART=dist    bench/distributed_step.py on 2 GPUs (kind nvidia-h200-x2)
#
#   A `.gpucache/` in the tree (carried: `python tools/prebuild_caches.py --experts 32 --graph-cache-dir
#   .gpucache/cubins --mlx-cache-dir .gpucache/mlx`, ~51 MB for 8 row counts) fills both kernel caches first.
#
#   PART="step graph" bash bench/gpu_all.sh        (default PART: tests; writes JSON, PNG and logs under $OUT)
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH=/tmp/mlxsite:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export MLX_PTX_CACHE_DIR=${MLX_PTX_CACHE_DIR:-/tmp/ptxcache}
if [ -d .gpucache ]; then  # kernel caches built on a CPU (tools/prebuild_caches.py), carried in: a cold start loads them
  cubins=${XDG_CACHE_HOME:-$HOME/.cache}/dsv4-serve/cubins; mkdir -p "$cubins" "$MLX_PTX_CACHE_DIR"
  cp -n .gpucache/cubins/* "$cubins"/ 2>/dev/null; cp -n .gpucache/mlx/* "$MLX_PTX_CACHE_DIR"/ 2>/dev/null
  echo "prebuilt caches: $(ls .gpucache/cubins | wc -l) cubins, $(ls .gpucache/mlx | wc -l) MLX cache files"
fi
python3 -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device())" || exit 2
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader
python3 bench/common.py  # the code's provenance (the device's .git may be stale: match the source digest)
# mlx.launch's entry point (pip --target leaves no console script on PATH); `timeout` needs a program.
flash="--load-format dummy --model flash --experts 32"  # the full V4-Flash on random weights (PART=http, prefix)
launch=(python3 -c "import sys; from mlx._distributed_utils.launch import main; sys.argv[0]='mlx.launch'; sys.exit(main())")
wait_ready() {  # url log until-seconds name: poll /ready each second; on giving up the log's tail and status 1
  until python3 -c "import httpx, sys; sys.exit(httpx.get('$1/ready').status_code != 200)" 2>/dev/null; do
    [ $SECONDS -gt $3 ] && { echo "$4: not ready"; tail -3 "$2"; return 1; }
    sleep 1
  done
  echo "$4: ready at $SECONDS s"
}
for part in ${PART:-tests}; do
  echo "== $part"
  case $part in
    tests) timeout 560 python3 -m pytest -m gpu -q --tb=short -rf -p no:cacheprovider tests/kernels 2>&1 | tail -20 ;;
    pytest) # PYTEST_PATHS: those gpu-marked tests (PYTEST_S seconds at most, default 300)
            timeout ${PYTEST_S:-300} python3 -m pytest -m gpu -q --tb=short -rf -p no:cacheprovider ${PYTEST_PATHS:-tests/kernels} \
              2>&1 | tail -15 ;;
    tests2) timeout 560 python3 -m pytest -m gpu -q --tb=short -rf -p no:cacheprovider tests/model tests/service \
              tests/e2e tests/distributed 2>&1 | tail -20 ;;
    prefill) # the prefill kernels' gpu tests (HEADS, the tile GEMMs incl. the indexer's scores, the mxfp8 dequantize,
           # the dispatch), prefill at 2K (1 and 4 prompts; arms fast / mlx_dequant / idx_ops / sync_build
           # alternated, CUPTI on fast, agreement with decode), 16K and 64K prompts, then the whole CUDA prefill
           # against CUDA decode (tests/model/test_cuda_prefill.py) in what time is left
           timeout 150 python3 -m pytest -m gpu -q --tb=short -rf -p no:cacheprovider tests/kernels/test_cuda_dequant.py \
             tests/kernels/test_cuda_tiles_mm.py tests/kernels/test_cuda_experts_grouped.py \
             tests/kernels/test_cuda_prefill_attention.py tests/kernels/test_cuda.py::test_dispatch_uses_fast_path \
             2>&1 | tail -8
           timeout 230 python3 bench/prefill.py --experts 32 --prompts 2048 --concurrent 1,4 \
             --arms fast,mlx_dequant,idx_ops,sync_build --agree 256 --profile --out "$OUT/prefill_final.json" \
             2>&1 | grep -v Warn | tail -14
           timeout 150 python3 bench/prefill.py --experts 32 --prompts 16384,65536 --concurrent 1 --agree 0 \
             --no-profile --out "$OUT/prefill_long.json" 2>&1 | tail -4
           timeout $((590 - SECONDS)) python3 -m pytest -m gpu -q --tb=short -rf -p no:cacheprovider \
             tests/model/test_cuda_prefill.py 2>&1 | tail -8 ;;
    graphs) # the host's cost a kernel under MLX's three ways of submitting work (read once a process): CUDA
            # graphs committed every 100 nodes (ours), no graphs (each kernel launched as encoded), one graph a step
            for mode in on off step; do
              case $mode in on) env=(MLX_MAX_OPS_PER_BUFFER=100) ;; off) env=(MLX_USE_CUDA_GRAPHS=0) ;;
                step) env=(MLX_MAX_OPS_PER_BUFFER=100000 MLX_MAX_MB_PER_BUFFER=1000000) ;; esac
              env "${env[@]}" timeout 180 python3 bench/step.py --experts 32 --rows 1,8 --contexts 4096 --reps 10 \
                --profile --arms fast,hc_one --out "$OUT/graphs_$mode.json" 2>&1 | grep -E "^ +4096|Error" | sed "s/^/$mode: /"
            done ;;
    replay) timeout 240 python3 -m pytest -m gpu -q --tb=short -rf -p no:cacheprovider \
              tests/kernels/test_cuda_glue.py tests/kernels/test_graph_runtime.py 2>&1 | tail -12
            DSV4_GRAPH_GLUE=1 timeout 200 python3 -m pytest -m gpu -q --tb=short -rf -p no:cacheprovider \
              tests/model/test_cuda_layer_numerics.py tests/model/test_step_angles.py 2>&1 | tail -6
            timeout $((590 - SECONDS)) python3 bench/step.py --experts 32 --rows 1,8 --contexts 4096 --reps 8 \
              --profile --arms fast,graph_glue --out "$OUT/replay_step.json" 2>&1 | grep -v Warn | tail -12 ;;
    graph) [ -z "${SKIP_TESTS:-}" ] && timeout 200 python3 -m pytest -m gpu -q --tb=short -rf -p no:cacheprovider \
             tests/kernels/test_graph_runtime.py tests/model/test_graph_step.py 2>&1 | tail -12
           [ -n "${REPLAY:-}" ] && timeout 200 python3 tools/graph_replay.py --layers 43 --experts 32 --rows 1 \
             --context 4096 --reps 10 --json "$OUT/graph_replay.json" 2>&1 | grep -v Warn | tail -3
           timeout ${STEP_TIMEOUT:-$((590 - SECONDS))} python3 bench/step.py --experts 32 --rows 1,8 --contexts 4096 \
             --reps 10 --profile --arms ${GRAPH_ARMS:-fast,graph} --out "$OUT/graph_step.json" 2>&1 | grep -v Warn | tail -9
           [ -n "${TESTS_AFTER:-}" ] && timeout $((590 - SECONDS)) python3 -m pytest -m gpu -q --tb=short -rf \
             -p no:cacheprovider $TESTS_AFTER 2>&1 | tail -8 ;;
    graphhttp) # a cold machine's server took 340 s to ready (H100, 2026-12-06: 199 s of it NVRTC for the graphs)
               # ROWS=4: graphs for 1..4 rows only (106 kernels, a cold server ready in ~260 s), cells 1 and 4 streams
               timeout ${HTTP_TIMEOUT:-580} python3 bench/serve.py --concurrency 1,${ROWS:-8} --output-len 128 \
                 --prompts-per-concurrency 2 --server-args "$flash --decode-graphs on --max-rows ${ROWS:-8}" \
                 --out "$OUT/serve_graphs.json" 2>&1 | tail -9 ;;
    profile)   # where the engine thread's time goes while serving: DSV4_ENGINE_PROFILE (cProfile of the serving loop,
               # each iteration of 50 ms or more logged with its phases and counters) at 1 and 8 streams, graphs
               # ${GRAPHS:-on} (full depth; GRAPHS="on overlap off": each, one server after the other; overlap:
               # on with DSV4_GRAPH_OVERLAP=1); then the slow iterations and the top functions; SERVER_EXTRA: more
               # server flags (e.g. "--max-rows 4": 4 row counts' graphs, a shorter cold start); SERVE_EXTRA: more
               # bench/serve.py flags (e.g. STREAMS=7 SERVE_EXTRA="--long-prompt 16384": the slow iterations of the
               # streams' gaps while a long prompt prefills; "--request-rate 4": arrivals spread)
               arms=(${GRAPHS:-on}); left=${#arms[@]}
               for g in "${arms[@]}"; do  # each later arm keeps 110 s (a restart over the kernel caches + its cells)
                 left=$((left - 1)) mode=$g env=()  # overlap: graphs on, DSV4_GRAPH_OVERLAP=1
                 [ $g = overlap ] && { mode=on; env=(DSV4_GRAPH_OVERLAP=1); }
                 env "${env[@]}" DSV4_ENGINE_PROFILE="$OUT/prof_$g" timeout $((${BUDGET:-590} - SECONDS - 110 * left)) \
                   python3 bench/serve.py --concurrency ${STREAMS:-1,8} --output-len 128 --prompts-per-concurrency 2 ${SERVE_EXTRA:-} \
                   --server-args "$flash --decode-graphs $mode ${SERVER_EXTRA:-}" --out "$OUT/serve_prof_$g.json" 2>&1 \
                   | grep -v Warn | tail -9
                 echo "slow iterations: $(grep -c 'slow iteration' "$OUT/serve_prof_$g.log")"
                 grep 'slow iteration' "$OUT/serve_prof_$g.log" | sed 's/.*slow iteration/slow/' > "$OUT/slow_$g.txt"
                 head -${SLOW_LINES:-12} "$OUT/slow_$g.txt" | cut -c1-230
                 [ -f "$OUT/prof_$g/engine.pstats" ] && python3 -c "import pstats, sys; s = pstats.Stats(sys.argv[1]); \
                   s.sort_stats('cumulative').print_stats(60); s.sort_stats('tottime').print_stats(30)" \
                   "$OUT/prof_$g/engine.pstats" > "$OUT/prof_$g.txt" 2>&1 && \
                   grep -A${TOP:-22} "ncalls" "$OUT/prof_$g.txt" | head -$((${TOP:-22} + 1)) | cut -c1-150
               done ;;
    grouped)   # the skinny kernels' 9..64 rows as 8-row groups of one launch: bit for bit the 8-row launches (gpu test)
               timeout 240 python3 -m pytest -m gpu -q --tb=short -rf -p no:cacheprovider tests/kernels/test_cuda_matmul.py \
                 -k "grouped or more_rows or alone" 2>&1 | tail -3 ;;
    short)     # a short prompt's forward (32 tokens; 1, 2 and 8 prompts: 32, 64, 256 rows): the skinny kernels' 8-row
               # groups in one launch (fast) against a launch a slice (slices), host and GPU time (issue 59's TTFT)
               timeout $((${BUDGET:-590} - SECONDS)) python3 bench/prefill.py --experts 32 --prompts 32 \
                 --concurrent ${SHORT_CONC:-1,2,8} --agree 0 --no-profile --arms fast,slices,group_loop \
                 --out "$OUT/prefill_short.json" 2>&1 | grep -v Warn | tail -9 ;;
    fwd32)     # a 32-token prompt's forward (issue 59's TTFT): CUPTI on the fast arm (GPU busy, its idle span and the
               # longest gaps: whether the GPU waits for the host), then the 8-row groups run in turn by each block
               timeout $((${BUDGET:-590} - SECONDS)) python3 bench/prefill.py --experts 32 --prompts 32 --concurrent 1,8 \
                 --agree 0 --profile --arms fast,group_loop --out "$OUT/prefill_fwd32.json" 2>&1 | grep -v Warn | tail -12 ;;
    prefillenv) # a 32-token prompt's forward (1 and 8 prompts) as bench/prefill.py runs it, then with what a graph
               # server changes around it: the glue kernels (DSV4_GRAPH_GLUE=1), the weights and pools in managed
               # memory (--managed), both; one process each (the server's prefill took ~2x the script's, 2026-12-07)
               for arm in ${PREFILLENV_ARMS:-plain glue managed both pooled}; do  # pooled: DSV4_POOLED_KERNEL=1
                 env=() extra=""
                 case $arm in glue) env=(DSV4_GRAPH_GLUE=1) ;; managed) extra=--managed ;;
                   both) env=(DSV4_GRAPH_GLUE=1); extra=--managed ;; pooled) env=(DSV4_POOLED_KERNEL=1) ;; esac
                 env "${env[@]}" timeout 140 python3 bench/prefill.py --experts 32 --prompts 32 --concurrent 1,8,1 \
                   --agree 0 --no-profile $extra --out "$OUT/prefillenv_$arm.json" 2>&1 | grep -E "^ +32 " | sed "s/^/$arm: /"
               done ;;
    poolkeep)  # one stream's TTFT against graph servers whose device pool gives its free bytes back at every
               # synchronization (DSV4_POOL_KEEP=0, MLX's default) or keeps them (1), one server after the other (the
               # first also stores the graphs' plans, the second loads them: its warm restart); then the MLX step beside
               # the graph step with the pool kept (bench/step.py's MLX arm: 18.95 ms at 1 row with it given back)
               for k in ${POOL_KEEP_ARMS:-0 1}; do
                 DSV4_POOL_KEEP=$k timeout 200 python3 bench/serve.py --concurrency 1 --output-len 32 \
                   --prompts-per-concurrency 8 --server-args "$flash --decode-graphs on" --out "$OUT/poolkeep_$k.json" \
                   2>&1 | grep -E "ready in|concurrency 1|TTFT by" | cut -c1-330 | sed "s/^/keep $k: /"
                 grep -E "managed memory in|captured in|warm-up took" "$OUT/poolkeep_$k.log" | cut -c1-260
               done
               DSV4_POOL_KEEP=1 timeout $((590 - SECONDS)) python3 bench/step.py --experts 32 --rows 1,8 --contexts 4096 \
                 --reps 10 --arms fast,graph --out "$OUT/poolkeep_step.json" 2>&1 | grep -v Warn | tail -5 ;;
    restart)   # a graph server restarted over the caches a first one filled (run after PART=profile or graphhttp): the
               # intermediates' addresses read by DLPack, then by the kernel (DSV4_GRAPH_ADDRESSES, opt-in): ready time and the
               # graphs' recording, one short cell each; the address kernel's gpu test; prefill's 32-token forwards
               timeout 60 python3 -m pytest -m gpu -q --tb=short -rf -p no:cacheprovider tests/kernels/test_cuda_address.py \
                 2>&1 | tail -3
               # RESTART_ARMS: dlpack / kernel (the intermediates' addresses), store (DSV4_GRAPH_PLAN_CACHE=1: the
               # first such arm records and stores the plans, a second loads them: "store store")
               for mode in ${RESTART_ARMS:-${ADDRESS_MODES:-dlpack kernel}}; do
                 a=$mode p=0; [ $mode = store ] && { a=dlpack; p=1; }
                 DSV4_GRAPH_ADDRESSES=$a DSV4_GRAPH_PLAN_CACHE=$p timeout 120 python3 bench/serve.py --concurrency 1 \
                   --output-len 64 --prompts-per-concurrency 2 --server-args "$flash --decode-graphs on ${SERVER_EXTRA:-}" \
                   --out "$OUT/restart_$mode.json" 2>&1 | grep -E "ready in|warm-up took|captured in|^ +1 " | cut -c1-330
               done
               timeout $((590 - SECONDS)) python3 bench/prefill.py --experts 32 --prompts 32 --concurrent 1,8 --agree 0 \
                 --no-profile --out "$OUT/prefill32.json" 2>&1 | grep -v Warn | tail -6 ;;
    inplace)   # the slot writes in place (model/state_copy.py's always; the forward's with DSV4_PREFILL_STATE_INPLACE=1):
               # their gpu test, then one graph server a setting (0, 1), 1 and 8 streams: the TTFT's prefill and
               # first step, and the replays' refreshes and pools moved (167 a prefill on the H100 while the reset
               # was MLX's scatter, 2026-12-07: 5.6 ms of the first step)
               timeout 120 python3 -m pytest -m gpu -q --tb=short -rf -p no:cacheprovider tests/model/test_slot_writes.py \
                 2>&1 | tail -3
               for k in ${INPLACE_ARMS:-0 1}; do
                 DSV4_PREFILL_STATE_INPLACE=$k timeout $(((590 - SECONDS) / ${k/0/2})) python3 bench/serve.py \
                   --concurrency 1,8 --output-len 128 --prompts-per-concurrency 3 --server-args "$flash --decode-graphs on" \
                   --out "$OUT/inplace_$k.json" 2>&1 | grep -v Warn | grep -E "concurrency|TTFT by" | sed "s/^/inplace=$k: /"
               done ;;
    correct)   # the correctness checks first (2026-12-07: the HTTP greedy comparisons had compared empty strings, and
               # headless prefill forwards had left their last layer's writes unrun): the prefill's gpu tests (a
               # headless forward's state against decode's, scatter and in place), then a full-depth graph server
               # whose canary (its start-up plain decode, re-admitted every 2 s through the parallel prefill and the
               # replayed steps) runs beside 8 streams: its checks and failures from /metrics
               # (the skinny products' tests first: their kernel's text changed 2026-12-07, the decode step's included)
               # (2026-12-08: the slot writes and the chained rows first, each file in its own process: test order
               # mattered once; the whole matmul file took ~250 s cold on the H100)
               for f in tests/model/test_slot_writes.py tests/kernels/test_scratch_ring.py \
                        tests/kernels/test_compressor_round_build.py tests/model/test_chained_rows.py tests/kernels/test_pool_rows.py \
                        tests/model/test_cuda_prefill.py tests/kernels/test_cuda_matmul.py; do
                 timeout $(( (400 - SECONDS) > 30 ? 400 - SECONDS : 30 )) python3 -m pytest -m gpu -q --tb=short -rf \
                   -p no:cacheprovider $f 2>&1 | grep -E "^E  |FAIL|ERROR|passed|failed|skipped" | cut -c1-240 | tail -8
               done
               port=18124 url=http://127.0.0.1:18124
               python3 -m dsv4_serve.service serve --host 127.0.0.1 --port $port ${CORRECT_SERVER-$flash --decode-graphs on} \
                 --canary-interval 2 --canary-action warn > "$OUT/canary_server.log" 2>&1 & spid=$!  # (CORRECT_SERVER="": the tiny model, a CPU dry run)
               wait_ready $url "$OUT/canary_server.log" 500 "canary server"
               timeout $((570 - SECONDS)) python3 bench/serve.py --url $url --concurrency 8 --output-len 256 \
                 --prompts-per-concurrency 2 --out "$OUT/canary_serve.json" 2>&1 | grep -v Warn | tail -3
               python3 -c "import httpx; print(*[l for l in httpx.get('$url/metrics').text.splitlines()
                                                 if l.startswith('dsv4_canary')], sep='\n')"
               grep -E "canary" "$OUT/canary_server.log" | tail -4 | cut -c1-400
               kill $spid; wait $spid 2>/dev/null ;;
    p59)       # issue 59's acceptance in one call: one graph server (full depth; POOLED=1: DSV4_POOLED_KERNEL=1), 1 and 8
               # streams (each cell's first wave a burst), 8 streams at 4 requests/s (arrivals spread), 7 streams beside a
               # 16K prompt (their ITL during its prefill); the server stopped (memory), the step at rows 1 and 8
               port=18123 url=http://127.0.0.1:18123
               DSV4_POOLED_KERNEL=${POOLED:-0} python3 -m dsv4_serve.service serve --host 127.0.0.1 --port $port $flash \
                 --decode-graphs on > "$OUT/p59_server.log" 2>&1 & spid=$!
               wait_ready $url "$OUT/p59_server.log" $((SECONDS + 400)) "p59 server" || { kill $spid; continue; }
               grep -E "warm-up took|decode graph" "$OUT/p59_server.log" | tail -3 | cut -c1-220
               timeout 150 python3 bench/serve.py --url $url --concurrency 1,8 --output-len 256 --prompts-per-concurrency 3 \
                 --out "$OUT/p59_burst.json" 2>&1 | grep -v Warn | tail -12
               timeout 100 python3 bench/serve.py --url $url --concurrency 8 --output-len 128 --prompts-per-concurrency 3 \
                 --request-rate 4 --seed 1 --out "$OUT/p59_rate.json" 2>&1 | grep -v Warn | tail -7
               timeout 120 python3 bench/serve.py --url $url --concurrency 7 --output-len 512 --prompts-per-concurrency 1 \
                 --long-prompt 16384 --seed 2 --out "$OUT/p59_itl.json" 2>&1 | grep -v Warn | tail -6
               kill $spid; wait $spid 2>/dev/null
               timeout $((595 - SECONDS)) python3 bench/step.py --experts 32 --rows 1,8 --contexts 4096 --reps 10 --profile \
                 --arms fast,graph --out "$OUT/p59_step.json" 2>&1 | grep -v Warn | tail -12 ;;
    ttft)      # issue 59's TTFT: 1 stream, then 8 with Poisson arrivals at 4 requests/s (each cell's first wave: a
               # burst), against the graph engine (full depth)
               timeout 560 python3 bench/serve.py --concurrency 1,8 --output-len 128 --prompts-per-concurrency 3 \
                 --request-rate 4 --server-args "$flash --decode-graphs on" --out "$OUT/serve_ttft.json" 2>&1 | tail -9 ;;
    graphab)   # the default's A/B: the same cells against --decode-graphs off, then on, one call (run it after a graph
               # server has filled the cubin cache, e.g. after PART=graphhttp, so both starts fit)
               for g in off on; do
                 share=1; [ $g = off ] && share=2  # the off server gets half of what is left
                 timeout $(((590 - SECONDS) / share)) python3 bench/serve.py --concurrency 1,8 \
                   --output-len 128 --prompts-per-concurrency 2 --server-args "$flash --decode-graphs $g" \
                   --out "$OUT/serve_ab_$g.json" 2>&1 | grep -v Warn | tail -7
               done ;;
    graphpace) # 8 streams against the graph engine with prefill paced (auto) and in whole forwards (0 and 0): which
               # costs the streams less, and the slices each cell built (bench/serve.py prints them); RATE=4: arrivals
               # at 4 requests/s (issue 59's spread TTFT), default a burst
               for t in auto 0; do
                 timeout $(((590 - SECONDS) / 2)) python3 bench/serve.py --concurrency 8 --output-len 128 \
                   --prompts-per-concurrency 2 --request-rate ${RATE:-inf} --out "$OUT/serve_pace_$t.json" --server-args \
                   "$flash --decode-graphs on --itl-target-ms $t $([ $t = 0 ] && echo --prefill-slice-ms 0)" \
                   2>&1 | grep -v Warn | tail -5
               done ;;
    startup)   # where a start's warm-up goes: the same warm-up twice in two processes (the second with MLX's kernel
               # cache as the first left it), cProfile and MLX_PTX_CACHE_DIR's listing each (tools/startup_profile.py)
               for run in cold warm; do  # DSV4_KERNEL_CACHE=1 (default here): the first run fills MLX's cache
                 DSV4_KERNEL_CACHE=${KERNEL_CACHE:-1} timeout $(((590 - SECONDS) / 2)) python3 tools/startup_profile.py \
                   --experts 32 \
                   --graphs ${STARTUP_GRAPHS:-off} --top 30 --json "$OUT/startup_$run.json" 2>&1 | grep -v Warn | tail -48
               done ;;
    spec)      # issue 61: one user's tok/s with MTP speculation, drafts forced right (1.0) or at 0.7 a draft, the verify
               # as the prefill forward and as a chained step (DSV4_CHAINED_ROWS=1 for that arm), against the plain
               # engine and the plain graph engine (bench/spec_decode.py)
               timeout 560 python3 bench/spec_decode.py --experts 32 --prompt 4096 --tokens 48 --ks 1,3 \
                 --accept 1.0,0.7 --verify ${VERIFY:-forward,rows} --graph --out "$OUT/spec_decode.json" 2>&1 \
                 | grep -v Warn | tail -12 ;;
    agree)     # greedy tokens with graphs on against the MLX step with the same kernels (the glue kernels on), then
               # against the default MLX step: joins, leaves and prefix hits at ~4K (tools/graph_agree.py)
               small=${AGREE_MODEL-"--load-format dummy --model flash --layers 8 --experts 16"}
               arms=(${AGREE_ARMS:-on glue off})
               start() {  # arm index: its server on port 8700 + index (glue: off with DSV4_GRAPH_GLUE; nopipe: on
                 local arm=${arms[$1]} g=${arms[$1]} env=()  # without host pipelining), a fixed state budget
                 [ $arm = glue ] && { g=off; env=(DSV4_GRAPH_GLUE=1); }
                 [ $arm = nopipe ] && { g=on; env=(DSV4_GRAPH_PIPELINE=0); }
                 env "${env[@]}" python3 -m dsv4_serve.service serve --host 127.0.0.1 --port $((8700 + $1)) $small \
                   --decode-graphs $g --max-state-gib ${AGREE_STATE_GIB:-10} > "$OUT/agree_$arm.log" 2>&1 &
               }
               run() {  # arm index: wait for its server, the scenario on it, then stop it
                 local arm=${arms[$1]} url="http://127.0.0.1:$((8700 + $1))"
                 wait_ready "$url" "$OUT/agree_$arm.log" ${AGREE_READY_S:-420} "agree: $arm" || return
                 timeout $((580 - SECONDS)) python3 tools/graph_agree.py --url "$url" --out "$OUT/agree_$arm.json" 2>&1 | tail -1
               }
               if [ -n "${AGREE_PARALLEL:-}" ]; then  # every server started at once: their start-ups overlap
                 for i in "${!arms[@]}"; do start $i; done
                 for i in "${!arms[@]}"; do run $i; done
               else
                 for i in "${!arms[@]}"; do start $i; run $i; kill %% 2>/dev/null; wait 2>/dev/null; done
               fi
               kill $(jobs -p) 2>/dev/null
               for arm in "${arms[@]:1}"; do [ -f "$OUT/agree_$arm.json" ] && \
                 python3 tools/graph_agree.py --compare "$OUT/agree_${arms[0]}.json" "$OUT/agree_$arm.json"; done ;;
    verify)    # one cold call: greedy tokens of the graph step with host pipelining (pipe) against the MLX step (off,
               # DSV4_KERNEL_CACHE=1: it fills MLX's kernel cache after its warm-up); then two restarts from what those
               # left: off again (warm: MLX's kernel cache) and the graph step without pipelining (on: the cubin
               # cache); each one's ready time and tokens against off's (tools/graph_agree.py's scenario). Each arm's
               # environment is explicit (the defaults as of 2026-12-07 c6e72db, when it first ran)
               small=${AGREE_MODEL-"--load-format dummy --model flash --layers 8 --experts 32"}
               serve() {  # name port graphs [VAR=value ...]: a server, its log under $OUT
                 local name=$1 port=$2 g=$3; shift 3
                 env "$@" python3 -m dsv4_serve.service serve --host 127.0.0.1 --port $port $small --decode-graphs $g \
                   --max-state-gib ${AGREE_STATE_GIB:-10} > "$OUT/verify_$name.log" 2>&1 &
                 eval "pid_$name=$!"
               }
               scenario() {  # name port: wait for its /ready, then the scenario on it
                 local name=$1 url="http://127.0.0.1:$2"
                 wait_ready "$url" "$OUT/verify_$name.log" 560 "verify: $name" || return
                 timeout $((585 - SECONDS)) python3 tools/graph_agree.py --url "$url" --out "$OUT/verify_$name.json" \
                   2>&1 | tail -1
               }
               serve off 8700 off DSV4_KERNEL_CACHE=1
               on=${VERIFY_ON:-on}  # off: the flow checked on a CPU (AGREE_MODEL="" AGREE_STATE_GIB=2: the tiny model)
               serve pipe 8701 $on DSV4_GRAPH_PIPELINE=1
               scenario off 8700
               until grep -q "kernel cache:" "$OUT/verify_off.log" || [ $SECONDS -gt 300 ]; do sleep 2; done
               kill $pid_off; serve warm 8702 off DSV4_KERNEL_CACHE=1
               scenario pipe 8701
               kill $pid_pipe; serve on 8703 $on DSV4_GRAPH_PIPELINE=0 ${VERIFY_ON_ENV:-}  # e.g. DSV4_PREFILL_STATE_INPLACE=1
               scenario warm 8702
               scenario on 8703
               kill $(jobs -p) 2>/dev/null
               grep -h "warm-up took\|kernel cache:\|decode graphs:\|late" "$OUT"/verify_*.log | cut -c1-400
               for arm in pipe warm on; do [ -f "$OUT/verify_$arm.json" ] && \
                 python3 tools/graph_agree.py --compare "$OUT/verify_off.json" "$OUT/verify_$arm.json"; done ;;
    http) timeout 560 python3 bench/serve.py --concurrency 1,8 --server-args "$flash" \
            --out "$OUT/serve_flash.json" 2>&1 | tail -6 ;;  # 260 s did not reach the 8-stream cell (2026-12-02)
    dispatch) # the decode step's Python dispatch (launch caches, views of one output): the kernels it launches
              # and the layer-by-layer numerics with every fast path
              timeout $((580 - SECONDS)) python3 -m pytest -m gpu -q --tb=short -rf -p no:cacheprovider -x \
                tests/kernels/test_cuda_matmul.py tests/kernels/test_cuda_pair.py tests/kernels/test_cuda_inplace.py \
                tests/kernels/test_cuda_indexer.py tests/kernels/test_cuda_workspace.py \
                tests/kernels/test_cuda_plans.py tests/model/test_step_angles.py tests/model/test_cuda_layer_numerics.py \
                2>&1 | tail -8 ;;
    numerics) # the layer-by-layer numerics with every fast path first (its fixture builds and JITs a 4-layer
              # V4-Flash: > 150 s on a fresh machine), then the skinny products' gpu tests
              timeout 380 python3 -m pytest -m gpu -q --tb=short -rf -p no:cacheprovider \
                tests/model/test_cuda_layer_numerics.py 2>&1 | tail -4
              timeout $((585 - SECONDS)) python3 -m pytest -m gpu -q --tb=short -rf -p no:cacheprovider \
                tests/kernels/test_cuda_matmul.py tests/kernels/test_cuda_hc.py 2>&1 | tail -4 ;;
    now) # issue 29's figures in one call: the step at 1 and 8 rows, 4K and 64K, with CUPTI, then 8 streams over HTTP
         timeout 250 python3 bench/step.py --experts 32 --rows 1,8 --contexts 4096,65536 --reps 8 --arms fast \
           --profile --out "$OUT/step.json" 2>&1 | grep -v Warn | tail -6
         timeout $((590 - SECONDS)) python3 bench/serve.py --concurrency 8 --output-len 256 \
           --prompts-per-concurrency 2 --server-args "$flash" --out "$OUT/serve8.json" 2>&1 | tail -6 ;;
    http90) # issue 29's HTTP point in one call: the engine's step at 8 rows (4K), then 8 streams through the service
            timeout 200 python3 bench/step.py --experts 32 --rows 8 --contexts 4096 --reps 8 --arms fast \
              --out "$OUT/step8.json" 2>&1 | tail -6
            timeout $((590 - SECONDS)) python3 bench/serve.py --concurrency 8 --output-len 256 \
              --prompts-per-concurrency 2 --server-args "$flash" --out "$OUT/serve8.json" 2>&1 | tail -4 ;;
    ncu) # where a 2K forward's GPU time goes, then the experts' tile GEMMs under ncu (2 layers, no CUDA graphs)
         timeout 200 python3 bench/prefill.py --experts 32 --prompts 2048 --concurrent 1 --agree 0 --profile \
           --out "$OUT/prefill_top.json" 2>&1 | grep -v Warn | tail -3
         MLX_USE_CUDA_GRAPHS=0 timeout $((560 - SECONDS)) ncu --clock-control none --kernel-name-base demangled \
           --kernel-name regex:tiles_mm --launch-count ${NCU_COUNT:-6} --section SpeedOfLight --section Occupancy \
           --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis \
           --section ComputeWorkloadAnalysis --section SchedulerStats \
           python3 bench/prefill.py --layers 2 --experts 32 --prompts 2048 --concurrent 1 --agree 0 --no-profile \
           --out /tmp/p2.json > "$OUT/ncu.txt" 2>&1; grep -E "tiles_mm|Duration|Throughput|Registers|Achieved Occ|Block Limit" \
           "$OUT/ncu.txt" | head -80 ;;
    skinny) timeout 200 python3 bench/matmuls.py --rows 1,8 --out "$OUT/matmuls.json" 2>&1 | grep -v Warn
            timeout $((580 - SECONDS)) python3 bench/step.py --experts 32 --rows 1,8 --contexts 4096 --reps 8 \
              --arms fast --profile --out "$OUT/step.json" 2>&1 | grep -v Warn | tail -6 ;;
    roofline) timeout 420 python3 bench/step.py --experts 32 --rows 1,8 --contexts 4096 --reps 8 --arms graph \
                --profile --traces "$OUT" --out "$OUT/step_graph.json" 2>&1 | grep -v Warn | tail -4
              timeout $((590 - SECONDS)) python3 bench/roofline.py --experts 32 --rows 1,8 --contexts 4096 \
                --trace "$OUT" --step-json "$OUT/step_graph.json" --out "$OUT/roofline.json" 2>&1 | grep -v Warn ;;
    ncu_skinny) MLX_USE_CUDA_GRAPHS=0 timeout 400 ncu --clock-control none --kernel-name-base demangled \
           --kernel-name regex:"skinny_mm|hc_pre" --launch-skip 4 --launch-count 12 --section SpeedOfLight \
           --section Occupancy --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis \
           --section ComputeWorkloadAnalysis --section SchedulerStats python3 bench/matmuls.py --rows 8 --sets 2 \
           --reps 1 --only "experts,pre-mix + norm" --no-profile > "$OUT/ncu_skinny.txt" 2>&1
         grep -E "skinny_mm|hc_pre|Duration|Throughput|Registers|Achieved Occ|Block Limit|Issue Slots|No Eligible" \
           "$OUT/ncu_skinny.txt" | head -120 ;;
    moe) timeout 170 python3 -m pytest -m gpu -q --tb=short -rf -p no:cacheprovider \
             tests/kernels/test_cuda_experts_grouped.py tests/kernels/test_cuda_tiles_mm.py \
             tests/model/test_cuda_prefill.py 2>&1 | tail -4
           timeout $((${LIMIT:-590} - SECONDS)) python3 bench/prefill.py --experts 32 --prompts 2048 --concurrent 1,4 \
             --arms fast --agree 0 --profile --out "$OUT/prefill_moe.json" 2>&1 \
             | grep -v Warn | tail -8
           [ "${SHORT:-0}" = 1 ] && continue  # a short call: the tests and the A/B only
           timeout 120 python3 bench/prefill.py --experts 32 --prompts 2048 --concurrent 1,4 --chunk 8192 \
             --arms fast --agree 0 --no-profile --out "$OUT/prefill_8k.json" 2>&1 | grep -v Warn | tail -3
           timeout $((590 - SECONDS)) python3 bench/prefill.py --experts 32 --prompts 16384,65536 --concurrent 1 \
             --arms fast --agree 0 --no-profile --out "$OUT/prefill_long.json" 2>&1 | grep -v Warn | tail -4 ;;
    itl) timeout 560 python3 bench/serve.py --concurrency 7 --output-len 512 --prompts-per-concurrency 1 \
           --long-prompt 16384 --server-args "$flash" --out "$OUT/serve_itl.json" 2>&1 | tail -6 ;;  # issue 30's ITL
    long64) # a 64K prompt beside 7 streams at the defaults (issue 30's memory point), their ITL during it
            timeout 560 python3 bench/serve.py --concurrency 7 --output-len 1024 --prompts-per-concurrency 1 \
              --long-prompt 65536 --server-args "$flash --max-model-len 70000" --out "$OUT/serve_itl64k.json" \
              2>&1 | tail -4 ;;
    prefix) timeout 560 python3 bench/prefix_turn.py --server-args "$flash" --cold-server-args \
              "$flash --prefix-cache-gib 0" --tokens 16384 --output-len 32 --tail 64 --repeats 1 \
              --out "$OUT/prefix_turn.json" 2>&1 | tail -8 ;;
    step) timeout 560 python3 bench/step.py --experts 32 --profile --out "$OUT/step.json" --plot "$OUT/step.png" \
            2>&1 | tail -40 ;;
    serve) timeout 250 python3 bench/serve.py --concurrency 1,8 --out "$OUT/serve.json" --plot "$OUT/serve.png" 2>&1 | tail -6
           timeout 250 python3 bench/serve.py --concurrency 1,8 --server-args=--no-pipeline \
             --out "$OUT/serve_no_pipeline.json" 2>&1 | tail -6 ;;
    dist) timeout 400 "${launch[@]}" --backend nccl -n 2 --env NCCL_NVLS_ENABLE=0 -- \
            python3 bench/distributed_step.py --backend nccl --out "$OUT/distributed_step.json" 2>&1 | tail -20 ;;
    *) echo "gpu_all.sh: unknown PART $part (tests pytest tests2 verify p59 inplace profile grouped short fwd32 prefillenv poolkeep restart graph graphhttp graphab graphpace startup roofline prefill graphs http dispatch now http90 ncu moe itl long64 prefix step serve dist)" >&2; exit 2 ;;
  esac
done 2>&1 | tee -a "$OUT/gpu_all.log"
