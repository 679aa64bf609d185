"""Host data into device memory without a GPU page fault (MLX's CUDA backend).

MLX's CUDA allocator (mlx/backend/cuda/allocator.cpp) keeps an array built from host data
(`mx.array(list / numpy)`) in CUDA managed memory, and every array of at most 8 bytes in a small
managed pool that the GPU maps without migrating. Measured on the H200 (bench/memloc.py, clock64 of
a kernel's first read): a freshly host-written managed array 50-550 us (a page fault and migration,
paid by the first kernel that reads it), the small pool ~1.4 us (over the host link, every read),
device memory ~0.2 us. A decode step builds its rows' arrays (slots, positions, q rows, block tables)
and its tokens on the host every step.

`upload(values)`: the values in device memory. On CUDA a short array goes as 8-byte pieces (the small
pool: no fault) that one kernel writes into a device buffer; a long one (block tables) as one managed
array that a kernel copies (one fault). Results are cached by content: slots, q rows and block tables
repeat from step to step, so a steady decode step uploads its positions and tokens only. Elsewhere
(CPU, `DSV4_UPLOAD=0`) it is `mx.array(values)`. Effect on the H200 (2026-11-30, 51e7ab5): the attention kernels'
blocks no longer wait ~14 us for the rows' arrays before their first key (bench/phases.py: dsplit
33 -> 15 us, `wide` 16.5 -> 10.8 us); bench/step.py, 4 layers, 4K: 5.42 -> 5.24 ms at 1 row.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from typing import Any

import mlx.core as mx
import numpy as np

from dsv4_serve.kernels.backend import cuda_available

MAX_PIECES = 32  # pieces of 2 values; longer arrays: one managed array (one fault), then cached
# kernel variants by piece count (the rest padded with a zero piece); at least 2: an output of 8 bytes would
# land in the small pool again
BUCKETS = (2, 4, 8, 16, MAX_PIECES)
CACHE_SIZE = 256
ENABLED = os.environ.get("DSV4_UPLOAD", "1").strip() not in ("0", "")

# per thread: an array not evaluated yet belongs to its thread's stream (MLX raises on another thread)
_local = threading.local()
_kernels: dict[int, Any] = {}
_zero: dict[Any, mx.array] = {}


def _cache() -> OrderedDict[tuple[Any, ...], mx.array]:
    if not hasattr(_local, "cache"):
        _local.cache = OrderedDict()
    return _local.cache


def clear() -> None:
    """Forget this thread's uploads."""
    _cache().clear()


def _kernel(k: int) -> Any:
    """k piece inputs (2 values each; k == 0: one `src` of any length) -> `out` in device memory."""
    if k not in _kernels:
        if k == 0:
            names = ["src"]
            src = "for (int i = threadIdx.x + blockIdx.x * blockDim.x; i < src_shape[0]; i += blockDim.x * gridDim.x)" \
                  " out[i] = src[i];"  # fmt: skip
        else:
            names = [f"p{i}" for i in range(k)]
            cases = "".join(f"case {i}: out[t] = p{i}[t & 1]; break;\n" for i in range(k))
            src = f"const int t = threadIdx.x;\nswitch (t >> 1) {{\n{cases}}}"
        _kernels[k] = mx.fast.cuda_kernel(name=f"dsv4_upload_{k}", input_names=names, output_names=["out"],
                                          source=src, ensure_row_contiguous=True)  # fmt: skip
    return _kernels[k]


def _pieces(a: np.ndarray, dt: mx.Dtype) -> mx.array:
    n = a.size
    flat = np.zeros(n + (n & 1), a.dtype)
    flat[:n] = a.reshape(-1)
    ps = [mx.array(flat[i : i + 2]) for i in range(0, flat.size, 2)]  # 8 bytes each: MLX's small pool
    k = next(b for b in BUCKETS if b >= len(ps))
    if k > len(ps):
        if dt not in _zero:  # shared by every thread: evaluated here, not left on this thread's stream
            _zero[dt] = mx.zeros((2,), dt)
            mx.eval(_zero[dt])
        ps += [_zero[dt]] * (k - len(ps))
    return _kernel(k)(inputs=ps, grid=(2 * k, 1, 1), threadgroup=(2 * k, 1, 1), output_shapes=[(2 * k,)],
                      output_dtypes=[dt])[0]  # fmt: skip


def _copy(a: np.ndarray, dt: mx.Dtype) -> mx.array:
    src = mx.array(a.reshape(-1))  # managed: the copy kernel's first read faults it in, once
    return _kernel(0)(inputs=[src], grid=(min(a.size, 64 * 256), 1, 1), threadgroup=(256, 1, 1),
                      output_shapes=[(max(a.size, 4),)], output_dtypes=[dt])[0]  # fmt: skip


def upload(values: Any, dtype: mx.Dtype = mx.int32) -> mx.array:
    """`mx.array(values, dtype)` (int32, uint32 or float32), in device memory on CUDA (module doc)."""
    np_dt = {mx.int32: np.int32, mx.uint32: np.uint32, mx.float32: np.float32}[dtype]
    a = np.ascontiguousarray(values, dtype=np_dt)
    if not (ENABLED and a.size and cuda_available()):
        return mx.array(a)
    key = (a.dtype.str, a.shape, a.tobytes())
    cache = _cache()
    out = cache.get(key)
    if out is not None:
        cache.move_to_end(key)
        return out
    buf = _pieces(a, dtype) if a.size <= 2 * MAX_PIECES else _copy(a, dtype)
    out = buf if buf.shape == a.shape else buf[: a.size].reshape(a.shape)
    cache[key] = out
    if len(cache) > CACHE_SIZE:
        cache.popitem(last=False)
    return out


ROW_VALUES = 8  # the most values of an array of one value a row: kernels/rows.py MAX_ROWS (a test holds them equal)


def warm() -> None:
    """Build every upload kernel variant serving launches (start-up, not the first request): MLX builds one per
    piece count and input dtype. int32 (rows, tables, tokens): every count and the copy; uint32 (seeds, grammar
    masks) and float32 (sampling parameters): up to a value a row, and the copy. (On an H100 a float32 variant
    the warm-up missed was built in a request's path: 2026-12-07, c6e72db.)"""
    if not (ENABLED and cuda_available()):
        return
    row_pieces = next(b for b in BUCKETS if 2 * b >= ROW_VALUES)
    outs = []
    for dt, np_dt in ((mx.int32, np.int32), (mx.uint32, np.uint32), (mx.float32, np.float32)):
        counts = [b for b in BUCKETS if dt == mx.int32 or b <= row_pieces]
        outs += [upload(np.arange(2 * b, dtype=np_dt) + 7919, dt) for b in counts]
        outs.append(upload(np.arange(2 * MAX_PIECES + 1, dtype=np_dt) + 7919, dt))
    mx.eval(outs)
