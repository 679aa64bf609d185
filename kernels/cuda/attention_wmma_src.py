"""The wmma kernels of sparse_attention_rows (DSPLIT: short rows, one launch; PARTIAL: split-K over head
groups of 16 for long rows); see attention_src.py for the plan of each. Candidates for the mma.sync +
ldmatrix fragments `WIDE` uses (wmma's fragment loads cost ~10x the instructions: ncu, dsplit).
"""

from __future__ import annotations

from kernels.cuda.attention_src import ROW

DSPLIT = (
    r"""
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
"""
    + ROW
    + r"""  const int nchunk = (W + KI + CK - 1) / CK;
  const float scale = fparams[0];
  const int* ind_row = indices + (size_t)qr * KI;
  const int* table_row = table + b * tw;
  auto offsets = [&](int c) {  // chunk c's key offsets into koff[c & 1]
    dsv4_chunk_offsets<D, PAGE, CK>(c, W, KI, nwin, ncomp, slot, ind_row, table_row, koff + (c & 1) * CK,
                                    kwin + (c & 1) * CK);
  };
  auto fetch = [&](int c) {  // chunk c's keys into Ks[c & 1]; always commits a group (maybe empty)
    if (c < nchunk)
      dsv4_gather_keys<T, D, CK, LDK, THREADS>(Ks + (c & 1) * CK * LDK, koff + (c & 1) * CK, kwin + (c & 1) * CK,
                                               window, pool);
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
    dsv4_qk_wmma<T, D, HG, CK, LDK>(Qs, kb, Ss);
    __syncthreads();
    dsv4_online_softmax<T, HG, CK, LDP, NWARP>(Ss, ko, scale, mrun, lrun, alpha, Ps);
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
)

PARTIAL = (
    r"""
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
  float* opart = part;  // one output in two planes: O [B][NS][NH][D], then (m, l) [B][NS][NH][2]
  float* ml = part + (size_t)gridDim.z * nsplit * NH * D;
  const int b = blockIdx.z;
"""
    + ROW
    + r"""  const int nchunk = (W + KI + CK - 1) / CK;
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
    dsv4_chunk_offsets<D, PAGE, CK>(c, W, KI, nwin, ncomp, slot, indices + (size_t)qr * KI, table + b * tw, koff,
                                    kwin);
    const int any = __syncthreads_or(tid < CK && koff[tid] >= 0);
    if (!any) continue;
    dsv4_gather_keys<T, D, CK, LDK, THREADS>(Ks, koff, kwin, window, pool);
    dsv4_cp_commit();
    dsv4_cp_wait<0>();
    __syncthreads();
    dsv4_qk_wmma<T, D, HG, CK, LDK>(Qs, Ks, Ss);
    __syncthreads();
    dsv4_online_softmax<T, HG, CK, LDP, NWARP>(Ss, koff, scale, mrun, lrun, alpha, Ps);
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
)
