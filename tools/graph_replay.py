"""One decode step replayed as a CUDA graph over MLX's own buffers, against the same step through MLX (CUDA GPU).

The step (V4-Flash dims, random mxfp8 + mxfp4 weights, the glue kernels on, MLX's compile off so every launch is
seen) runs once through MLX with `kernels.graph.record.Recorder` keeping its launches. `kernels.graph.runtime`
then builds each kernel with NVRTC and captures the whole launch list as one graph at MLX's addresses (the
recorder holds every array, so none is freed or reused). Replaying it runs the same step again: the state writes
are stores of the same values at the same positions. Check: every launch's outputs are zeroed, the graph
replayed, and the last launch's outputs (the logits) must equal MLX's bit for bit. Then the timing, arms
alternated: the MLX step (compiled as the engine runs it; graph built and evaluated) against a replay (launched
and waited for), host time of the call and wall time a step.

This is the probe, not the engine's path: the engine's graphs (docs/cuda_graphs.md) take the plan's static
arena and staging buffer so that one graph serves every step of a row count.

    python tools/graph_replay.py [--layers 4] [--experts 32] [--rows 1] [--reps 20] [--json out.json]

On an H100 (2026-12-06, 43 layers, 32 experts, 4K) the replay equals MLX bit for bit, 9.9 / 15.6 ms a step at 1 / 8
rows against MLX's 24.7 / 24.6 (docs/performance.md), once the runtime raised the dynamic shared memory cap of the
three kernels that ask for more than 48 KiB.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--context", type=int, default=700)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", type=Path)
    opt = ap.parse_args()

    from dsv4_serve.kernels.graph.record import Recorder

    rec = Recorder()
    rec.install()  # before kernels.cuda makes its kernel objects
    import dsv4_serve.kernels.cuda  # noqa: F401
    from bench.step import flash_args, random_model
    from dsv4_serve.kernels.cuda import set_graph_glue
    from dsv4_serve.kernels.graph.runtime import Runtime, mlx_address, unavailable
    from dsv4_serve.model.state import StatePools

    if (why := unavailable()) is not None:
        raise SystemExit(f"graph_replay: {why}")
    set_graph_glue(True)
    mx.disable_compile()
    args = flash_args(opt.layers, opt.experts)
    model = random_model(args)
    rows, ctx = opt.rows, opt.context
    pools = StatePools(args, max_slots=rows, max_positions=ctx + 64, page_size=64, dtype=model.dtype)
    handles = [pools.alloc(ctx + 64) for _ in range(rows)]
    batch = model.make_batch(pools, handles, [ctx - 8 * i for i in range(rows)])
    tokens = mx.array([5 + i for i in range(rows)], dtype=mx.int32)
    mx.eval(pools.arrays(), batch.positions, model.step(batch, tokens, pools))  # kernels JIT-built, uploads cached

    rec.recording = True
    logits = model.step(batch, tokens, pools)
    rec.recording = False
    mx.eval(logits, pools.arrays(), [a for ln in rec.launches for a in (*ln.inputs, *ln.outputs)])
    last = [np.array(o.astype(mx.float32)) for o in rec.launches[-1].outputs]
    arrays = {id(a): a for ln in rec.launches for a in (*ln.inputs, *ln.outputs)}
    address = {k: mlx_address(a) for k, a in arrays.items()}

    from dsv4_serve.kernels.graph.cubin_cache import default_dir

    rt = Runtime(default_dir())  # a later run (or the engine's capture) loads the cubins instead of building them
    try:
        rt.prefetch(list(arrays.values()))
    except RuntimeError as e:  # an array outside managed memory: the first replay faults pages in instead
        print(f"graph_replay: no prefetch ({e})", file=sys.stderr)
    t0 = time.perf_counter()
    graph = rt.capture(rec.launches, address)
    build_s = time.perf_counter() - t0

    from cuda.bindings import driver

    mx.synchronize()
    for ln in rec.launches:  # the graph must make every output again
        for o in ln.outputs:
            (err,) = driver.cuMemsetD8Async(address[id(o)], 0, o.nbytes, rt.stream.handle)
            assert err == driver.CUresult.CUDA_SUCCESS, err
    rt.stream.sync()
    rt.replay(graph)
    rt.wait()
    again = [np.array((o + 0).astype(mx.float32)) for o in rec.launches[-1].outputs]  # + 0: MLX reads the buffer
    equal = all(np.array_equal(a, b, equal_nan=True) for a, b in zip(last, again, strict=True))

    mx.enable_compile()  # the MLX arm as the engine runs it: its pure segments compiled
    mx.eval(model.step(batch, tokens, pools))

    def mlx_step() -> float:
        t = time.perf_counter()
        out = model.step(batch, tokens, pools)
        host = time.perf_counter() - t
        mx.eval(out)
        return host

    def replay() -> float:
        t = time.perf_counter()
        rt.replay(graph)
        host = time.perf_counter() - t
        rt.wait()
        return host

    arms: dict[str, dict[str, list[float]]] = {"mlx": {"host": [], "wall": []}, "graph": {"host": [], "wall": []}}
    for _ in range(opt.reps):
        for name, fn in (("mlx", mlx_step), ("graph", replay)):
            t = time.perf_counter()
            arms[name]["host"].append(fn())
            arms[name]["wall"].append(time.perf_counter() - t)
    res = {"layers": args.num_hidden_layers, "experts": args.n_routed_experts, "rows": rows, "context": ctx,
           "launches": len(rec.launches), "kernels_built": len(rt._kernels), "capture_s": round(build_s, 2),
           "replay_equals_mlx": equal, "glue": os.environ.get("DSV4_GRAPH_GLUE", "set in-process"),
           **{f"{n}_{k}_ms": round(1e3 * statistics.median(v), 3) for n, a in arms.items() for k, v in a.items()}}
    print(json.dumps(res))
    if opt.json:
        opt.json.write_text(json.dumps(res, indent=1))
    if not equal:
        raise SystemExit("graph_replay: the replayed step's logits differ from MLX's")


if __name__ == "__main__":
    main()
