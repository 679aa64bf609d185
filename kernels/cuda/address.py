"""Device addresses of MLX arrays read by a kernel, not through DLPack (the decode graphs' plan of a step).

A DLPack read of an address moves the array's buffer into a fresh managed allocation with a synchronous copy (MLX
0.32's `Buffer::raw_ptr` -> `move_to_unified_memory`). The graphs want that once for what they read for good (the
weights, pools and constants: a managed buffer is never moved again, so its address holds), but a recorded step
has ~2,000 intermediates whose addresses only sort its arguments into buffers (kernels/graph/record.py), each then
a managed allocation and a synchronous copy on every start. Here one launch an array writes the pointer MLX passes
it (its buffer's start plus its offset) and whether its strides are row-contiguous (NumPy's C order: a dim of one
has any stride); one read brings all back. Inputs are never copied (`ensure_row_contiguous=False`).

No plain twin: on the CPU a DLPack read moves nothing (`record.addresses` uses it there, and where this kernel
cannot be built).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np

# MLX passes a_shape / a_strides / a_ndim by value when the source names them (an array with dims only).
SOURCE = r"""
  bool dense = true;
  long long expect = 1;
  for (int d = a_ndim - 1; d >= 0; --d) {
    if (a_shape[d] != 1) {
      if ((long long)a_strides[d] != expect) dense = false;
      expect *= a_shape[d];
    }
  }
  out[0] = (unsigned long long)(const void*)a;
  out[1] = dense ? 1 : 0;
"""
SCALAR = "out[0] = (unsigned long long)(const void*)a; out[1] = 1;"

_kernels: dict[bool, Any] = {}


def _kernel(scalar: bool) -> Any:
    if scalar not in _kernels:
        _kernels[scalar] = mx.fast.cuda_kernel(
            name="dsv4_address" + ("_scalar" if scalar else ""), input_names=["a"], output_names=["out"],
            source=SCALAR if scalar else SOURCE, ensure_row_contiguous=False,
        )  # fmt: skip
    return _kernels[scalar]


def read(arrays: Sequence[mx.array]) -> list[int | None]:
    """Each evaluated array's first byte on the device (None: empty, or not row-contiguous), as DLPack would read
    it, without moving any buffer (raises where the kernel cannot be built)."""
    outs, at = [], []
    for i, a in enumerate(arrays):
        if a.nbytes == 0:
            continue
        (o,) = _kernel(a.ndim == 0)(inputs=[a], grid=(1, 1, 1), threadgroup=(1, 1, 1), output_shapes=[(2,)],
                                    output_dtypes=[mx.uint64])  # fmt: skip
        outs.append(o)
        at.append(i)
    got: list[int | None] = [None] * len(arrays)
    if outs:
        values = np.array(mx.stack(outs)).tolist()
        for i, (ptr, dense) in zip(at, values, strict=True):
            got[i] = int(ptr) if dense else None
    return got
