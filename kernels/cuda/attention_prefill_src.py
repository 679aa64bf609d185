"""`HEADS`, prefill's attention kernel: one query a block with ALL of its 64 heads (launch: kernels/cuda/
prefill_attention.py). V4 attention is multi-query (one K = V row a position, shared by every head), so a
block that holds all 64 heads gathers each key once for 64 heads (M = 64 rows of every mma), where decode's
`dsplit` gathers it once per 16-head group (4 blocks a query) and looks its row up among all B rows.

Grid (1, NH / 64, q rows), 16 warps, one block a multiprocessor (~223 KiB of shared memory). The block walks
its query's keys in 64-key chunks (offsets and keys of the next chunk in flight, cp.async double buffer):
- window rows j of batch row b are `keys[b + j]` (the reversed keys of the prompt chunk: no window copy),
  valid while j <= p; then the compressed entries: CSA's picked ids, or (`ALL`, HCA) every entry the query
  has emitted, in order, so the row stops after them;
- S = Q K^T: warp (half of D, 32 heads, 16 keys), the halves' sums meet in Ss (half 0 stores, half 1 adds);
- the online softmax (warp w: heads 4w ..), then O = alpha O + P V in registers: warp (32 heads, 64 of D's
  columns), 64 f32 accumulators a lane;
- chunks with no valid key (CSA picks past a short prompt's entries: -1) are skipped as a block;
- the epilogue adds the sink to the denominator and writes q.dtype.
Math as decode's kernels: bf16/f16 q, keys and P, f32 logits, softmax and accumulation.
"""

from __future__ import annotations

HEADS = r"""
  constexpr int LDK = D + 8, LDP = CK + 8, LDS = CK + 4, VPR = D / 8, NWARP = THREADS / 32;
  static_assert(HG == 64 && CK == 64 && THREADS == 512 && D % 128 == 0, "heads: 64 heads, 64 keys, 16 warps");
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* Qs = reinterpret_cast<T*>(smem_raw);               // [HG][LDK]
  T* Ks = Qs + HG * LDK;                                // [2][CK][LDK]: double buffer
  T* Ps = Ks + 2 * CK * LDK;                            // [HG][LDP]
  float* Ss = reinterpret_cast<float*>(Ps + HG * LDP);  // [HG][LDS]
  float* mrun = Ss + HG * LDS;
  float* lrun = mrun + HG;
  float* alpha = lrun + HG;
  long long* koff = reinterpret_cast<long long*>(alpha + HG);  // [2][CK]
  int* kwin = reinterpret_cast<int*>(koff + 2 * CK);           // [2][CK]
  const int g = blockIdx.y, z = blockIdx.z, tid = threadIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int NH = q_shape[1], B = positions_shape[0];
  int b = B - 1 - z;  // prefill's rows: q row z is batch row B - 1 - z (else looked up)
  if (b < 0 || b >= B || q_rows[b] != z) {
    b = -1;
    for (int i = 0; i < B; ++i) if (q_rows[i] == z) b = i;
  }
  T* o = out + ((size_t)z * NH + g * HG) * D;
  if (b < 0) {
    for (int i = tid; i < HG * D; i += THREADS) o[i] = dsv4_t<T>(0.f);
    return;
  }
  const int KI = RATIO ? indices_shape[1] : 0;
  const int slot = slots[b], p = positions[b], qr = q_rows[b];
  const int nwin = min(p, WIN - 1) + 1;
  const int ncomp = dsv4_emitted(p, RATIO);
  const int nkeys = WIN + (ALL ? min(KI, ncomp) : KI);
  const int nchunk = (nkeys + CK - 1) / CK;
  const float scale = fparams[0];
  const int* ind_row = indices + (ALL ? 0 : (size_t)qr * KI);
  auto offsets = [&](int c) {  // chunk c's key offsets (-1: masked) into koff[c & 1], keys (1) or pool (0)
    if (tid >= CK) return;
    const int j = c * CK + tid;
    long long off = -1;
    int win = 1;
    if (j < WIN) {
      if (j < nwin) off = (long long)(slot + j) * D;
    } else if (j < nkeys) {
      win = 0;
      const int id = ALL ? j - WIN : ind_row[j - WIN];
      if (id >= 0 && id < ncomp) off = ((long long)table[id / PAGE] * PAGE + id % PAGE) * D;
    }
    koff[(c & 1) * CK + tid] = off;
    kwin[(c & 1) * CK + tid] = win;
  };
  auto fetch = [&](int c, int live) {  // chunk c's keys into Ks[c & 1]; always commits a group (maybe empty)
    if (c < nchunk && live)
      dsv4_gather_keys<T, D, CK, LDK, THREADS>(Ks + (c & 1) * CK * LDK, koff + (c & 1) * CK, kwin + (c & 1) * CK,
                                               keys, pool);
    dsv4_cp_commit();
  };
  if (tid < HG) { mrun[tid] = -INFINITY; lrun[tid] = 0.f; }
  offsets(0);
  int live = __syncthreads_or(tid < CK && koff[tid] >= 0);
  const T* qsrc = q + ((size_t)qr * NH + g * HG) * D;
  for (int i = tid; i < HG * VPR; i += THREADS) {
    const int h = i / VPR, v = i - h * VPR;
    dsv4_cp16(Qs + h * LDK + v * 8, qsrc + (size_t)h * D + v * 8, 16);
  }
  fetch(0, live);  // one group: q and chunk 0
  // fragment rows: a lane's accumulators are rows gr, gr + 8 and columns c2, c2 + 1 of each 16 x 8 tile
  const int gr = lane >> 2, c2 = (lane & 3) * 2;
  const int arow = (lane & 7) + ((lane >> 3) & 1) * 8, acol = (lane >> 4) * 8;  // ldmatrix.x4 of an A tile
  const int om = warp >> 3, od = warp & 7;  // P V: heads 32 om .., columns 64 od ..
  float oacc[2][8][4];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 8; ++j) oacc[i][j][0] = oacc[i][j][1] = oacc[i][j][2] = oacc[i][j][3] = 0.f;
  for (int c = 0; c < nchunk; ++c) {
    if (c + 1 < nchunk) offsets(c + 1);  // its buffer was last read by chunk c - 1 (before the syncs below)
    const int live_next = __syncthreads_or(c + 1 < nchunk && tid < CK && koff[((c + 1) & 1) * CK + tid] >= 0);
    fetch(c + 1, live_next);
    dsv4_cp_wait<1>();  // chunk c (and q) landed: this thread's copies ...
    __syncthreads();    // ... everyone's
    if (live) {         // block-uniform
      const T* kb = Ks + (c & 1) * CK * LDK;
      {  // S = Q K^T: warp (half dh of D, heads 32 mh .., keys 16 kq ..); half 0 stores, then half 1 adds
        const int dh = warp >> 3, mh = (warp >> 2) & 1, kq = warp & 3;
        float acc[2][2][4];
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
          for (int j = 0; j < 2; ++j) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.f;
        const T* qa = Qs + (mh * 32 + arow) * LDK + acol + dh * (D / 2);
        const T* kbp = kb + (kq * 16 + (lane >> 4) * 8 + (lane & 7)) * LDK + ((lane >> 3) & 1) * 8 + dh * (D / 2);
#pragma unroll 4
        for (int ks = 0; ks < D / 32; ++ks) {
          uint32_t a0[4], a1[4], bk[4];
          dsv4_ldsm4(a0, qa + ks * 16);
          dsv4_ldsm4(a1, qa + 16 * LDK + ks * 16);
          dsv4_ldsm4(bk, kbp + ks * 16);  // keys 0-7 (bk 0, 1) and 8-15 (bk 2, 3) of the warp's 16
          dsv4_mma(acc[0][0], a0, bk[0], bk[1], T());
          dsv4_mma(acc[0][1], a0, bk[2], bk[3], T());
          dsv4_mma(acc[1][0], a1, bk[0], bk[1], T());
          dsv4_mma(acc[1][1], a1, bk[2], bk[3], T());
        }
        for (int pass = 0; pass < 2; ++pass) {
          if (dh == pass) {
#pragma unroll
            for (int i = 0; i < 2; ++i)
#pragma unroll
              for (int j = 0; j < 2; ++j) {
                float2* s0 = reinterpret_cast<float2*>(Ss + (mh * 32 + i * 16 + gr) * LDS + kq * 16 + j * 8 + c2);
                float2* s1 = s0 + 4 * LDS;  // 8 rows on (float2 units: LDS / 2 a row)
                const float2 u0 = pass ? *s0 : make_float2(0.f, 0.f), u1 = pass ? *s1 : make_float2(0.f, 0.f);
                *s0 = make_float2(u0.x + acc[i][j][0], u0.y + acc[i][j][1]);
                *s1 = make_float2(u1.x + acc[i][j][2], u1.y + acc[i][j][3]);
              }
          }
          __syncthreads();
        }
      }
      // the online softmax over this chunk (warp w: heads HG / NWARP w ..), S in one plane
      dsv4_online_softmax<T, HG, CK, LDP, NWARP, LDS, 1>(Ss, koff + (c & 1) * CK, scale, mrun, lrun, alpha, Ps);
      __syncthreads();
      {  // O = alpha O + P V (V = K), in registers
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const float a0 = alpha[om * 32 + i * 16 + gr], a1 = alpha[om * 32 + i * 16 + gr + 8];
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            oacc[i][j][0] *= a0; oacc[i][j][1] *= a0; oacc[i][j][2] *= a1; oacc[i][j][3] *= a1;
          }
        }
        const T* pa = Ps + (om * 32 + arow) * LDP + acol;
        // .trans B: lanes 8i..8i+7 address key rows ks*16 + 8 * (i % 2) + (lane % 8) of column tile i / 2
        const T* vb = kb + (((lane >> 3) & 1) * 8 + (lane & 7)) * LDK + (lane >> 4) * 8 + od * 64;
#pragma unroll
        for (int ks = 0; ks < CK / 16; ++ks) {
          uint32_t p0[4], p1[4];
          dsv4_ldsm4(p0, pa + ks * 16);
          dsv4_ldsm4(p1, pa + 16 * LDP + ks * 16);
#pragma unroll
          for (int jj = 0; jj < 4; ++jj) {
            uint32_t bv[4];
            dsv4_ldsm4t(bv, vb + ks * 16 * LDK + jj * 16);
            dsv4_mma(oacc[0][2 * jj], p0, bv[0], bv[1], T());
            dsv4_mma(oacc[0][2 * jj + 1], p0, bv[2], bv[3], T());
            dsv4_mma(oacc[1][2 * jj], p1, bv[0], bv[1], T());
            dsv4_mma(oacc[1][2 * jj + 1], p1, bv[2], bv[3], T());
          }
        }
      }
    }
    live = live_next;
  }
  __syncthreads();
  // the sink joins the denominator here
#pragma unroll
  for (int i = 0; i < 2; ++i) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int h = om * 32 + i * 16 + gr + 8 * r;
      const float sink = sinks[g * HG + h], m = mrun[h];
      const float M = fmaxf(m, sink);
      const float e = (m == -INFINITY) ? 0.f : __expf(m - M);
      const float f = e / (lrun[h] * e + __expf(sink - M));
      T* orow = o + (size_t)h * D + od * 64 + c2;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        orow[j * 8] = dsv4_t<T>(oacc[i][j][2 * r] * f);
        orow[j * 8 + 1] = dsv4_t<T>(oacc[i][j][2 * r + 1] * f);
      }
    }
  }
"""


def heads_smem(d: int, hg: int = 64, ck: int = 64) -> int:
    """Q, two key chunks, P (16-bit), S and the softmax state (f32), two chunks' key offsets."""
    return 2 * (hg * (d + 8) + 2 * ck * (d + 8) + hg * (ck + 8)) + 4 * (hg * (ck + 4) + 3 * hg) + 2 * ck * 12
