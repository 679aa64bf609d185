"""`DSPLIT`, the short-row kernel of sparse_attention_rows (rows of up to DSPLIT_CHUNKS 64-key chunks:
sliding, HCA up to ~100K context; 1 launch; plan in attention.py, layout notes in attention_src.py).

Grid (D slices, head groups of 16, q rows), 8 warps. A block walks all of its row's chunks (the next
chunk's key offsets and keys in flight, cp.async double buffer) for its 16 heads:
- S = Q K^T over the full D with mma.sync / ldmatrix fragments, as `wide` (wmma's fragment loads cost
  ~10x the instructions); warp w: keys 16 (w % 4) .., half w / 4 of D; the halves' sums meet in the
  shared online softmax (`dsv4_online_softmax`);
- O of the block's D / DS columns stays in registers across the chunks (warp w: 16-column tiles w,
  w + 8, ..): rescaled by alpha and accumulated with P V (ldmatrix.trans for V = K) in place, so no O
  buffer in shared memory, no rescale pass and no barrier for it;
- the epilogue adds the sink to the denominator and writes q.dtype straight from the registers.
"""

from __future__ import annotations

from dsv4_serve.kernels.cuda.attention_src import ROW

DSPLIT = (
    r"""
  constexpr int LDK = D + 8, LDP = CK + 8, DSL = D / DS, VPR = D / 8, NWARP = 8, NT16 = DSL / 16;
  constexpr int TPW = (NT16 + NWARP - 1) / NWARP;  // O's 16-column tiles per warp
  static_assert(HG == 16 && CK == 64 && THREADS == 32 * NWARP && DSL % 16 == 0 && D % 32 == 0,
                "dsplit: 16 heads, 64-key chunks, 8 warps, 16-column slices");
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
  if (tid < HG) { mrun[tid] = -INFINITY; lrun[tid] = 0.f; }
  // fragment rows: this lane's accumulators are heads gr, gr + 8, columns c2, c2 + 1 of each n8 tile
  const int gr = lane >> 2, c2 = (lane & 3) * 2;
  const int arow = (lane & 7) + ((lane >> 3) & 1) * 8, acol = (lane >> 4) * 8;  // ldmatrix.x4 of an A tile
  float oacc[TPW][2][4];
#pragma unroll
  for (int t = 0; t < TPW; ++t)
#pragma unroll
    for (int j = 0; j < 2; ++j) oacc[t][j][0] = oacc[t][j][1] = oacc[t][j][2] = oacc[t][j][3] = 0.f;
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
    {  // S = Q K^T: warp (keys 16 (w % 4) .., half w / 4 of D) -> Ss[half]
      const int kt = warp & 3, half = warp >> 2;
      float acc[2][4];
#pragma unroll
      for (int j = 0; j < 2; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
      const T* qa = Qs + arow * LDK + acol;
      const T* kbp = kb + (kt * 16 + (lane >> 4) * 8 + (lane & 7)) * LDK + ((lane >> 3) & 1) * 8;
#pragma unroll 4
      for (int ks = half * (D / 32); ks < (half + 1) * (D / 32); ++ks) {
        uint32_t a[4], bk[4];
        dsv4_ldsm4(a, qa + ks * 16);
        dsv4_ldsm4(bk, kbp + ks * 16);  // keys 0-7 (bk 0, 1) and 8-15 (bk 2, 3) of the warp's 16
        dsv4_mma(acc[0], a, bk[0], bk[1], T());
        dsv4_mma(acc[1], a, bk[2], bk[3], T());
      }
      float* sr = Ss + half * HG * CK + gr * CK + kt * 16 + c2;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        *reinterpret_cast<float2*>(sr + j * 8) = make_float2(acc[j][0], acc[j][1]);
        *reinterpret_cast<float2*>(sr + 8 * CK + j * 8) = make_float2(acc[j][2], acc[j][3]);
      }
    }
    __syncthreads();
    dsv4_online_softmax<T, HG, CK, LDP, NWARP>(Ss, ko, scale, mrun, lrun, alpha, Ps);
    __syncthreads();
    {  // O[:, slice] = alpha O + P V[:, slice] (V = K), in registers
      const float a0 = alpha[gr], a1 = alpha[gr + 8];
      uint32_t pa[CK / 16][4];
#pragma unroll
      for (int ks = 0; ks < CK / 16; ++ks) dsv4_ldsm4(pa[ks], Ps + arow * LDP + ks * 16 + acol);
      // .trans B: lanes 8i..8i+7 address key rows ks*16 + 8 * (i % 2) + (lane % 8) of column tile i / 2
      const T* vb = kb + (((lane >> 3) & 1) * 8 + (lane & 7)) * LDK + (lane >> 4) * 8 + ds * DSL;
#pragma unroll
      for (int t = 0; t < TPW; ++t) {
        const int nt = warp + t * NWARP;
        if (nt < NT16) {
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            oacc[t][j][0] *= a0; oacc[t][j][1] *= a0; oacc[t][j][2] *= a1; oacc[t][j][3] *= a1;
          }
#pragma unroll
          for (int ks = 0; ks < CK / 16; ++ks) {
            uint32_t bv[4];
            dsv4_ldsm4t(bv, vb + ks * 16 * LDK + nt * 16);
            dsv4_mma(oacc[t][0], pa[ks], bv[0], bv[1], T());
            dsv4_mma(oacc[t][1], pa[ks], bv[2], bv[3], T());
          }
        }
      }
    }
  }
  __syncthreads();
  // the sink joins the denominator here (as `combine` does over splits)
  {
    float e[2], den[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int h = gr + 8 * r;
      const float sink = sinks[g * HG + h], m = mrun[h];
      const float M = fmaxf(m, sink);
      e[r] = (m == -INFINITY) ? 0.f : __expf(m - M);
      den[r] = lrun[h] * e[r] + __expf(sink - M);
    }
#pragma unroll
    for (int t = 0; t < TPW; ++t) {
      const int nt = warp + t * NWARP;
      if (nt < NT16) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          T* orow = o + gr * D + nt * 16 + j * 8 + c2;
          orow[0] = dsv4_t<T>(oacc[t][j][0] * e[0] / den[0]);
          orow[1] = dsv4_t<T>(oacc[t][j][1] * e[0] / den[0]);
          orow[8 * D] = dsv4_t<T>(oacc[t][j][2] * e[1] / den[1]);
          orow[8 * D + 1] = dsv4_t<T>(oacc[t][j][3] * e[1] / den[1]);
        }
      }
    }
  }
"""
)
