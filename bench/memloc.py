"""Where the kernels' small inputs live, and what reading them costs (H200, MLX's CUDA allocator).

MLX's CUDA allocator (mlx/backend/cuda/allocator.cpp) puts every array built on the host (`mx.array`
of Python / numpy data) in CUDA managed memory, and every array of at most 8 bytes, whoever writes
it, in one managed "small pool" the GPU maps without migrating (`cudaMemAdviseSetAccessedBy`): a GPU
read of it crosses the host link. The row batch's arrays (slots, positions, q_rows, block tables)
are built on the host every step; f32_params (a kernel's scale / eps) is 4 bytes.

1. `latency`: clock64 cycles of a kernel's first read of one int from a 4-byte host-built array
   (small pool), a 16 KB host-built array (managed; its first GPU read, then the next launches'),
   a fresh host-built array each launch (the engine's batch every step) and a GPU-made copy
   (device memory).
2. `chain`: a compiled chain of 40 dependent one-block kernels that each read a scale: from the
   small pool vs from device memory.
3. `ops`: bench/cases ops and chain43, compiled chains, with the batch as RowBatch.build makes it
   (`base`) vs its arrays and the f32 params copied to device memory (`dev`), interleaved. Before
   kernels/upload.py `base` was host-built (memloc-h200-session11-before.log); since, both arms are
   in device memory and measure the same (memloc-h200-session11.json).

    python bench/memloc.py [--reps 10] [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

import bench.cases as bc  # noqa: E402
import kernels.cuda.attention as ka  # noqa: E402
import kernels.cuda.common as kcommon  # noqa: E402
import kernels.cuda.compressor as kcomp  # noqa: E402
import kernels.cuda.compressor_inplace as kcin  # noqa: E402
from bench.kernels import interleave  # noqa: E402
from kernels import RowBatch  # noqa: E402
from kernels.upload import upload  # noqa: E402

LAT = r"""
  if (threadIdx.x == 0) {
    long long t0 = clock64();
    const int v = p[0];
    out[2] = v;  // the store waits for the load
    long long t1 = clock64();
    const int v2 = p[0];
    out[3] = v2;
    long long t2 = clock64();
    out[0] = (int)(t1 - t0);
    out[1] = (int)(t2 - t1);
  }
"""
STEP = r"""
  const int i = threadIdx.x;
  out[i] = x[i] * p[0] + 1.0f;
"""


def to_device(x: mx.array) -> mx.array:
    """x's values in device memory (kernels.upload), evaluated."""
    y = upload(np.array(x), x.dtype)
    mx.eval(y)
    return y


def dev_batch(b: RowBatch) -> RowBatch:
    tables = {r: to_device(t) for r, t in b.tables.items()}
    return dataclasses.replace(b, slots=to_device(b.slots), positions=to_device(b.positions),
                               q_rows=to_device(b.q_rows), tables=tables)  # fmt: skip


def latency(reps: int) -> dict[str, Any]:
    k = mx.fast.cuda_kernel(name="memloc_lat", input_names=["p"], output_names=["out"], source=LAT)

    def run(p: mx.array) -> list[int]:
        o = k(inputs=[p], grid=(32, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(4,)], output_dtypes=[mx.int32])[0]
        return np.array(o)[:2].tolist()

    small = mx.array([0], dtype=mx.int32)
    managed = mx.array(np.zeros(4096, np.int32))
    device = to_device(mx.array(np.zeros(4096, np.int32)))
    out: dict[str, Any] = {}
    for name, p in (("small_pool", small), ("managed", managed), ("device", device)):
        out[name] = [run(p) for _ in range(reps)]
    out["fresh_managed"] = [run(mx.array(np.full(64, i, np.int32))) for i in range(reps)]
    out["fresh_small"] = [run(mx.array([i], dtype=mx.int32)) for i in range(reps)]
    out["fresh_upload"] = [run(upload([i, i + 1, i + 2])) for i in range(reps)]  # kernels/upload.py
    return out


def chain(reps: int) -> dict[str, Any]:
    k = mx.fast.cuda_kernel(name="memloc_step", input_names=["x", "p"], output_names=["out"], source=STEP)
    x0 = mx.zeros((32,))
    small = mx.array([0.5], dtype=mx.float32)
    dev = to_device(mx.array([0.5, 0, 0, 0], dtype=mx.float32))

    def make(p: mx.array) -> Any:
        def run() -> mx.array:
            x = x0
            for _ in range(40):
                x = k(inputs=[x, p], grid=(32, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(32,)],
                      output_dtypes=[mx.float32])[0]  # fmt: skip
            return x

        return mx.compile(run)

    return interleave({"small_pool": make(small), "device": make(dev)}, reps, {"small_pool": 40, "device": 40})


class _Dev:
    """Patch: f32 params copied to device memory (a cache of its own; plans made afresh)."""

    mods = (ka, kcomp, kcin)

    def __enter__(self) -> None:
        self.saved = [m.f32_params for m in self.mods]
        cache: dict[tuple[float, ...], mx.array] = {}

        def f32_params(*values: float) -> mx.array:
            key = tuple(float(v) for v in values)
            if key not in cache:
                cache[key] = to_device(mx.array(list(key), dtype=mx.float32))
            return cache[key]

        for m in self.mods:
            m.f32_params = f32_params
        self.batch = bc._batch
        bc._batch = lambda *a: (lambda r: (dev_batch(r[0]), [dev_batch(s) for s in r[1]]))(self.batch(*a))
        kcommon._plans.clear()

    def __exit__(self, *exc: object) -> None:
        for m, f in zip(self.mods, self.saved, strict=True):
            m.f32_params = f
        bc._batch = self.batch
        kcommon._plans.clear()


def ops(reps: int, cases: list[str], n: int) -> dict[str, Any]:
    res: dict[str, Any] = {}
    for c in cases:
        arms: dict[str, Any] = {}
        for name in ("base", "dev"):
            ctx = _Dev() if name == "dev" else None
            if ctx:
                ctx.__enter__()
            try:
                if c == "chain43":
                    f = bc.chain43(8, 8192).fast_c
                else:
                    op, rows, ctxlen = c.rsplit(":", 2)
                    case = bc.make_case(op, int(rows), int(ctxlen))
                    f = case.chain(case.fast, n, compiled=True)
                mx.eval(f())  # traced under this arm's patch
                arms[name] = f
            finally:
                if ctx:
                    ctx.__exit__()
        r = interleave(arms, reps, dict.fromkeys(arms, 1 if c == "chain43" else n))
        res[c] = {k: round(v["median_us"], 2) for k, v in r.items()}
        print(c, json.dumps(res[c]), flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument(
        "--cases",
        default="sparse_attention_rows:8:8192,sparse_attention_rows:128:8:8192,"
        "sparse_attention_rows:8:131072,sparse_attention_rows:1:8192,indexer_rows:8:131072,"
        "indexer_rows:1:131072,compressor_rows:128:8:8192,compressor_rows:1:8192,chain43",
    )
    a = ap.parse_args()
    out: dict[str, Any] = {"latency_cycles": latency(6)}
    for k, v in out["latency_cycles"].items():
        print("latency", k, v, flush=True)
    out["chain_us"] = chain(a.reps)
    print("chain", json.dumps({k: round(v["median_us"], 2) for k, v in out["chain_us"].items()}), flush=True)
    out["ops_us"] = ops(a.reps, a.cases.split(","), 10)
    Path(a.out, "memloc.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
