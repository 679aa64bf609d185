"""indexer_rows on CUDA: a tensor-core score kernel + a radix-select top-k kernel (2 launches).

1. `score`: grid (chunks of 128 entries, rows). Each block gathers its entries' keys through the
   row's block table into shared memory and computes `sum_h w_h relu(q_h . k)` with wmma bf16/f16
   16x16x16 (f32 accumulation), writing an order-preserving uint32 key per entry (-0 -> +0).
   Blocks past the row's visible entries exit at once.
2. `select`: one block per q-buffer row. Radix select (11+11+10 bits) finds the k-th largest key,
   then one ordered pass collects every larger key and the lowest-index entries equal to it, and
   a bitonic sort of the (~key << 32 | id) pairs gives the reference order: descending score,
   ties to the lowest id. Rows no batch row names get -1.
Fast path: q and keys bf16/f16, heads and dim multiples of 16, topk <= 2048; anything else runs
the reference.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from kernels.cuda import common
from kernels.cuda.common import kernel, next_pow2, plan_cached
from kernels.indexer import check_indexer, indexer_rows_reference
from kernels.rows import RowBatch, checked

CH = 128  # entries per score block (4 warps)
MAX_TOPK = 2048
SCORE_IN = ("positions", "q_rows", "table", "q", "weights", "keys")
SELECT_IN = ("positions", "q_rows", "skeys")

SCORE = r"""
  using namespace nvcuda;
  constexpr int CH = 128, NWARP = 4, LDQ = DI + 8, VPR = DI / 8;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* Qs = reinterpret_cast<T*>(smem_raw);
  T* Ks = Qs + NI * LDQ;
  float* Ws = reinterpret_cast<float*>(Ks + CH * LDQ);
  float* Sc = Ws + NI;
  const int b = blockIdx.y, tid = threadIdx.x;
  const int p = positions[b];
  const int n = p / 4 + ((p % 4) == 3 ? 1 : 0);
  const int e0 = blockIdx.x * CH;
  if (e0 >= n) return;
  const int qr = q_rows[b];
  const int tw = table_shape[1];
  const size_t ldk = (size_t)((tw * PAGE + 3) / 4) * 4;
  const uint4* qsrc = reinterpret_cast<const uint4*>(q + (size_t)qr * NI * DI);
  for (int i = tid; i < NI * VPR; i += blockDim.x) {
    const int h = i / VPR, v = i - h * VPR;
    *reinterpret_cast<uint4*>(Qs + h * LDQ + v * 8) = qsrc[i];
  }
  for (int i = tid; i < NI; i += blockDim.x) Ws[i] = weights[(size_t)qr * NI + i];
  constexpr int LPT = CH * VPR / 128;  // 128 threads; every key load in flight before the stores
  uint4 vals[LPT];
#pragma unroll
  for (int u = 0; u < LPT; ++u) {
    const int i = tid + u * 128;
    const int e = i / VPR, v = i - e * VPR;
    const int idx = e0 + e;
    vals[u] = make_uint4(0u, 0u, 0u, 0u);
    if (idx < n) {
      const int pg = table[b * tw + idx / PAGE];
      vals[u] = reinterpret_cast<const uint4*>(keys + ((size_t)pg * PAGE + idx % PAGE) * DI)[v];
    }
  }
#pragma unroll
  for (int u = 0; u < LPT; ++u) {
    const int i = tid + u * 128;
    const int e = i / VPR, v = i - e * VPR;
    *reinterpret_cast<uint4*>(Ks + e * LDQ + v * 8) = vals[u];
  }
  __syncthreads();
  const int warp = tid >> 5, lane = tid & 31;
  float* sc = Sc + warp * 256;
  for (int kt = warp; kt < CH / 16; kt += NWARP) {
    if (e0 + kt * 16 >= n) break;
    float part = 0.f;
    for (int ht = 0; ht < NI / 16; ++ht) {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
      wmma::fill_fragment(acc, 0.f);
#pragma unroll
      for (int ks = 0; ks < DI / 16; ++ks) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> fa;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> fb;
        wmma::load_matrix_sync(fa, Qs + ht * 16 * LDQ + ks * 16, LDQ);
        wmma::load_matrix_sync(fb, Ks + kt * 16 * LDQ + ks * 16, LDQ);
        wmma::mma_sync(acc, fa, fb, acc);
      }
      wmma::store_matrix_sync(sc, acc, 16, wmma::mem_row_major);
      __syncwarp();
      const int col = lane & 15, hb = (lane >> 4) * 8;
#pragma unroll
      for (int i = 0; i < 8; ++i) part += Ws[ht * 16 + hb + i] * fmaxf(sc[(hb + i) * 16 + col], 0.f);
      __syncwarp();
    }
    part += __shfl_xor_sync(0xffffffffu, part, 16);
    const int idx = e0 + kt * 16 + lane;
    if (lane < 16 && idx < n) {
      const float s = (part == 0.f) ? 0.f : part;
      const uint32_t bits = __float_as_uint(s);
      skeys[(size_t)b * ldk + idx] = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
    }
  }
"""

SELECT = r"""
  constexpr int NT = 1024;
  __shared__ unsigned int hist[2048];
  __shared__ unsigned long long cand[P2];
  __shared__ int wsum[32];
  __shared__ int s_digit, s_rem, s_cnt;
  const int r = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int nb = positions_shape[0];
  int b = -1;
  for (int i = 0; i < nb; ++i) if (q_rows[i] == r) b = i;
  int* o = out + (size_t)r * TOPK;
  int K = 0, n = 0;
  if (b >= 0) {
    const int p = positions[b];
    n = p / 4 + ((p % 4) == 3 ? 1 : 0);
    K = min(TOPK, n);
  }
  if (K == 0) {
    for (int i = tid; i < TOPK; i += NT) o[i] = -1;
    return;
  }
  const int ldk = skeys_shape[1];
  const unsigned int* keys = skeys + (size_t)b * ldk;
  const uint4* k4 = reinterpret_cast<const uint4*>(keys);
  const int n4 = (n + 3) / 4;
  unsigned int prefix = 0u, mask = 0u;
  int rem = K;
  for (int pass = 0; pass < 3; ++pass) {
    const int shift = pass == 0 ? 21 : (pass == 1 ? 10 : 0);
    const int nbins = pass == 2 ? 1024 : 2048;
    for (int i = tid; i < 2048; i += NT) hist[i] = 0u;
    __syncthreads();
    for (int i = tid; i < n4; i += 2 * NT) {
      uint4 a = k4[i];
      uint4 c = (i + NT < n4) ? k4[i + NT] : make_uint4(0u, 0u, 0u, 0u);
      const unsigned int va[8] = {a.x, a.y, a.z, a.w, c.x, c.y, c.z, c.w};
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int idx = (j < 4) ? 4 * i + j : 4 * (i + NT) + j - 4;
        // warp-aggregated: the lanes that hit one bin add their count once (the top bits of
        // similar scores fall in a few bins, and one-by-one shared atomics there serialize)
        const bool ok = idx < n && (va[j] & mask) == prefix;
        const unsigned int bin = ok ? ((va[j] >> shift) & (nbins - 1)) : 0xffffffffu;
        const unsigned int peers = __match_any_sync(__activemask(), bin);
        if (ok && lane == __ffs(peers) - 1) atomicAdd(&hist[bin], (unsigned int)__popc(peers));
      }
    }
    __syncthreads();
    // thread t owns bins nbins-1-t*bpt ... (descending); exclusive scan of the per-thread sums
    const int bpt = nbins / NT;
    const int top = nbins - 1 - tid * bpt;
    int local = 0;
    for (int j = 0; j < bpt; ++j) local += (int)hist[top - j];
    int incl = local;
    for (int ofs = 1; ofs < 32; ofs <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, incl, ofs);
      if (lane >= ofs) incl += v;
    }
    if (lane == 31) wsum[warp] = incl;
    __syncthreads();
    int wofs = 0;
    for (int j = 0; j < warp; ++j) wofs += wsum[j];
    int cum = wofs + incl - local;
    for (int j = 0; j < bpt; ++j) {
      const int h = (int)hist[top - j];
      if (cum < rem && cum + h >= rem) { s_digit = top - j; s_rem = rem - cum; }
      cum += h;
    }
    __syncthreads();
    rem = s_rem;
    prefix |= ((unsigned int)s_digit) << shift;
    mask |= ((unsigned int)(nbins - 1)) << shift;
    __syncthreads();
  }
  const unsigned int thr = prefix;
  const int need_eq = rem;
  if (tid == 0) s_cnt = 0;
  int eq_base = 0;
  __syncthreads();
  for (int base = 0; base < n4; base += NT) {
    const int i = base + tid;
    uint4 a = (i < n4) ? k4[i] : make_uint4(0u, 0u, 0u, 0u);
    const unsigned int va[4] = {a.x, a.y, a.z, a.w};
    int mine = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) mine += (4 * i + j < n && va[j] == thr) ? 1 : 0;
    int incl = mine;
    for (int ofs = 1; ofs < 32; ofs <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, incl, ofs);
      if (lane >= ofs) incl += v;
    }
    if (lane == 31) wsum[warp] = incl;
    __syncthreads();
    int wofs = 0, tot = 0;
    for (int j = 0; j < 32; ++j) { const int v = wsum[j]; if (j < warp) wofs += v; tot += v; }
    int rank = eq_base + wofs + incl - mine;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int idx = 4 * i + j;
      if (idx >= n) continue;
      bool take = va[j] > thr;
      if (va[j] == thr) { take = rank < need_eq; ++rank; }
      if (take) {
        const int pos = atomicAdd(&s_cnt, 1);
        cand[pos] = (((unsigned long long)(~va[j])) << 32) | (unsigned int)idx;
      }
    }
    eq_base += tot;
    __syncthreads();
  }
  for (int i = K + tid; i < P2; i += NT) cand[i] = 0xffffffffffffffffull;
  __syncthreads();
  for (int size = 2; size <= P2; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int i = tid; i < P2; i += NT) {
        const int j = i ^ stride;
        if (j > i) {
          const unsigned long long x = cand[i], y = cand[j];
          const bool up = (i & size) == 0;
          if ((x > y) == up) { cand[i] = y; cand[j] = x; }
        }
      }
      __syncthreads();
    }
  }
  for (int i = tid; i < TOPK; i += NT) o[i] = (i < K) ? (int)(cand[i] & 0xffffffffull) : -1;
"""


def supported(q: mx.array, keys: mx.array, topk: int) -> bool:
    ni, di = q.shape[1], q.shape[2]
    return (
        q.dtype in (mx.bfloat16, mx.float16)
        and keys.dtype == q.dtype
        and ni % 16 == 0
        and di % 16 == 0
        and topk <= MAX_TOPK
        and smem_bytes(ni, di) <= 200_000
    )


def smem_bytes(ni: int, di: int) -> int:
    return (ni + CH) * (di + 8) * 2 + ni * 4 + 4 * 256 * 4


class Plan:
    """Launch parameters of one (batch shape, argument shapes) combination, computed once."""

    __slots__ = ("compiled", "fast", "score", "score_grid", "score_shapes", "score_tmpl", "select", "select_grid",
                 "select_shapes", "select_tmpl")  # fmt: skip

    def __init__(self, batch: RowBatch, q: mx.array, keys: mx.array, topk: int) -> None:
        self.fast = supported(q, keys, topk)
        if not self.fast:
            return
        b, page = batch.size, batch.page_size
        ni, di = q.shape[1], q.shape[2]
        cap = batch.tables[4].shape[1] * page
        ld = -(-cap // 4) * 4  # 16-byte rows for the vector loads of the select pass
        chunks = -(-cap // CH)
        self.score = kernel("idx_score", SCORE_IN, ("skeys",), SCORE, smem_bytes(ni, di))
        self.score_tmpl = [("T", q.dtype), ("NI", ni), ("DI", di), ("PAGE", page)]
        self.score_grid = (chunks * 128, b, 1)
        self.score_shapes = [(b, ld)]
        self.select = kernel("idx_select", SELECT_IN, ("out",), SELECT)
        self.select_tmpl = [("TOPK", topk), ("P2", next_pow2(topk))]
        self.select_grid = (q.shape[0] * 1024, 1, 1)
        self.select_shapes = [(q.shape[0], topk)]
        self.compiled = mx.compile(self.launch)

    def launch(self, positions: mx.array, q_rows: mx.array, table: mx.array, q: mx.array, weights: mx.array,
               keys: mx.array) -> mx.array:  # fmt: skip
        (skeys,) = self.score(
            inputs=[positions, q_rows, table, q, weights, keys],
            template=self.score_tmpl,
            grid=self.score_grid,
            threadgroup=(128, 1, 1),
            output_shapes=self.score_shapes,
            output_dtypes=[mx.uint32],
        )
        (out,) = self.select(
            inputs=[positions, q_rows, skeys],
            template=self.select_tmpl,
            grid=self.select_grid,
            threadgroup=(1024, 1, 1),
            output_shapes=self.select_shapes,
            output_dtypes=[mx.int32],
        )
        return out


def indexer_rows_cuda(batch: RowBatch, q: mx.array, weights: mx.array, keys: mx.array, *, topk: int) -> mx.array:
    def check() -> None:
        check_indexer(batch, q, weights, keys, topk=topk)

    try:
        key: tuple[Any, ...] = ("indexer_rows", type(topk), topk, q.shape, q.dtype, weights.shape, weights.dtype,
                                keys.shape, keys.dtype)  # fmt: skip
    except AttributeError:  # not arrays: the check names the argument
        check()
        raise

    def make() -> Plan:
        pk = key + (batch.size, batch.page_size, batch.tables[4].shape)
        return plan_cached(pk, lambda: Plan(batch, q, keys, topk))

    plan: Plan = checked(batch, key, check, make)
    if not plan.fast:
        return indexer_rows_reference(batch, q, weights, keys, topk=topk)
    run = plan.compiled if common.COMPILE else plan.launch
    return run(batch.positions, batch.q_rows, batch.tables[4], q, weights, keys)
