"""Which arrays reach the decode step's fast ops, or its reshapes, laid out non-contiguously (no GPU).

On CUDA every `mx.fast.cuda_kernel` input that is not row-contiguous is copied first (`copy_g_nd`, one
more kernel and its host cost each), and so is a reshape of a strided array. CUPTI on the H200 counted
~4.5 such copies a decode layer (74386e5, 2026-12-02) that the compiled graphs do not show. This runs
one decode step of a 3-layer V4-Flash (sliding, CSA, HCA; small expert count) on the CPU with the
segments uncompiled, the fast ops' dispatch pointed at their references through a probe that
evaluates each array argument and reads its strides (the buffer protocol), and reports every op
argument that arrives strided, by layer kind and row count. The strides come from MLX's shared
primitive code, the same on the CPU as on CUDA.

    python tools/contiguity.py [--rows 1,8] [--tiny]
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import mlx.core as mx  # noqa: E402

from dsv4_serve.kernels import backend  # noqa: E402
from dsv4_serve.model.config import ModelArgs  # noqa: E402
from dsv4_serve.model.dummy import dummy_model  # noqa: E402
from dsv4_serve.model.state import StatePools  # noqa: E402


def strided(a: mx.array) -> bool:
    """Whether an array's data is not row-contiguous (what a custom kernel's input check copies)."""
    mx.eval(a)
    return a.size > 1 and not memoryview(a).c_contiguous


def arrays(v: Any, name: str) -> list[tuple[str, mx.array]]:
    if isinstance(v, mx.array):
        return [(name, v)]
    if isinstance(v, (tuple, list)):
        return [x for i, e in enumerate(v) for x in arrays(e, f"{name}[{i}]")]
    if hasattr(v, "_fields"):
        return [x for f in v._fields for x in arrays(getattr(v, f), f"{name}.{f}")]
    return []


def probe(found: collections.Counter, where: list[str]) -> None:
    """Every op of backend.OPS through a wrapper that records its strided array arguments, then runs the reference."""
    backend._use_fast = lambda: True  # the dispatch asks the registry: every op below is "fast"

    def wrap(op: str, ref: Any) -> Any:
        def run(*args: Any, **kw: Any) -> Any:
            for name, a in arrays(list(args), "arg") + arrays(list(kw.values()), "kw"):
                if strided(a):
                    found[(where[0], op, name, tuple(a.shape))] += 1
            return ref(*args, **kw)

        return run

    import dsv4_serve.kernels.matmul as km
    from dsv4_serve import kernels

    composed = {"hc_pre_rows": kernels.hc_pre_composed, "hc_pre_norm_rows": kernels.hc_pre_norm_composed}
    for op in backend.OPS:
        ref = getattr(kernels, f"{op}_reference", None) or getattr(km, f"{op}_reference", None) or composed.get(op)
        if ref is not None:
            backend.register(op, wrap(op, ref))
        else:  # nothing to probe it by: its default (whatever fast op a CUDA import registered never runs)
            backend.unregister(op)


def scan(a: ModelArgs, rows_list: list[int]) -> collections.Counter:
    """(rows, op, argument, shape) -> calls a step, for the fast ops' strided array arguments."""
    model = dummy_model(a, seed=0, dtype=mx.bfloat16, quantize=True)
    found: collections.Counter = collections.Counter()
    where = [""]
    fast = backend._use_fast, dict(backend._fast)
    probe(found, where)
    mx.disable_compile()  # every segment op by op, so the probe sees (and may evaluate) each call's arrays
    try:
        for rows in rows_list:
            pools = StatePools(a, max_slots=rows, max_positions=1024, page_size=256, dtype=mx.bfloat16)
            handles = [pools.alloc(1024) for _ in range(rows)]
            where[0] = f"{rows} rows"
            logits = model.step(model.make_batch(pools, handles, [300 + i for i in range(rows)]),
                                mx.arange(rows).astype(mx.int32), pools)  # fmt: skip
            mx.eval(logits, pools.arrays())
    finally:
        mx.enable_compile()
        backend._use_fast = fast[0]
        backend._fast.clear()
        backend._fast.update(fast[1])
    return found


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--tiny", action="store_true", help="the tiny model's dims (fast; the layouts can differ)")
    opt = ap.parse_args()
    if opt.tiny:
        a = ModelArgs.tiny()
        a.num_hidden_layers, a.compress_ratios, a.num_hash_layers = 3, [0, 4, 128], 0
    else:
        a = ModelArgs()
        a.num_hidden_layers, a.compress_ratios, a.num_hash_layers, a.n_routed_experts = 3, [0, 4, 128], 0, 8
    found = scan(a, [int(r) for r in opt.rows.split(",")])
    if not found:
        print("every fast op's array arguments were row-contiguous")
    for (rows, op, name, shape), n in sorted(found.items()):
        print(f"{rows:8} {op:28} {name:10} {str(shape):24} x{n}")


if __name__ == "__main__":
    main()
