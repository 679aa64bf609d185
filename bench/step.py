"""The decode step of record: the full V4-Flash (43 layers, release precision) on random weights.

mxfp8 dense projections + mxfp4 routed experts (as the release stores them; `--experts N` cuts the routed
experts to fit one GPU, default the most that fit), bf16 elsewhere; rows 1, 2, 4, 8 at 4K and 64K
context, each cell a pipelined greedy loop (the engine's: step i + 1 queued before step i's tokens are
read). The context is laid down as random state, not prefilled. Arms alternate in one process
(bench/arms.py): `fast` (every fast path), `unfused` (the fused glue ops as the launches they fuse),
`mlx_mm` (MLX's own matmuls for the weight products), `no_glue` (the glue ops' references), `hc_one` (the
mHC pre-mix one block a row). Per cell: ms a step, tokens/s, the byte floor (the bytes a step must read at
the release's precision over a plain copy's bandwidth measured in this run), the host's split of a step (`build`:
Python making the lazy graph; `encode`: MLX's async_eval, each node's host work and the CUDA graphs'
launch) and, with `--profile` (CUPTI through torch.profiler, the device's python3), kernels a step, GPU
busy time a step and the kernels that take it. Prints a table, writes JSON.

    python3 bench/step.py --out $OUT/step.json [--experts 32] [--rows 1,8] [--contexts 4096,65536] [--profile]
        [--plot step.png]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("MLX_ENABLE_TF32", "0")  # as the server runs (service/__main__.py)

import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

from bench.arms import ARMS, set_arm  # noqa: E402
from bench.common import copy_bandwidth, gpu_profile, plot_step, provenance  # noqa: E402
from dsv4_serve.model.checkpoint import is_f32_param  # noqa: E402
from dsv4_serve.model.config import ModelArgs  # noqa: E402
from dsv4_serve.model.deepseek_v4 import DeepseekV4  # noqa: E402
from dsv4_serve.model.dummy import dummy_model  # noqa: E402
from dsv4_serve.model.state import StatePools  # noqa: E402


def flash_args(layers: int, experts: int) -> ModelArgs:
    a = ModelArgs()  # V4-Flash defaults: 43 layers [0, 0] + [4, 128] * 20 + [4]
    if layers != a.num_hidden_layers:
        a.num_hidden_layers = layers
        a.compress_ratios = ([0, 4, 128, 4] * ((layers + 3) // 4))[:layers]
        a.num_hash_layers = min(a.num_hash_layers, layers)
    a.n_routed_experts = experts
    return a


def expert_bytes(a: ModelArgs) -> float:
    """One routed expert at mxfp4: 3 matrices of I x H nibbles + an e8m0 scale per 32."""
    return 3 * a.moe_intermediate_size * a.hidden_size * (0.5 + 1 / 32)


def most_experts(layers: int, reserve_gib: float = 12.0) -> int:
    """The most routed experts a layer that fit the device's memory beside the dense weights and the state."""
    try:
        total = float(mx.device_info()["memory_size"])
    except Exception:  # no device info: the release's count
        return 256
    a = flash_args(layers, 8)
    dense = sum(p.size for n, p in tree_flatten(DeepseekV4(a).parameters()) if ".ffn.experts." not in n)
    free = total - dense * 1.1 - reserve_gib * 2**30  # dense weights ~1 byte a parameter (mxfp8), a margin
    return max(8, min(256, int(free / (layers * expert_bytes(a)))))


def random_model(args: ModelArgs, quantize: bool = True, seed: int = 0) -> DeepseekV4:
    """Random weights laid out as the loader lays out a release checkpoint (model/dummy.py, what
    `serve --load-format dummy` serves): mxfp8 dense + mxfp4 experts, one tensor drawn at a time."""
    return dummy_model(args, seed=seed, dtype=mx.bfloat16, quantize=quantize)


def fill_state(pools: StatePools, ctx: int) -> None:
    """Random window rings, compressed entries and indexer keys, as if `ctx` tokens had been decoded."""
    for i, a in enumerate(pools.window):
        pools.window[i] = (0.5 * mx.random.normal(a.shape, key=mx.random.key(1000 + i))).astype(a.dtype)
    for d in (pools.ckv, pools.ikeys):
        for layer, a in d.items():
            d[layer] = (0.5 * mx.random.normal(a.shape, key=mx.random.key(layer + 7))).astype(a.dtype)
    for d in (pools.comp_kv, pools.comp_score, pools.idx_kv, pools.idx_score):
        for layer, a in d.items():
            d[layer] = mx.random.normal(a.shape, key=mx.random.key(layer + 99)).astype(a.dtype)
    mx.eval(pools.arrays())


def release_bytes(name: str, size: int) -> float:
    """A parameter's bytes as the release stores it (section 4 of the model doc): FP8 e4m3 (+ one scale a
    128 x 128 block) for the dense projections, wo_a included; FP4 + a scale per 32 for the routed
    experts; F32 for the release's f32 tensors; BF16 for the rest."""
    if ".ffn.experts." in name:
        return size * (0.5 + 1 / 32) if not name.endswith("_scales") else 0.0
    if name.endswith(".scales"):
        return 0.0  # counted with their weight
    for fp8 in ("attn.wq_a.", "attn.wq_b.", "attn.wkv.", "attn.wo_a.", "attn.wo_b.", "indexer.wq_b.",
                "shared_experts.w"):  # fmt: skip
        if fp8 in name and "compressor" not in name:
            return size * (1 + 1 / 16384)
    return size * (4 if is_f32_param(name) else 2)


def floor_bytes(model: DeepseekV4, rows: int, ctx: int) -> tuple[float, float]:
    """(weight bytes, state bytes) one step must read at least, at the release's precision (the MTP block's
    weights not: the plain step never runs it)."""
    a = model.args
    dense = expert = 0.0
    for name, p in tree_flatten(model.parameters()):
        if name.startswith(("embed.", "mtp.")):
            continue  # B rows of the embedding; the MTP block runs only when speculating
        # logical parameter count: a packed uint32 holds 4 (mxfp8) or 8 (mxfp4) values
        n = p.size * (8 if ".ffn.experts.w" in name else 4) if p.dtype == mx.uint32 else p.size
        b = release_bytes(name, n)
        if ".ffn.experts." in name:
            expert += b
        else:
            dense += b
    e, k = a.n_routed_experts, a.num_experts_per_tok
    distinct = e * (1 - (1 - k / e) ** rows)  # expected distinct experts of B rows, per layer
    state = 0
    for r in a.compress_ratios:
        n = min(ctx + 1, a.sliding_window)
        if r == 4:
            n += min(a.index_topk, ctx // 4)
            state += rows * (ctx // 4) * a.index_head_dim * 2  # the indexer scores every entry
        elif r == 128:
            n += ctx // 128
        state += rows * n * a.head_dim * 2
    return dense + expert * distinct / e, state


HOST: dict[str, list[float]] = {"build": [], "encode": []}
# The replayed arms: the engine's graphs as a chain of launches (`graph`), or each launch waiting only for what it
# depends on (`graph_dag`, kernels/graph/deps.py); the value is GraphStep's `dag`.
GRAPH_ARMS = {"graph": False, "graph_dag": True}


def time_loop(model: DeepseekV4, pools: StatePools, handles, ctx: int, reps: int) -> list[float]:
    """Pipelined greedy decode of `reps` steps (the engine's loop): step i + 1 is built and queued with step
    i's tokens still on the device, then step i's are read back. Returns the times between read-backs;
    HOST gets each step's host split: `build` (Python making the lazy graph) and `encode` (MLX's
    async_eval: each node's eval on the host, the CUDA graphs' update and launch)."""
    tok = mx.array([7] * len(handles), dtype=mx.int32)
    ts, pending = [], None
    HOST["build"].clear()
    HOST["encode"].clear()
    t = time.perf_counter()
    for i in range(reps + 1):
        if i < reps:
            t0 = time.perf_counter()
            logits = model.step(model.make_batch(pools, handles, [ctx + i] * len(handles)), tok, pools)
            tok = mx.argmax(logits, axis=-1).astype(mx.int32)
            t1 = time.perf_counter()
            mx.async_eval(tok, pools.arrays())
            HOST["build"].append(t1 - t0)
            HOST["encode"].append(time.perf_counter() - t1)
        done, pending = pending, tok
        if done is not None:
            done.tolist()
            now = time.perf_counter()
            ts.append(now - t)
            t = now
    return ts[:-1]  # the last read-back has no step behind it


def graph_loop(graphs, handles, ctx: int, reps: int) -> list[float]:
    """The `graph` arm, as the engine runs it: each step one replay (staging copy, graph launch, wait), then the
    greedy tokens read back for the next. HOST: `build` 0, `encode` the replay's call (the GPU's time in it)."""
    from dsv4_serve.kernels.rows import Row

    graphs.touched()  # another arm's MLX step may have moved a pool: read again (a recapture lands in the warm-up)
    tok, ts = [7] * len(handles), []
    HOST["build"].clear()
    HOST["encode"].clear()
    t = time.perf_counter()
    for i in range(reps):
        rows = [Row(slot=h.slot, position=ctx + i, q_row=j, tables=h.tables) for j, h in enumerate(handles)]
        t0 = time.perf_counter()
        logits = graphs.replay(rows, tok)
        HOST["encode"].append(time.perf_counter() - t0)
        HOST["build"].append(0.0)
        if logits is None:
            raise SystemExit(f"step.py: no graph for {len(handles)} rows: {graphs.reasons.get(len(handles))}")
        tok = mx.argmax(logits, axis=-1).tolist()
        now = time.perf_counter()
        ts.append(now - t)
        t = now
    return ts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=43)
    ap.add_argument("--experts", type=int, default=0, help="routed experts a layer (0: the most that fit)")
    ap.add_argument("--contexts", default="4096,65536")
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--arms", default="fast,unfused,no_glue", help=f"of {', '.join(ARMS)} (bench/arms.py)")
    ap.add_argument("--profile", action="store_true", help="CUPTI: kernels and GPU busy time a step (each arm)")
    ap.add_argument("--traces", default="", help="folder for the profiles' Chrome traces (default: none kept)")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "step.json"))
    ap.add_argument("--plot", metavar="PNG", help="also draw ms a step against rows, with the floor")
    opt = ap.parse_args()
    arms = opt.arms.split(",")
    recorder = None
    graph_arms = [a for a in arms if a in GRAPH_ARMS]
    if graph_arms:  # the recorder stands in for mx.fast.cuda_kernel before any kernel object is made
        from dsv4_serve.service.engine.graphs import prepare

        recorder = prepare("on")
    experts = opt.experts or most_experts(opt.layers)
    args = flash_args(opt.layers, experts)
    t0 = time.perf_counter()
    model = random_model(args)
    print(f"model: {opt.layers} layers, {experts} experts, ready in {time.perf_counter() - t0:.1f} s on "
          f"{mx.default_device()}, {mx.get_active_memory() / 2**30:.1f} GiB", flush=True)  # fmt: skip
    bw = copy_bandwidth()
    rows_list = [int(r) for r in opt.rows.split(",")]
    traces = Path(opt.traces) if opt.traces else None
    results, graph_info = [], []
    for ctx in (int(c) for c in opt.contexts.split(",")):
        cap = ctx + 4 * opt.reps + 64
        pools = StatePools(args, max_slots=max(rows_list), max_positions=cap, page_size=256, dtype=mx.bfloat16)
        handles = [pools.alloc(cap) for _ in range(max(rows_list))]
        fill_state(pools, ctx)
        graphs: dict = {}
        for arm in graph_arms:
            from dsv4_serve.kernels.graph.cubin_cache import default_dir
            from dsv4_serve.model.graph_step import GraphStep

            set_arm("graph", model)
            t1 = time.perf_counter()
            graphs[arm] = GraphStep(model, pools, recorder, default_dir(), dag=GRAPH_ARMS[arm])
            graphs[arm].capture(handles)
            print(f"{arm}: rows {sorted(graphs[arm].graphs)} captured in {time.perf_counter() - t1:.1f} s; "
                  f"{graphs[arm].reasons or 'no fallback'}", flush=True)  # fmt: skip
        pos = ctx

        def loop_of(arm: str, graphs=graphs, pools=pools):  # noqa: ANN001, ANN202 - this context's pools and graphs
            if arm in graphs:
                return lambda rows_, at, n: graph_loop(graphs[arm], rows_, at, n)
            return lambda rows_, at, n: time_loop(model, pools, rows_, at, n)

        for rows in rows_list:
            times: dict[str, list[float]] = {}
            host: dict[tuple[str, str], list[float]] = {}
            for arm in arms * 2:  # alternated
                set_arm(arm, model)
                loop = loop_of(arm)
                loop(handles[:rows], pos, 3)  # trace + warm
                times.setdefault(arm, []).extend(loop(handles[:rows], pos + 3, opt.reps))
                for k, v in HOST.items():
                    host.setdefault((arm, k), []).extend(v)
            wb, sb = floor_bytes(model, rows, ctx)
            floor = (wb + sb) / bw
            profs: dict[str, dict] = {}
            for arm in arms if opt.profile else ():  # each arm's kernels and busy time, for the before/after
                set_arm(arm, model)
                hs, fn = handles[:rows], loop_of(arm)
                profs[arm] = gpu_profile(lambda n, f=fn, hs=hs, at=pos: f(hs, at, n), 4, traces,
                                         f"{ctx}_{rows}_{arm}")  # fmt: skip
            for arm, ts in times.items():
                med = statistics.median(ts)
                cell = {"layers": opt.layers, "experts": experts, "context": ctx, "rows": rows, "arm": arm,
                        "ms_per_step": med * 1e3, "spread_ms": (max(ts) - min(ts)) * 1e3, "tokens_per_s": rows / med,
                        "floor_ms": floor * 1e3, "weight_gb": wb / 1e9, "state_gb": sb / 1e9,
                        "x_floor": med / floor, "build_ms": statistics.median(host[(arm, "build")]) * 1e3,
                        "encode_ms": statistics.median(host[(arm, "encode")]) * 1e3}  # fmt: skip
                if arm in profs:
                    cell |= profs[arm] | {"busy_x_floor": profs[arm]["gpu_busy_ms_per_step"] / (floor * 1e3)}
                results.append(cell)
                print(json.dumps(cell), flush=True)
        for arm, g in graphs.items():
            graph_info.append({"arm": arm, "context": ctx, "stats": dict(g.stats), "reasons": g.reasons})
        del pools, handles, loop_of
        graphs = {}
    meta = {"mlx": mx.__version__, "device": str(mx.default_device()), "copy_bw_GBs": bw / 1e9,
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), "python": platform.python_version(),
            "graphs": graph_info} | provenance()
    Path(opt.out).write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    print(json.dumps(meta))
    if opt.plot:
        plot_step(results, meta, opt.plot)
    head = ("ctx", "rows", "arm", "ms/step", "tok/s", "floor ms", "x floor", "kern/step", "busy ms", "kern ms",
            "build", "encode")  # fmt: skip
    print("{:>6} {:>4} {:>9} {:>8} {:>7} {:>8} {:>7} {:>9} {:>8} {:>8} {:>6} {:>6}".format(*head))
    for r in results:
        print(f"{r['context']:>6} {r['rows']:>4} {r['arm']:>9} {r['ms_per_step']:>8.2f} {r['tokens_per_s']:>7.1f} "
              f"{r['floor_ms']:>8.3f} {r['x_floor']:>7.2f} {r.get('kernels_per_step', 0):>9.0f} "
              f"{r.get('gpu_busy_ms_per_step', 0):>8.2f} {r.get('kernel_ms_per_step', 0):>8.2f} "
              f"{r['build_ms']:>6.1f} {r['encode_ms']:>6.1f}")


if __name__ == "__main__":
    main()
