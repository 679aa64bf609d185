"""CUDA device code of sparse_attention_rows (launch plans: kernels/cuda/attention.py); `DSPLIT` is in
attention_dsplit_src.py, the wmma kernel `PARTIAL` in attention_wmma_src.py.

- `DSPLIT` (rows of up to DSPLIT_CHUNKS = 3 key chunks: sliding, short HCA; 1 launch): grid
  (D slices, head groups, q rows). A block walks ALL of its row's keys for its 16 heads (QK over
  the full D, recomputed by each slice: cheap, the keys come from L2) with the next chunk's key
  offsets and keys (cp.async, double buffer) in flight, keeps O only for its D / DS output
  columns, and normalizes with the sink itself: exact softmax, no partial buffers, no combine.
- `WIDE` (rows of up to ~3 waves of chunks: CSA, HCA to ~128K): split-K with one chunk per block and
  all 64 heads in the block (HG = 64): each key chunk is gathered once for every head, the q rows
  arrive by cp.async while the key offsets are looked up; partial O and (max, sum) per head and
  chunk go to `COMBINE`.
- `PARTIAL` (longer rows: HCA at long context) is the split-K flash-decoding kernel (template
  constants T, D, PAGE, RATIO, HG, CK, THREADS, ONE): partial O and (max, sum) per split;
  `COMBINE` merges the splits with the sink in the denominator.
"""

from __future__ import annotations

# Device helpers shared by the three attention kernels (template arguments: the kernels' constants).
# Every kernel's batch row b: its slot, position, q row, window and compressed-entry counts.
ROW = r"""  const int KI = RATIO ? indices_shape[1] : 0;
  const int tw = table_shape[1];
  const int slot = slots[b], p = positions[b], qr = q_rows[b];
  const int nwin = min(p, W - 1) + 1;
  const int ncomp = dsv4_emitted(p, RATIO);
"""

ATTN_HELPERS = r"""
// Chunk c of a row's key list (window ring rows 0..W-1, then its KI selected ids): thread t < CK writes
// key c * CK + t's element offset in `window` (kwin 1) or `pool` (kwin 0) to koff[t], -1 when masked
// (ring row not written yet, id -1, or an entry the row has not emitted yet).
template <int D, int PAGE, int CK>
__device__ __forceinline__ void dsv4_chunk_offsets(int c, int W, int KI, int nwin, int ncomp, int slot,
                                                   const int* ind_row, const int* table_row, long long* koff,
                                                   int* kwin) {
  const int t = threadIdx.x;
  if (t >= CK) return;
  const int j = c * CK + t;
  long long off = -1;
  int win = 1;
  if (j < W) {
    if (j < nwin) off = ((long long)slot * W + j) * D;
  } else if (j < W + KI) {
    win = 0;
    const int id = ind_row[j - W];
    if (id >= 0 && id < ncomp) {
      const int pg = table_row[id / PAGE];
      off = ((long long)pg * PAGE + id % PAGE) * D;
    }
  }
  koff[t] = off;
  kwin[t] = win;
}
// The chunk's keys into Ks [CK][LDK] by cp.async (no register staging; masked ones zero-filled).
template <typename T, int D, int CK, int LDK, int NT>
__device__ __forceinline__ void dsv4_gather_keys(T* Ks, const long long* koff, const int* kwin, const T* window,
                                                 const T* pool) {
  constexpr int VPR = D / 8;
  for (int i = threadIdx.x; i < CK * VPR; i += NT) {
    const int e = i / VPR, v = i - e * VPR;
    const long long off = koff[e];
    const T* src = (kwin[e] ? window : pool) + (off >= 0 ? off : 0) + v * 8;
    dsv4_cp16(Ks + e * LDK + v * 8, src, off >= 0 ? 16 : 0);
  }
}
// wmma S = Q K^T of 16 heads x CK keys, 8 warps: warp (key tile w % 4, half of D w / 4); the two
// halves' partial sums go to Ss [2][HG][CK] (the softmax adds them).
template <typename T, int D, int HG, int CK, int LDK>
__device__ __forceinline__ void dsv4_qk_wmma(const T* Qs, const T* Kb, float* Ss) {
  using namespace nvcuda;
  const int warp = threadIdx.x >> 5, kt = warp & 3, half = warp >> 2;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
  wmma::fill_fragment(acc, 0.f);
  for (int ks = half * (D / 32); ks < (half + 1) * (D / 32); ++ks) {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> fa;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> fb;
    wmma::load_matrix_sync(fa, Qs + ks * 16, LDK);
    wmma::load_matrix_sync(fb, Kb + kt * 16 * LDK + ks * 16, LDK);
    wmma::mma_sync(acc, fa, fb, acc);
  }
  wmma::store_matrix_sync(Ss + half * HG * CK + kt * 16, acc, CK, wmma::mem_row_major);
}
// A warp's softmax numerators over one 64-key chunk for its HPW heads h0 .., all at once (their shuffle
// reductions interleaved level by level: one head after another left each reduction's latency exposed).
// s0 / s1: the lane's keys lane, lane + 32 (scaled; v0 / v1 false where masked). m: the max over the
// chunk and, with `mfloor`, over mfloor[h] (an online softmax's running max); P at m to Ps; l: sum of P.
template <typename T, int HPW, int LDP>
__device__ __forceinline__ void dsv4_warp_softmax(const float* s0, const float* s1, bool v0, bool v1, int h0,
                                                  const float* mfloor, float* m, float* l, T* Ps) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int hh = 0; hh < HPW; ++hh) m[hh] = fmaxf(s0[hh], s1[hh]);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
#pragma unroll
    for (int hh = 0; hh < HPW; ++hh) m[hh] = fmaxf(m[hh], __shfl_xor_sync(0xffffffffu, m[hh], o));
  }
#pragma unroll
  for (int hh = 0; hh < HPW; ++hh) {
    const int h = h0 + hh;
    if (mfloor) m[hh] = fmaxf(mfloor[h], m[hh]);
    const float p0 = v0 ? __expf(s0[hh] - m[hh]) : 0.f, p1 = v1 ? __expf(s1[hh] - m[hh]) : 0.f;
    l[hh] = p0 + p1;
    Ps[h * LDP + lane] = dsv4_t<T>(p0);
    Ps[h * LDP + lane + 32] = dsv4_t<T>(p1);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
#pragma unroll
    for (int hh = 0; hh < HPW; ++hh) l[hh] += __shfl_xor_sync(0xffffffffu, l[hh], o);
  }
}
// Online softmax update over one 64-key chunk (warp w: heads HPW w ..): P (numerators at the new max) to
// Ps, the running (max, sum) updated, alpha = the old O's rescale factor per head. S is HALVES planes [HG][LDS]
// (two: halves of D, summed here).
template <typename T, int HG, int CK, int LDP, int NWARP, int LDS = CK, int HALVES = 2>
__device__ __forceinline__ void dsv4_online_softmax(const float* Ss, const long long* koff, float scale, float* mrun,
                                                    float* lrun, float* alpha, T* Ps) {
  constexpr int HPW = HG / NWARP;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const bool v0 = koff[lane] >= 0, v1 = koff[lane + 32] >= 0;
  float s0[HPW], s1[HPW], m[HPW], l[HPW];
#pragma unroll
  for (int hh = 0; hh < HPW; ++hh) {
    const int h = warp * HPW + hh;
    if (HALVES == 2) {
      s0[hh] = v0 ? (Ss[h * LDS + lane] + Ss[HG * LDS + h * LDS + lane]) * scale : -INFINITY;
      s1[hh] = v1 ? (Ss[h * LDS + lane + 32] + Ss[HG * LDS + h * LDS + lane + 32]) * scale : -INFINITY;
    } else {
      s0[hh] = v0 ? Ss[h * LDS + lane] * scale : -INFINITY;
      s1[hh] = v1 ? Ss[h * LDS + lane + 32] * scale : -INFINITY;
    }
  }
  dsv4_warp_softmax<T, HPW, LDP>(s0, s1, v0, v1, warp * HPW, mrun, m, l, Ps);
  __syncwarp();
  if (lane == 0) {
#pragma unroll
    for (int hh = 0; hh < HPW; ++hh) {
      const int h = warp * HPW + hh;
      const float mold = mrun[h];
      const float a = (mold == -INFINITY) ? 0.f : __expf(mold - m[hh]);
      alpha[h] = a;
      lrun[h] = lrun[h] * a + l[hh];
      mrun[h] = m[hh];
    }
  }
}
"""

WIDE = (
    r"""
  using namespace nvcuda;
  // mma.sync / ldmatrix layout: 8 warps over HT = HG / 16 head tiles (HG 64 or 32), WPT warps per tile,
  // each with KW of the CK = 64 keys in S and DW of the D dims in O (64: 32 keys / 256 dims; 32: 16 / 128)
  constexpr int LDK = D + 8, LDP = CK + 8, LDS = CK + 4, VPR = D / 8, NWARP = THREADS / 32, KT = CK / 16;
  constexpr int HT = HG / 16, WPT = NWARP / HT, WSH = WPT == 4 ? 2 : (WPT == 2 ? 1 : 0), KW = CK / WPT, DW = D / WPT;
  static_assert((1 << WSH) == WPT && KW % 16 == 0 && DW % 64 == 0, "wide: HG, CK, D do not fit 8 warps");
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* Qs = reinterpret_cast<T*>(smem_raw);               // [HG][LDK]
  T* Ks = Qs + HG * LDK;                                // [CK][LDK]
  T* Ps = Ks + CK * LDK;                                // [HG][LDP]
  float* Ss = reinterpret_cast<float*>(Ps + HG * LDP);  // [HG][LDS]
  float* mrun = Ss + HG * LDS;
  float* lrun = mrun + HG;
  long long* koff = reinterpret_cast<long long*>(lrun + HG);  // [CK]
  int* kwin = reinterpret_cast<int*>(koff + CK);              // [CK]
  const int c = blockIdx.x, g = blockIdx.y, b = blockIdx.z;  // one chunk per block
  const int nsplit = gridDim.x;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int NH = q_shape[1], W = window_shape[1];
  float* opart = part;  // one output in two planes: O [B][NS][NH][D], then (m, l) [B][NS][NH][2]
  float* ml = part + (size_t)gridDim.z * nsplit * NH * D;
"""
    + ROW
    + r"""  const float scale = fparams[0];
  const size_t ob = ((size_t)b * nsplit + c) * NH + g * HG;  // this split's first head row
  // q rows in flight (cp.async) while the chunk's key offsets are looked up
  const T* qb = q + ((size_t)qr * NH + g * HG) * D;
  for (int i = tid; i < HG * VPR; i += THREADS) {
    const int h = i / VPR, v = i - h * VPR;
    dsv4_cp16(Qs + h * LDK + v * 8, qb + (size_t)h * D + v * 8, 16);
  }
  dsv4_cp_commit();
  dsv4_chunk_offsets<D, PAGE, CK>(c, W, KI, nwin, ncomp, slot, indices + (size_t)qr * KI, table + b * tw, koff, kwin);
  const int any = __syncthreads_or(tid < CK && koff[tid] >= 0);
  if (!any) {  // nothing to attend in this chunk: an empty split (the combine skips m = -inf)
    if (tid < HG) { ml[(ob + tid) * 2] = -INFINITY; ml[(ob + tid) * 2 + 1] = 0.f; }
    dsv4_cp_wait<0>();
    return;
  }
  dsv4_gather_keys<T, D, CK, LDK, THREADS>(Ks, koff, kwin, window, pool);
  dsv4_cp_commit();
  dsv4_cp_wait<0>();
  __syncthreads();
  {  // S = Q K^T: warp (head tile w / WPT, keys KW * (w % WPT) ..): mma.sync with ldmatrix fragments
    const int mt = warp >> WSH, kh = warp & (WPT - 1), g = lane >> 2, c2 = (lane & 3) * 2;
    float acc[KW / 8][4];
#pragma unroll
    for (int j = 0; j < KW / 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
    const T* qa = Qs + (mt * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LDK + (lane >> 4) * 8;
    const T* kbp = Ks + (kh * KW + (lane >> 4) * 8 + (lane & 7)) * LDK + ((lane >> 3) & 1) * 8;
#pragma unroll 4
    for (int ks = 0; ks < D / 16; ++ks) {
      uint32_t a[4], bk[KW / 16][4];
      dsv4_ldsm4(a, qa + ks * 16);
#pragma unroll
      for (int t = 0; t < KW / 16; ++t) dsv4_ldsm4(bk[t], kbp + t * 16 * LDK + ks * 16);  // key tiles 2t, 2t + 1
#pragma unroll
      for (int t = 0; t < KW / 16; ++t) {
        dsv4_mma(acc[2 * t], a, bk[t][0], bk[t][1], T());
        dsv4_mma(acc[2 * t + 1], a, bk[t][2], bk[t][3], T());
      }
    }
#pragma unroll
    for (int j = 0; j < KW / 8; ++j) {
      float* sr = Ss + (mt * 16 + g) * LDS + kh * KW + j * 8 + c2;
      *reinterpret_cast<float2*>(sr) = make_float2(acc[j][0], acc[j][1]);
      *reinterpret_cast<float2*>(sr + 8 * LDS) = make_float2(acc[j][2], acc[j][3]);
    }
  }
  __syncthreads();
  {  // this chunk's softmax numerators, warp w for heads HPW w .. (one chunk: no running max)
    constexpr int HPW = HG / NWARP;
    const bool v0 = koff[lane] >= 0, v1 = koff[lane + 32] >= 0;
    float s0[HPW], s1[HPW], m[HPW], l[HPW];
#pragma unroll
    for (int hh = 0; hh < HPW; ++hh) {
      const int h = warp * HPW + hh;
      s0[hh] = v0 ? Ss[h * LDS + lane] * scale : -INFINITY;
      s1[hh] = v1 ? Ss[h * LDS + lane + 32] * scale : -INFINITY;
    }
    dsv4_warp_softmax<T, HPW, LDP>(s0, s1, v0, v1, warp * HPW, nullptr, m, l, Ps);
    if (lane == 0) {
#pragma unroll
      for (int hh = 0; hh < HPW; ++hh) {
        ml[(ob + warp * HPW + hh) * 2] = m[hh];
        ml[(ob + warp * HPW + hh) * 2 + 1] = l[hh];
      }
    }
  }
  __syncthreads();
  {  // O = P V (V = K): warp (head tile w / WPT, dims DW * (w % WPT) ..) in passes of 64 dims, straight to opart
    const int mt = warp >> WSH, dh = warp & (WPT - 1), g = lane >> 2, c2 = (lane & 3) * 2;
    uint32_t pa[KT][4];
#pragma unroll
    for (int ks = 0; ks < KT; ++ks)
      dsv4_ldsm4(pa[ks], Ps + (mt * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LDP + ks * 16 + (lane >> 4) * 8);
    // .trans B: lanes 8i..8i+7 address key rows ks*16 + 8 * (i % 2) + (lane % 8) of dim tile 2 * jj + i / 2
    const T* vb = Ks + (((lane >> 3) & 1) * 8 + (lane & 7)) * LDK + (lane >> 4) * 8;
    for (int d0 = dh * DW; d0 < (dh + 1) * DW; d0 += 64) {
      float acc[8][4];
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
#pragma unroll
      for (int ks = 0; ks < KT; ++ks) {
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) {
          uint32_t bv[4];
          dsv4_ldsm4t(bv, vb + ks * 16 * LDK + d0 + jj * 16);
          dsv4_mma(acc[2 * jj], pa[ks], bv[0], bv[1], T());
          dsv4_mma(acc[2 * jj + 1], pa[ks], bv[2], bv[3], T());
        }
      }
      float* orow = opart + (ob + mt * 16 + g) * D + d0 + c2;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        *reinterpret_cast<float2*>(orow + j * 8) = make_float2(acc[j][0], acc[j][1]);
        *reinterpret_cast<float2*>(orow + 8 * D + j * 8) = make_float2(acc[j][2], acc[j][3]);
      }
    }
  }
"""
)

COMBINE_MAX_SPLITS = 1024  # splits per row the combine takes (the plans make at most ~530)
COMBINE = (r"""
  const int NH = sinks_shape[0], B = q_rows_shape[0], NS = part_shape[1];
  const float* opart = part;
  const float* ml = part + (size_t)B * NS * NH * D;
  const int r = blockIdx.x / NH, h = blockIdx.x - (blockIdx.x / NH) * NH, tid = threadIdx.x;
  int b = -1;
  for (int i = 0; i < B; ++i) if (q_rows[i] == r) b = i;
  T* o = out + ((size_t)r * NH + h) * D;
  if (b < 0) {
    for (int d = tid; d < D; d += blockDim.x) o[d] = dsv4_t<T>(0.f);
    return;
  }
  // every split's (m, l) read at once into shared memory, not one dependent global read after another;
  // warp 0 reduces the max and the denominator; then each split's weight exp(m - M) (0: an empty split,
  // whose O was never written) is in shared memory and the O loads of the splits are independent
  __shared__ float sw[COMBINE_MAX_SPLITS], sl[COMBINE_MAX_SPLITS];
  __shared__ float sM, sinv;
  for (int s = tid; s < NS; s += blockDim.x) {
    const size_t row = ((size_t)b * NS + s) * NH + h;
    sw[s] = ml[row * 2];
    sl[s] = ml[row * 2 + 1];
  }
  __syncthreads();
  if (tid < 32) {
    const float sink = sinks[h];
    float M = sink;
    for (int s = tid; s < NS; s += 32) M = fmaxf(M, sw[s]);
    for (int o = 16; o > 0; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
    float den = 0.f;
    for (int s = tid; s < NS; s += 32) if (sw[s] != -INFINITY) den += sl[s] * __expf(sw[s] - M);
    for (int o = 16; o > 0; o >>= 1) den += __shfl_xor_sync(0xffffffffu, den, o);
    if (tid == 0) { sM = M; sinv = 1.f / (den + __expf(sink - M)); }
  }
  __syncthreads();
  const float M = sM, inv = sinv;
  for (int s = tid; s < NS; s += blockDim.x) sw[s] = sw[s] == -INFINITY ? 0.f : __expf(sw[s] - M);
  __syncthreads();
  const float4* vp = reinterpret_cast<const float4*>(opart + ((size_t)b * NS * NH + h) * D);
  for (int d4 = tid; d4 < D / 4; d4 += blockDim.x) {
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 8
    for (int s = 0; s < NS; ++s) {
      const float w = sw[s];
      const float4 v = vp[(size_t)s * NH * (D / 4) + d4];
      if (w != 0.f) { acc.x += w * v.x; acc.y += w * v.y; acc.z += w * v.z; acc.w += w * v.w; }
    }
    o[4 * d4] = dsv4_t<T>(acc.x * inv);
    o[4 * d4 + 1] = dsv4_t<T>(acc.y * inv);
    o[4 * d4 + 2] = dsv4_t<T>(acc.z * inv);
    o[4 * d4 + 3] = dsv4_t<T>(acc.w * inv);
  }
""").replace("COMBINE_MAX_SPLITS", str(COMBINE_MAX_SPLITS))
