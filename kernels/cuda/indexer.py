"""indexer_rows on CUDA: per-segment score + top-k, then a merge (2 launches; 1 up to 4,096 entries).

1. `segment`: grid (segments of SEG entries, rows), 8 warps. A block streams its segment's keys
   through the row's block table into shared memory (cp.async, 4 chunks of 64 entries in flight;
   one table read per chunk when pages hold whole chunks) and scores them with mma.sync m16n8k16
   (bf16/f16 in, f32 accumulation; B fragments by ldmatrix): warp w holds the q fragments of head
   tile w % (NI/16) in registers for the whole segment, and `w_h relu(.)` is summed over its 16
   heads in registers (shuffles) before the head tiles are added. The segment's order-preserving
   uint32 score keys stay in shared memory; a radix select (11+11+10 bits) finds its k-th
   largest, and an ordered compaction writes its top min(k, entries) candidates (key, id) in id
   order, padded with key 0 (below every score). It also writes its m-th largest key, m =
   ceil(k / the row's segments): the least of those bounds has at least k keys above it.
2. `merge`: one block per q-buffer row. Each warp keeps the candidates >= that bound from its run
   of the list (in order; usually ~1-2 k of nseg * k), then the same radix select + ordered
   compaction over the kept ones write the ids in ascending order (the list is in id order, so
   "ties to the lowest id" is "first in the list"). No sort. Rows no batch row names get -1.
The top-k of a row is a subset of the union of its segments' top-k, so the result is exact.
Rows of at most SINGLE_MAX entries (8K context) take one launch: `single` is the segment kernel
over the whole row, writing its top-k ids itself (grid over the q rows).
Fast path: q and keys bf16/f16, index heads 16/32/64/128, dim a multiple of 16 up to 256,
topk <= 2048; anything else runs the reference.
"""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx

from kernels.cuda import common
from kernels.cuda.common import kernel, next_pow2, plan_cached
from kernels.cuda.select import HELPERS
from kernels.indexer import check_indexer, indexer_rows_reference
from kernels.rows import RowBatch, checked

CH, NT, STAGES = 64, 256, 4  # entries per pipelined chunk, threads per segment block, chunks in flight
MAX_TOPK = 2048
MAX_SEG = 16384
MERGE_CAP = 16384  # candidates >= the bound the merge keeps in shared memory (more: it reads the list)
SINGLE_MAX = 4096  # a row's entries up to this: one block scores and selects (1 launch)
SEG_IN = ("positions", "q_rows", "table", "q", "weights", "keys")
MERGE_IN = ("positions", "q_rows", "ckeys", "cids", "cbound")

PRE = r"""
  constexpr int NT = 256, NWARP = 8, HT = NI / 16, KG = NWARP / HT, KS = DI / 16, LDK = DI + 8, VPR = DI / 8;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* Ks = reinterpret_cast<T*>(smem_raw);                               // [ST][CH][LDK]: ST-stage pipeline
  float* part = reinterpret_cast<float*>(Ks + ST * CH * LDK);           // [HT][CH]
  unsigned int* skey = reinterpret_cast<unsigned int*>(part + HT * CH);  // [SEG]
  unsigned int* hist = skey + SEG;                                       // [2048]
  __shared__ int wsum[NWARP];
  __shared__ int sh[2];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
"""
HEAD_SEG = r"""  const int seg = blockIdx.x, b = blockIdx.y;
  const int p = positions[b];
  const int n = p / 4 + ((p % 4) == 3 ? 1 : 0);
  const int s0 = seg * SEG;
  const int nv = max(0, min(SEG, n - s0));
  const size_t obase = (size_t)b * LDC + (size_t)seg * TOPK;
  unsigned int* ok = ckeys + obase;
  int* oi = cids + obase;
  if (nv == 0) {
    for (int i = tid; i < TOPK; i += NT) { ok[i] = 0u; oi[i] = -1; }
    if (tid == 0) cbound[(size_t)b * NSEG + seg] = 0xffffffffu;  // neutral in the merge's min
    return;
  }
"""
HEAD_FINAL = r"""  // one segment holds the row: z runs over the q rows, rows no batch row names get -1
  const int r = blockIdx.y;
  int b = -1;
  for (int i = 0; i < positions_shape[0]; ++i) if (q_rows[i] == r) b = i;
  int* o = out + (size_t)r * TOPK;
  int n = 0;
  if (b >= 0) { const int p = positions[b]; n = p / 4 + ((p % 4) == 3 ? 1 : 0); }
  const int s0 = 0, nv = min(SEG, n);
  if (nv == 0) {
    for (int i = tid; i < TOPK; i += NT) o[i] = -1;
    return;
  }
"""
SCORE = r"""  const int tw = table_shape[1];
  const int qr = q_rows[b];
  const int ht = warp % HT, kg = warp / HT, g = lane >> 2, c2 = (lane & 3) * 2;
  uint32_t qa[KS][4];
  {
    const T* qb = q + ((size_t)qr * NI + ht * 16) * DI;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      qa[ks][0] = *reinterpret_cast<const uint32_t*>(qb + g * DI + ks * 16 + c2);
      qa[ks][1] = *reinterpret_cast<const uint32_t*>(qb + (g + 8) * DI + ks * 16 + c2);
      qa[ks][2] = *reinterpret_cast<const uint32_t*>(qb + g * DI + ks * 16 + c2 + 8);
      qa[ks][3] = *reinterpret_cast<const uint32_t*>(qb + (g + 8) * DI + ks * 16 + c2 + 8);
    }
  }
  const float w0 = weights[(size_t)qr * NI + ht * 16 + g], w1 = weights[(size_t)qr * NI + ht * 16 + g + 8];
  const int nch = (nv + CH - 1) / CH;
  auto load = [&](int c) {  // chunk c into buffer c % ST; always commits a group (maybe empty)
    if (c < nch) {
      T* dst = Ks + (c % ST) * CH * LDK;
      if (PAGE % CH == 0) {  // the chunk lies in one page (chunks start at multiples of CH): one table read
        const int idx0 = s0 + c * CH;
        const T* base = keys + ((size_t)table[(size_t)b * tw + idx0 / PAGE] * PAGE + idx0 % PAGE) * DI;
        for (int i = tid; i < CH * VPR; i += NT) {
          const int e = i / VPR, v = i - e * VPR;
          const bool ok = c * CH + e < nv;
          dsv4_cp16(dst + e * LDK + v * 8, ok ? base + e * DI + v * 8 : keys, ok ? 16 : 0);
        }
      } else {
        for (int i = tid; i < CH * VPR; i += NT) {
          const int e = i / VPR, v = i - e * VPR;
          const int idx = s0 + c * CH + e;
          const T* src = keys;
          int bytes = 0;
          if (c * CH + e < nv) {
            const int pg = table[(size_t)b * tw + idx / PAGE];
            src = keys + ((size_t)pg * PAGE + idx % PAGE) * DI + v * 8;
            bytes = 16;
          }
          dsv4_cp16(dst + e * LDK + v * 8, src, bytes);
        }
      }
    }
    dsv4_cp_commit();
  };
#pragma unroll
  for (int c = 0; c < ST - 1; ++c) load(c);
  for (int c = 0; c < nch; ++c) {
    dsv4_cp_wait<ST - 2>();  // chunk c has landed (this thread's copies)
    __syncthreads();         // ... everyone's; and everyone is done with chunk c - 1's buffer
    load(c + ST - 1);
    const T* kb = Ks + (c % ST) * CH * LDK;
    for (int kt = kg; kt < CH / 8; kt += KG) {
      float acc[4] = {0.f, 0.f, 0.f, 0.f};
      // B fragments by ldmatrix.x4: lanes 8i..8i+7 address rows (entries) of 8x8 matrix i = (k-step
      // ks + i / 2, dims +8 * (i % 2)); lane gets (entry g, dims c2, c2 + 1) of each matrix
      const T* kr = kb + (kt * 8 + (lane & 7)) * LDK + (lane >> 4) * 16 + ((lane >> 3) & 1) * 8;
#pragma unroll
      for (int ks = 0; ks < KS; ks += 2) {
        uint32_t bf[4];
        dsv4_ldsm4(bf, kr + ks * 16);
        dsv4_mma(acc, qa[ks], bf[0], bf[1], T());
        if (ks + 1 < KS) dsv4_mma(acc, qa[ks + 1], bf[2], bf[3], T());
      }
      // acc: (head g, entry c2), (g, c2+1), (g+8, c2), (g+8, c2+1): ReLU, head weights, sum over heads
      float sa = w0 * fmaxf(acc[0], 0.f) + w1 * fmaxf(acc[2], 0.f);
      float sb = w0 * fmaxf(acc[1], 0.f) + w1 * fmaxf(acc[3], 0.f);
#pragma unroll
      for (int o = 4; o < 32; o <<= 1) {
        sa += __shfl_xor_sync(0xffffffffu, sa, o);
        sb += __shfl_xor_sync(0xffffffffu, sb, o);
      }
      if (lane < 4) { part[ht * CH + kt * 8 + c2] = sa; part[ht * CH + kt * 8 + c2 + 1] = sb; }
    }
    __syncthreads();  // part is full
    if (tid < CH && c * CH + tid < nv) {
      float s = 0.f;
#pragma unroll
      for (int h = 0; h < HT; ++h) s += part[h * CH + tid];
      skey[c * CH + tid] = dsv4_okey(s);
    }
  }
  __syncthreads();
"""
TAIL_SEG = r"""  const int K = min(TOPK, nv);
  unsigned int thr = 0u;  // score keys are >= 1 (0 only for NaN): with thr 0 every entry is taken
  int need_eq = nv;
  if (nv > TOPK) dsv4_radix_kth<NT>(skey, nv, K, hist, wsum, sh, thr, need_eq);
  // the merge's filter bound: this segment's m-th largest key, m = ceil(min(TOPK, n) / the row's
  // segments), so the row has at least min(TOPK, n) keys >= the least of its segments' bounds
  // (0, no filtering, if this segment has fewer than m entries)
  const int nsr = (n + SEG - 1) / SEG;
  const int m = (min(TOPK, n) + nsr - 1) / nsr;
  unsigned int bm = 0u;
  if (nv >= m) {
    int e2;
    dsv4_radix_kth<NT>(skey, nv, m, hist, wsum, sh, bm, e2);
  }
  if (tid == 0) cbound[(size_t)b * NSEG + seg] = bm;
  dsv4_take<NT>(skey, nv, thr, need_eq, wsum, [&](int pos, int i, unsigned int v) { ok[pos] = v; oi[pos] = s0 + i; });
  for (int i = K + tid; i < TOPK; i += NT) { ok[i] = 0u; oi[i] = -1; }
"""
TAIL_FINAL = r"""  const int K = min(TOPK, nv);
  unsigned int thr = 0u;
  int need_eq = nv;
  if (nv > TOPK) dsv4_radix_kth<NT>(skey, nv, K, hist, wsum, sh, thr, need_eq);
  dsv4_take<NT>(skey, nv, thr, need_eq, wsum, [&](int pos, int i, unsigned int v) { o[pos] = i; });  // ascending ids
  for (int i = K + tid; i < TOPK; i += NT) o[i] = -1;
"""
SEGMENT = PRE + HEAD_SEG + SCORE + TAIL_SEG
SINGLE = PRE + HEAD_FINAL + SCORE + TAIL_FINAL

MERGE = r"""
  constexpr int NT = 1024, NW = NT / 32, PER = (L + NW - 1) / NW;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned int* ck = reinterpret_cast<unsigned int*>(smem_raw);  // [CAPC] candidates >= the bound, in order
  int* cpos = reinterpret_cast<int*>(ck + CAPC);                 // [CAPC] their places in the row's list
  __shared__ unsigned int hist[2048];
  __shared__ int wsum[32];
  __shared__ int sh[3];
  const int r = blockIdx.x, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int nb = positions_shape[0];
  int b = -1;
  for (int i = 0; i < nb; ++i) if (q_rows[i] == r) b = i;
  int* o = out + (size_t)r * TOPK;
  int K = 0;
  if (b >= 0) {
    const int p = positions[b];
    K = min(TOPK, p / 4 + ((p % 4) == 3 ? 1 : 0));
  }
  if (K == 0) {
    for (int i = tid; i < TOPK; i += NT) o[i] = -1;
    return;
  }
  const int ld = ckeys_shape[1];
  const unsigned int* keys = ckeys + (size_t)b * ld;
  const int* ids = cids + (size_t)b * ld;
  if (warp == 0) {  // the least of the segments' bounds: at least K candidates are >= it
    unsigned int v = 0xffffffffu;
    for (int s = lane; s < NSEG; s += 32) v = min(v, cbound[(size_t)b * NSEG + s]);
    for (int sft = 16; sft > 0; sft >>= 1) v = min(v, __shfl_xor_sync(0xffffffffu, v, sft));
    if (lane == 0) sh[2] = (int)v;
  }
  __syncthreads();
  const unsigned int bound = (unsigned int)sh[2];
  // warp w filters its contiguous run [w0, w1) of the list (count, block scan, ordered write)
  const int w0 = min(L, warp * PER), w1 = min(L, w0 + PER);
  int cnt = 0;
  for (int i = w0 + lane; i < w1; i += 32) cnt += keys[i] >= bound ? 1 : 0;
  for (int sft = 16; sft > 0; sft >>= 1) cnt += __shfl_xor_sync(0xffffffffu, cnt, sft);
  const int off = __shfl_sync(0xffffffffu, dsv4_block_excl<NT>(lane == 0 ? cnt : 0, wsum), 0);
  if (warp == NW - 1 && lane == 0) sh[2] = off + cnt;
  __syncthreads();
  const int n2 = sh[2];
  unsigned int thr;
  int need_eq;
  if (n2 <= CAPC) {
    int pos = off;
    for (int base = w0; base < w1; base += 32) {
      const int i = base + lane;
      const unsigned int v = i < w1 ? keys[i] : 0u;
      const bool t = i < w1 && v >= bound;
      const unsigned int bal = __ballot_sync(0xffffffffu, t);
      if (t) {
        const int q = pos + __popc(bal & ((1u << lane) - 1u));
        ck[q] = v;
        cpos[q] = i;
      }
      pos += __popc(bal);
    }
    __syncthreads();
    dsv4_radix_kth<NT>(ck, n2, K, hist, wsum, sh, thr, need_eq);
    dsv4_take<NT>(ck, n2, thr, need_eq, wsum, [&](int q, int i, unsigned int v) { o[q] = ids[cpos[i]]; });
  } else {  // the bound filtered too little: select over the whole list in global memory
    dsv4_radix_kth<NT>(keys, L, K, hist, wsum, sh, thr, need_eq);
    dsv4_take<NT>(keys, L, thr, need_eq, wsum, [&](int q, int i, unsigned int v) { o[q] = ids[i]; });
  }
  for (int i = K + tid; i < TOPK; i += NT) o[i] = -1;
"""


def segment_size(cap: int, topk: int) -> int:
    """Entries per segment block: one segment (no merge launch) up to SINGLE_MAX entries; else at most
    ~32 segments per row (the merge reads 32 x topk candidates), at least twice the top-k (else a
    segment keeps nearly all it scored)."""
    lo = max(1024, 2 * next_pow2(topk))
    if cap <= SINGLE_MAX:
        return max(lo, next_pow2(cap))
    return min(MAX_SEG, max(lo, next_pow2(math.ceil(cap / 32))))


def smem_bytes(ni: int, di: int, seg: int) -> int:
    """Pipeline buffers, per-head-tile partial scores, segment keys, histogram."""
    return STAGES * CH * (di + 8) * 2 + (ni // 16) * CH * 4 + seg * 4 + 2048 * 4


def supported(q: mx.array, keys: mx.array, topk: int) -> bool:
    ni, di = q.shape[1], q.shape[2]
    return (
        q.dtype in (mx.bfloat16, mx.float16)
        and keys.dtype == q.dtype
        and ni in (16, 32, 64, 128)
        and di % 16 == 0
        and 16 <= di <= 256
        and topk <= MAX_TOPK
    )


class Plan:
    """Launch parameters of one (batch shape, argument shapes) combination, computed once."""

    __slots__ = ("compiled", "fast", "merge", "merge_grid", "merge_tmpl", "out_shape", "seg", "seg_grid",
                 "seg_shapes", "seg_tmpl", "single")  # fmt: skip

    def __init__(self, batch: RowBatch, q: mx.array, keys: mx.array, topk: int) -> None:
        self.fast = supported(q, keys, topk)
        if not self.fast:
            return
        b, page = batch.size, batch.page_size
        ni, di = q.shape[1], q.shape[2]
        cap = batch.tables[4].shape[1] * page
        seg = segment_size(cap, topk)
        nseg = -(-cap // seg)
        self.out_shape = (q.shape[0], topk)
        self.seg_tmpl = [("T", q.dtype), ("NI", ni), ("DI", di), ("PAGE", page), ("SEG", seg), ("TOPK", topk),
                         ("CH", CH), ("ST", STAGES)]  # fmt: skip
        self.single = nseg == 1
        if self.single:  # z over the q rows, the top-k ids straight to the output
            self.seg = kernel("idx_single", SEG_IN, ("out",), SINGLE, smem_bytes(ni, di, seg), HELPERS)
            self.seg_grid = (NT, q.shape[0], 1)
            self.seg_shapes = [self.out_shape]
        else:
            cand = nseg * topk
            ld = -(-cand // 4) * 4
            outs = ("ckeys", "cids", "cbound")
            self.seg = kernel("idx_segment", SEG_IN, outs, SEGMENT, smem_bytes(ni, di, seg), HELPERS)
            self.seg_tmpl += [("LDC", ld), ("NSEG", nseg)]
            self.seg_grid = (nseg * NT, b, 1)
            self.seg_shapes = [(b, ld), (b, ld), (b, nseg)]
            self.merge = kernel("idx_merge", MERGE_IN, ("out",), MERGE, 8 * MERGE_CAP, HELPERS)
            self.merge_tmpl = [("TOPK", topk), ("L", cand), ("NSEG", nseg), ("CAPC", MERGE_CAP)]
            self.merge_grid = (q.shape[0] * 1024, 1, 1)
        self.compiled = mx.compile(self.launch)

    def launch(self, positions: mx.array, q_rows: mx.array, table: mx.array, q: mx.array, weights: mx.array,
               keys: mx.array) -> mx.array:  # fmt: skip
        outs = self.seg(
            inputs=[positions, q_rows, table, q, weights, keys],
            template=self.seg_tmpl,
            grid=self.seg_grid,
            threadgroup=(NT, 1, 1),
            output_shapes=self.seg_shapes,
            output_dtypes=[mx.int32] if self.single else [mx.uint32, mx.int32, mx.uint32],
        )
        if self.single:
            return outs[0]
        (out,) = self.merge(
            inputs=[positions, q_rows, *outs],
            template=self.merge_tmpl,
            grid=self.merge_grid,
            threadgroup=(1024, 1, 1),
            output_shapes=[self.out_shape],
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
