"""A recorded launch's kernel as a translation unit NVRTC builds outside MLX.

The layout is `mx.fast.cuda_kernel`'s (mlx/backend/cuda/custom_kernel.cpp: the header as the kernel was given
it, `kernels.cuda.common.HEADER` included, then in namespace
`mlx::core::cu` a `__global__` function of the inputs as `const T*` and the outputs as `T*`, the template
values as `constexpr` / `using` lines, then the body), with one change: a graph replays one shape, so an input's
`<name>_shape` is a constant inside the function instead of a parameter, and every argument is a pointer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from dsv4_serve.kernels.cuda.common import CUDA_TYPES, template_lines
from dsv4_serve.kernels.graph.record import KernelSource, RawLaunch

# What MLX's device headers give a kernel body (mlx/backend/cuda/device/utils.cuh, config.h: the CUDA half types,
# libcu++'s array / limits / tuple / complex, which bring int32_t and INFINITY under NVRTC), and a Shape of our own.
PRELUDE = [
    "#define LIBCUDACXX_ENABLE_SIMPLIFIED_COMPLEX_OPERATIONS", "#include <cuda_bf16.h>", "#include <cuda_fp16.h>",
    "#include <cuda/std/array>", "#include <cuda/std/limits>", "#include <cuda/std/tuple>",
    "#include <cuda/std/complex>", "#include <cooperative_groups.h>", "#define MAX_NDIM 10", "#define WARP_SIZE 32",
    "struct Shape { int32_t v[8]; __device__ int32_t operator[](int i) const { return v[i]; } };",
]  # fmt: skip
MAX_NDIM = 8


def entry(ks: KernelSource) -> str:
    """The kernel's C++ name (NVRTC's name expression)."""
    return f"mlx::core::cu::{ks.name}"


def translation_unit(ks: KernelSource, template: Sequence[tuple[str, Any]], inputs: Sequence[mx.array],
                     output_dtypes: Sequence[mx.Dtype]) -> str:  # fmt: skip
    """The source of one launch's kernel: `inputs` give each input's dtype and (baked) shape."""
    if len(inputs) != len(ks.input_names) or len(output_dtypes) != len(ks.output_names):
        raise ValueError(f"{ks.name}: {len(inputs)} inputs / {len(output_dtypes)} outputs for "
                         f"{len(ks.input_names)} / {len(ks.output_names)} names")  # fmt: skip
    for n in ks.input_names:
        if f"{n}_strides" in ks.source or f"{n}_ndim" in ks.source:
            raise ValueError(f"{ks.name}: input {n}'s strides / ndim are read: not supported in a graph")
    params = [f"    const {CUDA_TYPES[a.dtype]}* {n}" for n, a in zip(ks.input_names, inputs, strict=True)]
    params += [f"    {CUDA_TYPES[d]}* {n}" for n, d in zip(ks.output_names, output_dtypes, strict=True)]
    shapes = []
    for n, a in zip(ks.input_names, inputs, strict=True):
        if f"{n}_shape" in ks.source:
            if a.ndim > MAX_NDIM:
                raise ValueError(f"{ks.name}: input {n} has {a.ndim} dims, at most {MAX_NDIM}")
            dims = ", ".join(str(d) for d in (*a.shape, *[0] * (MAX_NDIM - a.ndim)))
            shapes.append(f"  const Shape {n}_shape = {{{{{dims}}}}};")
    return "\n".join([
        *PRELUDE, ks.header, "namespace mlx::core::cu {", "namespace cg = cooperative_groups;",
        f"__global__ void {ks.name}(", ",\n".join(params) + ") {", *shapes, *template_lines(template),
        ks.source, "}", "}",
    ])  # fmt: skip


_UNITS: dict[tuple[Any, ...], str] = {}


def launch_unit(ln: RawLaunch) -> str:
    """`translation_unit` of a recorded launch, made once per kernel, template, input dtypes and shapes and output
    dtypes (what it reads of them): 8 row counts of a V4-Flash step are ~8,300 launches of 193 units, and making
    each launch's took 0.3 s of a start, twice (the prebuild, the capture)."""
    key = (ln.kernel, ln.template, tuple((a.dtype, a.shape) for a in ln.inputs), tuple(o.dtype for o in ln.outputs))
    src = _UNITS.get(key)
    if src is None:
        src = _UNITS[key] = translation_unit(ln.kernel, ln.template, ln.inputs, [o.dtype for o in ln.outputs])
    return src
