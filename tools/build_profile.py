"""The decode step's host build on any machine: Python making one step's lazy graph through the CUDA path, the
kernels stood in for (each launch returns zero buffers of its output shapes that depend on its inputs), per
layer, and a cProfile of where it goes. On the H200 the build is a third of a 1-row step (`bench/step.py`'s
`build`: 6.2 of 18.9 ms at 5d133be, ~144 us a layer); this says which part of it is ours. The stand-in is two
or three graph nodes a launch where MLX's `cuda_kernel` makes one, so the compiled segments' replay (C++, the
own time of `Block.__call__` in the profile) reads somewhat high; the Python around the kernels reads true.

    python tools/build_profile.py [--layers 4] [--rows 1] [--steps 30] [--top 25] [--tiny] [--random] [--reset]

Per layer kind (sliding / CSA / HCA) it prints the median build of a layer, the first of its kind in a step
apart (it makes the step's once-a-kind values). The weights are zeros unless --random: the build reads no
value, and drawing V4-Flash's random weights on the CPU takes ~40 s a layer.

`--reset` instead: a slot's reset at admission (model/state_copy.py), every per-slot array in one `write_slots`
against a `write_rows` an array (its form before 2026-12-07), alternated, median host ms of each (2-core CPU,
`--layers 43`, 167 arrays: 0.6-0.7 against 4.0-4.2 ms; the stand-ins carry no MLX encode, which the GPU adds).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from bench.stand_in import stand_in as _stand_in  # noqa: E402  (its old name: tools/graph_plan.py, tests)
from bench.stand_in import zero_weights  # noqa: E402


def stand_in_cuda_path() -> None:
    """Import kernels.cuda with MLX's `cuda_kernel` stood in for, and have the backend pick the fast ops."""
    mx.fast.cuda_kernel = _stand_in
    import dsv4_serve.kernels.cuda  # noqa: F401  (registers the fast ops)
    from dsv4_serve.kernels import backend

    backend._use_fast = lambda: True


def time_layers(spans: list[tuple[int, float]]) -> None:
    """Each Block call appends (layer, seconds) to `spans`."""
    from dsv4_serve.model.deepseek_v4 import Block

    call = Block.__call__

    def timed(self, *a, **kw):
        t = time.perf_counter()
        out = call(self, *a, **kw)
        spans.append((self.attn.layer, time.perf_counter() - t))
        return out

    Block.__call__ = timed


def report_layers(spans: list[tuple[int, float]], ratios: list[int]) -> None:
    """Median us a layer by kind, the first layer of each kind in a step (once-a-step work) apart."""
    name = {0: "sliding", 4: "CSA", 128: "HCA"}
    first = {r: ratios.index(r) for r in set(ratios)}
    by: dict[str, list[float]] = defaultdict(list)
    for layer, t in spans:
        r = ratios[layer]
        by[name.get(r, str(r)) + (" (first)" if first[r] == layer else "")].append(t * 1e6)
    print("per layer: " + ", ".join(f"{k} {statistics.median(v):.0f} us" for k, v in sorted(by.items())))


def reset_ms(pools, reps: int) -> dict[str, float]:  # noqa: ANN001 - a model.state.StatePools
    """Median host ms of a slot's reset, one `write_slots` against a `write_rows` an array, alternated."""
    import numpy as np

    from dsv4_serve.kernels.pool_rows import check_write_slots, write_rows
    from dsv4_serve.kernels.upload import upload
    from dsv4_serve.model import state_copy

    def per_array(ps, slot, values):  # noqa: ANN001, ANN202 - write_slots' signature, a write_rows a pool
        check_write_slots(ps, slot, values)
        out = [write_rows(p, upload(np.arange(slot * p.shape[1], (slot + 1) * p.shape[1], dtype=np.int32)), v)
               for p, v in zip(ps, values, strict=True)]  # fmt: skip
        return [a for a, _ in out], mx.concatenate([t for _, t in out])

    forms, times = {"write_slots": state_copy.write_slots, "write_rows each": per_array}, {}
    for _ in range(reps):
        for name, fn in forms.items():
            state_copy.write_slots = fn
            t = time.perf_counter()
            pools._reset_slot(0)
            times.setdefault(name, []).append(time.perf_counter() - t)
            mx.eval(*pools.arrays())
    state_copy.write_slots = forms["write_slots"]
    return {name: 1e3 * statistics.median(ts[2:]) for name, ts in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4, help="V4-Flash layers (sliding, CSA, HCA, CSA, ...)")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--tiny", action="store_true", help="the tiny model instead (the tool's own check)")
    ap.add_argument("--random", action="store_true", help="random weights (model/dummy.py's), not zeros")
    ap.add_argument("--reset", action="store_true", help="a slot's reset instead: write_slots against write_rows")
    opt = ap.parse_args()
    stand_in_cuda_path()
    if not opt.random:
        zero_weights()
    from bench.step import flash_args, random_model
    from dsv4_serve.model.state import StatePools

    if opt.tiny:
        from dsv4_serve.model.tiny import tiny_model

        model, args, _ = tiny_model(seed=0)
        opt.layers = args.num_hidden_layers
    else:
        args = flash_args(opt.layers, opt.experts)
        model = None if opt.reset else random_model(args)  # (a reset reads the pools alone)
    if opt.reset:
        pools = StatePools(args, max_slots=2, max_positions=256, page_size=256, dtype=mx.bfloat16)
        mx.eval(*pools.arrays())
        ms = reset_ms(pools, opt.steps)
        print(f"reset: {len(pools.slot_arrays())} per-slot arrays, host ms (median of {opt.steps}): "
              + ", ".join(f"{k} {v:.2f}" for k, v in ms.items()))  # fmt: skip
        return
    ctx = 4096
    pools = StatePools(args, max_slots=opt.rows, max_positions=ctx + 2 * opt.steps + 8, page_size=256,
                       dtype=mx.bfloat16)  # fmt: skip
    handles = [pools.alloc(ctx + 2 * opt.steps + 8) for _ in range(opt.rows)]
    tok = mx.array([7] * opt.rows, dtype=mx.int32)

    def build(i: int) -> mx.array:
        return model.step(model.make_batch(pools, handles, [ctx + i] * opt.rows), tok, pools)

    for i in range(3):  # trace the compiled segments, make the plans
        mx.eval(build(i))
    spans: list[tuple[int, float]] = []
    time_layers(spans)
    times, prof = [], cProfile.Profile()
    for i in range(opt.steps):  # timed without the profiler, then profiled
        out = build(3 + i)
        mx.eval(out, pools.arrays())
    del spans[:]
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
    report_layers(spans, [args.layer_ratio(i) for i in range(opt.layers)])
    pstats.Stats(prof).sort_stats("tottime").print_stats(opt.top)


if __name__ == "__main__":
    main()
