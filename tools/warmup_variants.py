"""Kernel variants a serving shape launches that the warm-up did not, found on any machine (no GPU).

On CUDA, MLX builds each `mx.fast.cuda_kernel` variant with NVRTC on its first launch (1-2.5 s on an H100): one the
warm-up missed is built in a request's path. Here CUDA is faked: `backend.cuda_available` says yes, Python's
`mx.default_device()` is not the CPU (so the dummy model is bf16, as on a GPU), and `mx.fast.cuda_kernel` is
kernels/cuda/mlx_cache.py's Noter over a factory whose kernels return zeros, so each launch is keyed as MLX keys
its builds (kernel, template, input dtypes and ranks, output dtypes) while the MLX ops around the kernels run on
the CPU. The engine's warm-up runs, then prefill forwards of serving's shapes (each followed by a decode step of
its rows); each prints the variants it added. MLX's own JIT kernels (its compiled fusions, gathers, copies) are not
seen: they are built in C++.

    python tools/warmup_variants.py [--layers 4] [--experts 8] [--old]    (--old: without the warm-up's short forward)

2026-12-06, e953bb2, V4-Flash dims, 4 layers (one CSA, one HCA past the two window layers), 8 experts: the warm-up
notes 54 variants, and 1..4 and 8 prompts of 32 tokens, sliced or whole, 17 and 300 tokens add none, with or
without the warm-up's short forward. 2026-12-07, 468f5df (a forward's compressors and indexer picks in one call for
all its requests): the same, 54 and none. Again with a short context's CSA picks made on the host (`every_visible`;
the warm-up's long prompt scored through `prefill_indexer.scored()`, as a long context is): 54 and none, a
2,100-token prompt (past the picks' top-k: scored) included; without `scored()` that prompt adds the indexer scores'
tile GEMM (`dsv4_tiles_mm`, an NVRTC build in its request's path). With the skinny kernels' 8-row groups (a short
prompt's 9..64 rows in one launch: their own variants, template GR): the warm-up notes 65, and the same shapes none.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

SHAPES = [("1x32", [32], False), ("2x32", [32, 32], False), ("3x32", [32] * 3, False), ("4x32", [32] * 4, False),
          ("1x32 sliced", [32], True), ("4x32 sliced", [32] * 4, True), ("1x17", [17], False),
          ("1x300", [300], False), ("8x32", [32] * 8, False),
          ("1x2100", [2100], False)]  # a context past the CSA picks' top-k (512 entries): scored  # fmt: skip


class _NotCpu:
    """What `mx.default_device()` returns here: unequal to the CPU, so the model takes a GPU's dtypes."""

    type = mx.gpu

    def __eq__(self, other: object) -> bool:
        return False

    __hash__ = object.__hash__


def fake_cuda() -> object:
    """CUDA as the kernels' Python sees it, each launch noted; the Noter."""
    from dsv4_serve.kernels import backend
    from dsv4_serve.kernels.cuda import mlx_cache

    def factory(**_: object) -> object:
        def launch(*, output_shapes: list, output_dtypes: list, **__: object) -> list[mx.array]:
            return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes, strict=True)]

        return launch

    backend.cuda_available = lambda: True
    mx.default_device = lambda: _NotCpu()  # Python's callers only: MLX itself still runs on the CPU
    noter = mlx_cache.Noter()
    noter.install(factory)
    return noter


def forward(eng: object, sizes: list[int], sliced: bool) -> None:
    """One prefill forward of prompts of `sizes` tokens (in slices of a layer, or whole), then a decode step of
    their rows; their state released."""
    hs = [eng.admit(n + 8) for n in sizes]
    try:
        work = [(h, [5] * n, 0) for h, n in zip(hs, sizes, strict=True)]
        if sliced:
            built = eng.prefill_batch(work, slice_seconds=1e-6, rows_layers=sum(sizes))
            while not built:
                built = eng.prefill_advance(1e-6, sum(sizes))
        else:
            eng.prefill_batch(work)
        mx.eval(eng.pools.arrays())
        mx.eval(eng.step([(h, 5, n) for h, n in zip(hs, sizes, strict=True)]))
    finally:
        for h in hs:
            eng.release(h)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4, help="V4-Flash's first 4 hold one CSA and one HCA layer")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--old", action="store_true", help="the warm-up without its forward of two short prompts")
    opt = ap.parse_args()
    os.environ.setdefault("DSV4_KERNEL_CACHE", "0")  # the Engine must not install a second noter
    noter = fake_cuda()
    from dsv4_serve.service.engine import warmup
    from dsv4_serve.service.engine.build import build_engine

    if opt.old:
        warmup.SHORT_PROMPT = 1 << 30
    eng, _ = build_engine("flash", load_format="dummy", experts=opt.experts, layers=opt.layers, max_rows=8,
                          max_model_len=4096, state_budget_bytes=2 << 30, prefix_cache_bytes=0)  # fmt: skip
    eng.warmup()
    print(f"warm-up: {len(noter.variants)} variants ({eng.model.dtype}, {opt.layers} layers)", flush=True)
    for name, sizes, sliced in SHAPES:
        before = set(noter.variants)
        forward(eng, sizes, sliced)
        new = sorted({noter.variants[m][0] for m in noter.variants if m not in before})
        print(f"{name}: {len(new)} new" + (f": {new}" if new else ""), flush=True)


if __name__ == "__main__":
    main()
