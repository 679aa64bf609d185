"""The decode step's weight products alone, each V4-Flash shape at 1..8 rows, against the copy's bandwidth.

At <= 8 rows the step's GPU time is mostly its weight products (`kernels/cuda/matmul.py`'s skinny kernel: the
mxfp8 projections, the mxfp4 routed experts, the bf16 weights multiplied in f32) and the mHC pre-mix
(`kernels/cuda/hc_fused.py`). Each product here runs as the step runs it, once a layer over `--sets`
distinct weight sets (more bytes than the L2 holds, as 43 layers are), and CUPTI (torch.profiler, the
device's python3) times every launch. Per product and rows: us a launch (median), the bytes it must read
(each distinct expert once), those bytes' time at the plain copy's bandwidth measured in the same run, the
ratio, and the product's share of a step (launches a step x us). Prints a table, writes JSON. (The launch
geometries of 2026-12-03 were chosen with arms of this script, alternated in one process: see
docs/performance.md; the arms went once measured, at 023ce1c.)

    python3 bench/matmuls.py --out $OUT/matmuls.json [--rows 1,8] [--only experts,wo_a] [--sets 16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from bench.common import copy_bandwidth, provenance  # noqa: E402
from dsv4_serve.model.config import ModelArgs  # noqa: E402


def _q(shape: tuple[int, ...], bits: int) -> tuple[mx.array, mx.array]:
    """Random packed weights and e8m0 scales of a [(E,) N, K] mxfp8 / mxfp4 weight (values do not matter here)."""
    *lead, n, k = shape
    w = mx.random.randint(0, 2**31 - 1, (*lead, n, k * bits // 32)).astype(mx.uint32)
    s = mx.random.randint(118, 130, (*lead, n, k // 32)).astype(mx.uint8)
    return w, s


def products(a: ModelArgs, rows: int, experts: int) -> dict[str, tuple[int, Callable[[], Any], float]]:
    """name -> (launches a step, a maker of one launch's (fn, args), bytes a launch reads)."""
    from dsv4_serve.kernels.cuda import hc_fused
    from dsv4_serve.kernels.cuda import matmul as km

    h, ql, d, nh, inter = a.hidden_size, a.q_lora_rank, a.head_dim, a.num_attention_heads, a.moe_intermediate_size
    csa = sum(r == 4 for r in a.compress_ratios)
    hca = sum(r == 128 for r in a.compress_ratios)
    layers = a.num_hidden_layers
    k = a.num_experts_per_tok
    idx = mx.array([[(3 * b + 5 * j) % experts for j in range(k)] for b in range(rows)], dtype=mx.uint32)
    distinct = len({int(e) for e in idx.reshape(-1).tolist()})
    ebytes = inter * h * (0.5 + 1 / 32)
    fp8 = 1 + 1 / 32

    def x(kk: int) -> mx.array:
        return mx.random.normal((rows, kk)).astype(mx.bfloat16)

    def q8(n: int, kk: int) -> Callable[[], Any]:
        return lambda: (km.qlinear_rows_cuda, (x(kk), *_q((n, kk), 8)))

    def cat8(n1: int, n2: int, kk: int) -> Callable[[], Any]:
        return lambda: (km.qlinear_cat_rows_cuda, (x(kk), *_q((n1, kk), 8), *_q((n2, kk), 8)))

    def grouped() -> tuple[Any, tuple[Any, ...]]:
        g, r, i = a.o_groups, a.o_lora_rank, nh * d // a.o_groups
        xg = mx.random.normal((rows, g, i)).astype(mx.bfloat16)
        return km.grouped_qlinear_rows_cuda, (xg, *_q((g, r, i), 8))

    def bf(n: int, kk: int, pair: bool) -> Callable[[], Any]:
        w = [lambda: mx.random.normal((n, kk)).astype(mx.bfloat16) for _ in range(2 if pair else 1)]
        fn = km.f32_linear_pair_rows_cuda if pair else km.f32_linear_rows_cuda
        return lambda: (fn, (x(kk), *(m() for m in w)))

    def swiglu() -> tuple[Any, tuple[Any, ...]]:
        fn = lambda *v: km.swiglu_rows_cuda(*v, limit=a.swiglu_limit)  # noqa: E731
        return fn, (x(h), *_q((inter, h), 8), *_q((inter, h), 8))

    def gate_up() -> tuple[Any, tuple[Any, ...]]:
        fn = lambda xx, i, *w: km.experts_gate_up_rows_cuda(xx, i, *w, limit=a.swiglu_limit)  # noqa: E731
        return fn, (x(h), idx, *_q((experts, inter, h), 4), *_q((experts, inter, h), 4))

    def down() -> tuple[Any, tuple[Any, ...]]:
        hid = mx.random.normal((rows, k, inter)).astype(mx.bfloat16)
        return km.experts_down_rows_cuda, (hid, idx, *_q((experts, h, inter), 4))

    def pre(iters: int = a.hc_sinkhorn_iters) -> tuple[Any, tuple[Any, ...]]:
        nc = a.hc_mult
        fn = lambda *v: hc_fused.hc_pre_norm_rows_cuda(*v, iters=iters, eps=a.hc_eps,  # noqa: E731
                                                       norm_eps=a.rms_norm_eps, x_eps=a.rms_norm_eps)
        return fn, (mx.random.normal((rows, nc, h)).astype(mx.bfloat16),
                    mx.random.normal((nc * (2 + nc), nc * h)) * 0.01, mx.ones((3,)), mx.zeros((nc * (2 + nc),)),
                    mx.ones((h,), dtype=mx.bfloat16))  # fmt: skip

    return {
        "wq_a+wkv (mxfp8)": (layers, cat8(ql, d, h), (ql + d) * h * fp8),
        "wq_b (mxfp8)": (layers - csa, q8(nh * d, ql), nh * d * ql * fp8),
        "wq_b+idx wq_b (mxfp8)": (csa, cat8(nh * d, a.index_n_heads * a.index_head_dim, ql),
                                  (nh * d + a.index_n_heads * a.index_head_dim) * ql * fp8),
        "wo_a (mxfp8, 8 groups)": (layers, grouped, nh * d * a.o_lora_rank * fp8),
        "wo_b (mxfp8)": (layers, q8(h, a.o_groups * a.o_lora_rank), h * a.o_groups * a.o_lora_rank * fp8),
        "shared gate+up (mxfp8)": (layers, swiglu, 2 * inter * h * fp8),
        "shared down (mxfp8)": (layers, q8(h, inter), h * inter * fp8),
        "experts gate+up (mxfp4)": (layers, gate_up, 2 * distinct * ebytes),
        "experts down (mxfp4)": (layers, down, distinct * ebytes),
        "compressor kv+gate CSA (bf16)": (csa, bf(2 * d, h, True), 2 * 2 * d * h * 2),
        "compressor kv+gate idx (bf16)": (csa, bf(2 * a.index_head_dim, h, True), 2 * 2 * a.index_head_dim * h * 2),
        "compressor kv+gate HCA (bf16)": (hca, bf(d, h, True), 2 * d * h * 2),
        "router (bf16)": (layers, bf(experts, h, False), experts * h * 2),
        "head (bf16)": (1, bf(a.vocab_size, h, False), a.vocab_size * h * 2),
        "mHC pre-mix + norm": (2 * layers, pre, a.hc_mult * (2 + a.hc_mult) * a.hc_mult * h * 4),
        # what the Sinkhorn rounds cost of it (not in a step's sum)
        "mHC pre-mix, 1 Sinkhorn round": (0, lambda: pre(1), a.hc_mult * (2 + a.hc_mult) * a.hc_mult * h * 4),
    }


def _first(out: Any) -> mx.array:
    return out[0] if isinstance(out, (tuple, list)) else out


def time_launches(make: Callable[[], Any], sets: int, reps: int, profile: bool = True) -> list[float]:
    """CUPTI durations (us) of the product's kernels over `reps` evals of `sets` launches, each on its own
    weights and each waiting for the one before (its x carries a zero times the last output's first value:
    independent launches could run at once in MLX's CUDA graph, and a step's products run one after another)."""
    import tempfile

    calls = [make() for _ in range(sets)]
    mx.eval([c[1] for c in calls])

    def chain() -> list[Any]:
        outs, link = [], None
        for fn, (x, *rest) in calls:
            if link is not None:
                x = x + (link * 0).astype(x.dtype)
            outs.append(fn(x, *rest))
            link = _first(outs[-1]).reshape(-1)[:1]
        return outs

    for _ in range(2):  # JIT, plans, graphs
        mx.eval(chain())
    if not profile:  # under Nsight Compute: the launches only
        for _ in range(reps):
            mx.eval(chain())
        return []
    from torch.profiler import ProfilerActivity  # the device's python3; not a project dependency
    from torch.profiler import profile as cupti

    with cupti(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            mx.eval(chain())
        mx.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.loads(Path(f.name).read_text()).get("traceEvents", [])
    return [e["dur"] for e in trace if e.get("ph") == "X" and e.get("cat") == "kernel" and "dsv4_" in e["name"]]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--sets", type=int, default=16, help="distinct weight sets a product cycles through")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--only", default="", help="products whose name contains one of these (comma-separated)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-profile", action="store_true", help="launch only, no timing (to run under ncu)")
    opt = ap.parse_args()
    from dsv4_serve.kernels.cuda import hc_fused

    hc_fused.set_split(True)  # the step's pre-mix (its workspace)
    a = ModelArgs()
    bw = copy_bandwidth()
    results = []
    for rows in (int(r) for r in opt.rows.split(",")):
        for name, (per_step, make, nbytes) in products(a, rows, opt.experts).items():
            if opt.only and not any(part in name for part in opt.only.split(",")):
                continue
            ts = time_launches(make, opt.sets if per_step != 1 else 2, opt.reps, not opt.no_profile)
            us = statistics.median(ts) if ts else float("nan")
            floor = nbytes / bw * 1e6
            results.append({"rows": rows, "product": name, "launches_per_step": per_step,
                            "kernels_per_call": len(ts) / (opt.reps * (opt.sets if per_step != 1 else 2)),
                            "us": us, "bytes": nbytes, "floor_us": floor, "x_floor": us / floor,
                            "ms_per_step": us * per_step / 1e3})  # fmt: skip
            print(f"{rows} {name:32s} {us:8.1f} us  floor {floor:7.1f}  x{us / floor:5.2f}  "
                  f"{us * per_step / 1e3:6.3f} ms a step  ({results[-1]['kernels_per_call']:.1f} kernels a call)",
                  flush=True)  # fmt: skip
    for rows in sorted({r["rows"] for r in results}):
        cell = [r for r in results if r["rows"] == rows]
        tot, fl = sum(r["ms_per_step"] for r in cell), sum(r["floor_us"] * r["launches_per_step"] for r in cell)
        print(f"rows {rows}: {tot:.2f} ms a step of these products, floor {fl / 1e3:.2f} ms (x{tot * 1e3 / fl:.2f})")
    meta = provenance() | {"copy_bw_GBs": bw / 1e9, "experts": opt.experts, "sets": opt.sets}
    if opt.out:
        Path(opt.out).write_text(json.dumps({"meta": meta, "results": results}, indent=1))


if __name__ == "__main__":
    main()
