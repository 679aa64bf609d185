"""write_rows on CUDA: rows of a state pool written into the pool's own buffer (kernels/pool_rows.py).

One launch: a grid-stride loop over (row, 16-byte word) pairs, `uint4` stores where both rows are 16-byte
aligned (every pool row of V4's dims is: 512 or 128 bf16), element by element otherwise; the same threads copy
`carry` into the token. The pool is an input written through a `const_cast`, as the in-place compressor writes
its pages: its Python array and buffer stay the same, and the token (complete only when the launch is) orders
the readers. A row id outside the pool writes nothing.

`write_slots` on CUDA: one launch for up to MAX_POOLS pools (a slot's reset, load or copy: V4-Flash's 167 per-slot
arrays in two launches where each was a `write_rows` of its own, ~50 us of the host's time each on the H200's
host). Block row y copies values[y]'s bytes over pool y's slot (its b x d elements: one contiguous range of the
row-major pool), 16 bytes a store where both ends allow. The pools' sizes are baked into the source (a kernel a
layout, made once), so no shape is passed: the parameters stay 2 x MAX_POOLS pointers, well under CUDA's 4 KB.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import mlx.core as mx

from dsv4_serve.kernels.cuda.common import TOKEN_WORDS, kernel
from dsv4_serve.kernels.pool_rows import check_write_rows, check_write_slots
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
        threadgroup=(THREADS, 1, 1), output_shapes=[(max(TOKEN_WORDS, carry.shape[0]),)], output_dtypes=[mx.int32],
    )  # fmt: skip  (the token carries `carry` in its first words; TOKEN_WORDS: device memory)
    return pool, token


MAX_POOLS = 96  # pools a write_slots launch (2 pointers each: 1.5 KB of parameters)
SLOTS_BLOCKS = 16  # blocks a pool: a slot's rows are at most a few hundred KB

SLOTS_COPY = r"""
  const size_t tid = (size_t)blockIdx.x * blockDim.x + threadIdx.x, step = (size_t)gridDim.x * blockDim.x;
  const int s = slot[0];
  if (tid == 0 && blockIdx.y == 0) token[0] = s;
  char* dst = nullptr; const char* src = nullptr; size_t n = 0;
  switch (blockIdx.y) {
%s
    default: return;
  }
  if ((n & 15) == 0 && (((size_t)dst | (size_t)src) & 15) == 0) {
    uint4* d = reinterpret_cast<uint4*>(dst);
    const uint4* v = reinterpret_cast<const uint4*>(src);
    for (size_t i = tid; i < n / 16; i += step) d[i] = v[i];
  } else {
    for (size_t i = tid; i < n; i += step) dst[i] = src[i];
  }
"""


@functools.cache
def slots_source(layout: tuple[tuple[int, int], ...]) -> str:
    """The kernel for pools of (slots, bytes a slot) each: pool y's slot s is bytes [s * n_y, (s + 1) * n_y). Made
    once a layout (~40 us of string building for 96 pools, and a new string's hash at each `kernel` lookup)."""
    cases = "\n".join(
        f"    case {y}: if (s < {a}) {{ dst = const_cast<char*>(reinterpret_cast<const char*>(pool{y})) + (size_t)s * "
        f"{n}; src = reinterpret_cast<const char*>(val{y}); n = {n}; }} break;"
        for y, (a, n) in enumerate(layout)
    )
    return SLOTS_COPY % cases


def write_slots_cuda(pools: Sequence[mx.array], slot: int, values: Sequence[mx.array]
                     ) -> tuple[list[mx.array], mx.array | None]:  # fmt: skip
    check_write_slots(pools, slot, values)
    at = upload([slot])  # cached by content
    tokens = []
    for lo in range(0, len(pools), MAX_POOLS):
        ps, vs = list(pools[lo:lo + MAX_POOLS]), list(values[lo:lo + MAX_POOLS])
        layout = tuple((p.shape[0], p.shape[1] * p.shape[2] * p.dtype.size) for p in ps)
        names = tuple(f"pool{y}" for y in range(len(ps))) + tuple(f"val{y}" for y in range(len(ps))) + ("slot",)
        words = max(n for _, n in layout) // 16 + 1
        blocks = max(1, min(SLOTS_BLOCKS, -(-words // THREADS)))
        (token,) = kernel(f"write_slots{len(ps)}", names, ("token",), slots_source(layout))(
            inputs=[*ps, *vs, at], template=[], grid=(blocks * THREADS, len(ps), 1), threadgroup=(THREADS, 1, 1),
            output_shapes=[(TOKEN_WORDS,)], output_dtypes=[mx.int32],  # device memory (common.TOKEN_WORDS)
        )  # fmt: skip
        tokens.append(token)
    return list(pools), tokens[0] if len(tokens) == 1 else mx.concatenate(tokens)
