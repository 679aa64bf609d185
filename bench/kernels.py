"""Kernel benchmark on the GPU: the three row-batched ops, reference vs CUDA fast path.

Per op, rows in {1, 2, 4, 8}, context in {8K, 128K, 1M}: reference time, fast time, the same rows
as single-row fast calls, bytes moved / time against the byte floor (a plain copy measured in the
same run), the launch floor (one trivial `cuda_kernel` in a chain) and the eval floor. Times per
call come from a chain of N calls linked by data, with one eval, so each call waits for the last on the
GPU too (`mx.depends` puts no edge in MLX's CUDA graph): attention: each output is the next q;
compressor: the state; indexer and attention: the last output is also their `after` input, so a
compiled reference chain cannot share one call's key gather with the next (`--link data`: the link of the
figures before c5999d3, bench.cases.make_case); medians over
>= 10 interleaved repetitions. Plus the 43-layer chained emulation (2 sliding, 21 CSA, 20 HCA) at
8 rows, 8K context, reference vs fast, one eval per step: each layer's ops wait for the previous
layer's output through CUDA-graph edges, as in the model (bench/cases.chain43; `fast_c_dep` is the
compiled step linked by mx.depends as before 107803a, where nothing but attention waited).

Host time: every arm also records the time to build its graph (python + MLX graph construction,
no eval) per call, `*_build_us`; `host us` in the table is the fast arm's. The compressor's
fast arm is the in-place op the model runs (compressor_rows_inplace: state and pool written through their
buffers); its `functional` arm times the functional CUDA op (kernel + pool
scatter), and the check covers that op's two state-update forms (full copy / slot-pool scatters).
`--extra-arms` also times the scatter form and the per-op `mx.compile` flipped. Every arm is timed twice: as built by
Python per call (eager) and with the whole chain under one `mx.compile` (compiled).

    python bench/kernels.py [--out DIR] [--reps 15] [--quick] [--plot kernels.png]
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

import dsv4_serve.kernels.cuda as kc  # noqa: E402
import dsv4_serve.kernels.cuda.common as kcommon  # noqa: E402
import dsv4_serve.kernels.cuda.compressor as kcomp  # noqa: E402
from bench.cases import Case, add_link_argument, chain43, make_case  # noqa: E402
from bench.common import copy_kernel, plot_kernels, provenance  # noqa: E402


def timed(fn: Callable[[], Any]) -> tuple[float, float]:
    """(graph build time, build + eval time) of one call of `fn`."""
    t = time.perf_counter()
    out = fn()
    b = time.perf_counter()
    mx.eval(out)
    return b - t, time.perf_counter() - t


def interleave(arms: dict[str, Callable[[], Any]], reps: int, per: dict[str, int], block: int = 1
               ) -> dict[str, dict[str, float]]:  # fmt: skip
    """Median / spread of each arm's time per call (us), arms interleaved A, B, C, A, B, C, ... (drift hits
    every arm alike). `block` > 1: each turn runs its arm `block` times in a row and the median is over the
    later runs (warm: a call after a call of its own kind, as a server's steps follow each other); the
    turns' first runs (after another arm: the only figure before 8f88e25) are `cold_median_us`."""
    for k, f in list(arms.items()):  # warm-up (compile, allocate); an arm MLX cannot run is reported, not timed
        try:
            timed(f)
        except (RuntimeError, IndexError, ValueError) as e:
            print(f"arm {k}: {type(e).__name__}: {e}", flush=True)
            del arms[k]
    samples: dict[str, list[float]] = {k: [] for k in arms}
    cold: dict[str, list[float]] = {k: [] for k in arms}
    builds: dict[str, list[float]] = {k: [] for k in arms}
    for _ in range(reps):
        for k, f in arms.items():
            for i in range(block):
                b, t = timed(f)
                (cold if i == 0 else samples)[k].append(t * 1e6 / per[k])
                if i or block == 1:
                    builds[k].append(b * 1e6 / per[k])
    out = {}
    for k in arms:
        s = samples[k] or cold[k]
        q = np.percentile(s, [10, 90])
        out[k] = {"median_us": statistics.median(s), "p10_us": float(q[0]), "p90_us": float(q[1]),
                  "build_us": statistics.median(builds[k]), "cold_median_us": statistics.median(cold[k])}  # fmt: skip
    return out


def other_compile(fn: Callable[[], Any]) -> Callable[[], Any]:
    """`fn` with `kernels.cuda.common.COMPILE` (mx.compile around each op's launches) flipped."""

    def run() -> Any:
        kcommon.COMPILE = not kcommon.COMPILE
        try:
            return fn()
        finally:
            kcommon.COMPILE = not kcommon.COMPILE

    return run


def forced(fn: Callable[[], Any], full: bool) -> Callable[[], Any]:
    """`fn` with the compressor's state-update form forced (the graph is built inside)."""

    def run() -> Any:
        kcomp.FORCE_FULL = full
        try:
            return fn()
        finally:
            kcomp.FORCE_FULL = None

    return run


def floors(reps: int) -> dict[str, float]:
    n = 1 << 27  # 128 Mi 16-byte words: a 2 GiB copy
    x = mx.random.randint(0, 1 << 30, (n * 4,), dtype=mx.int32)
    idx = mx.zeros((n,), mx.int32)
    copy = copy_kernel()

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

    arms = {"copy": cp, "launch": launches, "launch_c": mx.compile(launches), "eval": lambda: tiny + 1}
    r = interleave(arms, reps, {"copy": 1, "launch": 50, "launch_c": 50, "eval": 1})
    bw = 2 * x.nbytes / (r["copy"]["median_us"] * 1e-6)
    return {"copy_bytes_per_s": bw, "launch_us": r["launch"]["median_us"],
            "launch_compiled_us": r["launch_c"]["median_us"], "eval_us": r["eval"]["median_us"]}  # fmt: skip


def copies(st: tuple[mx.array, ...]) -> tuple[mx.array, ...]:
    """Evaluated copies (the in-place compressor writes its inputs' buffers)."""
    out = tuple(mx.array(np.array(x.astype(mx.float32))).astype(x.dtype) for x in st)
    mx.eval(out)
    return out


def check(case: Case) -> dict[str, float]:
    ref = case.ref(copies(case.init) if case.op == "compressor_rows" else None)
    mx.eval(ref)
    fast = case.fast(copies(case.init) if case.op == "compressor_rows" else None)
    mx.eval(fast)
    if case.op == "indexer_rows":
        same = float((np.array(ref) == np.array(fast)).mean())
        return {"same_ids": same}
    a = ref if isinstance(ref, mx.array) else ref[2]
    b = fast if isinstance(fast, mx.array) else fast[2]
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    out = {"max_abs": float(mx.abs(a - b).max()),
           "rel": float(mx.sqrt(((a - b) ** 2).sum()) / mx.sqrt((a * a).sum()))}  # fmt: skip
    if case.op == "compressor_rows":  # in place: states exact; + the functional CUDA op's two forms
        out["inplace_states_equal"] = float(all(bool(mx.array_equal(g, w, equal_nan=True))
                                                for g, w in zip(fast[:2], ref[:2], strict=True)))  # fmt: skip
        for full in (True, False):
            got = forced(lambda: case.call(kc.compressor_rows_cuda, case.batch, copies(case.init)), full)()
            mx.eval(got)
            same = all(bool(mx.array_equal(g, w, equal_nan=True)) for g, w in zip(got[:2], ref[:2], strict=True))
            g2 = got[2].astype(mx.float32)
            rel = float(mx.sqrt(((a - g2) ** 2).sum()) / mx.sqrt((a * a).sum()))
            out[f"{'full' if full else 'scatter'}_states_equal"] = float(same)
            out[f"{'full' if full else 'scatter'}_rel"] = rel
    return out


def save(out_dir: str, meta: dict[str, Any], fl: dict[str, float], rows: list[dict[str, Any]],
         step: dict[str, Any] | None) -> None:  # fmt: skip
    """Write (or rewrite, after every case: a run cut short keeps what it measured) kernels.json."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernels.json").write_text(json.dumps({"meta": meta, "floors": fl, "rows": rows, "chain43": step},
                                                 indent=1))  # fmt: skip


def print_chain43(step: dict[str, Any] | None) -> None:
    if step is None:
        return
    ms = {k: v / 1e3 for k, v in step.items() if k.endswith("_us")}
    nan = float("nan")
    print(f"chain43 (2 sliding, 21 CSA, 20 HCA), 8 rows, 8K, ms per step: eager ref {ms['ref_median_us']:.2f} "
          f"({ms['ref_p10_us']:.2f}-{ms['ref_p90_us']:.2f}), fast {ms['fast_median_us']:.3f} "
          f"({ms['fast_p10_us']:.3f}-{ms['fast_p90_us']:.3f}; host {ms['fast_build_us']:.3f}) | compiled step: ref "
          f"{ms.get('ref_c_median_us', nan):.2f}, fast {ms.get('fast_c_median_us', nan):.3f} "
          f"({ms.get('fast_c_p10_us', nan):.3f}-{ms.get('fast_c_p90_us', nan):.3f}); compiled, layers linked by "
          f"mx.depends (no GPU edge; before 107803a): {ms.get('fast_c_dep_median_us', nan):.3f}")  # fmt: skip
    if "other_median_us" in ms:
        print(f"chain43 with per-op mx.compile flipped: {ms['other_median_us']:.3f} ms; forced slot-pool scatters: "
              f"{ms['scatter_median_us']:.3f} ms")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--plot", metavar="PNG", help="also draw each op's compiled call against its floors")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--chain", type=int, default=10)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--ops", default="compressor_rows,indexer_rows,sparse_attention_rows",
                    help="op names; `:128` for the HCA form (compressor_rows:128, sparse_attention_rows:128)")
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--ctxs", default="8192,131072,1048576")
    ap.add_argument("--no-chain43", action="store_true")
    ap.add_argument("--block", type=int, default=2,
                    help="runs of an arm per turn; the figures are the warm ones after the first (1: every run, "
                    "each after another arm, as before 8f88e25)")
    add_link_argument(ap)
    ap.add_argument("--extra-arms", action="store_true", help="also: per-op mx.compile flipped, forced scatters")
    a = ap.parse_args()
    t0 = time.perf_counter()
    env = {k: v for k, v in os.environ.items() if k.startswith(("MLX_", "DSV4_"))}
    meta = {"mlx": mx.__version__, "device": str(mx.default_device()), "backend": "cuda", "compile": kcommon.COMPILE,
            "env": env, "link": a.link,
            "date": datetime.datetime.now(datetime.UTC).isoformat()} | provenance()  # fmt: skip
    kc.precompile(dtype=mx.bfloat16, page_size=64, n_heads=64, head_dim=512, rope_dim=64,
                  index_heads=64, index_dim=128, topk=512, inplace_compressor=True)  # fmt: skip
    fl = floors(a.reps)
    print(f"floors: copy {fl['copy_bytes_per_s'] / 1e12:.2f} TB/s, launch {fl['launch_us']:.1f} us, "
          f"eval {fl['eval_us']:.1f} us", flush=True)  # fmt: skip
    rows_out: list[dict[str, Any]] = []
    # chain43 first: the acceptance figure survives a device call cut short during the sweep
    chain = None if a.no_chain43 else chain43(8, 8192)
    arms = {} if chain is None else {"ref": chain.ref, "fast": chain.fast, "ref_c": chain.ref_c, "fast_c": chain.fast_c,
                                     "fast_c_dep": chain.fast_c_dep}  # fmt: skip
    if chain is not None and a.extra_arms:
        arms |= {"scatter": forced(chain.fast, False), "other": other_compile(chain.fast)}
    r = interleave(arms, a.reps, dict.fromkeys(arms, 1), a.block) if arms else {}
    step = None if not r else {"op": "chain43", "rows": 8, "ctx": 8192,
                               **{f"{k}_{m}": v[m] for k, v in r.items() for m in v}}  # fmt: skip
    save(a.out, meta, fl, rows_out, step)
    print_chain43(step)
    del chain, arms, r
    ctxs = [int(c) for c in a.ctxs.split(",")][: 2 if a.quick else None]
    for op in a.ops.split(","):
        for ctx in ctxs:
            for nr in (int(r) for r in a.rows.split(",")):
                case = make_case(op, nr, ctx, link=a.link)
                err = check(case)
                arms = {"ref": case.chain(case.ref, a.chain), "fast": case.chain(case.fast, a.chain),
                        "single": case.chain(case.single, a.chain)}  # fmt: skip
                for k in ("ref", "fast", "single"):  # the same chains under one mx.compile each
                    arms[f"{k}_c"] = case.chain(getattr(case, k), a.chain, compiled=True)
                if a.extra_arms:
                    arms["other"] = other_compile(case.chain(case.fast, a.chain))  # mx.compile flipped
                if case.op == "compressor_rows":  # A/B: the functional CUDA op (kernel + pool scatter, new arrays)
                    arms["functional"] = case.chain(
                        lambda prev, c=case: c.call(kc.compressor_rows_cuda, c.batch, c.init if prev is None else prev),
                        a.chain)  # fmt: skip
                if a.extra_arms and case.op == "compressor_rows":
                    arms["scatter"] = forced(arms["functional"], False)
                r = interleave(arms, a.reps, dict.fromkeys(arms, a.chain), a.block)
                floor_us = case.bytes / fl["copy_bytes_per_s"] * 1e6
                row = {"op": op, "rows": nr, "ctx": ctx, "bytes": case.bytes, "byte_floor_us": floor_us,
                       "launch_floor_us": fl["launch_us"], "eval_floor_us": fl["eval_us"], **err,
                       **{f"{k}_{m}": v[m] for k, v in r.items() for m in v}}  # fmt: skip
                rows_out.append(row)
                extra = f" scatter {row['scatter_median_us']:7.1f}" if "scatter_median_us" in row else ""
                if "functional_median_us" in row:
                    extra += f" functional {row['functional_median_us']:7.1f}"
                if "other_median_us" in row:
                    extra += f" | compile {'off' if kcommon.COMPILE else 'on'}: {row['other_median_us']:7.1f} " \
                             f"(host {row['other_build_us']:5.1f})"
                print(f"{op:22s} rows {nr} ctx {ctx:>7}: ref {row['ref_median_us']:8.1f} fast "
                      f"{row['fast_median_us']:7.1f} (host {row['fast_build_us']:5.1f}) single "
                      f"{row['single_median_us']:7.1f}{extra} | compiled chain: ref {row['ref_c_median_us']:8.1f} "
                      f"fast {row['fast_c_median_us']:7.1f} single {row['single_c_median_us']:7.1f} us  err {err}",
                      flush=True)  # fmt: skip
                save(a.out, meta, fl, rows_out, step)
                del case, arms
    save(a.out, meta, fl, rows_out, step)
    if a.plot and rows_out:
        plot_kernels(rows_out, meta, a.plot)
    print(f"\nbench/kernels.py  {meta['device']}  mlx {meta['mlx']}  ({time.perf_counter() - t0:.0f} s)")
    print(f"floors: copy {fl['copy_bytes_per_s'] / 1e12:.2f} TB/s | launch {fl['launch_us']:.1f} us "
          f"(compiled chain {fl['launch_compiled_us']:.1f}) | eval {fl['eval_us']:.1f} us | env {env}")  # fmt: skip
    print("eager: every call built by Python; compiled: the chain of calls under one mx.compile")
    hdr = f"{'op':22s} {'rows':>4} {'ctx':>8} {'ref us':>9} {'fast us':>8} {'spread':>13} {'host us':>7} " \
          f"{'1-row x n':>9} {'ref/fast':>8} {'n1/fast':>7} | {'ref_c us':>9} {'fast_c':>7} {'ref/fast':>8} " \
          f"{'n1/fast':>7} | {'floor us':>8} {'GB/s':>7} {'err':>9}"
    print(hdr)
    for x in rows_out:
        e = x.get("same_ids", x.get("rel", 0.0))
        f, fc = x["fast_median_us"], x["fast_c_median_us"]
        print(f"{x['op']:22s} {x['rows']:>4} {x['ctx']:>8} {x['ref_median_us']:9.1f} {f:8.1f} "
              f"{x['fast_p10_us']:6.1f}-{x['fast_p90_us']:<6.1f} {x['fast_build_us']:7.1f} "
              f"{x['single_median_us']:9.1f} {x['ref_median_us'] / f:8.1f} {x['single_median_us'] / f:7.1f} | "
              f"{x['ref_c_median_us']:9.1f} {fc:7.1f} {x['ref_c_median_us'] / fc:8.1f} "
              f"{x['single_c_median_us'] / fc:7.1f} | "
              f"{x['byte_floor_us']:8.2f} {x['bytes'] / fc / 1e3:7.0f} {e:9.2e}")  # fmt: skip
    print_chain43(step)
    if a.block > 1:  # the first run of each turn: after another arm's (the reference's) calls
        print("cold (each arm's first run of a turn), fast_c us: " + ", ".join(
            f"{x['op']} {x['rows']}x{x['ctx']} {x['fast_c_cold_median_us']:.1f}" for x in rows_out)
            + ("" if step is None else f"; chain43 fast_c {step['fast_c_cold_median_us'] / 1e3:.3f} ms"))  # fmt: skip
    cs = [x for x in rows_out if x["op"] == "compressor_rows"]
    if cs:
        bad = [x for x in cs if x.get("full_states_equal") != 1.0 or x.get("scatter_states_equal") != 1.0
               or x.get("inplace_states_equal") != 1.0 or x.get("rel", 1) > 1e-2
               or x.get("full_rel", 1) > 1e-2 or x.get("scatter_rel", 1) > 1e-2]  # fmt: skip
        print(f"compressor forms checked against the reference: {'ALL OK' if not bad else f'{len(bad)} BAD'}")


if __name__ == "__main__":
    main()
