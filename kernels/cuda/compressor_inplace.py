"""compressor_rows_inplace on CUDA: one launch, the state and the new entries written in place.

One block per batch row writes the token's row into its slot of `kv_state` / `score_state`, and when
the row's window completes pools it (per-feature softmax over the window, the CSA overlap), RMSNorms
and RoPEs the entry, writes it into its page of `pool`, and rolls the CSA window. All three arrays
are the kernel's *inputs*, written through their buffers (MLX does not see it): no scatter, no copy
of a slot pool, and the pools no longer depend on MLX donating their buffers (a step queued ahead of
the previous one's read-back keeps those referenced until the GPU is done with them). The kernel's
one output is a 1-element token; the arrays' readers take it (`after=`), which gives their CUDA-graph
nodes an edge from this one. The arithmetic is kernels/cuda/compressor.py's (f32, as the reference).
The three arrays must be row-contiguous (StatePools' are): MLX copies any other input for the kernel,
and the writes would land in the copy.
"""

from __future__ import annotations

import mlx.core as mx

from kernels.cuda import common
from kernels.cuda.common import f32_params, i32_dummy, kernel, plan_cached
from kernels.cuda.compressor import NORM_ROPE, THREADS, key_and_check, template
from kernels.rows import RowBatch, check_after, checked

INPUTS = ("slots", "positions", "q_rows", "table", "kv", "score", "ape", "norm",
          "kv_state", "score_state", "pool", "rcos", "rsin", "fparams", "after")  # fmt: skip

SOURCE = (
    r"""
  constexpr int COFF = (M == 4) ? 2 : 1;
  constexpr int C = COFF * D;
  constexpr int R = COFF * M;
  constexpr int RC = R * C;
  __shared__ float xs[D];
  __shared__ float red[32];
  const int b = blockIdx.x, tid = threadIdx.x, nt = blockDim.x;
  if (b == 0 && tid == 0) token[0] = 0;
  const int slot = slots[b], p = positions[b], qr = q_rows[b];
  const int pm = p % M;
  const bool emit = pm == M - 1;
  const int newrow = (COFF - 1) * M + pm;
  const float* kvq = kv + (size_t)qr * C;
  const float* scq = score + (size_t)qr * C;
  const float* apr = ape + (size_t)pm * C;
  // in place (the op's contract): every state read and write goes through these pointers
  float* kst = const_cast<float*>(kv_state) + (size_t)slot * RC;
  float* sst = const_cast<float*>(score_state) + (size_t)slot * RC;
  for (int c = tid; c < C; c += nt) {
    kst[newrow * C + c] = kvq[c];
    sst[newrow * C + c] = scq[c] + apr[c];
  }
  if (!emit) return;
  __syncthreads();  // the new row is in the state for the whole block
  const int tw = table_shape[1];
  const int w = p / M;
  T* ent = const_cast<T*>(pool) + ((size_t)table[b * tw + w / PAGE] * PAGE + w % PAGE) * D;  // entry w's place
  // Pool: softmax over the window's rows per feature (max, then sum / weighted sum), as
  // mx.softmax(precise=True); CSA rows >= M take the second half of the features.
  float ssq = 0.f;
  for (int f = tid; f < D; f += nt) {
    float mx_ = -INFINITY;
#pragma unroll 8
    for (int j = 0; j < R; ++j) mx_ = fmaxf(mx_, sst[j * C + ((COFF == 2 && j >= M) ? D + f : f)]);
    float sum = 0.f, acc = 0.f;
#pragma unroll 8
    for (int j = 0; j < R; ++j) {
      const int col = (COFF == 2 && j >= M) ? D + f : f;
      const float e = expf(sst[j * C + col] - mx_);
      sum += e;
      acc += e * kst[j * C + col];
    }
    const float x = dsv4_f(dsv4_t<T>(acc / sum));
    xs[f] = x;
    ssq += x * x;
  }
"""
    + NORM_ROPE
    + r"""  if (COFF == 2) {  // CSA: the window just pooled becomes "previous" (rows M..2M-1 stay, stale)
    for (int e = tid; e < M * C; e += nt) { kst[e] = kst[M * C + e]; sst[e] = sst[M * C + e]; }
  }
"""
)


class Plan:
    """Launch parameters of one (batch shape, argument shapes) combination, computed once."""

    __slots__ = ("compiled", "fparams", "grid", "kernel", "template")

    def __init__(self, b: int, pool: mx.array, norm: mx.array, ratio: int, head_dim: int, half: int, page: int,
                 eps: float) -> None:  # fmt: skip
        self.fparams = f32_params(eps)
        self.kernel = kernel("compressor_inplace", INPUTS, ("token",), SOURCE)
        self.template = template(pool.dtype, norm.dtype, ratio, head_dim, half, page, False)
        self.grid = (b * THREADS, 1, 1)
        self.compiled = mx.compile(self.launch)

    def launch(self, *inputs: mx.array) -> mx.array:
        return self.kernel(inputs=list(inputs), template=self.template, grid=self.grid, threadgroup=(THREADS, 1, 1),
                           output_shapes=[(1,)], output_dtypes=[mx.int32])[0]  # fmt: skip


def compressor_rows_inplace_cuda(
    batch: RowBatch,
    kv: mx.array,
    score: mx.array,
    ape: mx.array,
    norm: mx.array,
    kv_state: mx.array,
    score_state: mx.array,
    pool: mx.array,
    *,
    ratio: int,
    head_dim: int,
    eps: float,
    cos: mx.array,
    sin: mx.array,
    after: mx.array | None = None,
) -> tuple[mx.array, mx.array, mx.array, mx.array | None]:
    check_after("compressor_rows", after)
    key, check = key_and_check("compressor_rows_inplace", batch, kv, score, ape, norm, kv_state, score_state, pool,
                               ratio=ratio, head_dim=head_dim, eps=eps, cos=cos, sin=sin)  # fmt: skip

    def make() -> Plan:
        pk = key + (batch.size, batch.page_size, batch.tables[ratio].shape)
        return plan_cached(pk, lambda: Plan(batch.size, pool, norm, ratio, head_dim, cos.shape[1], batch.page_size,
                                            eps))  # fmt: skip

    plan: Plan = checked(batch, key, check, make)
    run = plan.compiled if common.COMPILE else plan.launch
    token = run(batch.slots, batch.positions, batch.q_rows, batch.tables[ratio], kv, score, ape, norm, kv_state,
                score_state, pool, cos, sin, plan.fparams, i32_dummy((1,)) if after is None else after)  # fmt: skip
    return kv_state, score_state, pool, token
