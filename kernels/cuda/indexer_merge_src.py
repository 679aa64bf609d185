"""CUDA device code of indexer_rows' second launch, `MERGE` (launch plan: kernels/cuda/indexer.py): per q-buffer
row, the top-k over the segments' candidates (`indexer_src.CAND` names the planes it reads). Template
constants: TOPK, L, LDC, NSEG, SEG, CAPS, CAPC, UR, HB, DENSE. Block-wide select helpers: kernels/cuda/select.py.
"""

from __future__ import annotations

MERGE = r"""
  constexpr int NT = 1024, NW = NT / 32, PER = (L + NW - 1) / NW, V = 32 * UR;  // V: a warp's items a chunk
  static_assert(!DENSE || NSEG <= NW, "dense segments: a warp each");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned int* ck = reinterpret_cast<unsigned int*>(smem_raw);  // [CAPC] kept candidates minus the bound, in order
  int* cpos = reinterpret_cast<int*>(ck + CAPC);                 // [CAPC] their places in the row's list
  __shared__ __align__(16) unsigned int hist[1 << HB];  // 16-byte aligned: dsv4_pick_bin's uint4 reads
  __shared__ int wsum[32];
  __shared__ int sh[3];
  __shared__ unsigned int top;  // the greatest kept key
  const int r = blockIdx.x, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int nb = positions_shape[0];
  int b = -1;
  for (int i0 = 0; i0 < nb; i0 += 32) {  // every warp finds the batch row itself: a load per lane, a ballot
    const unsigned int m = __ballot_sync(0xffffffffu, i0 + lane < nb && q_rows[i0 + lane] == r);
    if (m) b = i0 + 31 - __clz(m);  // the last batch row naming r
  }
  int* o = out + (size_t)r * TOPK;
  const size_t NBL = (size_t)nb * LDC, NBS = (size_t)nb * NSEG, rb = (size_t)max(b, 0);
  const unsigned int* cbounds = cand + (DENSE ? NBL + 2 * NBS * CAPS : 2 * NBL);
  const unsigned int* keys = cand + rb * LDC;
  const int* ids = reinterpret_cast<const int*>(cand + NBL) + rb * LDC;
  // The filter: each warp's items, in list order. DENSE: warp w takes segment w, from its compact list when
  // that holds every key >= the bound (its tau <= the bound, at most CAPS keys: 128K, random data, ~120 of
  // 1,024), else from its keys in the list. Otherwise warp w takes its run [w0, w1) of the list.
  const int w0 = min(L, warp * (DENSE ? SEG : PER));
  const int w1 = (DENSE && warp >= NSEG) ? w0 : min(L, w0 + (DENSE ? SEG : PER));
  const uint2* cl = reinterpret_cast<const uint2*>(cand + NBL) + (rb * NSEG + warp) * CAPS;
  int clen = -1;
  unsigned int ctau = 0xffffffffu;
  if (DENSE && b >= 0 && warp < NSEG) {  // these load with the bounds
    ctau = cbounds[NBS + rb * NSEG + warp];
    clen = reinterpret_cast<const int*>(cbounds + 2 * NBS)[rb * NSEG + warp];
  }
  int K = 0;
  unsigned int bnd = 0xffffffffu;  // warp 0: the least of the segments' bounds (at least K candidates are >= it)
  if (b >= 0) {  // the position and the bounds load together (neither waits for the other)
    const int p = positions[b];
    if (warp == 0) for (int s = lane; s < NSEG; s += 32) bnd = min(bnd, cbounds[rb * NSEG + s]);
    K = min(TOPK, dsv4_emitted(p, 4));
  }
  if (K == 0) {
    for (int i = tid; i < TOPK; i += NT) o[i] = -1;
    return;
  }
  if (warp == 0) {
    for (int sft = 16; sft > 0; sft >>= 1) bnd = min(bnd, __shfl_xor_sync(0xffffffffu, bnd, sft));
    if (lane == 0) { sh[2] = (int)bnd; top = 0u; }
  }
  __syncthreads();
  const unsigned int bound = (unsigned int)sh[2];
  const bool compact = DENSE && clen >= 0 && ctau <= bound;
  const int nit = compact ? clen : w1 - w0;
  // chunks of V items, UR loads per lane in flight (the list is in L2); the count runs last chunk first so
  // that the first stays in registers for the write (one chunk: the items are read once)
  const int nck = (nit + V - 1) / V;
  unsigned int kv[UR];
  int pv[UR];
  auto fetch = [&](int base) {
#pragma unroll
    for (int u = 0; u < UR; ++u) {
      const int j = base + u * 32 + lane;
      if (compact) {
        const uint2 e = j < nit ? cl[j] : make_uint2(0u, 0u);
        kv[u] = e.x;
        pv[u] = w0 + (int)e.y;
      } else {
        kv[u] = j < nit ? keys[w0 + j] : 0u;
        pv[u] = w0 + j;
      }
    }
  };
  int cnt = 0;
  unsigned int kmax = 0u;
  for (int ci = nck - 1; ci >= 0; --ci) {
    const int base = ci * V;
    fetch(base);
#pragma unroll
    for (int u = 0; u < UR; ++u) {
      const bool t = base + u * 32 + lane < nit && kv[u] >= bound;
      cnt += t ? 1 : 0;
      kmax = t ? max(kmax, kv[u]) : kmax;
    }
  }
  for (int sft = 16; sft > 0; sft >>= 1) {
    cnt += __shfl_xor_sync(0xffffffffu, cnt, sft);
    kmax = max(kmax, __shfl_xor_sync(0xffffffffu, kmax, sft));
  }
  if (lane == 0 && cnt) atomicMax(&top, kmax);
  const int off = __shfl_sync(0xffffffffu, dsv4_block_excl<NT>(lane == 0 ? cnt : 0, wsum), 0);
  if (warp == NW - 1 && lane == 0) sh[2] = off + cnt;
  __syncthreads();
  const int n2 = sh[2];
  unsigned int thr;
  int need_eq;
  if (n2 <= CAPC) {
    const unsigned int below = (1u << lane) - 1u;
    int pos = off;
    for (int ci = 0; ci < nck; ++ci) {
      const int base = ci * V;
      if (ci) fetch(base);
#pragma unroll
      for (int u = 0; u < UR; ++u) {
        const bool t = base + u * 32 + lane < nit && kv[u] >= bound;
        const unsigned int bal = __ballot_sync(0xffffffffu, t);
        if (t) {
          const int q = pos + __popc(bal & below);
          ck[q] = kv[u] - bound;
          cpos[q] = pv[u];
        }
        pos += __popc(bal);
      }
    }
    __syncthreads();
    // over the offsets from the bound: the kept keys share their top bits (128K, random data: 24 bits
    // differ, two 12-bit passes, not three)
    dsv4_radix_kth_span<NT, HB>(ck, n2, K, top - bound, hist, wsum, sh, thr, need_eq);
    dsv4_take<NT>(ck, n2, thr, need_eq, wsum,
                  [&](int q, int i, unsigned int v) { o[q] = DENSE ? cpos[i] : ids[cpos[i]]; });
  } else {  // the bound filtered too little: select over the whole list in global memory
    dsv4_radix_kth<NT>(keys, L, K, hist, wsum, sh, thr, need_eq);
    dsv4_take<NT>(keys, L, thr, need_eq, wsum, [&](int q, int i, unsigned int v) { o[q] = DENSE ? i : ids[i]; });
  }
  for (int i = K + tid; i < TOPK; i += NT) o[i] = -1;
"""
