"""Block-wide top-k building blocks (CUDA device code) for the indexer's kernels.

- `dsv4_block_excl`: exclusive prefix sum over the block (warp shuffles, then warp 0 over the warp totals).
- `dsv4_radix_kth`: the k-th largest of n uint32 keys (radix select, 11 + 11 + 10 bits, shared-memory
  histograms by one atomic per key) and how many keys equal to it belong to the top k.
- `dsv4_radix_kth_span`: the same over offsets in [0, span], passes over span's bits only.
- `dsv4_class_maxima`: a lower bound of the m-th largest (m <= 32) and the least of 32 class maxima.
- `dsv4_take`: ordered compaction of the top k (every key above the threshold, then the first keys
  equal to it: ties go to the lowest index), in index order; warps take contiguous runs.
"""

# Block-wide helpers shared by the indexer's kernels (NT threads; hist: 2048 words of shared memory, 2^HB for
# dsv4_radix_kth_span).
HELPERS = r"""
template <int NT>
__device__ __forceinline__ int dsv4_block_excl(int v, int* wsum) {
  // warp scans, then warp 0 scans the warp totals (no serial walk over the warps)
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int incl = v;
  for (int o = 1; o < 32; o <<= 1) {
    const int t = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += t;
  }
  __syncthreads();  // wsum may still be read by the previous scan
  if (lane == 31) wsum[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    const int tot = lane < NT / 32 ? wsum[lane] : 0;
    int x = tot;
    for (int o = 1; o < 32; o <<= 1) {
      const int t = __shfl_up_sync(0xffffffffu, x, o);
      if (lane >= o) x += t;
    }
    if (lane < NT / 32) wsum[lane] = x - tot;  // exclusive offset of each warp
  }
  __syncthreads();
  return wsum[warp] + incl - v;
}

// Loads for the selects: plain, or through L2 (__ldcg) for keys other blocks of the launch wrote (no SM
// may serve them from a stale L1 line).
template <bool G> __device__ __forceinline__ unsigned int dsv4_ld(const unsigned int* p);
template <> __device__ __forceinline__ unsigned int dsv4_ld<true>(const unsigned int* p) { return __ldcg(p); }
template <> __device__ __forceinline__ unsigned int dsv4_ld<false>(const unsigned int* p) { return *p; }

// The bin of hist[0..nbins) (descending) that holds the rem-th largest: sh[0] = bin, sh[1] = rem left in
// it; with_k2 (and 1 <= k2): sh[2] = the bin that holds the k2-th largest. nbins <= 4096; hist 16-byte
// aligned. Thread t owns bins lo .. lo + bpt - 1 (taken descending), read once into registers, as uint4 where
// bpt is a multiple of 4: the strided scalar reads had bpt-way bank conflicts, twice (before and after the
// scan). H200, 8 rows (bench/phases.py; 2026-11-30, 40f5c60): the merge's select 7.5K -> 5.65K cycles at 128K, 1M's
// segment select 17.1K -> 15.1K.
template <int NT>
__device__ __forceinline__ void dsv4_pick_bin(const unsigned int* hist, int nbins, int rem, int* wsum, int* sh,
                                              bool with_k2 = false, int k2 = 0) {
  constexpr int MB = 4096 / NT > 0 ? 4096 / NT : 1;  // the most bins a thread owns
  const int tid = threadIdx.x;
  const int bpt = nbins / NT > 0 ? nbins / NT : 1;
  const int lo = nbins - (tid + 1) * bpt;  // < 0: no bin (nbins < NT)
  unsigned int hv[MB];
  if (bpt % 4 == 0) {
#pragma unroll
    for (int q = 0; q < (MB + 3) / 4; ++q) {
      if (4 * q < bpt) {
        const uint4 x = *reinterpret_cast<const uint4*>(hist + lo + 4 * q);
        hv[4 * q] = x.x;
        if (4 * q + 1 < MB) hv[4 * q + 1] = x.y;
        if (4 * q + 2 < MB) hv[4 * q + 2] = x.z;
        if (4 * q + 3 < MB) hv[4 * q + 3] = x.w;
      }
    }
  } else {
#pragma unroll
    for (int j = 0; j < MB; ++j) hv[j] = (j < bpt && lo + j >= 0) ? hist[lo + j] : 0u;
  }
  int local = 0;
#pragma unroll
  for (int j = 0; j < MB; ++j) local += (j < bpt && lo + j >= 0) ? (int)hv[j] : 0;
  int cum = dsv4_block_excl<NT>(local, wsum);
#pragma unroll
  for (int j = MB - 1; j >= 0; --j) {
    if (j >= bpt || lo + j < 0) continue;
    const int h = (int)hv[j];
    if (cum < rem && cum + h >= rem) { sh[0] = lo + j; sh[1] = rem - cum; }
    if (with_k2 && cum < k2 && cum + h >= k2) sh[2] = lo + j;
    cum += h;
  }
  __syncthreads();
}

// One radix pass's histogram: hist[0..nbins) counts the keys of keys[0..n) whose bits under `mask` are
// `prefix`, by their bits [shift, shift + log2(nbins)). Ends after a __syncthreads.
template <int NT, bool G>
__device__ __forceinline__ void dsv4_hist_pass(const unsigned int* keys, int n, int shift, int nbins,
                                               unsigned int prefix, unsigned int mask, unsigned int* hist) {
  const int tid = threadIdx.x;
  constexpr int UR = G ? 16 : 4;  // independent loads in flight per thread (more for L2 latency)
  for (int i = tid; i < nbins; i += NT) hist[i] = 0u;
  __syncthreads();
  for (int base = 0; base < n; base += UR * NT) {
    unsigned int v[UR];
    bool ok[UR];
#pragma unroll
    for (int u = 0; u < UR; ++u) {
      const int i = base + u * NT + tid;
      v[u] = i < n ? dsv4_ld<G>(keys + i) : 0u;
      ok[u] = i < n && (v[u] & mask) == prefix;
    }
#pragma unroll
    for (int u = 0; u < UR; ++u) {
      if (!__any_sync(0xffffffffu, ok[u])) continue;  // later passes: most warps hold no key of the bin
      // one shared atomic per key: aggregating a warp's equal bins first (__match_any_sync) cost more on
      // the H200 (8 rows: segment select 11.3K -> 9.1K cycles at 128K, 31.6K -> 17.3K at 1M; 2026-11-30, 5e43be3)
      if (ok[u]) atomicAdd(&hist[(v[u] >> shift) & (unsigned int)(nbins - 1)], 1u);
    }
  }
  __syncthreads();
}

// One radix pass: the bin of bits [shift, shift + log2(nbins)) that holds the rem-th largest of the keys
// matching prefix under mask; narrows rem, prefix and mask to it. with_k2 (and 1 <= k2; the first pass of
// dsv4_radix_kth only: bins of the top 11 bits): floor2, the floor of the bin of the k2-th largest.
template <int NT, bool G>
__device__ __forceinline__ void dsv4_radix_pass(const unsigned int* keys, int n, int shift, int nbins,
                                                unsigned int* hist, int* wsum, int* sh, int& rem,
                                                unsigned int& prefix, unsigned int& mask, bool with_k2,
                                                int k2, unsigned int& floor2) {
  dsv4_hist_pass<NT, G>(keys, n, shift, nbins, prefix, mask, hist);
  dsv4_pick_bin<NT>(hist, nbins, rem, wsum, sh, with_k2, k2);
  if (with_k2 && k2 > 0) floor2 = ((unsigned int)sh[2]) << 21;
  rem = sh[1];
  prefix |= ((unsigned int)sh[0]) << shift;
  mask |= ((unsigned int)(nbins - 1)) << shift;
}

// Radix select (11 + 11 + 10 bits; passes P0..PE-1): the k-th largest of keys[0..n) (thr) and how many entries equal to
// it belong to the top k (need_eq). 1 <= k <= n. With 1 <= k2 <= n it also gives floor2, the floor of
// the first pass's bin that holds the k2-th largest (a lower bound of it, for free). sh: 3 ints.
// From pass P0 > 0: among the keys whose higher bits match `prefix` under `mask` only.
template <int NT, bool G = false, int P0 = 0, int PE = 3>
__device__ void dsv4_radix_kth(const unsigned int* keys, int n, int k, unsigned int* hist, int* wsum, int* sh,
                               unsigned int& thr, int& need_eq, int k2, unsigned int& floor2,
                               unsigned int prefix = 0u, unsigned int mask = 0u) {
  int rem = k;
  for (int pass = P0; pass < PE; ++pass) {
    const int shift = pass == 0 ? 21 : (pass == 1 ? 10 : 0);
    const int nbins = pass == 2 ? 1024 : 2048;
    dsv4_radix_pass<NT, G>(keys, n, shift, nbins, hist, wsum, sh, rem, prefix, mask, pass == 0, k2, floor2);
    __syncthreads();
  }
  thr = prefix;
  need_eq = rem;
}
template <int NT, bool G = false>
__device__ __forceinline__ void dsv4_radix_kth(const unsigned int* keys, int n, int k, unsigned int* hist, int* wsum,
                                               int* sh, unsigned int& thr, int& need_eq) {
  unsigned int unused;
  dsv4_radix_kth<NT, G>(keys, n, k, hist, wsum, sh, thr, need_eq, 0, unused);
}
// The first pass only: the floor of the top-11-bit bin that holds the k-th largest of keys[0..n) (a lower
// bound of it). 1 <= k <= n.
template <int NT>
__device__ __forceinline__ unsigned int dsv4_kth_floor(const unsigned int* keys, int n, int k, unsigned int* hist,
                                                       int* wsum, int* sh) {
  unsigned int thr, unused;
  int need_eq;
  dsv4_radix_kth<NT, false, 0, 1>(keys, n, k, hist, wsum, sh, thr, need_eq, 0, unused);
  return thr;
}
// The maxima of the 32 classes i mod 32 of keys[0..n) (32 <= n), to every thread: `bound`, their m-th largest
// (1 <= m <= 32; a lower bound of the keys' m-th largest: m distinct keys are >= it), and `least`, the
// least of them. A pass over the keys, two barriers and one warp's shuffles: 1.1K cycles at 128K, 8 rows,
// against 2.7K for the first radix pass it replaces (bench/idx_variants.py `kthfloor`; 2026-11-30, 4d0dfc9).
// gm: NT words of shared memory; sh: 2 ints.
template <int NT>
__device__ __forceinline__ void dsv4_class_maxima(const unsigned int* keys, int n, int m, unsigned int* gm, int* sh,
                                                  unsigned int& bound, unsigned int& least) {
  const int tid = threadIdx.x, lane = tid & 31;
  unsigned int mx = 0u;
  for (int i = tid; i < n; i += NT) mx = max(mx, keys[i]);  // class lane: NT is a multiple of 32
  gm[tid] = mx;
  __syncthreads();
  if (tid < 32) {
    unsigned int g = 0u;
    for (int w = 0; w < NT / 32; ++w) g = max(g, gm[w * 32 + lane]);
    int rank = 0;  // of this class's maximum among the 32, ties by lane: one lane has each rank
    for (int j = 0; j < 32; ++j) {
      const unsigned int x = __shfl_sync(0xffffffffu, g, j);
      rank += (x > g || (x == g && j < lane)) ? 1 : 0;
    }
    if (rank == m - 1) sh[0] = (int)g;
    if (rank == 31) sh[1] = (int)g;
  }
  __syncthreads();
  bound = (unsigned int)sh[0];
  least = (unsigned int)sh[1];
}

// Passes 2 and 3 only, among keys whose top 11 bits are `top` (its first pass came from elsewhere).
template <int NT, bool G>
__device__ __forceinline__ void dsv4_radix_low(const unsigned int* keys, int n, int rem, unsigned int top,
                                               unsigned int* hist, int* wsum, int* sh, unsigned int& thr,
                                               int& need_eq) {
  unsigned int unused;
  dsv4_radix_kth<NT, G, 1>(keys, n, rem, hist, wsum, sh, thr, need_eq, 0, unused, top << 21, 0x7ffu << 21);
}

// Radix select over offsets: keys[0..n) all in [0, span] (a list's keys minus its least kept key). Passes
// of up to HB bits from span's top bit down: two passes cover spans below 2^(2 HB), and no pass counts bits
// every key shares (the merge at 128K: 7.6K cycles, against 8.2K for the fixed 11 + 11 + 10-bit passes over
// the same offsets; bench/idx_variants.py `rawsel`; 2026-11-30, a260cb5). hist: 2^HB words. Gives the k-th largest
// offset (thr) and how many equal to it belong to the top k (need_eq).
template <int NT, int HB>
__device__ void dsv4_radix_kth_span(const unsigned int* keys, int n, int k, unsigned int span, unsigned int* hist,
                                    int* wsum, int* sh, unsigned int& thr, int& need_eq) {
  unsigned int prefix = 0u, mask = 0u, unused;
  int rem = k;
  for (int hi = 32 - __clz(span); hi > 0;) {  // hi: the bits below it are still open (0: every key equal)
    const int shift = hi > HB ? hi - HB : 0, nbins = 1 << (hi - shift);
    dsv4_radix_pass<NT, false>(keys, n, shift, nbins, hist, wsum, sh, rem, prefix, mask, false, 0, unused);
    __syncthreads();
    hi = shift;
  }
  thr = prefix;
  need_eq = rem;
}
// Ordered compaction of the top k: every key > thr and the first need_eq keys == thr, in index
// order; emit(position, index, key). Warp w takes a contiguous run of indices and its lanes read
// consecutive keys (no shared-memory bank conflicts, coalesced in global memory); ballots keep the order.
template <int NT, typename F>
__device__ void dsv4_take(const unsigned int* keys, int n, unsigned int thr, int need_eq, int* wsum, F emit) {
  constexpr int NW = NT / 32;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const unsigned int below = (1u << lane) - 1u;
  const int per = ((n + NW - 1) / NW + 31) & ~31;
  const int w0 = min(n, warp * per), w1 = min(n, w0 + per);
  int eq = 0, gt = 0;
  for (int i = w0 + lane; i < w1; i += 32) { const unsigned int v = keys[i]; eq += v == thr; gt += v > thr; }
  for (int s = 16; s > 0; s >>= 1) {
    eq += __shfl_xor_sync(0xffffffffu, eq, s);
    gt += __shfl_xor_sync(0xffffffffu, gt, s);
  }
  const int eq_before = __shfl_sync(0xffffffffu, dsv4_block_excl<NT>(lane == 0 ? eq : 0, wsum), 0);
  const int take_eq = max(0, min(eq, need_eq - eq_before));
  int pos = __shfl_sync(0xffffffffu, dsv4_block_excl<NT>(lane == 0 ? gt + take_eq : 0, wsum), 0);
  int r = eq_before;  // keys == thr before this run of 32
  for (int base = w0; base < w1; base += 32) {
    const int i = base + lane;
    const unsigned int v = i < w1 ? keys[i] : 0u;
    const bool is_eq = i < w1 && v == thr;
    const unsigned int beq = __ballot_sync(0xffffffffu, is_eq);
    const bool take = i < w1 && (v > thr || (is_eq && r + __popc(beq & below) < need_eq));
    const unsigned int bt = __ballot_sync(0xffffffffu, take);
    if (take) emit(pos + __popc(bt & below), i, v);
    pos += __popc(bt);
    r += __popc(beq);
  }
}
"""
