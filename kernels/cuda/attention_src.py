"""CUDA device code of sparse_attention_rows (launch plans: kernels/cuda/attention.py).

`PARTIAL` is the split-K flash-decoding kernel (template constants T, D, PAGE, RATIO, HG, CK,
THREADS, ONE); its `//@FINAL` / `//@SPLIT` sections make the one-split variant (grid z over the q
rows, sink normalization in the kernel) and the split variant (partial O and (max, sum) per
split). `COMBINE` merges the splits with the sink in the denominator.
"""

from __future__ import annotations

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
