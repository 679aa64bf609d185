"""sparse_attention_rows on CUDA: split-K flash decoding with tensor cores (1 or 2 launches).

1. `partial`: grid (splits, head groups of 16, rows). Heads-as-rows: a block holds its 16 heads'
   q rows [16, D] in shared memory and walks its range of 64-key chunks of the row's key list
   (window ring rows `0..W-1`, then the selected ids; invalid ones are never read, their keys are
   zero and masked). Per chunk: keys gathered through the slot id / block table into shared
   memory, S = Q K^T (wmma bf16/f16, f32 accumulation), an online softmax update, O += P V
   (wmma, O kept in shared memory in f32). Writes O [16, D] and (max, sum) per head. With one
   chunk per block (`ONE`) there is no O buffer: P V goes straight to the split's output, and
   two blocks fit on a multiprocessor.
2. `combine`: one block per (q-buffer row, head): merges the splits with the sink in the
   denominator, writes `q.dtype`; rows no batch row names get 0.
Rows of at most FINAL_CHUNKS chunks (sliding layers, short HCA) take one split: `final` is the
partial kernel over the q rows, normalizing with the sink itself (1 launch).
Fast path: q, window, pool of one 16-bit dtype, heads and D multiples of 16; else the reference.
"""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx

from kernels.cuda import common
from kernels.cuda.common import arange_rows, f32_params, i32_dummy, kernel, plan_cached
from kernels.rows import RowBatch, checked
from kernels.sparse_attention import check_sparse_attention, sparse_attention_rows_reference

HG, CK, THREADS = 16, 64, 256
TARGET_BLOCKS = 264  # about two blocks per multiprocessor on the H200 (132 SMs)
FINAL_CHUNKS = 3  # up to this many 64-key chunks per row: one block per (row, head group), no combine
PART_IN = ("slots", "positions", "q_rows", "table", "q", "window", "pool", "indices", "fparams", "sinks")
COMB_IN = ("q_rows", "opart", "ml", "sinks")

PARTIAL = r"""
  using namespace nvcuda;
  constexpr int LDK = D + 8, LDP = CK + 8, LDO = D + 4, VPR = D / 8, NWARP = 8;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* Qs = reinterpret_cast<T*>(smem_raw);
  T* Ks = Qs + HG * LDK;
  T* Ps = Ks + CK * LDK;
  float* Ss = reinterpret_cast<float*>(Ps + HG * LDP);
  float* mrun = Ss + 2 * HG * CK;
  float* lrun = mrun + HG;
  float* alpha = lrun + HG;
  long long* koff = reinterpret_cast<long long*>(alpha + HG + (HG & 1));
  int* kwin = reinterpret_cast<int*>(koff + CK);
  float* Os = reinterpret_cast<float*>(kwin + CK);  // [HG][LDO]; absent with ONE (one chunk per block)
  const int split = blockIdx.x, g = blockIdx.y;
  const int nsplit = gridDim.x;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int NH = q_shape[1], W = window_shape[1];
  //@FINAL
  // FINAL (one split): z runs over the q rows; rows no batch row names get zeros
  int b = -1;
  for (int i = 0; i < positions_shape[0]; ++i) if (q_rows[i] == (int)blockIdx.z) b = i;
  if (b < 0) {
    T* oz = out + ((size_t)blockIdx.z * NH + g * HG) * D;
    for (int i = tid; i < HG * D; i += THREADS) oz[i] = dsv4_t<T>(0.f);
    return;
  }
  //@SPLIT
  const int b = blockIdx.z;
  //@END
  const int KI = RATIO ? indices_shape[1] : 0;
  const int tw = table_shape[1];
  const int slot = slots[b], p = positions[b], qr = q_rows[b];
  const int nwin = min(p, W - 1) + 1;
  const int ncomp = RATIO ? (p / (RATIO ? RATIO : 1) + ((p % (RATIO ? RATIO : 1)) == RATIO - 1 ? 1 : 0)) : 0;
  const int nchunk = (W + KI + CK - 1) / CK;
  const int per = (nchunk + nsplit - 1) / nsplit;
  const int c0 = split * per, c1 = min(nchunk, c0 + per);
  const float scale = fparams[0];
  const uint4* qsrc = reinterpret_cast<const uint4*>(q + ((size_t)qr * NH + g * HG) * D);
  for (int i = tid; i < HG * VPR; i += THREADS) {
    const int h = i / VPR, v = i - h * VPR;
    *reinterpret_cast<uint4*>(Qs + h * LDK + v * 8) = qsrc[i];
  }
  if (!ONE) for (int i = tid; i < HG * LDO; i += THREADS) Os[i] = 0.f;
  if (tid < HG) { mrun[tid] = -INFINITY; lrun[tid] = 0.f; }
  for (int c = c0; c < c1; ++c) {
    __syncthreads();
    if (tid < CK) {
      const int j = c * CK + tid;
      long long off = -1;
      int win = 1;
      if (j < W) {
        if (j < nwin) off = ((long long)slot * W + j) * D;
      } else if (j < W + KI) {
        win = 0;
        const int id = indices[(size_t)qr * KI + (j - W)];
        if (id >= 0 && id < ncomp) {
          const int pg = table[b * tw + id / PAGE];
          off = ((long long)pg * PAGE + id % PAGE) * D;
        }
      }
      koff[tid] = off;
      kwin[tid] = win;
    }
    const int any = __syncthreads_or(tid < CK && koff[tid] >= 0);
    if (!any) continue;
    // keys by cp.async (no register staging; invalid ones zero-filled)
    for (int i = tid; i < CK * VPR; i += THREADS) {
      const int e = i / VPR, v = i - e * VPR;
      const long long off = koff[e];
      const T* src = (kwin[e] ? window : pool) + (off >= 0 ? off : 0) + v * 8;
      dsv4_cp16(Ks + e * LDK + v * 8, src, off >= 0 ? 16 : 0);
    }
    dsv4_cp_commit();
    dsv4_cp_wait<0>();
    __syncthreads();
    {
      const int kt = warp & 3, half = warp >> 2;
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
      wmma::fill_fragment(acc, 0.f);
      for (int ks = half * (D / 32); ks < (half + 1) * (D / 32); ++ks) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> fa;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> fb;
        wmma::load_matrix_sync(fa, Qs + ks * 16, LDK);
        wmma::load_matrix_sync(fb, Ks + kt * 16 * LDK + ks * 16, LDK);
        wmma::mma_sync(acc, fa, fb, acc);
      }
      wmma::store_matrix_sync(Ss + half * HG * CK + kt * 16, acc, CK, wmma::mem_row_major);
    }
    __syncthreads();
    for (int hh = 0; hh < HG / NWARP; ++hh) {
      const int h = warp * (HG / NWARP) + hh;
      const bool v0 = koff[lane] >= 0, v1 = koff[lane + 32] >= 0;
      const float s0 = v0 ? (Ss[h * CK + lane] + Ss[HG * CK + h * CK + lane]) * scale : -INFINITY;
      const float s1 = v1 ? (Ss[h * CK + lane + 32] + Ss[HG * CK + h * CK + lane + 32]) * scale : -INFINITY;
      float m = fmaxf(s0, s1);
      for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
      const float mold = mrun[h];
      const float mnew = fmaxf(mold, m);
      const float p0 = v0 ? __expf(s0 - mnew) : 0.f, p1 = v1 ? __expf(s1 - mnew) : 0.f;
      float l = p0 + p1;
      for (int o = 16; o > 0; o >>= 1) l += __shfl_xor_sync(0xffffffffu, l, o);
      Ps[h * LDP + lane] = dsv4_t<T>(p0);
      Ps[h * LDP + lane + 32] = dsv4_t<T>(p1);
      __syncwarp();
      if (lane == 0) {
        const float a = (mold == -INFINITY) ? 0.f : __expf(mold - mnew);
        alpha[h] = a;
        lrun[h] = lrun[h] * a + l;
        mrun[h] = mnew;
      }
    }
    __syncthreads();
    if (!ONE) {
      for (int i = tid; i < HG * D; i += THREADS) {
        const int h = i / D, d = i - h * D;
        Os[h * LDO + d] *= alpha[h];
      }
      __syncthreads();
    }
    {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> fp[CK / 16];
#pragma unroll
      for (int ks = 0; ks < CK / 16; ++ks) wmma::load_matrix_sync(fp[ks], Ps + ks * 16, LDP);
      for (int nt = warp; nt < D / 16; nt += NWARP) {
        wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
        if (ONE) wmma::fill_fragment(acc, 0.f);
        else wmma::load_matrix_sync(acc, Os + nt * 16, LDO, wmma::mem_row_major);
#pragma unroll
        for (int ks = 0; ks < CK / 16; ++ks) {
          wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> fv;
          wmma::load_matrix_sync(fv, Ks + ks * 16 * LDK + nt * 16, LDK);
          wmma::mma_sync(acc, fp[ks], fv, acc);
        }
        //@SPLIT
        if (ONE) {  // this block's only chunk: straight to its split's partial output
          const size_t ob = ((size_t)b * nsplit + split) * NH + g * HG;
          wmma::store_matrix_sync(opart + ob * D + nt * 16, acc, D, wmma::mem_row_major);
          continue;
        }
        //@END
        wmma::store_matrix_sync(Os + nt * 16, acc, LDO, wmma::mem_row_major);
      }
    }
  }
  __syncthreads();
  //@FINAL
  // the only split: the sink joins the denominator here (as `combine` does over splits)
  T* o = out + ((size_t)qr * NH + g * HG) * D;
  for (int i = tid; i < HG * D; i += THREADS) {
    const int h = i / D, d = i - h * D;
    const float sink = sinks[g * HG + h], m = mrun[h];
    const float M = fmaxf(m, sink);
    const float e = (m == -INFINITY) ? 0.f : __expf(m - M);
    o[i] = dsv4_t<T>(Os[h * LDO + d] * e / (lrun[h] * e + __expf(sink - M)));
  }
  //@SPLIT
  const size_t base = ((size_t)b * nsplit + split) * NH + g * HG;
  if (!ONE) {
    for (int i = tid; i < HG * D / 4; i += THREADS) {
      const int h = i / (D / 4), d4 = i - h * (D / 4);
      const float* src = Os + h * LDO + d4 * 4;
      reinterpret_cast<float4*>(opart + (base + h) * D)[d4] = make_float4(src[0], src[1], src[2], src[3]);
    }
  }
  if (tid < HG) { ml[(base + tid) * 2] = mrun[tid]; ml[(base + tid) * 2 + 1] = lrun[tid]; }
  //@END
"""


def variant(source: str, final: bool) -> str:
    """The source with the other variant's `//@FINAL` / `//@SPLIT` ... `//@END` sections left out."""
    out, keep = [], True
    for line in source.splitlines():
        tag = line.strip()
        if tag in ("//@FINAL", "//@SPLIT"):
            keep = (tag == "//@FINAL") == final
        elif tag == "//@END":
            keep = True
        elif keep:
            out.append(line)
    return "\n".join(out) + "\n"

COMBINE = r"""
  const int NH = sinks_shape[0], B = q_rows_shape[0], NS = ml_shape[1];
  const int r = blockIdx.x / NH, h = blockIdx.x - (blockIdx.x / NH) * NH, tid = threadIdx.x;
  int b = -1;
  for (int i = 0; i < B; ++i) if (q_rows[i] == r) b = i;
  T* o = out + ((size_t)r * NH + h) * D;
  if (b < 0) {
    for (int d = tid; d < D; d += blockDim.x) o[d] = dsv4_t<T>(0.f);
    return;
  }
  const float sink = sinks[h];
  float M = sink;
  for (int s = 0; s < NS; ++s) M = fmaxf(M, ml[(((size_t)b * NS + s) * NH + h) * 2]);
  float den = __expf(sink - M);
  for (int s = 0; s < NS; ++s) {
    const float m = ml[(((size_t)b * NS + s) * NH + h) * 2];
    if (m != -INFINITY) den += ml[(((size_t)b * NS + s) * NH + h) * 2 + 1] * __expf(m - M);
  }
  const float inv = 1.f / den;
  for (int d4 = tid; d4 < D / 4; d4 += blockDim.x) {
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int s = 0; s < NS; ++s) {
      const size_t row = ((size_t)b * NS + s) * NH + h;
      const float m = ml[row * 2];
      if (m == -INFINITY) continue;
      const float w = __expf(m - M);
      const float4 v = reinterpret_cast<const float4*>(opart + row * D)[d4];
      acc.x += w * v.x; acc.y += w * v.y; acc.z += w * v.z; acc.w += w * v.w;
    }
    o[4 * d4] = dsv4_t<T>(acc.x * inv);
    o[4 * d4 + 1] = dsv4_t<T>(acc.y * inv);
    o[4 * d4 + 2] = dsv4_t<T>(acc.z * inv);
    o[4 * d4 + 3] = dsv4_t<T>(acc.w * inv);
  }
"""


def smem_bytes(d: int, one: bool = False) -> int:
    """Q, K chunk, P, S, softmax state, key offsets; + the O accumulator unless ONE (one chunk per block)."""
    t = 2 * (HG * (d + 8) + CK * (d + 8) + HG * (CK + 8))
    f = 4 * (2 * HG * CK + 3 * HG + (HG & 1)) + (0 if one else 4 * HG * (d + 4))
    return t + f + 8 * CK + 4 * CK


def supported(q: mx.array, window: mx.array, pool: mx.array | None) -> bool:
    nh, d = q.shape[1], q.shape[2]
    same = window.dtype == q.dtype and (pool is None or pool.dtype == q.dtype)
    return q.dtype in (mx.bfloat16, mx.float16) and same and nh % HG == 0 and d % 32 == 0 and smem_bytes(d) <= 200_000


def splits(b: int, groups: int, nchunk: int) -> int:
    """Key splits per (row, head group): 1 for a few chunks (no combine launch); one chunk per block while
    that stays within ~2 blocks per multiprocessor; else about TARGET_BLOCKS blocks."""
    if nchunk <= FINAL_CHUNKS:
        return 1
    if b * groups * nchunk <= 2 * TARGET_BLOCKS:
        return nchunk
    want = max(1, math.ceil(TARGET_BLOCKS / (b * groups)))
    ns = min(nchunk, want)
    per = math.ceil(nchunk / ns)
    return math.ceil(nchunk / per)  # no empty split


class Plan:
    """Launch parameters of one (batch shape, argument shapes) combination, computed once."""

    __slots__ = ("comb", "comb_grid", "comb_tmpl", "compiled", "fast", "final", "fparams", "part", "part_grid",
                 "part_shapes", "part_tmpl", "ratio")  # fmt: skip

    def __init__(self, batch: RowBatch, q: mx.array, window: mx.array, pool: mx.array | None,
                 indices: mx.array | None, scale: float, ratio: int | None) -> None:  # fmt: skip
        self.fast = supported(q, window, pool)
        if not self.fast:
            return
        b, page = batch.size, batch.page_size
        bq, nh, d = q.shape
        if pool is None:
            self.ratio, ki = 0, 0
        else:
            assert ratio is not None
            self.ratio = ratio
            ki = indices.shape[1] if indices is not None else batch.tables[ratio].shape[1] * page
        groups = nh // HG
        nchunk = -(-(window.shape[1] + ki) // CK)
        ns = splits(b, groups, nchunk)
        self.final = ns == 1
        one = not self.final and ns == nchunk
        self.fparams = f32_params(scale)
        self.part_tmpl = [("T", q.dtype), ("D", d), ("PAGE", page), ("RATIO", self.ratio), ("HG", HG), ("CK", CK),
                          ("THREADS", THREADS), ("ONE", one)]  # fmt: skip
        if self.final:  # grid z over the q rows, the normalized output straight from the kernel
            self.part = kernel("attn_final", PART_IN, ("out",), variant(PARTIAL, True), smem_bytes(d))
            self.part_grid = (THREADS, groups, bq)
            self.part_shapes = [q.shape]
        else:
            self.part = kernel("attn_partial", PART_IN, ("opart", "ml"), variant(PARTIAL, False), smem_bytes(d, one))
            self.part_grid = (ns * THREADS, groups, b)
            self.part_shapes = [(b, ns, nh, d), (b, ns, nh, 2)]
            self.comb = kernel("attn_combine", COMB_IN, ("out",), COMBINE)
            self.comb_tmpl = [("T", q.dtype), ("D", d)]
            self.comb_grid = (bq * nh * 128, 1, 1)
        self.compiled = mx.compile(self.launch)

    def launch(self, slots: mx.array, positions: mx.array, q_rows: mx.array, table: mx.array, q: mx.array,
               window: mx.array, pool: mx.array, ind: mx.array, fparams: mx.array,
               sinks: mx.array) -> mx.array:  # fmt: skip
        outs = self.part(
            inputs=[slots, positions, q_rows, table, q, window, pool, ind, fparams, sinks],
            template=self.part_tmpl,
            grid=self.part_grid,
            threadgroup=(THREADS, 1, 1),
            output_shapes=self.part_shapes,
            output_dtypes=[q.dtype] if self.final else [mx.float32, mx.float32],
        )
        if self.final:
            return outs[0]
        (out,) = self.comb(
            inputs=[q_rows, *outs, sinks],
            template=self.comb_tmpl,
            grid=self.comb_grid,
            threadgroup=(128, 1, 1),
            output_shapes=[q.shape],
            output_dtypes=[q.dtype],
        )
        return out


def sparse_attention_rows_cuda(
    batch: RowBatch,
    q: mx.array,
    window: mx.array,
    pool: mx.array | None,
    indices: mx.array | None,
    sinks: mx.array,
    *,
    scale: float,
    ratio: int | None = None,
) -> mx.array:
    def check() -> None:
        check_sparse_attention(batch, q, window, pool, indices, sinks, scale=scale, ratio=ratio)

    try:
        key: tuple[Any, ...] = (
            "sparse_attention_rows", type(scale), scale, type(ratio), ratio, q.shape, q.dtype,
            window.shape, window.dtype, sinks.shape, sinks.dtype,
            None if pool is None else (pool.shape, pool.dtype),
            None if indices is None else (indices.shape, indices.dtype),
        )  # fmt: skip
    except AttributeError:  # not arrays: the check names the argument
        check()
        raise

    def make() -> Plan:
        tw = None if ratio is None or ratio not in batch.tables else batch.tables[ratio].shape
        pk = key + (batch.size, batch.page_size, tw)
        return plan_cached(pk, lambda: Plan(batch, q, window, pool, indices, scale, ratio))

    plan: Plan = checked(batch, key, check, make)
    if not plan.fast:
        return sparse_attention_rows_reference(batch, q, window, pool, indices, sinks, scale=scale, ratio=ratio)
    if pool is None:
        table, pool_in, ind = i32_dummy((batch.size, 1)), window, i32_dummy((1, 1))
    else:
        table, pool_in = batch.tables[plan.ratio], pool
        if indices is None:
            indices = arange_rows(q.shape[0], table.shape[1] * batch.page_size)
        ind = indices
    run = plan.compiled if common.COMPILE else plan.launch
    return run(batch.slots, batch.positions, batch.q_rows, table, q, window, pool_in, ind, plan.fparams, sinks)
