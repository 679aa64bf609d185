"""The wmma kernels of sparse_attention_rows (DSPLIT: short rows, one launch; PARTIAL: split-K over head
groups of 16 for long rows); see attention_src.py for the plan of each. Candidates for the mma.sync +
ldmatrix fragments `WIDE` uses (wmma's fragment loads cost ~10x the instructions: ncu, dsplit).
"""

from __future__ import annotations

DSPLIT = r"""
  using namespace nvcuda;
  constexpr int LDK = D + 8, LDP = CK + 8, DSL = D / DS, LDO = DSL + 4, VPR = D / 8, NWARP = 8, NT16 = DSL / 16;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* Qs = reinterpret_cast<T*>(smem_raw);        // [HG][LDK]
  T* Ks = Qs + HG * LDK;                         // [2][CK][LDK]: double buffer
  T* Ps = Ks + 2 * CK * LDK;                     // [HG][LDP]
  float* Ss = reinterpret_cast<float*>(Ps + HG * LDP);  // [2 halves of D][HG][CK]
  float* mrun = Ss + 2 * HG * CK;
  float* lrun = mrun + HG;
  float* alpha = lrun + HG;
  long long* koff = reinterpret_cast<long long*>(alpha + HG + (HG & 1));  // [2][CK]
  int* kwin = reinterpret_cast<int*>(koff + 2 * CK);                     // [2][CK]
  float* Os = reinterpret_cast<float*>(kwin + 2 * CK);                   // [HG][LDO]: this slice's O
  const int ds = blockIdx.x, g = blockIdx.y;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int NH = q_shape[1], W = window_shape[1];
  // z runs over the q rows; rows no batch row names get zeros
  int b = -1;
  for (int i = 0; i < positions_shape[0]; ++i) if (q_rows[i] == (int)blockIdx.z) b = i;
  T* o = out + ((size_t)blockIdx.z * NH + g * HG) * D + ds * DSL;
  if (b < 0) {
    for (int i = tid; i < HG * DSL; i += THREADS) o[(i / DSL) * D + i % DSL] = dsv4_t<T>(0.f);
    return;
  }
  const int KI = RATIO ? indices_shape[1] : 0;
  const int tw = table_shape[1];
  const int slot = slots[b], p = positions[b], qr = q_rows[b];
  const int nwin = min(p, W - 1) + 1;
  const int ncomp = RATIO ? (p / (RATIO ? RATIO : 1) + ((p % (RATIO ? RATIO : 1)) == RATIO - 1 ? 1 : 0)) : 0;
  const int nchunk = (W + KI + CK - 1) / CK;
  const float scale = fparams[0];
  // chunk c's key offsets (window ring rows, then the selected ids; -1: masked) into koff[c & 1]
  auto offsets = [&](int c) {
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
      koff[(c & 1) * CK + tid] = off;
      kwin[(c & 1) * CK + tid] = win;
    }
  };
  // chunk c's keys into Ks[c & 1] by cp.async (masked ones zero-filled); always commits a group
  auto fetch = [&](int c) {
    if (c < nchunk) {
      const long long* ko = koff + (c & 1) * CK;
      const int* kw = kwin + (c & 1) * CK;
      T* kd = Ks + (c & 1) * CK * LDK;
      for (int i = tid; i < CK * VPR; i += THREADS) {
        const int e = i / VPR, v = i - e * VPR;
        const long long off = ko[e];
        const T* src = (kw[e] ? window : pool) + (off >= 0 ? off : 0) + v * 8;
        dsv4_cp16(kd + e * LDK + v * 8, src, off >= 0 ? 16 : 0);
      }
    }
    dsv4_cp_commit();
  };
  const uint4* qsrc = reinterpret_cast<const uint4*>(q + ((size_t)qr * NH + g * HG) * D);
  for (int i = tid; i < HG * VPR; i += THREADS) {
    const int h = i / VPR, v = i - h * VPR;
    *reinterpret_cast<uint4*>(Qs + h * LDK + v * 8) = qsrc[i];
  }
  for (int i = tid; i < HG * LDO; i += THREADS) Os[i] = 0.f;
  if (tid < HG) { mrun[tid] = -INFINITY; lrun[tid] = 0.f; }
  offsets(0);
  __syncthreads();
  fetch(0);
  for (int c = 0; c < nchunk; ++c) {
    if (c + 1 < nchunk) offsets(c + 1);  // its buffer was last read by chunk c - 1 (before the syncs below)
    __syncthreads();                     // offsets visible; everyone is done with Ks[(c + 1) & 1]
    fetch(c + 1);
    dsv4_cp_wait<1>();                   // chunk c has landed (this thread's copies) ...
    __syncthreads();                     // ... everyone's
    const T* kb = Ks + (c & 1) * CK * LDK;
    const long long* ko = koff + (c & 1) * CK;
    {  // S = Q K^T: warp (key tile kt, half of D)
      const int kt = warp & 3, half = warp >> 2;
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
      wmma::fill_fragment(acc, 0.f);
      for (int ks = half * (D / 32); ks < (half + 1) * (D / 32); ++ks) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> fa;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> fb;
        wmma::load_matrix_sync(fa, Qs + ks * 16, LDK);
        wmma::load_matrix_sync(fb, kb + kt * 16 * LDK + ks * 16, LDK);
        wmma::mma_sync(acc, fa, fb, acc);
      }
      wmma::store_matrix_sync(Ss + half * HG * CK + kt * 16, acc, CK, wmma::mem_row_major);
    }
    __syncthreads();
    for (int hh = 0; hh < HG / NWARP; ++hh) {  // online softmax, one warp per head
      const int h = warp * (HG / NWARP) + hh;
      const bool v0 = ko[lane] >= 0, v1 = ko[lane + 32] >= 0;
      const float s0 = v0 ? (Ss[h * CK + lane] + Ss[HG * CK + h * CK + lane]) * scale : -INFINITY;
      const float s1 = v1 ? (Ss[h * CK + lane + 32] + Ss[HG * CK + h * CK + lane + 32]) * scale : -INFINITY;
      float m = fmaxf(s0, s1);
      for (int sh = 16; sh > 0; sh >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, sh));
      const float mold = mrun[h];
      const float mnew = fmaxf(mold, m);
      const float p0 = v0 ? __expf(s0 - mnew) : 0.f, p1 = v1 ? __expf(s1 - mnew) : 0.f;
      float l = p0 + p1;
      for (int sh = 16; sh > 0; sh >>= 1) l += __shfl_xor_sync(0xffffffffu, l, sh);
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
    for (int i = tid; i < HG * DSL; i += THREADS) {
      const int h = i / DSL, d = i - h * DSL;
      Os[h * LDO + d] *= alpha[h];
    }
    __syncthreads();
    if (warp < NT16) {  // O[:, slice] += P V[:, slice] (V = K)
      wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> fp[CK / 16];
#pragma unroll
      for (int ks = 0; ks < CK / 16; ++ks) wmma::load_matrix_sync(fp[ks], Ps + ks * 16, LDP);
      for (int nt = warp; nt < NT16; nt += NWARP) {
        wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
        wmma::load_matrix_sync(acc, Os + nt * 16, LDO, wmma::mem_row_major);
#pragma unroll
        for (int ks = 0; ks < CK / 16; ++ks) {
          wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> fv;
          wmma::load_matrix_sync(fv, kb + ks * 16 * LDK + ds * DSL + nt * 16, LDK);
          wmma::mma_sync(acc, fp[ks], fv, acc);
        }
        wmma::store_matrix_sync(Os + nt * 16, acc, LDO, wmma::mem_row_major);
      }
    }
  }
  __syncthreads();
  // the sink joins the denominator here (as `combine` does over splits)
  for (int i = tid; i < HG * DSL; i += THREADS) {
    const int h = i / DSL, d = i - h * DSL;
    const float sink = sinks[g * HG + h], m = mrun[h];
    const float M = fmaxf(m, sink);
    const float e = (m == -INFINITY) ? 0.f : __expf(m - M);
    o[h * D + d] = dsv4_t<T>(Os[h * LDO + d] * e / (lrun[h] * e + __expf(sink - M)));
  }
"""

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
  const int b = blockIdx.z;
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
        if (ONE) {  // this block's only chunk: straight to its split's partial output
          const size_t ob = ((size_t)b * nsplit + split) * NH + g * HG;
          wmma::store_matrix_sync(opart + ob * D + nt * 16, acc, D, wmma::mem_row_major);
          continue;
        }
        wmma::store_matrix_sync(Os + nt * 16, acc, LDO, wmma::mem_row_major);
      }
    }
  }
  __syncthreads();
  const size_t base = ((size_t)b * nsplit + split) * NH + g * HG;
  if (!ONE) {
    for (int i = tid; i < HG * D / 4; i += THREADS) {
      const int h = i / (D / 4), d4 = i - h * (D / 4);
      const float* src = Os + h * LDO + d4 * 4;
      reinterpret_cast<float4*>(opart + (base + h) * D)[d4] = make_float4(src[0], src[1], src[2], src[3]);
    }
  }
  if (tid < HG) { ml[(base + tid) * 2] = mrun[tid]; ml[(base + tid) * 2 + 1] = lrun[tid]; }
"""
