"""compressor_rows on CUDA: one block per row (state write + pooling + RMSNorm + RoPE), then 3 scatters.

The kernel reads each row's state from the slot pool through its slot id (no gathered copy) and
emits: the row's new state rows (CSA: all 2m rows after the write and the overlap roll; HCA: only
the written row), the new entry in the pool dtype (zeros for rows that do not emit) and the flat
destinations. `put_along_axis` then writes them into the slot and page pools (in place when MLX
can donate the buffers). Rows that do not emit skip the pooling and write to the trash page 0.
All float dtypes are supported (the arithmetic is f32 as in the reference).
"""

from __future__ import annotations

import mlx.core as mx

from kernels.compressor import check_compressor
from kernels.cuda.common import check_once, f32_params, kernel
from kernels.rows import RowBatch

THREADS = 256
INPUTS = ("slots", "positions", "q_rows", "table", "kv", "score", "ape", "norm",
          "kv_state", "score_state", "rcos", "rsin", "fparams")  # fmt: skip
OUTPUTS = ("rows_kv", "rows_s", "entry", "dest")

SOURCE = r"""
  constexpr int COFF = (M == 4) ? 2 : 1;
  constexpr int C = COFF * D;
  constexpr int R = COFF * M;
  __shared__ float xs[D];
  __shared__ float red[32];
  const int b = blockIdx.x;
  const int tid = threadIdx.x, nt = blockDim.x;
  const int slot = slots[b], p = positions[b], qr = q_rows[b];
  const int pm = p % M;
  const bool emit = pm == M - 1;
  const int newrow = (COFF - 1) * M + pm;
  const float* kvq = kv + (size_t)qr * C;
  const float* scq = score + (size_t)qr * C;
  const float* apr = ape + (size_t)pm * C;
  const float* kst = kv_state + (size_t)slot * R * C;
  const float* sst = score_state + (size_t)slot * R * C;
  if (COFF == 2) {
    float* okv = rows_kv + (size_t)b * R * C;
    float* os = rows_s + (size_t)b * R * C;
    for (int e = tid; e < R * C; e += nt) {
      const int r = e / C, c = e - r * C;
      const int src = (emit && r < M) ? r + M : r;
      float v, g;
      if (src == newrow) { v = kvq[c]; g = scq[c] + apr[c]; }
      else { v = kst[src * C + c]; g = sst[src * C + c]; }
      okv[e] = v;
      os[e] = g;
    }
  } else {
    for (int c = tid; c < C; c += nt) {
      rows_kv[(size_t)b * C + c] = kvq[c];
      rows_s[(size_t)b * C + c] = scq[c] + apr[c];
    }
  }
  if (tid == 0) {
    const int tw = table_shape[1];
    const int w = p / M;
    const int col = min(w / PAGE, tw - 1);
    const int pg = emit ? table[b * tw + col] : 0;
    dest[2 * b] = (COFF == 2) ? slot : slot * M + pm;
    dest[2 * b + 1] = pg * PAGE + (emit ? w % PAGE : 0);
  }
  T* ent = entry + (size_t)b * D;
  if (!emit) {
    for (int f = tid; f < D; f += nt) ent[f] = dsv4_t<T>(0.f);
    return;
  }
  float ssq = 0.f;
  for (int f = tid; f < D; f += nt) {
    float mx_ = -INFINITY, sum = 0.f, acc = 0.f;
    for (int j = 0; j < R; ++j) {
      const int col = (COFF == 2 && j >= M) ? D + f : f;
      float v, g;
      if (j == newrow) { v = kvq[col]; g = scq[col] + apr[col]; }
      else { v = kst[j * C + col]; g = sst[j * C + col]; }
      if (g == -INFINITY) continue;
      if (g > mx_) { const float s = expf(mx_ - g); sum *= s; acc *= s; mx_ = g; }
      const float e = expf(g - mx_);
      sum += e;
      acc += e * v;
    }
    const float x = dsv4_f(dsv4_t<T>(acc / sum));
    xs[f] = x;
    ssq += x * x;
  }
  for (int o = 16; o > 0; o >>= 1) ssq += __shfl_xor_sync(0xffffffffu, ssq, o);
  if ((tid & 31) == 0) red[tid >> 5] = ssq;
  __syncthreads();
  if (tid < 32) {
    float v = (tid < (nt >> 5)) ? red[tid] : 0.f;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (tid == 0) red[0] = v;
  }
  __syncthreads();
  const float inv = rsqrtf(red[0] / (float)D + fparams[0]);
  for (int f = tid; f < D; f += nt) xs[f] = dsv4_f(dsv4_t<T>(xs[f] * inv * norm[f]));
  __syncthreads();
  constexpr int BASE = D - 2 * HALF;
  for (int f = tid; f < D; f += nt) {
    float y = xs[f];
    if (f >= BASE) {
      const int i = (f - BASE) >> 1;
      const float co = rcos[(size_t)qr * HALF + i], si = rsin[(size_t)qr * HALF + i];
      if (((f - BASE) & 1) == 0) y = y * co - xs[f + 1] * si;
      else y = xs[f - 1] * si + y * co;
    }
    ent[f] = dsv4_t<T>(y);
  }
"""


def template(pool: mx.array, ratio: int, head_dim: int, half: int, page: int) -> list:
    return [("T", pool.dtype), ("M", ratio), ("D", head_dim), ("HALF", half), ("PAGE", page)]


def compressor_rows_cuda(
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
) -> tuple[mx.array, mx.array, mx.array]:
    check_once(
        "compressor_rows", batch, (kv, score, ape, norm, kv_state, score_state, pool, cos, sin),
        (ratio, head_dim, eps, type(ratio), type(head_dim), type(eps)),
        lambda: check_compressor(
            batch, kv, score, ape, norm, kv_state, score_state, pool,
            ratio=ratio, head_dim=head_dim, eps=eps, cos=cos, sin=sin,
        ),
    )  # fmt: skip
    coff = 2 if ratio == 4 else 1
    m, d, b, page = ratio, head_dim, batch.size, batch.page_size
    c = coff * d
    ro = coff * m if coff == 2 else 1
    k = kernel("compressor", INPUTS, OUTPUTS, SOURCE)
    rows_kv, rows_s, entry, dest = k(
        inputs=[batch.slots, batch.positions, batch.q_rows, batch.tables[ratio], kv, score, ape,
                norm.astype(mx.float32), kv_state, score_state, cos, sin, f32_params(eps)],
        template=template(pool, ratio, head_dim, cos.shape[1], page),
        grid=(b * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(b, ro, c), (b, ro, c), (b, d), (b, 2)],
        output_dtypes=[mx.float32, mx.float32, pool.dtype, mx.int32],
    )  # fmt: skip
    if coff == 2:
        where = batch.slots[:, None, None]
        new_kv = mx.put_along_axis(kv_state, where, rows_kv, axis=0)
        new_s = mx.put_along_axis(score_state, where, rows_s, axis=0)
    else:
        s = kv_state.shape[0]
        row = dest[:, 0:1]
        new_kv = mx.put_along_axis(kv_state.reshape(s * m, c), row, rows_kv.reshape(b, c), axis=0)
        new_s = mx.put_along_axis(score_state.reshape(s * m, c), row, rows_s.reshape(b, c), axis=0)
        new_kv, new_s = new_kv.reshape(kv_state.shape), new_s.reshape(score_state.shape)
    flat = pool.reshape(pool.shape[0] * page, d)
    new_pool = mx.put_along_axis(flat, dest[:, 1:2], entry, axis=0).reshape(pool.shape)
    return new_kv, new_s, new_pool
