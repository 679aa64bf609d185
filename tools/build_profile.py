"""The decode step's host build on any machine: Python making one step's lazy graph through the CUDA path, the
kernels stood in for (each launch returns zero buffers of its output shapes that depend on its inputs), per
layer, and a cProfile of where it goes. On the H200 the build is a third of a 1-row step (`bench/step.py`'s
`build`: 6.2 of 18.9 ms at 5d133be, ~144 us a layer); this says which part of it is ours. The stand-in is two
or three graph nodes a launch where MLX's `cuda_kernel` makes one, so the compiled segments' replay (C++, the
own time of `Block.__call__` in the profile) reads somewhat high; the Python around the kernels reads true.

    python tools/build_profile.py [--layers 4] [--rows 1] [--steps 30] [--top 25] [--tiny]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402


def _stand_in(*_: object, **__: object):
    """kernels.cuda.common.kernel's stand-in: a launch is zero buffers of its output shapes, after its inputs."""

    def launch(*, inputs, template, grid, threadgroup, output_shapes, output_dtypes, **_kw):
        outs = [mx.zeros(tuple(s), d) for s, d in zip(output_shapes, output_dtypes, strict=True)]
        return mx.depends(outs, [i for i in inputs if isinstance(i, mx.array)])

    return launch


def stand_in_cuda_path() -> None:
    """Import kernels.cuda with MLX's `cuda_kernel` stood in for, and have the backend pick the fast ops."""
    mx.fast.cuda_kernel = _stand_in
    import kernels.cuda  # noqa: F401  (registers the fast ops)
    from kernels import backend

    backend._use_fast = lambda: True


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4, help="V4-Flash layers (sliding, CSA, HCA, CSA, ...)")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--tiny", action="store_true", help="the tiny model instead (the tool's own check)")
    opt = ap.parse_args()
    stand_in_cuda_path()
    from bench.step import flash_args, random_model
    from model.state import StatePools

    if opt.tiny:
        from model.loader import tiny_model

        model, args, _ = tiny_model(seed=0)
        opt.layers = args.num_hidden_layers
    else:
        args = flash_args(opt.layers, opt.experts)
        model = random_model(args)
    ctx = 4096
    pools = StatePools(args, max_slots=opt.rows, max_positions=ctx + 2 * opt.steps + 8, page_size=256,
                       dtype=mx.bfloat16)  # fmt: skip
    handles = [pools.alloc(ctx + 2 * opt.steps + 8) for _ in range(opt.rows)]
    tok = mx.array([7] * opt.rows, dtype=mx.int32)

    def build(i: int) -> mx.array:
        return model.step(model.make_batch(pools, handles, [ctx + i] * opt.rows), tok, pools)

    for i in range(3):  # trace the compiled segments, make the plans
        mx.eval(build(i))
    times, prof = [], cProfile.Profile()
    for i in range(opt.steps):
        t = time.perf_counter()
        prof.enable()
        out = build(3 + i)
        prof.disable()
        times.append(time.perf_counter() - t)
        mx.eval(out, pools.arrays())  # not timed: keeps the graphs one step deep
    times.sort()
    med = times[len(times) // 2]
    print(f"build: {med * 1e3:.2f} ms a step (median of {opt.steps}), {med / opt.layers * 1e6:.0f} us a layer, "
          f"{opt.layers} layers, {opt.rows} rows, {mx.default_device()}")  # fmt: skip
    pstats.Stats(prof).sort_stats("tottime").print_stats(opt.top)


if __name__ == "__main__":
    main()
