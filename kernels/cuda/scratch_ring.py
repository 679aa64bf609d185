"""A chained batch's scratch ring on CUDA (kernels/sparse_attention.py `scratch_ring`, its twin): out [B, W, D],
row b's window ring as the single step at its position reads it: ring row j from the step's own keys (`tail`,
q row of batch row b - d) where it holds one of the slot's positions the step feeds (d = (p - j) mod W at most the
row's rank among its slot's adjacent rows), else the slot's ring as before the step. One launch, a block row a
batch row, 16 bytes a copy where the rows allow; the chain read from the slots themselves (a row's rank: the
adjacent rows before it of its slot), so one launch serves every chain pattern of a row count (a graph's replay).
"""

from __future__ import annotations

import mlx.core as mx

from dsv4_serve.kernels.cuda.common import kernel
from dsv4_serve.kernels.rows import RowBatch

THREADS = 256
BLOCKS = 8  # blocks a batch row: W x D x 2 bytes is 128 KB for V4 (W 128, D 512, bf16)

SOURCE = r"""
  const int b = blockIdx.y;
  const int W = window_shape[1];
  const int slot = slots[b], p = positions[b];
  int rank = 0;
  while (rank < b && slots[b - rank - 1] == slot) ++rank;
  const size_t tid = (size_t)blockIdx.x * blockDim.x + threadIdx.x, step = (size_t)gridDim.x * blockDim.x;
  constexpr int V = (D * sizeof(T)) % 16 == 0 ? 16 / sizeof(T) : 1;  // elements a copy
  constexpr int DV = D / V;
  for (size_t i = tid; i < (size_t)W * DV; i += step) {
    const int j = (int)(i / DV), k = (int)(i % DV) * V;
    const int d = (int)((((long long)p - j) % W + W) % W);  // p minus the position ring row j holds for row b
    const T* src = d <= rank ? tail + (size_t)q_rows[b - d] * D + k : window + ((size_t)slot * W + j) * D + k;
    T* dst = out + ((size_t)b * W + j) * D + k;
    if (V > 1) *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
    else *dst = *src;
  }
"""


def scratch_ring_cuda(batch: RowBatch, window: mx.array, tail: mx.array) -> mx.array:
    """The twin's contract (checked by the caller: the batch against `window`, `tail` [Bq, D] in its dtype)."""
    b, w, d = batch.size, window.shape[1], window.shape[2]
    (out,) = kernel("scratch_ring", ("slots", "positions", "q_rows", "window", "tail"), ("out",), SOURCE)(
        inputs=[batch.slots, batch.positions, batch.q_rows, window, tail], template=[("T", window.dtype), ("D", d)],
        grid=(BLOCKS * THREADS, b, 1), threadgroup=(THREADS, 1, 1), output_shapes=[(b, w, d)],
        output_dtypes=[window.dtype],
    )  # fmt: skip
    return out
