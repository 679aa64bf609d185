"""write_rows on CUDA: rows of a state pool written into the pool's own buffer (kernels/pool_rows.py).

One launch: a grid-stride loop over (row, 16-byte word) pairs, `uint4` stores where both rows are 16-byte
aligned (every pool row of V4's dims is: 512 or 128 bf16), element by element otherwise; the same threads copy
`carry` into the token. The pool is an input written through a `const_cast`, as the in-place compressor writes
its pages: its Python array and buffer stay the same, and the token (complete only when the launch is) orders
the readers. A row id outside the pool writes nothing.
"""

from __future__ import annotations

import mlx.core as mx

from dsv4_serve.kernels.cuda.common import kernel
from dsv4_serve.kernels.pool_rows import check_write_rows
from dsv4_serve.kernels.upload import upload

THREADS = 256
MAX_BLOCKS = 1024

# pool_shape / rows_shape by value (MLX passes an input's shape when the source names it: no memory read)
SOURCE = r"""
  const size_t nrows = (size_t)pool_shape[0] * (size_t)pool_shape[1], e_n = (size_t)rows_shape[0];
  const size_t tid = (size_t)blockIdx.x * blockDim.x + threadIdx.x, step = (size_t)gridDim.x * blockDim.x;
  T* dst = const_cast<T*>(pool);
  constexpr size_t BYTES = (size_t)D * sizeof(T);
  if (BYTES % 16 == 0 && ((reinterpret_cast<size_t>(dst) | reinterpret_cast<size_t>(values)) & 15) == 0) {
    constexpr size_t WORDS = BYTES / 16;
    for (size_t i = tid; i < e_n * WORDS; i += step) {
      const size_t e = i / WORDS, w = i % WORDS;
      const int r = rows[e];
      if (r < 0 || (size_t)r >= nrows) continue;
      reinterpret_cast<uint4*>(dst + (size_t)r * D)[w] = reinterpret_cast<const uint4*>(values + e * D)[w];
    }
  } else {
    for (size_t i = tid; i < e_n * D; i += step) {
      const size_t e = i / D, k = i % D;
      const int r = rows[e];
      if (r < 0 || (size_t)r >= nrows) continue;
      dst[(size_t)r * D + k] = values[e * D + k];
    }
  }
  for (size_t i = tid; i < (size_t)carry_shape[0]; i += step) token[i] = carry[i];
"""


def write_rows_cuda(pool: mx.array, rows: mx.array, values: mx.array, carry: mx.array | None = None
                    ) -> tuple[mx.array, mx.array | None]:  # fmt: skip
    check_write_rows(pool, rows, values, carry)
    if not rows.shape[0]:
        return pool, carry
    if carry is None:
        carry = upload([1])
    d = pool.shape[2]
    words = max(rows.shape[0] * max(1, d * pool.dtype.size // 16), carry.shape[0])
    blocks = max(1, min(MAX_BLOCKS, -(-words // THREADS)))
    (token,) = kernel("write_rows", ("pool", "rows", "values", "carry"), ("token",), SOURCE)(
        inputs=[pool, rows, values, carry], template=[("T", pool.dtype), ("D", d)], grid=(blocks * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1), output_shapes=[carry.shape], output_dtypes=[mx.int32],
    )  # fmt: skip
    return pool, token
