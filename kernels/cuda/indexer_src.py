"""CUDA device code of indexer_rows (launch plans: kernels/cuda/indexer.py).

`SEGMENT` (score + top-k of one segment, + its filter bound) and indexer_one_src.ONE (the one-launch
kernel) share the scoring body `SCORE` (its `EMIT` says where a chunk's keys go); indexer_merge_src.MERGE
is the per-row top-k over the segments' candidates. Template constants: T, NI, DI, PAGE, SEG, TOPK, CH, ST
(+ LDC, NSEG, DENSE, CAPS: segment). Block-wide select helpers: kernels/cuda/select.py.
"""

from __future__ import annotations

PRE = r"""
  constexpr int NT = 256, NWARP = 8, HT = NI / 16, KG = NWARP / HT, KS = DI / 16, LDK = DI + 8, VPR = DI / 8;
  constexpr int NJ = CH / 8 / KG;  // entry tiles of 8 per warp and chunk
  static_assert(NJ >= 1 && KG * NJ * 8 == CH, "CH / 8 entry tiles over the warps of a head tile");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* Ks = reinterpret_cast<T*>(smem_raw);                               // [ST][CH][LDK]: ST-stage pipeline
  float* part = reinterpret_cast<float*>(Ks + ST * CH * LDK);           // [HT][CH]
  unsigned int* skey = reinterpret_cast<unsigned int*>(part + HT * CH);  // [SEG]
  unsigned int* hist = skey + SEG;                                       // [2048]
  __shared__ int wsum[NWARP];
  __shared__ int sh[3];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
"""
# One output buffer `cand` in planes (one output, not several: MLX's host cost grows with each): keys [B][LDC]
# uint32, then ids [B][LDC] int32 and bounds [B][NSEG] uint32. DENSE (segments of at most 2 * TOPK entries):
# every key of the segment at its entry's place (the list position is the id; no ids plane), then each
# segment's compact list [B][NSEG][CAPS] of (key, place in the segment): its keys >= tau, in order, then
# the bounds, the taus and the compact lists' lengths (-1: more than CAPS) [B][NSEG] each.
CAND = r"""  const size_t NBL = (size_t)positions_shape[0] * LDC, NBS = (size_t)positions_shape[0] * NSEG;
  unsigned int* ckeys = cand;
  int* cids = reinterpret_cast<int*>(cand + NBL);
  uint2* clist = reinterpret_cast<uint2*>(cand + NBL);  // DENSE; LDC % 4 == 0: 8-byte aligned
  unsigned int* cbound = cand + (DENSE ? NBL + 2 * NBS * CAPS : 2 * NBL);
  unsigned int* ctau = cbound + NBS;
  int* clen = reinterpret_cast<int*>(ctau + NBS);
"""
HEAD_SEG = CAND + r"""  const int seg = blockIdx.x, b = blockIdx.y;
  const int p = positions[b];
  const int n = dsv4_emitted(p, 4);
  const int s0 = seg * SEG;
  const int nv = max(0, min(SEG, n - s0));
  constexpr int PER = DENSE ? SEG : TOPK;  // list entries a segment writes
  const size_t obase = (size_t)b * LDC + (size_t)seg * PER;
  unsigned int* ok = ckeys + obase;
  int* oi = cids + obase;
  if (nv == 0) {
    for (int i = tid; i < PER; i += NT) { ok[i] = 0u; if (!DENSE) oi[i] = -1; }
    if (tid == 0) {
      cbound[(size_t)b * NSEG + seg] = 0xffffffffu;  // neutral in the merge's min
      if (DENSE) { ctau[(size_t)b * NSEG + seg] = 0u; clen[(size_t)b * NSEG + seg] = 0; }
    }
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
  LOADER
#pragma unroll
  for (int c = 0; c < ST - 1; ++c) load(c);
  for (int c = 0; c < nch; ++c) {
    WAIT
    __syncthreads();  // ... everyone's; and everyone is done with chunk c - 1's buffer and `part`
    load(c + ST - 1);
    const T* kb = Ks + (c % ST) * CH * LDK;
    // The warp's NJ entry tiles as NJ independent mma chains, interleaved in program order. Written one
    // tile after another they ran as 4 serial 8-deep HMMA chains (SASS), and the loop was latency-bound;
    // ptxas keeps most of each chain together at its default ~57 registers; indexer.SEG_BOUNDED_MAX bounds it.
    float acc[NJ][4];
#pragma unroll
    for (int j = 0; j < NJ; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
    // B fragments by ldmatrix.x4: lanes 8i..8i+7 address rows (entries) of 8x8 matrix i = (k-step
    // ks + i / 2, dims +8 * (i % 2)); lane gets (entry g, dims c2, c2 + 1) of each matrix
    const T* kr = kb + (kg * 8 + (lane & 7)) * LDK + (lane >> 4) * 16 + ((lane >> 3) & 1) * 8;
#pragma unroll
    for (int ks = 0; ks < KS; ks += 2) {
      uint32_t bf[NJ][4];
#pragma unroll
      for (int j = 0; j < NJ; ++j) dsv4_ldsm4(bf[j], kr + j * KG * 8 * LDK + ks * 16);
#pragma unroll
      for (int j = 0; j < NJ; ++j) dsv4_mma(acc[j], qa[ks], bf[j][0], bf[j][1], T());
      if (ks + 1 < KS) {
#pragma unroll
        for (int j = 0; j < NJ; ++j) dsv4_mma(acc[j], qa[ks + 1], bf[j][2], bf[j][3], T());
      }
    }
    // acc[j]: (head g, entry c2), (g, c2+1), (g+8, c2), (g+8, c2+1): ReLU, head weights, sum over heads
    float sa[NJ], sb[NJ];
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      sa[j] = w0 * fmaxf(acc[j][0], 0.f) + w1 * fmaxf(acc[j][2], 0.f);
      sb[j] = w0 * fmaxf(acc[j][1], 0.f) + w1 * fmaxf(acc[j][3], 0.f);
    }
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) {
#pragma unroll
      for (int j = 0; j < NJ; ++j) {
        sa[j] += __shfl_xor_sync(0xffffffffu, sa[j], o);
        sb[j] += __shfl_xor_sync(0xffffffffu, sb[j], o);
      }
    }
    if (lane < 4) {
#pragma unroll
      for (int j = 0; j < NJ; ++j) {
        const int kt = kg + j * KG;
        part[ht * CH + kt * 8 + c2] = sa[j];
        part[ht * CH + kt * 8 + c2 + 1] = sb[j];
      }
    }
    __syncthreads();  // part is full
    EMIT
  }
  __syncthreads();
"""
# Chunk loaders of SCORE (LOADER: the `load(c)` lambda that fills buffer c % ST; WAIT: chunk c has landed).
# cp.async: every thread copies 16-byte pieces (its groups: one per chunk, maybe empty).
LOAD_CP = r"""// LEAN: a chunk lies in one page (chunks start at multiples of CH) and the threads' 16-byte pieces tile
  // it evenly: one table read a chunk and CH * VPR / NT copies at fixed offsets (SASS: ~40 instructions a
  // chunk, against ~230 for the general loop, whose divisions and bounds ran in every thread).
  constexpr bool LEAN = PAGE % CH == 0 && NT % VPR == 0 && (CH * VPR) % NT == 0;
  constexpr int EP = NT / VPR;  // entries a pass of the block's threads covers
  const int le = tid / VPR, lv = tid - (tid / VPR) * VPR;
  const int* trow = table + (size_t)b * tw;
  auto load = [&](int c) {  // chunk c into buffer c % ST; always commits a group (maybe empty)
    if (c < nch) {
      T* dst = Ks + (c % ST) * CH * LDK;
      if (LEAN) {
        const int idx0 = s0 + c * CH, lim = nv - c * CH;
        const T* base = keys + ((size_t)trow[idx0 / PAGE] * PAGE + idx0 % PAGE + le) * DI + lv * 8;
        T* d = dst + le * LDK + lv * 8;
#pragma unroll
        for (int k = 0; k < CH * VPR / NT; ++k) {
          const bool ok = le + k * EP < lim;
          dsv4_cp16(d + k * EP * LDK, ok ? base + (size_t)k * EP * DI : keys, ok ? 16 : 0);
        }
      } else {
        for (int i = tid; i < CH * VPR; i += NT) {
          const int e = i / VPR, v = i - e * VPR;
          const int idx = s0 + c * CH + e;
          const T* src = keys;
          int bytes = 0;
          if (c * CH + e < nv) {
            const int pg = trow[idx / PAGE];
            src = keys + ((size_t)pg * PAGE + idx % PAGE) * DI + v * 8;
            bytes = 16;
          }
          dsv4_cp16(dst + e * LDK + v * 8, src, bytes);
        }
      }
    }
    dsv4_cp_commit();
  };"""
WAIT_CP = "dsv4_cp_wait<ST - 2>();  // chunk c has landed (this thread's copies)"


def score(loader: str = LOAD_CP, wait: str = WAIT_CP) -> str:
    """SCORE with its chunk loader (bench/phases.py swaps in others to time them)."""
    return SCORE.replace("LOADER", loader).replace("WAIT", wait)


# The chunk's scores to their keys in shared memory (segment).
EMIT_SMEM = r"""if (tid < CH && c * CH + tid < nv) {
      float s = 0.f;
#pragma unroll
      for (int h = 0; h < HT; ++h) s += part[h * CH + tid];
      skey[c * CH + tid] = dsv4_okey(s);
    }"""
TAIL_SEG = r"""  const int K = min(TOPK, nv);
  // the merge's filter bound: a lower bound of this segment's m-th largest key, m = ceil(min(TOPK, n)
  // / the row's segments), so the row has at least min(TOPK, n) keys >= the least of its segments'
  // bounds (0, no filtering, if this segment has fewer than m entries). A full segment gets it from
  // its top-k select's first pass (the floor of the m-th largest's bin); a short one selects it.
  const int nsr = (n + SEG - 1) / SEG;
  const int m = (min(TOPK, n) + nsr - 1) / nsr;
  unsigned int thr = 0u;  // score keys are >= 1 (0 only for NaN): with thr 0 every entry is taken
  int need_eq = nv;
  unsigned int bm = 0u;
  unsigned int tau = 0u;  // DENSE: the compact list holds the keys >= tau (all of a segment of at most CAPS)
  if (DENSE) {  // a select would keep at least half the segment: the merge takes every key. The bound is over
    // the row's full segments only: a short last segment's bound would be 0, and the merge would then keep the
    // whole list (past its shared memory: its slow path). Up to m = 32 from the class maxima (no radix pass;
    // 128K at top-512: m = 16), else from the first radix pass.
    const int nfull = n / SEG, kr = min(TOPK, n), mf = nfull ? (kr + nfull - 1) / nfull : kr;
    const bool cls = nfull > 0 && nv == SEG && mf <= 32;
    unsigned int cb = 0u;
    // tau, the least class maximum: below the row's bound (the least of the segments' class-maxima bounds)
    // on random data, so the merge reads ~120 keys a segment (of 1,024 at 128K), not all of them
    if (nv > CAPS) dsv4_class_maxima<NT>(skey, nv, cls ? mf : 32, hist, sh, cb, tau);
    if (cls) bm = cb;
    else if (nfull > 0 && nv < SEG) bm = 0xffffffffu;
    else bm = dsv4_kth_floor<NT>(skey, nv, mf, hist, wsum, sh);  // the row's one segment, or m > 32
  } else if (nv > TOPK) {
    dsv4_radix_kth<NT>(skey, nv, K, hist, wsum, sh, thr, need_eq, m, bm);
  } else if (nv >= m) {
    int e2;
    dsv4_radix_kth<NT>(skey, nv, m, hist, wsum, sh, bm, e2);
  }
  if (tid == 0) cbound[(size_t)b * NSEG + seg] = bm;
  if (DENSE) {  // key 0 past the row's entries: below every score, and after every entry in the list
    // + the compact list: warp w's run of RUN keys, one ballot per 32, one block scan (dsv4_take's general
    // form, ties and two scans, cost ~4K cycles here); the last warp knows the length
    constexpr int RUN = SEG / NWARP, STEPS = RUN / 32;
    static_assert(RUN % 32 == 0, "dense segments: whole ballots per warp");
    unsigned int bal[STEPS];
    int c = 0;
#pragma unroll
    for (int st = 0; st < STEPS; ++st) {
      const int i = warp * RUN + st * 32 + lane;
      const unsigned int v = i < nv ? skey[i] : 0u;
      ok[i] = v;
      bal[st] = __ballot_sync(0xffffffffu, i < nv && v >= tau);
      c += __popc(bal[st]);
    }
    int pos = __shfl_sync(0xffffffffu, dsv4_block_excl<NT>(lane == 0 ? c : 0, wsum), 0);
    if (warp == NWARP - 1 && lane == 0) {
      const int len = pos + c;
      ctau[(size_t)b * NSEG + seg] = tau;
      clen[(size_t)b * NSEG + seg] = len <= CAPS ? len : -1;  // -1: the merge reads the segment's keys
    }
    uint2* cl = clist + ((size_t)b * NSEG + seg) * CAPS;
    const unsigned int below = (1u << lane) - 1u;
#pragma unroll
    for (int st = 0; st < STEPS; ++st) {
      const int i = warp * RUN + st * 32 + lane, q = pos + __popc(bal[st] & below);
      if (((bal[st] >> lane) & 1u) && q < CAPS) cl[q] = make_uint2(skey[i], (unsigned int)i);
      pos += __popc(bal[st]);
    }
    return;
  }
  dsv4_take<NT>(skey, nv, thr, need_eq, wsum, [&](int pos, int i, unsigned int v) { ok[pos] = v; oi[pos] = s0 + i; });
  for (int i = K + tid; i < TOPK; i += NT) { ok[i] = 0u; oi[i] = -1; }
"""


def segment(loader: str = LOAD_CP, wait: str = WAIT_CP) -> str:
    return PRE + HEAD_SEG + score(loader, wait).replace("EMIT", EMIT_SMEM) + TAIL_SEG


SEGMENT = segment()
