"""The prefill of record: full V4-Flash prompts through the batched parallel prefill (model/prefill.py).

The model of bench/step.py (43 layers, mxfp8 dense + mxfp4 routed experts, `--experts N`, random weights).
Per cell (prompt length x concurrent prompts): the prompts go through `prefill_batch` as the engine feeds
them, at most `--chunk` tokens a forward, oldest first (several prompts share a forward); every token of
each prompt is prefilled, the last one's logits are the first token's. Reports tokens/s, ms to first
token (per prompt: until its last forward's logits are read), the compute floor (the matmul FLOPs of the
prefill, weights and attention, over a bf16 GEMM's rate measured in this run), with `--profile` (default
on CUDA; CUPTI through torch.profiler, the device's python3) the GPU busy time, and once the logits'
agreement with token-by-token decode of the first `--agree` tokens (the decode step's fast kernels).
Prints a table, writes JSON.

    python3 bench/prefill.py --out $OUT/prefill.json [--experts 32] [--prompts 2048,16384,65536]
        [--concurrent 1,4] [--chunk 2048] [--agree 1024] [--profile] [--arms fast,tiles,f32_simt]
    python3 bench/prefill.py --layers 2 --experts 8 --prompts 64 --chunk 32 --agree 48   # CPU, V4-Flash dims
    python3 bench/prefill.py --tiny --prompts 64 --concurrent 1,2 --chunk 32 --agree 48   # CPU, tests/test_bench.py
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("MLX_ENABLE_TF32", "0")  # as the server runs (service/__main__.py)

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

from bench.common import gpu_profile, on_cuda, provenance  # noqa: E402
from bench.step import flash_args, most_experts, random_model  # noqa: E402
from dsv4_serve.kernels import backend, experts_grouped  # noqa: E402
from dsv4_serve.kernels import matmul as kmatmul  # noqa: E402
from dsv4_serve.model import prefill as mprefill  # noqa: E402
from dsv4_serve.model.deepseek_v4 import DeepseekV4  # noqa: E402
from dsv4_serve.model.state import StatePools  # noqa: E402
from dsv4_serve.model.tiny import tiny_model  # noqa: E402


def gemm_rate(n: int, reps: int = 5) -> float:
    """bf16 GEMM FLOP/s, [n, n] @ [n, n], best of `reps`: the device's matmul rate for the floor."""
    a = mx.random.normal((n, n)).astype(mx.bfloat16)
    b = mx.random.normal((n, n)).astype(mx.bfloat16)
    mx.eval(a, b, a @ b)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        mx.eval(a @ b)
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def weight_flops(model: DeepseekV4) -> float:
    """Matmul FLOPs a token spends on the weights: 2 x every logical matrix entry of the blocks (a packed
    uint32 holds 4 mxfp8 or 8 mxfp4 values), the routed experts' times k / E; not the embedding (a
    gather) nor the head (one token a prompt, `head_flops`)."""
    a, total = model.args, 0.0
    for name, p in tree_flatten(model.layers):
        if p.ndim < 2 or name.endswith((".scales", ".biases", "ape", "tid2eid")):
            continue
        n = p.size * (8 if ".ffn.experts.w" in name else 4) if p.dtype == mx.uint32 else p.size
        total += 2 * n * (a.num_experts_per_tok / a.n_routed_experts if ".ffn.experts." in name else 1)
    return total


def attention_flops(model: DeepseekV4, prompt: int) -> float:
    """Score + value FLOPs of a whole prompt (positions 0..prompt-1): the window, CSA's top-k entries and
    its indexer scoring every entry, HCA every entry."""
    a, total = model.args, 0.0
    pos = np.arange(prompt, dtype=np.float64)
    qk = 4 * a.num_attention_heads * a.head_dim  # q.k and p.v, 2 FLOP each, per key
    for r in a.compress_ratios:
        keys = np.minimum(pos + 1, a.sliding_window)
        if r == 4:
            entries = (pos + 1) // 4
            keys = keys + np.minimum(entries, a.index_topk)
            total += float((2 * a.index_n_heads * a.index_head_dim * entries).sum())
        elif r:
            keys = keys + (pos + 1) // r
        total += float((qk * keys).sum())
    return total


def run_cell(model: DeepseekV4, pools: StatePools, prompts: list[list[int]], chunk: int):
    """All prompts through `prefill_batch`, `chunk` tokens a forward, oldest first. Returns (seconds,
    ms to first token per prompt, ms of each forward, last logits per prompt)."""
    handles = [pools.alloc(len(p)) for p in prompts]
    fed, ttft, last, forwards = [0] * len(prompts), [0.0] * len(prompts), [None] * len(prompts), []
    t0 = prev = time.perf_counter()
    try:
        while any(f < len(p) for f, p in zip(fed, prompts, strict=True)):
            budget, work, ids = chunk, [], []
            for j, p in enumerate(prompts):
                n = min(budget, len(p) - fed[j])
                if n > 0:
                    work.append((handles[j], p[fed[j] : fed[j] + n], fed[j]))
                    ids.append(j)
                    budget -= n
            out = model.prefill_batch(pools, work)  # evaluates logits + state
            now = time.perf_counter()
            forwards.append((now - prev) * 1e3)
            prev = now
            for j, (_, toks, _), lg in zip(ids, work, out, strict=True):
                fed[j] += len(toks)
                if fed[j] == len(prompts[j]):
                    ttft[j], last[j] = (now - t0) * 1e3, np.array(lg)
            prev = time.perf_counter()  # the logits' read-back counts in the TTFT, not in the next forward
        return time.perf_counter() - t0, ttft, forwards, last
    finally:
        for h in handles:
            pools.free(h)


def agreement(model: DeepseekV4, pools: StatePools, prompt: list[int], chunk: int) -> dict:
    """The prompt token by token through the decode step vs the batched prefill: the last logits."""
    h = pools.alloc(len(prompt))
    try:
        t = time.perf_counter()
        for i, tok in enumerate(prompt):
            la = model.decode(pools, [h], [tok], [i])[0]
        serial = time.perf_counter() - t
    finally:
        pools.free(h)
    _, _, _, (lb,) = run_cell(model, pools, [prompt], chunk)
    la = np.array(la)
    return {"agree_tokens": len(prompt), "serial_ms": serial * 1e3,
            "max_abs_logit_diff": float(np.abs(la - lb).max()),
            "rel_logit_diff": float(np.abs(la - lb).max() / max(np.abs(la).max(), 1e-30)),
            "argmax_equal": bool(la.argmax() == lb.argmax())}  # fmt: skip


# arm -> (the fast ops it runs as their plain twins, DSV4_GROUPED_EXPERTS)
ARMS = {"fast": ((), None), "plain_attn": (("prefill_attention",), None),
        "tiles": ((experts_grouped.OP,), None), "qtiles": ((experts_grouped.OP,), "qtiles"),
        "f32_simt": ((), None), "dsplit_attn": ((), None), "mlx_dequant": (("dequantize_mxfp8",), None),
        "idx_ops": (("indexer_scores",), None), "sync_build": ((), None), "rope_block": ((), None),
        "slices": ((), None), "group_loop": ((), None)}  # fmt: skip


EVAL_EVERY = mprefill.EVAL_EVERY


def set_arm(arm: str, held: dict, grouped: str) -> None:
    """Register `held`'s fast ops but the arm's plain ones; the arm's experts form (read at each call)."""
    plain, how = ARMS[arm]
    for op, fn in held.items():
        if op in plain:
            backend.unregister(op)
        else:
            backend.register(op, fn)
    os.environ[experts_grouped.ENV] = how or grouped
    mprefill.EVAL_EVERY = 0 if arm == "sync_build" else EVAL_EVERY  # sync_build: the whole forward, then its eval
    kmatmul.GROUPED = arm != "slices"  # slices: a short prompt's 9..64 rows a launch an 8-row slice, not one launch
    if backend.name() == "cuda":  # f32_simt: the f32 products of many rows as MLX's f32 matmul (TF32 off: SIMT)
        import dsv4_serve.kernels.cuda.tiles_mm as tm

        tm.F32_MANY = arm != "f32_simt"
        import dsv4_serve.kernels.cuda.prefill_attention as kpa  # dsplit_attn: the decode kernel's rows, one a query

        kpa.HEADS_ON = arm != "dsplit_attn"
        import dsv4_serve.kernels.cuda.rope as kp  # rope_block: rms_rope a block a vector at every count

        kp.MANY_ON = arm != "rope_block"
        import dsv4_serve.kernels.cuda.matmul as km  # group_loop: each block runs the 8-row groups in turn

        km.GROUP_LOOP = arm == "group_loop"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=43)
    ap.add_argument("--experts", type=int, default=0, help="routed experts a layer (0: the most that fit)")
    ap.add_argument("--prompts", default="2048,16384,65536", help="prompt lengths")
    ap.add_argument("--concurrent", default="1,4", help="prompts prefilled together")
    ap.add_argument("--chunk", type=int, default=2048, help="tokens a forward (the engine's --prefill-chunk)")
    ap.add_argument("--agree", type=int, default=1024, help="tokens of the decode agreement check (0: none)")
    ap.add_argument("--profile", action=argparse.BooleanOptionalAction, default=None,
                    help="CUPTI GPU busy time per cell (default: on CUDA)")  # fmt: skip
    ap.add_argument(
        "--arms",
        default="fast",
        help="fast (every fast path), plain_attn (prefill's attention as plain MLX ops, DSV4_PREFILL_ATTN=0), "
        "tiles (the routed experts as the plain tiles form: dequantized copy + gather_mm, DSV4_GROUPED_MMA=0) "
        "qtiles (the tiles through gather_qmm on the mxfp4 weights, DSV4_GROUPED_EXPERTS=qtiles) and / or "
        "f32_simt (the compressors' f32 products as MLX's f32 matmul, DSV4_TILES_F32=0), "
        "dsplit_attn (prefill's attention as rows of decode's kernel, DSV4_PREFILL_ATTN=dsplit), "
        "mlx_dequant (the dense weights' dequantized copy by mx.dequantize, DSV4_DEQUANT_KERNEL=0), "
        "idx_ops (the indexer's scores as products + MLX ops, DSV4_INDEXER_SCORES=0), "
        "sync_build (the forward built whole before its evaluation starts, DSV4_PREFILL_EVAL_EVERY=0), "
        "rope_block (rms_rope a block a vector for prefill's counts too, DSV4_ROPE_MANY=0), "
        "slices (9..64 rows a launch an 8-row slice, DSV4_SKINNY_GROUPS=0), "
        "group_loop (those rows' 8-row groups run in turn by each block, DSV4_SKINNY_GROUP_LOOP=1), "
        "alternated per cell; the first is profiled",
    )
    ap.add_argument("--tiny", action="store_true", help="the tiny model (f32) instead: the script's check on a CPU")
    ap.add_argument("--managed", action="store_true",
                    help="the weights and pools moved into managed memory first, as a graph server moves them "
                    "(kernels/graph/runtime.py to_managed; CUDA only)")  # fmt: skip
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "prefill.json"))
    opt = ap.parse_args()
    if opt.chunk < 1:
        ap.error(f"--chunk must be >= 1, got {opt.chunk}")
    profile = on_cuda() if opt.profile is None else opt.profile
    t0 = time.perf_counter()
    if opt.tiny:
        model, args, _ = tiny_model(seed=0)
        opt.layers, experts, dtype, page = args.num_hidden_layers, args.n_routed_experts, mx.float32, 8
    else:
        experts = opt.experts or most_experts(opt.layers)
        args = flash_args(opt.layers, experts)
        model, dtype, page = random_model(args), mx.bfloat16, 256
    print(f"model: {opt.layers} layers, {experts} experts, ready in {time.perf_counter() - t0:.1f} s on "
          f"{mx.default_device()}, {mx.get_active_memory() / 2**30:.1f} GiB", flush=True)  # fmt: skip
    rate = gemm_rate(8192 if on_cuda() else 512)
    lengths = [int(x) for x in opt.prompts.split(",")]
    concurrent = [int(x) for x in opt.concurrent.split(",")]
    cap, slots = max(lengths), max(concurrent)
    pools = StatePools(args, max_slots=slots, max_positions=cap, page_size=page, dtype=dtype)
    if opt.managed:  # where a graph server's forwards read and write them (its prefill: ~2x this script's, 2026-12-07)
        from dsv4_serve.kernels.graph.runtime import to_managed
        from dsv4_serve.model.graph_record import persistent_arrays

        t1 = time.perf_counter()
        moved = [a for kind in persistent_arrays(model, pools).values() for a in kind.values()]
        to_managed(moved)
        print(f"managed: {len(moved)} arrays in {time.perf_counter() - t1:.1f} s", flush=True)
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(0, args.vocab_size, cap)]
    arms = opt.arms.split(",")
    held = backend.registered()  # the fast ops an arm may turn off (the CUDA path registers them)
    if any(arm not in ARMS for arm in arms):
        ap.error(f"--arms: expected some of {', '.join(ARMS)}, got {opt.arms}")
    grouped = os.environ.get(experts_grouped.ENV, "")
    t0 = time.perf_counter()
    for arm in arms[::-1]:  # warm-up: every arm's compiles and JIT (the first arm last: it is profiled first)
        set_arm(arm, held, grouped)
        run_cell(model, pools, [prompt[: min(cap, 2 * opt.chunk)]], opt.chunk)
    h = pools.alloc(2)
    model.decode(pools, [h], [prompt[0]], [0])
    pools.free(h)
    print(f"warm-up (the kernels' first compiles, {len(arms)} arms): {time.perf_counter() - t0:.1f} s", flush=True)
    wf = weight_flops(model)
    head = 2 * args.vocab_size * args.hidden_size
    results = []
    for n, c, arm in [(n, c, arm) for n in lengths for c in concurrent for arm in arms]:
        set_arm(arm, held, grouped)
        prompts = [(prompt[7 * i :] + prompt[: 7 * i])[:n] for i in range(c)]  # distinct prompts
        secs, ttft, forwards, _ = run_cell(model, pools, prompts, opt.chunk)
        flops = c * (n * wf + attention_flops(model, n) + head)
        cell = {"layers": opt.layers, "experts": experts, "prompt": n, "concurrent": c, "chunk": opt.chunk,
                "arm": arm, "forwards": len(forwards), "forward_ms": [round(f, 1) for f in forwards],
                "forward_ms_max": max(forwards), "seconds": secs, "tokens_per_s": c * n / secs,
                "ttft_ms": ttft, "ttft_ms_max": max(ttft), "tflop": flops / 1e12,
                "floor_s": flops / rate, "x_floor": secs / (flops / rate)}  # fmt: skip
        print(json.dumps(cell), flush=True)  # before the profile: a run cut short still reports the cell
        if profile and arm == arms[0]:
            prof = gpu_profile(lambda k, ps=prompts: [run_cell(model, pools, ps, opt.chunk) for _ in range(k)],
                               1, None, f"prefill_{n}_{c}")  # fmt: skip
            cell |= {"kernels": prof["kernels_per_step"], "gpu_busy_s": prof["gpu_busy_ms_per_step"] / 1e3,
                     "gpu_idle_s": prof["gpu_idle_ms_per_step"] / 1e3, "longest_gaps_ms": prof["longest_gaps_ms"],
                     "top": prof["top"]}  # fmt: skip
            cell["busy_x_floor"] = cell["gpu_busy_s"] / cell["floor_s"]
            print(json.dumps({k: cell[k] for k in ("prompt", "concurrent", "kernels", "gpu_busy_s", "gpu_idle_s",
                                                   "longest_gaps_ms", "top")}), flush=True)  # fmt: skip
        results.append(cell)
    set_arm("fast", held, grouped)
    agree = agreement(model, pools, prompt[: min(opt.agree, cap)], opt.chunk) if opt.agree > 0 else {}
    print(json.dumps(agree), flush=True)
    meta = {"mlx": mx.__version__, "device": str(mx.default_device()), "bf16_gemm_tflops": rate / 1e12,
            "weight_gflop_per_token": wf / 1e9, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "python": platform.python_version()} | provenance()  # fmt: skip
    Path(opt.out).parent.mkdir(parents=True, exist_ok=True)
    Path(opt.out).write_text(json.dumps({"meta": meta, "results": results, "agreement": agree}, indent=1))
    print(json.dumps(meta))
    cols = ("prompt", "conc", "arm", "fwd", "tok/s", "ttft ms", "floor s", "x floor", "busy s")
    print("{:>7} {:>4} {:>10} {:>5} {:>9} {:>9} {:>8} {:>7} {:>7}".format(*cols))
    for r in results:
        print(
            f"{r['prompt']:>7} {r['concurrent']:>4} {r['arm']:>10} {r['forwards']:>5} {r['tokens_per_s']:>9.1f} "
            f"{r['ttft_ms_max']:>9.1f} {r['floor_s']:>8.3f} {r['x_floor']:>7.2f} {r.get('gpu_busy_s', 0):>7.3f}"
        )


if __name__ == "__main__":
    main()
