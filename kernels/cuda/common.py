"""Shared helpers of the CUDA fast path: kernel objects (cached by source hash), scalar params, dtypes.

`mx.fast.cuda_kernel` names its NVRTC module `custom_kernel_<name><template hash>` and MLX keeps a
PTX cache on disk keyed by that name, so every kernel name here carries a digest of its source:
an edited kernel can never pick up a stale module. Input dtypes are not part of MLX's name, so
every kernel takes its element types as template arguments (`T`, ...).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from typing import Any

import mlx.core as mx

# Type conversions shared by every kernel (T is float, __nv_bfloat16 or __half).
HEADER = r"""
#include <mma.h>
__device__ __forceinline__ float dsv4_f(float x) { return x; }
__device__ __forceinline__ float dsv4_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float dsv4_f(__half x) { return __half2float(x); }
template <typename U> __device__ __forceinline__ U dsv4_t(float x);
template <> __device__ __forceinline__ float dsv4_t<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 dsv4_t<__nv_bfloat16>(float x) { return __float2bfloat16(x); }
template <> __device__ __forceinline__ __half dsv4_t<__half>(float x) { return __float2half(x); }
"""

CUDA_TYPES = {
    mx.float32: "float",
    mx.bfloat16: "__nv_bfloat16",
    mx.float16: "__half",
    mx.int32: "int32_t",
    mx.uint32: "uint32_t",
}

# `mx.compile` around each op's launches (per launch plan): a call after the first replays the traced
# graph instead of rebuilding each `cuda_kernel` node (MLX rebuilds the kernel's source string per
# call). `DSV4_CUDA_COMPILE=0` turns it off; bench/kernels.py times both.
COMPILE = os.environ.get("DSV4_CUDA_COMPILE", "0").strip() not in ("0", "")

_kernels: dict[tuple[str, int], Any] = {}  # one source per name
_consts: dict[tuple[Any, ...], mx.array] = {}


def kernel(name: str, inputs: Sequence[str], outputs: Sequence[str], source: str, shared_memory: int = 0) -> Any:
    """One `mx.fast.cuda_kernel` object per (source, shared memory), named by the source digest."""
    key = (name, shared_memory)
    if key not in _kernels:
        digest = hashlib.sha1((HEADER + source).encode()).hexdigest()[:10]
        _kernels[key] = mx.fast.cuda_kernel(
            name=f"dsv4_{name}_{digest}",
            input_names=list(inputs),
            output_names=list(outputs),
            source=source,
            header=HEADER,
            ensure_row_contiguous=True,
            shared_memory=shared_memory,
        )
    return _kernels[key]


def f32_params(*values: float) -> mx.array:
    """A cached float32 array of scalar parameters (eps, scale): no host upload per call."""
    key = ("f32",) + tuple(float(v) for v in values)
    if key not in _consts:
        _consts[key] = mx.array(list(key[1:]), dtype=mx.float32)
    return _consts[key]


def i32_dummy(shape: tuple[int, ...]) -> mx.array:
    key = ("i32",) + shape
    if key not in _consts:
        _consts[key] = mx.zeros(shape, dtype=mx.int32)
    return _consts[key]


def next_pow2(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


def standalone(name: str, inputs: Sequence[tuple[str, mx.Dtype, bool]], outputs: Sequence[tuple[str, mx.Dtype]],
               template: Sequence[tuple[str, Any]], source: str, shared_memory: int = 0) -> str:
    """The translation unit MLX would build (for an offline `nvcc` syntax check; no MLX headers needed).

    `inputs`: (name, dtype, uses_shape). Mirrors mlx/backend/cuda/custom_kernel.cpp's layout.
    """
    del shared_memory
    lines = [
        "#include <cuda_bf16.h>", "#include <cuda_fp16.h>", "#include <cstdint>",
        "#include <cooperative_groups.h>", "#include <cuda/std/limits>",
        "struct Shape { int32_t v[8]; __device__ int32_t operator[](int i) const { return v[i]; } };",
        HEADER, "namespace mlx::core::cu {", "namespace cg = cooperative_groups;",
        f"__global__ void {name}(",
    ]
    params = []
    for n, dt, shp in inputs:
        params.append(f"    const {CUDA_TYPES[dt]}* {n}")
        if shp:
            params.append(f"    const __grid_constant__ Shape {n}_shape")
    for n, dt in outputs:
        params.append(f"    {CUDA_TYPES[dt]}* {n}")
    lines.append(",\n".join(params) + ") {")
    for n, v in template:
        if isinstance(v, mx.Dtype):
            lines.append(f"  using {n} = {CUDA_TYPES[v]};")
        elif isinstance(v, bool):
            lines.append(f"  constexpr bool {n} = {'true' if v else 'false'};")
        else:
            lines.append(f"  constexpr int {n} = {v};")
    lines += [source, "}", "}"]
    return "\n".join(lines)


# ---- contract checks once per batch ---------------------------------------------------------
# The checks live in `kernels.rows` (shared with the references); `rows.checked` runs an op's
# check once per RowBatch object and argument shapes / dtypes / scalars, and keeps the op's
# per-shape launch plan (kernel object, template, grid, output shapes) beside it, so a layer's
# call after the first costs one tuple and one dict lookup. Plans are also kept across batches.
_plans: dict[tuple[Any, ...], Any] = {}


def plan_cached(key: tuple[Any, ...], make: Any) -> Any:
    """A launch plan per shape key, shared by every batch (a few dozen entries in a model)."""
    plan = _plans.get(key)
    if plan is None:
        if len(_plans) > 4096:
            _plans.clear()
        plan = _plans[key] = make()
    return plan


def arange_rows(rows: int, cap: int) -> mx.array:
    """A cached `[rows, cap]` int32 array whose every row is 0..cap-1 (HCA: attend to the whole table)."""
    key = ("arange_rows", rows, cap)
    if key not in _consts:
        a = mx.broadcast_to(mx.arange(cap, dtype=mx.int32)[None, :], (rows, cap))
        _consts[key] = mx.contiguous(a)  # materialized by its first eval, then kept
    return _consts[key]
