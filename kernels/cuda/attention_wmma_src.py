"""The wmma kernel of sparse_attention_rows: PARTIAL, split-K over head groups of 16 for long rows (see
attention_src.py for its plan). A candidate for the mma.sync + ldmatrix fragments `WIDE` and `DSPLIT`
use (wmma's fragment loads cost ~10x the instructions: ncu, dsplit).
"""

from __future__ import annotations

from dsv4_serve.kernels.cuda.attention_src import ROW

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
