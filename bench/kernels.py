"""Kernel benchmark on the GPU: the three row-batched ops, reference vs CUDA fast path.

Per op, rows in {1, 2, 4, 8}, context in {8K, 128K, 1M}: reference time, fast time, the same rows
as single-row fast calls, bytes moved / time against the byte floor (a plain copy measured in the
same run), the launch floor (one trivial `cuda_kernel` in a chain) and the eval floor. Times per
call come from a chain of N dependent calls (`mx.depends`) with one eval, medians over >= 15
interleaved repetitions. Plus the 43-layer chained emulation (2 sliding, 21 CSA, 20 HCA) at
8 rows, 8K context, reference vs fast, one eval per step.

    python bench/kernels.py [--out DIR] [--reps 15] [--quick]
Writes DIR/kernels.json ($OUT by default) and prints a table last.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

import kernels.cuda as kc  # noqa: E402
from bench.cases import Case, chain43, make_case  # noqa: E402
from kernels.cuda.common import kernel  # noqa: E402

COPY = r"""
  const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n_shape[0]) reinterpret_cast<uint4*>(out)[i] = reinterpret_cast<const uint4*>(x)[i];
"""


def timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    mx.eval(fn())
    return time.perf_counter() - t


def interleave(arms: dict[str, Callable[[], Any]], reps: int, per: dict[str, int]) -> dict[str, dict[str, float]]:
    """Median / spread of each arm's time per call (us), arms interleaved A, B, C, A, B, C, ..."""
    for f in arms.values():  # warm-up (compile, allocate)
        timed(f)
    samples: dict[str, list[float]] = {k: [] for k in arms}
    for _ in range(reps):
        for k, f in arms.items():
            samples[k].append(timed(f) * 1e6 / per[k])
    out = {}
    for k, s in samples.items():
        q = np.percentile(s, [10, 90])
        out[k] = {"median_us": statistics.median(s), "p10_us": float(q[0]), "p90_us": float(q[1])}
    return out


def floors(reps: int) -> dict[str, float]:
    n = 1 << 27  # 128 Mi 16-byte words: a 2 GiB copy
    x = mx.random.randint(0, 1 << 30, (n * 4,), dtype=mx.int32)
    idx = mx.zeros((n,), mx.int32)
    copy = kernel("copy", ("x", "n"), ("out",), COPY)

    def cp() -> mx.array:
        return copy(inputs=[x, idx], grid=(n, 1, 1), threadgroup=(256, 1, 1),
                    output_shapes=[x.shape], output_dtypes=[x.dtype])[0]  # fmt: skip

    tiny = mx.zeros((4,), mx.int32)
    small = mx.zeros((1,), mx.int32)

    def launches() -> mx.array:
        y = tiny
        for _ in range(50):
            y = copy(inputs=[y, small], grid=(1, 1, 1), threadgroup=(32, 1, 1),
                     output_shapes=[y.shape], output_dtypes=[y.dtype])[0]  # fmt: skip
        return y

    arms = {"copy": cp, "launch": launches, "eval": lambda: tiny + 1}
    r = interleave(arms, reps, {"copy": 1, "launch": 50, "eval": 1})
    bw = 2 * x.nbytes / (r["copy"]["median_us"] * 1e-6)
    return {"copy_bytes_per_s": bw, "launch_us": r["launch"]["median_us"], "eval_us": r["eval"]["median_us"]}


def check(case: Case) -> dict[str, float]:
    ref, fast = case.ref(), case.fast()
    mx.eval(ref, fast)
    if case.op == "indexer_rows":
        same = float((np.array(ref) == np.array(fast)).mean())
        return {"same_ids": same}
    a = ref if isinstance(ref, mx.array) else ref[2]
    b = fast if isinstance(fast, mx.array) else fast[2]
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return {"max_abs": float(mx.abs(a - b).max()),
            "rel": float(mx.sqrt(((a - b) ** 2).sum()) / mx.sqrt((a * a).sum()))}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--chain", type=int, default=10)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    t0 = time.perf_counter()
    meta = {"mlx": mx.__version__, "device": str(mx.default_device()), "backend": "cuda",
            "date": datetime.datetime.now(datetime.UTC).isoformat()}  # fmt: skip
    kc.precompile(dtype=mx.bfloat16, page_size=64, n_heads=64, head_dim=512, rope_dim=64,
                  index_heads=64, index_dim=128, topk=512)  # fmt: skip
    fl = floors(a.reps)
    print(f"floors: copy {fl['copy_bytes_per_s'] / 1e12:.2f} TB/s, launch {fl['launch_us']:.1f} us, "
          f"eval {fl['eval_us']:.1f} us", flush=True)  # fmt: skip
    rows_out: list[dict[str, Any]] = []
    ctxs = (8192, 131072) if a.quick else (8192, 131072, 1048576)
    for op in ("compressor_rows", "indexer_rows", "sparse_attention_rows"):
        for ctx in ctxs:
            for nr in (1, 2, 4, 8):
                case = make_case(op, nr, ctx)
                err = check(case)
                arms = {"ref": case.chain(case.ref, a.chain), "fast": case.chain(case.fast, a.chain),
                        "single": case.chain(case.single, a.chain)}  # fmt: skip
                r = interleave(arms, a.reps, {"ref": a.chain, "fast": a.chain, "single": a.chain})
                floor_us = case.bytes / fl["copy_bytes_per_s"] * 1e6
                row = {"op": op, "rows": nr, "ctx": ctx, "bytes": case.bytes, "byte_floor_us": floor_us,
                       "launch_floor_us": fl["launch_us"], "eval_floor_us": fl["eval_us"], **err,
                       **{f"{k}_{m}": v[m] for k, v in r.items() for m in v}}  # fmt: skip
                rows_out.append(row)
                print(f"{op:22s} rows {nr} ctx {ctx:>7}: ref {row['ref_median_us']:8.1f} fast "
                      f"{row['fast_median_us']:7.1f} single {row['single_median_us']:7.1f} us", flush=True)  # fmt: skip
                del case, arms
    chain = chain43(8, 8192)
    r = interleave({"ref": chain.ref, "fast": chain.fast}, a.reps, {"ref": 1, "fast": 1})
    step = {"op": "chain43", "rows": 8, "ctx": 8192, **{f"{k}_{m}": v[m] for k, v in r.items() for m in v}}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernels.json").write_text(json.dumps({"meta": meta, "floors": fl, "rows": rows_out, "chain43": step},
                                                 indent=1))  # fmt: skip
    print(f"\nbench/kernels.py  {meta['device']}  mlx {meta['mlx']}  ({time.perf_counter() - t0:.0f} s)")
    print(f"floors: copy {fl['copy_bytes_per_s'] / 1e12:.2f} TB/s | launch {fl['launch_us']:.1f} us | "
          f"eval {fl['eval_us']:.1f} us")  # fmt: skip
    hdr = f"{'op':22s} {'rows':>4} {'ctx':>8} {'ref us':>9} {'fast us':>8} {'spread':>13} {'1-row x n':>9} " \
          f"{'ref/fast':>8} {'n1/fast':>7} {'floor us':>8} {'GB/s':>7} {'err':>9}"
    print(hdr)
    for x in rows_out:
        e = x.get("same_ids", x.get("rel", 0.0))
        print(f"{x['op']:22s} {x['rows']:>4} {x['ctx']:>8} {x['ref_median_us']:9.1f} {x['fast_median_us']:8.1f} "
              f"{x['fast_p10_us']:6.1f}-{x['fast_p90_us']:<6.1f} {x['single_median_us']:9.1f} "
              f"{x['ref_median_us'] / x['fast_median_us']:8.1f} {x['single_median_us'] / x['fast_median_us']:7.1f} "
              f"{x['byte_floor_us']:8.2f} {x['bytes'] / x['fast_median_us'] / 1e3:7.0f} {e:9.2e}")  # fmt: skip
    ms = {k: v / 1e3 for k, v in step.items() if k.endswith("_us")}
    print(f"chain43 (2 sliding, 21 CSA, 20 HCA), 8 rows, 8K: ref {ms['ref_median_us']:.2f} ms "
          f"({ms['ref_p10_us']:.2f}-{ms['ref_p90_us']:.2f}), fast {ms['fast_median_us']:.3f} ms "
          f"({ms['fast_p10_us']:.3f}-{ms['fast_p90_us']:.3f}) per step")  # fmt: skip


if __name__ == "__main__":
    main()
