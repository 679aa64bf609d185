"""The project's real decode step on a truncated V4-Flash (real dims, random weights, bf16).

4 layers by default (sliding, CSA, HCA, CSA); rows 1, 2, 4, 8 at 4K and 128K context; with the fast
kernels and with DSV4_KERNELS=reference, measured side by side in one run. The context is laid down as
random state (window rings, compressed entries, indexer keys), not prefilled. Prints a table, writes JSON.

    python bench/step.py --out $OUT/step.json [--layers 4] [--contexts 4096,131072] [--rows 1,2,4,8] [--plot step.png]
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
from mlx.utils import tree_flatten, tree_unflatten  # noqa: E402

import kernels.upload as kupload  # noqa: E402
from bench.common import copy_bandwidth, plot_step, provenance  # noqa: E402
from model import attention  # noqa: E402
from model.checkpoint import is_f32_compute  # noqa: E402
from model.config import ModelArgs  # noqa: E402
from model.deepseek_v4 import DeepseekV4  # noqa: E402
from model.state import StatePools  # noqa: E402

COPY_BW = None  # bytes/s of a plain device copy, measured in this run


def flash_args(layers: int) -> ModelArgs:
    a = ModelArgs()  # V4-Flash defaults
    a.num_hidden_layers = layers
    a.compress_ratios = ([0, 4, 128, 4] * ((layers + 3) // 4))[:layers]
    return a


def random_model(args: ModelArgs, dtype: mx.Dtype, quantize: str | None) -> DeepseekV4:
    model = DeepseekV4(args)
    key = mx.random.key(0)
    for name, p in tree_flatten(model.parameters()):
        key, sub = mx.random.split(key)
        if p.dtype == mx.int32:  # tid2eid: distinct-ish random experts
            v = mx.random.randint(0, args.n_routed_experts, p.shape, key=sub).astype(mx.int32)
        else:
            fan = p.shape[-1] if p.ndim >= 2 else 1
            std = fan**-0.5 if p.ndim >= 2 else 0.1
            base = 1.0 if name.endswith("norm.weight") else 0.0
            keep = p.ndim < 2 or is_f32_compute(name)  # as the loader keeps them
            v = (base + std * mx.random.normal(p.shape, key=sub)).astype(mx.float32 if keep else dtype)
            if name.endswith("norm.weight"):
                v = v.astype(dtype)
        model.update(tree_unflatten([(name, v)]))
        mx.eval(v)
    if quantize:
        from model.quant import quantize_model  # issue 5: mxfp8 dense / mxfp4 experts

        quantize_model(model, mode=quantize)
    mx.eval(model.parameters())
    return model


def fill_state(pools: StatePools, handles, ctx: int) -> None:
    key = mx.random.key(1)
    for lst in (pools.window,):
        for i, a in enumerate(lst):
            lst[i] = (0.5 * mx.random.normal(a.shape, key=mx.random.split(key, i + 2)[i + 1])).astype(a.dtype)
    for d in (pools.ckv, pools.ikeys):
        for layer, a in d.items():
            d[layer] = (0.5 * mx.random.normal(a.shape, key=mx.random.key(layer + 7))).astype(a.dtype)
    for d in (pools.comp_kv, pools.comp_score, pools.idx_kv, pools.idx_score):
        for layer, a in d.items():
            d[layer] = mx.random.normal(a.shape, key=mx.random.key(layer + 99)).astype(a.dtype)
    mx.eval(pools.arrays())


def floor_bytes(model: DeepseekV4, rows: int, ctx: int) -> tuple[float, float]:
    """(weight bytes, state bytes) one step must read at least."""
    a = model.args
    total = 0
    expert = 0
    for name, p in tree_flatten(model.parameters()):
        if ".ffn.experts." in name:
            expert += p.nbytes
        else:
            total += p.nbytes
    e, k = a.n_routed_experts, a.num_experts_per_tok
    distinct = e * (1 - (1 - k / e) ** rows)
    weights = total + expert * distinct / e
    state = 0
    for r in a.compress_ratios:
        n = min(ctx + 1, a.sliding_window)
        if r == 4:
            n += min(a.index_topk, ctx // 4)
            state += rows * (ctx // 4) * a.index_head_dim * 2
        elif r == 128:
            n += ctx // 128
        state += rows * n * a.head_dim * 2
    return weights, state


def set_op_compile(on: bool) -> None:
    """kernels.cuda's per-op mx.compile switch (DSV4_CUDA_COMPILE), flipped in-process for an A/B arm."""
    if on or "kernels.cuda.common" in sys.modules:
        import kernels.cuda.common as kc

        kc.COMPILE = on or os.environ.get("DSV4_CUDA_COMPILE", "0").strip() not in ("0", "")


def set_hc_kernel(on: bool) -> None:
    """The mHC pre-mix kernel in or out of the backend (model.reset_compiled() makes the segments retrace)."""
    from kernels import backend

    if on:
        import kernels.cuda as kc

        backend.register("hc_pre_mix", kc.hc_pre_mix_cuda)
    else:
        backend.unregister("hc_pre_mix")


def time_steps(model, pools, handles, ctx, reps) -> list[float]:
    ts = []
    for i in range(reps):
        t = time.perf_counter()
        model.decode(pools, handles, [7] * len(handles), [ctx + i] * len(handles))
        ts.append(time.perf_counter() - t)
    return ts


def time_loop(model, pools, handles, ctx, reps, pipelined: bool) -> list[float]:
    """Greedy decode `reps` steps, the next step's tokens the argmax of this one's logits (on the device).
    Synced: each step's token is read back before the next step is built, as the engine does now.
    Pipelined (mlx-lm's generate loop): step i + 1 is built and queued with step i's lazy tokens, and
    step i's tokens are read back after, so the host builds one step while the GPU runs the previous
    one. Returns the time between consecutive token read-backs."""
    tok = mx.array([7] * len(handles), dtype=mx.int32)
    ts, pending = [], None
    t = time.perf_counter()
    for i in range(reps + 1 if pipelined else reps):
        if i < reps:
            logits = model.step(model.make_batch(pools, handles, [ctx + i] * len(handles)), tok, pools)
            tok = mx.argmax(logits, axis=-1).astype(mx.int32)
            mx.async_eval(tok, pools.arrays())
        done, pending = (pending, tok) if pipelined else (tok, None)
        if done is not None:
            done.tolist()
            now = time.perf_counter()
            ts.append(now - t)
            t = now
    return ts[:-1] if pipelined else ts  # the pipelined loop's last read-back has no step behind it


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--contexts", default="4096,131072")
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--quantize", default="", help="'' (bf16 weights) or 'mxfp' (mxfp8 dense + mxfp4 experts)")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "step.json"))
    ap.add_argument("--plot", metavar="PNG", help="also draw ms a step against rows, with the floor")
    ap.add_argument("--arms", default="fast,reference",
                    help="of fast, reference, fast_opc (fast with mx.compile around each op's launches), "
                    "fast_nohc (fast with the plain-MLX mHC pre-mix, DSV4_HC_KERNEL=0), fast_sync / fast_pipe (greedy "
                    "decode loop, each token read back before / after the next step is queued: time_loop); "
                    "fast_functional / fast_pipe_functional: fast / fast_pipe with the functional compressor "
                    "(model.attention.INPLACE_COMPRESSOR off; the in-place one is the default); any arm + "
                    "`_noupload`: the rows' arrays and tokens host-built (managed memory, kernels/upload.py off)")
    opt = ap.parse_args()
    args = flash_args(opt.layers)
    t0 = time.perf_counter()
    model = random_model(args, mx.bfloat16, opt.quantize or None)
    print(f"model ready in {time.perf_counter() - t0:.1f} s on {mx.default_device()}", flush=True)
    bw = copy_bandwidth()
    rows_list = [int(r) for r in opt.rows.split(",")]
    results = []
    for ctx in (int(c) for c in opt.contexts.split(",")):
        pools = StatePools(args, max_slots=max(rows_list), max_positions=ctx + opt.reps + 8, page_size=256,
                           dtype=mx.bfloat16)
        handles = [pools.alloc(ctx + opt.reps + 8) for _ in range(max(rows_list))]
        fill_state(pools, handles, ctx)
        for rows in rows_list:
            arm = {}
            for arm_name in opt.arms.split(",") * 2:  # interleaved arms
                mode = arm_name.removesuffix("_noupload")
                kupload.ENABLED = mode == arm_name
                kupload.clear()
                os.environ["DSV4_KERNELS"] = "reference" if mode == "reference" else "auto"
                set_op_compile(mode == "fast_opc")
                set_hc_kernel(mode != "fast_nohc")
                attention.INPLACE_COMPRESSOR = not mode.endswith("_functional")
                model.reset_compiled()  # the compiled segments trace this arm's op choice (hc_pre_mix)
                time_steps(model, pools, handles[:rows], ctx, 3)  # warm-up / compile
                if mode in ("fast_sync", "fast_pipe", "fast_pipe_functional"):
                    ts = time_loop(model, pools, handles[:rows], ctx, opt.reps, pipelined=mode != "fast_sync")
                else:
                    ts = time_steps(model, pools, handles[:rows], ctx, opt.reps)
                arm.setdefault(arm_name, []).extend(ts)
            set_op_compile(False)
            wb, sb = floor_bytes(model, rows, ctx)
            floor = (wb + sb) / bw
            for mode, ts in arm.items():
                med = statistics.median(ts)
                results.append({
                    "layers": opt.layers, "context": ctx, "rows": rows, "kernels": mode,
                    "weights": opt.quantize or "bf16", "ms_per_step": med * 1e3,
                    "spread_ms": (max(ts) - min(ts)) * 1e3, "tokens_per_s": rows / med,
                    "floor_ms": floor * 1e3, "ms_per_layer": med * 1e3 / opt.layers,
                    "floor_ms_per_layer": floor * 1e3 / opt.layers, "ratio_to_floor": med / floor,
                })
        del pools, handles
    meta = {
        "mlx": mx.__version__, "device": str(mx.default_device()), "copy_bw_GBs": bw / 1e9,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "python": platform.python_version(),
    } | provenance()
    Path(opt.out).write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    print(json.dumps(meta))
    if opt.plot:
        plot_step(results, meta, opt.plot)
    head = ("ctx", "rows", "kernels", "weights", "ms/step", "tok/s", "floor ms", "x floor")
    print("{:>7} {:>4} {:>9} {:>7} {:>8} {:>8} {:>8} {:>7}".format(*head))
    for r in results:
        print(f"{r['context']:>7} {r['rows']:>4} {r['kernels']:>9} {r['weights']:>7} {r['ms_per_step']:>8.2f} "
              f"{r['tokens_per_s']:>8.1f} {r['floor_ms']:>8.3f} {r['ratio_to_floor']:>7.1f}")


if __name__ == "__main__":
    main()
