"""Host cost of the parts of one fast-path call, in a compiled chain (see bench/host_cost.py).

Prices, per link of a 10-deep compiled chain (host = `mx.async_eval` time): a bare kernel node with
the compressor's arity (13 inputs, 5 outputs) and a 10 KB source; the same plus the page-pool
write as the compressor does it (reshape, put_along_axis, reshape) or as one two-index scatter;
a kernel of 1 input; and `mx.depends` links.

    python bench/host_parts.py [--reps 20]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from bench.host_cost import split  # noqa: E402

B, D, PAGES, PAGE = 8, 512, 257, 64


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--depth", type=int, default=10)
    opt = ap.parse_args()
    names = [f"in{i}" for i in range(13)]
    src = "/*" + "x" * 10000 + "*/\n"
    src += "int i = threadIdx.x; if (i < 8) { o0[i] = in0[i] + 1.0f; o3[i] = i; o4[i] = i; }"
    k = mx.fast.cuda_kernel(name="parts13", input_names=names, output_names=[f"o{i}" for i in range(5)], source=src)
    src1 = src.replace("o3[i] = i; o4[i] = i;", "")
    k1 = mx.fast.cuda_kernel(name="parts1", input_names=["in0"], output_names=["o0"], source=src1)
    xs = [mx.zeros((64,)) for _ in range(13)]
    pool0 = mx.zeros((PAGES, PAGE, D), mx.bfloat16)
    mx.eval(xs, pool0)
    shapes = [(64,), (B, D), (B, D), (B,), (B,)]
    dts = [mx.float32, mx.float32, mx.bfloat16, mx.int32, mx.int32]

    def node(x: mx.array) -> list[mx.array]:
        return k(inputs=[x] + xs[1:], output_shapes=shapes, output_dtypes=dts, grid=(32, 1, 1), threadgroup=(32, 1, 1))

    def chain(link: Callable[[Any, Any], tuple[Any, Any]]) -> Callable[[], Any]:
        def run(pool: mx.array) -> Any:
            x = xs[0]
            for _ in range(opt.depth):
                x, pool = link(x, pool)
            return [x, pool]

        c = mx.compile(run)
        state = {"pool": pool0}

        def go() -> Any:
            out = c(state["pool"])
            state["pool"] = out[1]
            return out

        return go

    def bare(x: mx.array, pool: mx.array) -> Any:
        return node(x)[0], pool

    def put_axis(x: mx.array, pool: mx.array) -> Any:
        o = node(x)
        dest = mx.broadcast_to(o[3][:, None] * 0, (B, D))
        flat = mx.put_along_axis(pool.reshape(PAGES * PAGE, D), dest, o[2], axis=0).reshape(pool.shape)
        return o[0], flat

    def put_axis_kernel_dest(x: mx.array, pool: mx.array) -> Any:  # dest made by the kernel (as compressor does)
        o = k(inputs=[x] + xs[1:], output_shapes=shapes[:3] + [(B, D), (B, 1)], output_dtypes=dts,
              grid=(32, 1, 1), threadgroup=(32, 1, 1))  # fmt: skip
        flat = mx.put_along_axis(pool.reshape(PAGES * PAGE, D), o[3], o[2], axis=0).reshape(pool.shape)
        return o[0], flat

    def scatter2(x: mx.array, pool: mx.array) -> Any:
        o = node(x)
        pool[o[3], o[4]] = o[2]
        return o[0], pool

    def one_input(x: mx.array, pool: mx.array) -> Any:
        return k1(inputs=[x], output_shapes=[(64,)], output_dtypes=[mx.float32], grid=(32, 1, 1),
                  threadgroup=(32, 1, 1))[0], pool  # fmt: skip

    def depends(x: mx.array, pool: mx.array) -> Any:
        y = one_input(x, pool)[0]
        return mx.depends(xs[1], y), pool

    for name, link in (("kernel_13in_5out", bare), ("kernel_1in_1out", one_input),
                       ("kernel_1in+depends", depends), ("kernel+put_along_axis", put_axis),
                       ("kernel(dest)+put_along_axis", put_axis_kernel_dest),
                       ("kernel+scatter2", scatter2)):  # fmt: skip
        print(json.dumps({"part": name} | split(chain(link), opt.reps, opt.depth)), flush=True)


if __name__ == "__main__":
    main()
