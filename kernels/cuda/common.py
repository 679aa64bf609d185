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
import numpy as np

from dsv4_serve.kernels.upload import upload

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
// mma.sync m16n8k16, f32 accumulation (Ampere+ layouts; g = lane / 4, c = 2 * (lane % 4)):
// a: 4 regs of A rows {g, g+8} x cols {c, c+8}; b: 2 regs of B(k, n), k {c, c+8}, n = g;
// acc: rows {g, g+8} x cols {c, c+1}.
__device__ __forceinline__ void dsv4_mma(float* acc, const uint32_t* a, uint32_t b0, uint32_t b1, __nv_bfloat16) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
               "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void dsv4_mma(float* acc, const uint32_t* a, uint32_t b0, uint32_t b1, __half) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
               "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// 16-byte global -> shared copy that bypasses registers; `bytes` 0 zero-fills the destination.
__device__ __forceinline__ void dsv4_cp16(void* smem, const void* gmem, int bytes) {
  const unsigned int s = (unsigned int)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(bytes));
}
// ldmatrix .x4 (16-bit elements): lanes 8i..8i+7 give the 16-byte row addresses of 8x8 matrix i; each
// lane gets (row lane / 4, cols 2 * (lane % 4), +1) of every matrix in r[i].
__device__ __forceinline__ void dsv4_ldsm4(uint32_t* r, const void* smem) {
  const unsigned int s = (unsigned int)__cvta_generic_to_shared(smem);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(s));
}
// ldmatrix .x4 .trans: lane gets (rows 2 * (lane % 4), +1; col lane / 4) of every matrix (B from a [k][n] tile).
__device__ __forceinline__ void dsv4_ldsm4t(uint32_t* r, const void* smem) {
  const unsigned int s = (unsigned int)__cvta_generic_to_shared(smem);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(s));
}
__device__ __forceinline__ void dsv4_cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void dsv4_cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }
// Compressed entries a row at position p has emitted at ratio r (0: none): (p + 1) / r.
__device__ __forceinline__ int dsv4_emitted(int p, int r) { return r ? (p + 1) / r : 0; }
// Order-preserving uint32 of a float score (-0 -> +0, so equal scores give equal keys).
__device__ __forceinline__ unsigned int dsv4_okey(float s) {
  const unsigned int bits = __float_as_uint(s == 0.f ? 0.f : s);
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}
"""

# e2m1 nibbles to bf16 bits (the exponent short by 126: the group scale folds it in), for the kernels that read
# mxfp4 weights (kernels/cuda/matmul.py, kernels/cuda/tiles_mm.py) as their `header`.
E2M1 = r"""
// Nibbles 0 and 4 of q as a bf16 pair in lo, nibbles 1 and 5 in hi (the sign bit, then 3 bits into the exponent).
__device__ __forceinline__ void dsv4_e2m1_bits(uint32_t q, uint32_t& lo, uint32_t& hi) {
  const uint32_t q4 = q >> 4;
  lo = ((q << 6) & 0x01C001C0u) | ((q << 12) & 0x80008000u);
  hi = ((q4 << 6) & 0x01C001C0u) | ((q4 << 12) & 0x80008000u);
}
"""

CUDA_TYPES = {
    mx.float32: "float",
    mx.bfloat16: "__nv_bfloat16",
    mx.float16: "__half",
    mx.int32: "int32_t",
    mx.uint32: "uint32_t",
    mx.uint8: "uint8_t",
    mx.int64: "int64_t",
    mx.bool_: "bool",
}

# `mx.compile` around each op's launches (per launch plan): a call after the first replays the traced
# graph instead of rebuilding each `cuda_kernel` node (MLX rebuilds the kernel's source string per
# call). `DSV4_CUDA_COMPILE=0` turns it off.
COMPILE = os.environ.get("DSV4_CUDA_COMPILE", "0").strip() not in ("0", "")

_kernels: dict[tuple[str, str, int], Any] = {}
# The same objects' keys by their texts: a launch that asks for its kernel each time (write_rows, prefill attention)
# finds it by dict lookups (the strings' hashes are cached on them) instead of a SHA-1 of ~5 KB of text (~5 us);
# the object is `_kernels`' own, so a clear of `_kernels` (forget_kernels, tests) makes it again.
_by_text: dict[tuple[str, str, str, int], tuple[str, str, int]] = {}
_consts: dict[tuple[Any, ...], mx.array] = {}


def minify(src: str) -> str:
    """Device code without comments, indentation or blank lines. MLX hashes a custom kernel's whole
    source on every launch (its module cache key), about 0.2 us per KB on the H200's host, so the
    text it gets is kept short. Line breaks stay (preprocessor lines); lines with a string keep
    their comments (an `asm` template may hold `//`)."""
    out = []
    for line in src.splitlines():
        s = line.strip()
        if '"' not in s and "//" in s:
            s = s[: s.index("//")].rstrip()
        if s:
            out.append(s)
    return "\n".join(out)


# A token an in-place writer returns and the caller queues and drops (`pool_rows.commit`) has at least this many
# int32 words (16 bytes): MLX's CUDA allocator keeps outputs of <= 8 bytes in a small managed pool, and a block a
# dropped output frees there can go to the next small array the host writes (a gather's index, an upload) while the
# kernel that writes the token is still queued, which then overwrites that array (MLX 0.32, allocator.cpp; custom
# kernels' outputs are not kept alive to their launch's end). 16 bytes come from device memory, reused in stream
# order.
TOKEN_WORDS = 4

MAX_GRID_Y = 65535  # CUDA's limit on a grid's y: kernels with rows there take longer inputs to the reference


def kernel(name: str, inputs: Sequence[str], outputs: Sequence[str], source: str, shared_memory: int = 0,
           header: str = "") -> Any:  # fmt: skip
    """One `mx.fast.cuda_kernel` object per (source, shared memory), named by the source digest.

    `header`: device functions of this kernel, after the shared `HEADER`."""
    text = (name, source, header, shared_memory)
    known = _by_text.get(text)
    if known is not None and known in _kernels:
        return _kernels[known]
    digest = hashlib.sha1((HEADER + header + source).encode()).hexdigest()[:10]
    key = (name, digest, shared_memory)
    if key not in _kernels:
        _kernels[key] = mx.fast.cuda_kernel(
            name=f"dsv4_{name}_{digest}",
            input_names=list(inputs),
            output_names=list(outputs),
            source=minify(source),
            header=minify(HEADER + header) + "\n",  # MLX appends its namespace line right after: a last
            # `#define` line (common.launch_bounds) must end before it
            ensure_row_contiguous=True,
            shared_memory=shared_memory,
        )
    _by_text[text] = key
    return _kernels[key]


def launch_bounds(threads: int, min_blocks: int) -> str:
    """Header text that puts `__launch_bounds__(threads, min_blocks)` on the kernel MLX writes right after
    the header (`cuda_kernel` writes the signature itself; `__location__(global)` is what the CUDA headers'
    `__global__` expands to). ptxas may then spend registers up to 64K / (threads x min_blocks): at the
    indexer's default ~57 it ran each warp's mma chains one after another (H200, 2026-11-30, 58ca642)."""
    if min_blocks <= 0:
        return ""
    return f"\n#undef __global__\n#define __global__ __location__(global) __launch_bounds__({threads}, {min_blocks})\n"


def f32_params(*values: float) -> mx.array:
    """A cached float32 array of scalar parameters (eps, scale): no host upload per call."""
    key = ("f32",) + tuple(float(v) for v in values)
    if key not in _consts:
        # device memory (kernels/upload.py): a 4-byte host-built array is read over the host link by every block
        _consts[key] = upload(list(key[1:]), mx.float32)
        mx.eval(_consts[key])
    return _consts[key]


def dummy(shape: tuple[int, ...], dtype: mx.Dtype = mx.int32) -> mx.array:
    """Zeros for a kernel input the launch does not read (absent scales, an unused table), one per shape and
    dtype, evaluated once."""
    key = ("dummy", dtype, *shape)
    a = _consts.get(key)
    if a is None:
        a = _consts[key] = mx.zeros(shape, dtype=dtype)
        mx.eval(a)
    return a


def i32_dummy(shape: tuple[int, ...]) -> mx.array:
    return dummy(shape, mx.int32)


def next_pow2(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


def standalone(name: str, inputs: Sequence[tuple[str, mx.Dtype, bool]], outputs: Sequence[tuple[str, mx.Dtype]],
               template: Sequence[tuple[str, Any]], source: str, shared_memory: int = 0, header: str = "") -> str:
    """The translation unit MLX would build (for an offline `nvcc` syntax check; no MLX headers needed).

    `inputs`: (name, dtype, uses_shape). Mirrors mlx/backend/cuda/custom_kernel.cpp's layout.
    """
    del shared_memory
    lines = [
        "#include <cuda_bf16.h>", "#include <cuda_fp16.h>", "#include <cstdint>",
        "#include <cooperative_groups.h>", "#include <cuda/std/limits>",
        "struct Shape { int32_t v[8]; __device__ int32_t operator[](int i) const { return v[i]; } };",
        minify(HEADER + header), "namespace mlx::core::cu {", "namespace cg = cooperative_groups;",
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
    lines += [*template_lines(template), minify(source), "}", "}"]
    return "\n".join(lines)


def template_lines(template: Sequence[tuple[str, Any]]) -> list[str]:
    """A launch's template values as MLX writes them at the top of the kernel: `using` a dtype, `constexpr`
    a bool or an int."""
    out = []
    for n, v in template:
        if isinstance(v, mx.Dtype):
            out.append(f"  using {n} = {CUDA_TYPES[v]};")
        elif isinstance(v, bool):
            out.append(f"  constexpr bool {n} = {'true' if v else 'false'};")
        else:
            out.append(f"  constexpr int {n} = {int(v)};")
    return out


# ---- contract checks once per batch ---------------------------------------------------------
# The checks live in `kernels.rows` (shared with the references); `rows.checked` runs an op's
# check once per RowBatch object and argument shapes / dtypes / scalars, and keeps the op's
# per-shape launch plan (kernel object, template, grid, output shapes) beside it, so a layer's
# call after the first costs one tuple and one dict lookup. Plans are also kept across batches.
_plans: dict[tuple[Any, ...], Any] = {}
# Plans dropped from `_plans`, kept: a plan's `mx.compile(self.launch)` freed could leave its traces in another
# thread's compile cache for a new plan at its address to replay (model/block.py, issue 57).
_retired: list[Any] = []


def forget_kernels() -> None:
    """Drop every kernel object and launch plan made so far, so the next launches make them again through whatever
    stands in for `mx.fast.cuda_kernel` now (the graphs' recorder, the kernel cache's noter). The plans' compiled
    launches are kept (`_retired`)."""
    _kernels.clear()
    _retired.extend(_plans.values())
    _plans.clear()


def plan_cached(key: tuple[Any, ...], make: Any) -> Any:
    """A launch plan per shape key, shared by every batch (a few dozen entries in a model)."""
    plan = _plans.get(key)
    if plan is None:
        if len(_plans) > 4096:
            _retired.extend(_plans.values())
            _plans.clear()
        plan = _plans[key] = make()
    return plan


def arange_rows(rows: int, cap: int, dtype: mx.Dtype = mx.int32) -> mx.array:
    """A cached `[rows, cap]` array whose every row is 0..cap-1 (HCA: attend to the whole table; wo_a's groups as
    the skinny kernel's experts), made from NumPy: no graph node, so it may be first asked for in a compiled trace."""
    key = ("arange_rows", rows, cap, dtype)
    if key not in _consts:
        _consts[key] = mx.array(np.tile(np.arange(cap), (rows, 1)), dtype=dtype)
        mx.eval(_consts[key])
    return _consts[key]
