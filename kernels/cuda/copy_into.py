"""copy_into on CUDA: one array's bytes written into another array's buffer in place, on MLX's stream.

The decode graphs keep each state pool's first buffer as its home (model/graph_step.py); an MLX write that could
not donate a pool leaves the pool's bytes in a new buffer, and they go back home before the next replay. Reading
the new buffer's address through DLPack would move it into a fresh managed allocation with a synchronous full copy
(MLX 0.32's `Buffer::raw_ptr` -> `move_to_unified_memory`), and prefetching that back to the GPU crosses the host
link: ~0.5 s a prefill at 7.7 GiB of state (docs/cuda_graphs.md#serving-at-full-depth). This kernel reads the new
buffer where MLX put it and writes the home in place (a `const_cast`: the caller holds the home and orders its
readers after, as every in-place kernel of kernels/cuda does), so nothing is exported.

No plain twin: on the CPU DLPack moves nothing, and the graphs run on CUDA only.
"""

from __future__ import annotations

import mlx.core as mx

from dsv4_serve.kernels.cuda.common import kernel

THREADS = 256
MAX_BLOCKS = 1024  # a grid-stride loop past this: enough blocks to keep every SM's loads in flight

# src_shape: [leading dim, its bytes a row] (MLX passes an input's shape by value when the source names it: no read
# of memory; its dims are int32, so a pool past 2 GiB could not be one flat dim).
SOURCE = r"""
  const size_t n = (size_t)src_shape[0] * (size_t)src_shape[1], words = n / 16;
  const size_t tid = (size_t)blockIdx.x * blockDim.x + threadIdx.x, step = (size_t)gridDim.x * blockDim.x;
  uint8_t* d8 = const_cast<uint8_t*>(dst);
  uint4* d = reinterpret_cast<uint4*>(d8);
  const uint4* s = reinterpret_cast<const uint4*>(src);
  for (size_t i = tid; i < words; i += step) d[i] = s[i];
  if (tid < n - words * 16) d8[words * 16 + tid] = src[words * 16 + tid];
  if (tid == 0) token[0] = 1;
"""


def _flat(a: mx.array) -> mx.array:
    """[leading dim, its bytes]: a view of the same buffer (the array is row-contiguous)."""
    return a.reshape(a.shape[0] if a.ndim else 1, -1).view(mx.uint8)


def copy_into(dst: mx.array, src: mx.array) -> mx.array:
    """Write `src`'s bytes into `dst`'s buffer; returns a 4-byte token to evaluate (the copy runs with it). Both
    evaluated, row-contiguous, of one size and dtype, each its own buffer start (16-byte aligned, as MLX allocates)."""
    if src.shape != dst.shape or src.dtype != dst.dtype:
        raise ValueError(f"copy_into: {src.shape} {src.dtype} into {dst.shape} {dst.dtype}")
    if src.nbytes == 0:
        return mx.zeros((1,), mx.int32)
    blocks = max(1, min(MAX_BLOCKS, -(-src.nbytes // (16 * THREADS))))
    (token,) = kernel("copy_into", ("dst", "src"), ("token",), SOURCE)(
        inputs=[_flat(dst), _flat(src)], grid=(blocks * THREADS, 1, 1), threadgroup=(THREADS, 1, 1),
        output_shapes=[(1,)], output_dtypes=[mx.int32],
    )  # fmt: skip
    return token
