"""compressor_rows on CUDA: one launch (state write + pooling + RMSNorm + RoPE) and one pool scatter.

Blocks `0..B-1` take one row each: they read the row's state from the slot pool through its slot
id (no gathered copy), pool the window when the row emits, and write the new entry in the pool
dtype (zeros for rows that do not emit) with its flat pool row (`page * PAGE + offset`, the trash
page 0 for rows that do not emit), broadcast over the entry so that `put_along_axis` needs no
extra op. The state update has two forms, picked by the size of the slot pools:
- `FULL` (slot pools of at most `FULL_BYTES` together, the usual case: a few slots): blocks
  `B..` copy the whole `kv_state` / `score_state` into the kernel's outputs with every batch row's
  write (and the CSA overlap roll) applied on the way. No scatter: 1 launch + 1 pool scatter.
- otherwise: the row blocks emit only the rows that change (CSA: the slot's 2m rows after the
  write and the roll; HCA: the written row) and two `put_along_axis` write them (in place when MLX
  can donate the buffers): 1 launch + 3 scatters.
All float dtypes are supported (the arithmetic is f32 as in the reference).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx

from dsv4_serve.kernels.compressor import check_compressor
from dsv4_serve.kernels.cuda import common
from dsv4_serve.kernels.cuda.common import f32_params, kernel, plan_cached
from dsv4_serve.kernels.rows import RowBatch, checked

THREADS = 256
CHUNK = THREADS * 8  # state floats per copy block
FULL_BYTES = 16 << 20  # kv_state + score_state at most this: copy them whole instead of scattering
FORCE_FULL: bool | None = None  # bench / tests: True or False forces one state-update form
INPUTS = ("slots", "positions", "q_rows", "table", "kv", "score", "ape", "norm",
          "kv_state", "score_state", "rcos", "rsin", "fparams")  # fmt: skip
OUTPUTS = ("st_kv", "st_s", "entry", "dest", "sidx")

# The pooled entry xs[D] (with each thread's sum of squares in ssq) -> RMSNorm * norm -> RoPE on the last
# 2 * HALF features -> ent[D], in the pool dtype; shared with compressor_inplace.SOURCE. `norm_rope` names
# where the weight of feature f, the RoPE row's cos / sin of pair i and eps come from.
_NORM_ROPE = r"""  for (int o = 16; o > 0; o >>= 1) ssq += __shfl_xor_sync(0xffffffffu, ssq, o);
  if ((tid & 31) == 0) red[tid >> 5] = ssq;
  __syncthreads();
  if (tid < 32) {
    float v = (tid < (nt >> 5)) ? red[tid] : 0.f;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (tid == 0) red[0] = v;
  }
  __syncthreads();
  const float inv = rsqrtf(red[0] / (float)D + EPS);
  for (int f = tid; f < D; f += nt) xs[f] = dsv4_f(dsv4_t<T>(xs[f] * inv * WEIGHT));
  __syncthreads();
  constexpr int BASE = D - 2 * HALF;
  for (int f = tid; f < D; f += nt) {
    float y = xs[f];
    if (f >= BASE) {
      const int i = (f - BASE) >> 1;
      const float co = COS, si = SIN;
      if (((f - BASE) & 1) == 0) y = y * co - xs[f + 1] * si;
      else y = xs[f - 1] * si + y * co;
    }
    ent[f] = dsv4_t<T>(y);
  }
"""


def norm_rope(weight: str, cos: str, sin: str, eps: str) -> str:
    """_NORM_ROPE with its sources: C expressions of feature `f`'s weight, pair `i`'s cos and sin, and eps."""
    return _NORM_ROPE.replace("WEIGHT", weight).replace("COS", cos).replace("SIN", sin).replace("EPS", eps)

SOURCE = r"""
  constexpr int COFF = (M == 4) ? 2 : 1;
  constexpr int C = COFF * D;
  constexpr int R = COFF * M;
  constexpr int RC = R * C;
  __shared__ float xs[D];
  __shared__ float red[32];
  const int NB = slots_shape[0];
  const int tid = threadIdx.x, nt = blockDim.x;
  if (FULL && (int)blockIdx.x >= NB) {
    // copy block: elements [e0, e1) of slot s, with the batch row's write applied if s is in the batch
    constexpr int CPS = (RC + CHUNK - 1) / CHUNK;
    const int k = blockIdx.x - NB;
    const int s = k / CPS, e0 = (k - s * CPS) * CHUNK;
    const int e1 = min(RC, e0 + CHUNK);
    int kb = -1;
    for (int i = 0; i < NB; ++i) if (slots[i] == s) kb = i;
    const float* ksrc = kv_state + (size_t)s * RC;
    const float* ssrc = score_state + (size_t)s * RC;
    float* kdst = st_kv + (size_t)s * RC;
    float* sdst = st_s + (size_t)s * RC;
    if (kb < 0) {
      for (int e = e0 + tid; e < e1; e += nt) { kdst[e] = ksrc[e]; sdst[e] = ssrc[e]; }
      return;
    }
    const int p = positions[kb], qr = q_rows[kb];
    const int pm = p % M;
    const bool emit = pm == M - 1;
    const int newrow = (COFF - 1) * M + pm;
    const float* kvq = kv + (size_t)qr * C;
    const float* scq = score + (size_t)qr * C;
    const float* apr = ape + (size_t)pm * C;
    for (int e = e0 + tid; e < e1; e += nt) {
      const int r = e / C, c = e - r * C;
      const int src = (COFF == 2 && emit && r < M) ? r + M : r;
      if (src == newrow) { kdst[e] = kvq[c]; sdst[e] = scq[c] + apr[c]; }
      else { kdst[e] = ksrc[src * C + c]; sdst[e] = ssrc[src * C + c]; }
    }
    return;
  }
  const int b = blockIdx.x;
  const int slot = slots[b], p = positions[b], qr = q_rows[b];
  const int pm = p % M;
  const bool emit = pm == M - 1;
  const int newrow = (COFF - 1) * M + pm;
  const float* kvq = kv + (size_t)qr * C;
  const float* scq = score + (size_t)qr * C;
  const float* apr = ape + (size_t)pm * C;
  const float* kst = kv_state + (size_t)slot * RC;
  const float* sst = score_state + (size_t)slot * RC;
  if (!FULL) {
    if (COFF == 2) {  // the slot's 2m rows after the write and the roll
      float* okv = st_kv + (size_t)b * RC;
      float* os = st_s + (size_t)b * RC;
      for (int e = tid; e < RC; e += nt) {
        const int r = e / C, c = e - r * C;
        const int src = (emit && r < M) ? r + M : r;
        if (src == newrow) { okv[e] = kvq[c]; os[e] = scq[c] + apr[c]; }
        else { okv[e] = kst[src * C + c]; os[e] = sst[src * C + c]; }
      }
    } else {  // the written row only
      for (int c = tid; c < C; c += nt) {
        st_kv[(size_t)b * C + c] = kvq[c];
        st_s[(size_t)b * C + c] = scq[c] + apr[c];
      }
    }
    if (tid == 0) sidx[b] = (COFF == 2) ? slot : slot * M + pm;
  }
  {
    const int tw = table_shape[1];
    const int w = p / M;
    const int col = min(w / PAGE, tw - 1);
    const int pg = emit ? table[b * tw + col] : 0;
    const int flat = pg * PAGE + (emit ? w % PAGE : 0);
    for (int f = tid; f < D; f += nt) dest[(size_t)b * D + f] = flat;
  }
  T* ent = entry + (size_t)b * D;
  if (!emit) {
    for (int f = tid; f < D; f += nt) ent[f] = dsv4_t<T>(0.f);
    return;
  }
  // Pool: softmax over the window's rows per feature (two passes: max, then sum / weighted sum;
  // every row's loads are independent, so they pipeline), as mx.softmax(precise=True).
  float ssq = 0.f;
  for (int f = tid; f < D; f += nt) {
    float mx_ = -INFINITY;
#pragma unroll 8
    for (int j = 0; j < R; ++j) {
      const int col = (COFF == 2 && j >= M) ? D + f : f;
      const float g = (j == newrow) ? scq[col] + apr[col] : sst[j * C + col];
      mx_ = fmaxf(mx_, g);
    }
    float sum = 0.f, acc = 0.f;
#pragma unroll 8
    for (int j = 0; j < R; ++j) {
      const int col = (COFF == 2 && j >= M) ? D + f : f;
      float v, g;
      if (j == newrow) { v = kvq[col]; g = scq[col] + apr[col]; }
      else { v = kst[j * C + col]; g = sst[j * C + col]; }
      const float e = expf(g - mx_);
      sum += e;
      acc += e * v;
    }
    const float x = dsv4_f(dsv4_t<T>(acc / sum));
    xs[f] = x;
    ssq += x * x;
  }
""" + norm_rope("dsv4_f(norm[f])", "rcos[(size_t)qr * HALF + i]", "rsin[(size_t)qr * HALF + i]", "fparams[0]")



def template(pool_dtype: mx.Dtype, norm_dtype: mx.Dtype, ratio: int, head_dim: int, half: int, page: int,
             full: bool) -> list[tuple[str, Any]]:  # fmt: skip
    return [("T", pool_dtype), ("N", norm_dtype), ("M", ratio), ("D", head_dim), ("HALF", half), ("PAGE", page),
            ("FULL", full), ("CHUNK", CHUNK)]  # fmt: skip


def variant(full: bool) -> tuple[tuple[str, ...], str]:
    """Output names and source of a state-update form. `FULL` has no slot-row output (`sidx`): each
    output costs MLX about 2 us of host time per launch."""
    if full:
        return OUTPUTS[:4], "int* const sidx = nullptr;\n" + SOURCE
    return OUTPUTS, SOURCE


def use_full(slots: int, ratio: int, head_dim: int) -> bool:
    coff = 2 if ratio == 4 else 1
    return 2 * slots * (coff * ratio) * (coff * head_dim) * 4 <= FULL_BYTES


class Plan:
    """Launch parameters of one (batch shape, argument shapes) combination, computed once."""

    __slots__ = ("compiled", "fparams", "full", "grid", "kernel", "out_dtypes", "out_shapes", "ratio", "template")

    def __init__(self, b: int, s: int, pool: mx.array, norm: mx.array, ratio: int, head_dim: int, half: int,
                 page: int, eps: float, full: bool) -> None:  # fmt: skip
        coff = 2 if ratio == 4 else 1
        r, c, d = coff * ratio, coff * head_dim, head_dim
        self.full = full
        self.ratio = ratio
        self.fparams = f32_params(eps)
        self.compiled = mx.compile(self.launch)
        outs, src = variant(full)
        self.kernel = kernel("compressor_full" if full else "compressor", INPUTS, outs, src)
        self.template = template(pool.dtype, norm.dtype, ratio, head_dim, half, page, self.full)
        if self.full:
            blocks = b + s * (-(-(r * c) // CHUNK))
            st = [(s, r, c), (s, r, c)]
        else:
            blocks = b
            st = [(b, r, c), (b, r, c)] if coff == 2 else [(b, c), (b, c)]
        self.grid = (blocks * THREADS, 1, 1)
        self.out_shapes = st + [(b, d), (b, d)] + ([] if full else [(b, 1)])
        self.out_dtypes = [mx.float32, mx.float32, pool.dtype, mx.int32] + ([] if full else [mx.int32])

    def launch(self, slots: mx.array, positions: mx.array, q_rows: mx.array, table: mx.array, kv: mx.array,
               score: mx.array, ape: mx.array, norm: mx.array, kv_state: mx.array, score_state: mx.array,
               pool: mx.array, cos: mx.array, sin: mx.array, fparams: mx.array) -> tuple[mx.array, ...]:  # fmt: skip
        st_kv, st_s, entry, dest, *sidx = self.kernel(
            inputs=[slots, positions, q_rows, table, kv, score, ape, norm, kv_state, score_state, cos, sin, fparams],
            template=self.template,
            grid=self.grid,
            threadgroup=(THREADS, 1, 1),
            output_shapes=self.out_shapes,
            output_dtypes=self.out_dtypes,
        )
        if self.full:
            new_kv, new_s = st_kv, st_s
        elif self.ratio == 4:
            where = slots[:, None, None]
            new_kv = mx.put_along_axis(kv_state, where, st_kv, axis=0)
            new_s = mx.put_along_axis(score_state, where, st_s, axis=0)
        else:
            s, c = kv_state.shape[0] * self.ratio, kv_state.shape[2]
            new_kv = mx.put_along_axis(kv_state.reshape(s, c), sidx[0], st_kv, axis=0).reshape(kv_state.shape)
            new_s = mx.put_along_axis(score_state.reshape(s, c), sidx[0], st_s, axis=0).reshape(score_state.shape)
        p = pool.shape
        new_pool = mx.put_along_axis(pool.reshape(p[0] * p[1], p[2]), dest, entry, axis=0).reshape(p)
        return new_kv, new_s, new_pool


def key_and_check(op: str, batch: RowBatch, kv: mx.array, score: mx.array, ape: mx.array, norm: mx.array,
                  kv_state: mx.array, score_state: mx.array, pool: mx.array, *, ratio: int, head_dim: int, eps: float,
                  cos: mx.array, sin: mx.array, chains: bool = False
                  ) -> tuple[tuple[Any, ...], Callable[[], None]]:  # fmt: skip
    """A compressor call's `rows.checked` key (`op`, the scalars with their types, every argument's shape and
    dtype) and its contract check. An argument that is not an array: the check runs now and names it. `chains`:
    a chained batch is taken (a launch a round, compressor_inplace.py's ROUND)."""

    def check() -> None:
        check_compressor(
            batch, kv, score, ape, norm, kv_state, score_state, pool,
            ratio=ratio, head_dim=head_dim, eps=eps, cos=cos, sin=sin, chains=chains,
        )  # fmt: skip

    try:
        key: tuple[Any, ...] = (
            op, chains, type(ratio), ratio, type(head_dim), head_dim, type(eps), eps,
            kv.shape, kv.dtype, score.shape, score.dtype, ape.shape, ape.dtype, norm.shape, norm.dtype,
            kv_state.shape, kv_state.dtype, score_state.shape, score_state.dtype, pool.shape, pool.dtype,
            cos.shape, cos.dtype, sin.shape, sin.dtype,
        )  # fmt: skip
    except AttributeError:
        check()
        raise
    return key, check


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
    key, check = key_and_check("compressor_rows", batch, kv, score, ape, norm, kv_state, score_state, pool,
                               ratio=ratio, head_dim=head_dim, eps=eps, cos=cos, sin=sin)  # fmt: skip

    def make(full: bool | None = None) -> Plan:
        if full is None:
            full = use_full(kv_state.shape[0], ratio, head_dim)
        pk = key + (batch.size, batch.page_size, batch.tables[ratio].shape, full)
        return plan_cached(pk, lambda: Plan(batch.size, kv_state.shape[0], pool, norm, ratio, head_dim,
                                            cos.shape[1], batch.page_size, eps, full))  # fmt: skip

    plan: Plan = checked(batch, key, check, make)
    if FORCE_FULL is not None and plan.full != FORCE_FULL:
        plan = make(FORCE_FULL)
    run = plan.compiled if common.COMPILE else plan.launch
    return run(batch.slots, batch.positions, batch.q_rows, batch.tables[ratio], kv, score, ape, norm,
               kv_state, score_state, pool, cos, sin, plan.fparams)  # fmt: skip
