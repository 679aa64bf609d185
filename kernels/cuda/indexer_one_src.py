"""CUDA device code of indexer_rows in ONE launch (launch plan: kernels/cuda/indexer.py).

Grid (blocks of EB entries, batch rows + 1), 256 threads. Every block scores its EB entries (the
shared scoring body, `indexer_src.SCORE`), writes their order-preserving keys to the row's plane of
`scratch` and adds their top-11-bit histogram to the row's global one. The last block of a row to
finish (a counter per row: fence, then an atomic ticket, as in CUDA's threadFenceReduction) selects:
the k-th largest key's bin from the row's histogram, then the rest of its bits by radix over the
keys of that bin only (collected in shared memory; over the whole row when too many share it), then
an ordered compaction writes the top-k ids ascending (ties to the lowest id). The extra grid row
writes -1 for q rows no batch row names. The one output `out` (int32) holds the ids [Bq][TOPK], then
from word ceil4(Bq * TOPK) the `scratch` planes (uint32): ticket counters [ceil4(B)], histograms
[B][2048], keys [B][CAPN]; all start zeroed (the launch's init_value). `ONE_WS` (a caller's
`workspace` [rows][4 + 2048 + CAPN]: row b's ticket, histogram (zero before the launch) and keys) leaves `out`
the ids alone ([Bq][TOPK]), needs no init_value fill (a graph node) and zeroes its rows' tickets and
histograms again as each row's last block finishes: launches that share a workspace must run one after
another (the model's layers do).
Template constants: T, NI, DI, PAGE, TOPK, CH, ST (as the segment kernel), NTO (threads per block:
more warps hide more of the select's latency), EB, CAPN, CAPL (keys the shared-memory list holds).
"""

from __future__ import annotations

from dsv4_serve.kernels.cuda.indexer_src import PRE, score

# Helpers (after select.HELPERS: dsv4_block_excl, the radix selects). Loads of `scratch` written by other
# blocks of this launch go through L2 (__ldcg): no SM may serve them from a stale L1 line.
ONE_HELPERS = r"""
// A warp's ordered sweep over global keys[w0, w1) (w0 a multiple of 4; reads to a multiple of 4 stay
// in bounds): U 16-byte loads per lane in flight (through L2), then f(i, x) for each run of 128 keys
// in order, lane l getting keys i..i+3 (x[0..3]) of it; f checks i + j < w1 itself.
template <int U, typename F>
__device__ __forceinline__ void dsv4_sweep(const unsigned int* keys, int w0, int w1, F f) {
  const int lane = threadIdx.x & 31;
  for (int base = w0; base < w1; base += 128 * U) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int i = base + u * 128 + 4 * lane;
      v[u] = i < w1 ? __ldcg(reinterpret_cast<const uint4*>(keys + i)) : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (base + u * 128 >= w1) break;  // the same for the whole warp
      const unsigned int x[4] = {v[u].x, v[u].y, v[u].z, v[u].w};
      f(base + u * 128 + 4 * lane, x);
    }
  }
}
// Warp w's contiguous run of n keys (a multiple of 128 long).
template <int NT>
__device__ __forceinline__ void dsv4_warp_run(int n, int& w0, int& w1) {
  constexpr int NW = NT / 32;
  const int per = ((n + NW - 1) / NW + 127) & ~127;
  w0 = min(n, (int)(threadIdx.x >> 5) * per);
  w1 = min(n, w0 + per);
}
// Ordered compaction over global keys[0..n): emit(rank, i, key) for every key > thr and the first need_eq
// keys == thr, ascending i (ties to the lowest id). A count sweep, block scans, a write sweep.
template <int NT, typename E>
__device__ void dsv4_take_ordered(const unsigned int* keys, int n, unsigned int thr, int need_eq, int* wsum, E emit) {
  const int lane = threadIdx.x & 31;
  int w0, w1;
  dsv4_warp_run<NT>(n, w0, w1);
  int gt = 0, eq = 0;
  dsv4_sweep<8>(keys, w0, w1, [&](int i, const unsigned int* x) {
#pragma unroll
    for (int j = 0; j < 4; ++j) if (i + j < w1) { gt += x[j] > thr; eq += x[j] == thr; }
  });
  for (int s = 16; s > 0; s >>= 1) {
    gt += __shfl_xor_sync(0xffffffffu, gt, s);
    eq += __shfl_xor_sync(0xffffffffu, eq, s);
  }
  const int eq_before = __shfl_sync(0xffffffffu, dsv4_block_excl<NT>(lane == 0 ? eq : 0, wsum), 0);
  const int take_eq = max(0, min(eq, need_eq - eq_before));
  int pos = __shfl_sync(0xffffffffu, dsv4_block_excl<NT>(lane == 0 ? gt + take_eq : 0, wsum), 0);
  int r = eq_before;  // keys == thr before this run of 128
  dsv4_sweep<8>(keys, w0, w1, [&](int i, const unsigned int* x) {
    int e = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) e += (i + j < w1 && x[j] == thr) ? 1 : 0;
    int ei = e;  // inclusive scan of the lanes' equal counts
    for (int s = 1; s < 32; s <<= 1) { const int t = __shfl_up_sync(0xffffffffu, ei, s); if (lane >= s) ei += t; }
    int re = r + ei - e;
    bool tk[4];
    int t = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const bool in = i + j < w1;
      tk[j] = in && (x[j] > thr || (x[j] == thr && re < need_eq));
      re += (in && x[j] == thr) ? 1 : 0;
      t += tk[j] ? 1 : 0;
    }
    int ti = t;
    for (int s = 1; s < 32; s <<= 1) { const int u = __shfl_up_sync(0xffffffffu, ti, s); if (lane >= s) ti += u; }
    int at = pos + ti - t;
#pragma unroll
    for (int j = 0; j < 4; ++j) if (tk[j]) emit(at++, i + j, x[j]);
    pos += __shfl_sync(0xffffffffu, ti, 31);
    r += __shfl_sync(0xffffffffu, ei, 31);
  });
}
"""

# The chunk's scores to their keys in global memory, and to the block's histogram of their top 11 bits.
EMIT_GLOBAL = r"""if (tid < CH) {  // warps 0 and 1, whole
      const bool ok = c * CH + tid < nv;
      float s = 0.f;
#pragma unroll
      for (int h = 0; h < HT; ++h) s += part[h * CH + tid];
      const unsigned int v = dsv4_okey(s);
      if (ok) skey[c * CH + tid] = v;
      const unsigned int bin = ok ? v >> 21 : 0xffffffffu;
      const unsigned int peers = __match_any_sync(0xffffffffu, bin);
      if (ok && lane == __ffs(peers) - 1) atomicAdd(&hist[bin], (unsigned int)__popc(peers));
    }"""

# Row b's ticket, histogram and keys: tickets + b * t_st, ghist + b * h_st, gkeys + b * k_st.
_SCRATCH = r"""  unsigned int* scratch = reinterpret_cast<unsigned int*>(out) + ((q_shape[0] * TOPK + 3) & ~3);
  unsigned int* tickets = scratch;
  unsigned int* ghist = scratch + ((nb + 3) & ~3);
  unsigned int* gkeys = ghist + (size_t)nb * 2048;
  constexpr size_t t_st = 1, h_st = 2048, k_st = CAPN;
"""
# ONE_WS: row b of the workspace [rows][4 + 2048 + keys] (kernels.indexer.WS_HEAD): the same place whatever nb
_SCRATCH_WS = r"""  unsigned int* tickets = const_cast<unsigned int*>(workspace);
  unsigned int* ghist = tickets + 4;
  unsigned int* gkeys = tickets + 4 + 2048;
  const size_t t_st = workspace_shape[1], h_st = t_st, k_st = t_st;
"""
HEAD_ONE = r"""  const int nb = positions_shape[0];
SCRATCH  if (blockIdx.y == nb) {  // the extra grid row: q rows no batch row names get -1
    if (blockIdx.x == 0) {
      for (int r = 0; r < q_shape[0]; ++r) {
        bool named = false;
        for (int i = 0; i < nb; ++i) named |= q_rows[i] == r;
        if (!named) for (int i = tid; i < TOPK; i += NT) out[(size_t)r * TOPK + i] = -1;
      }
    }
    return;
  }
  const int b = blockIdx.y;
  const int n = dsv4_emitted(positions[b], 4);
  const int s0 = blockIdx.x * EB;
  const int nv = max(0, min(EB, n - s0));
  unsigned int* skey = gkeys + b * k_st + s0;
  if (nv > 0) {
    for (int i = tid; i < 2048; i += NT) hist[i] = 0u;
    __syncthreads();
"""

TAIL_ONE = r"""    for (int i = tid; i < 2048; i += NT) {
      const unsigned int h = hist[i];
      if (h) atomicAdd(ghist + b * h_st + i, h);
    }
  }
  dsv4_cp_wait<0>();
  __threadfence();  // this block's keys and histogram are visible before its ticket
  __syncthreads();
  if (tid == 0) sh[0] = atomicAdd(tickets + b * t_st, 1u) == gridDim.x - 1 ? 1 : 0;
  __syncthreads();
  if (sh[0] == 0) return;
  __threadfence();
  // the row's last block: its top-k
  int* o = out + (size_t)q_rows[b] * TOPK;
  const unsigned int* rk = gkeys + b * k_st;  // the row's keys
  const int K = min(TOPK, n);
  unsigned int thr = 0u;  // keys are >= 1 (0 only for NaN): with thr 0 and need_eq n every entry is taken
  int need_eq = n;
  if (n > TOPK) {
    for (int i = tid; i < 2048; i += NT) hist[i] = __ldcg(ghist + b * h_st + i);
    __syncthreads();
    dsv4_pick_bin<NT>(hist, 2048, K, wsum, sh);
    const unsigned int top = (unsigned int)sh[0];
    const int rem = sh[1];
    __syncthreads();
    // the keys of bin `top`, in any order, into the (now idle) pipeline buffers
    unsigned int* list = reinterpret_cast<unsigned int*>(smem_raw);
    if (tid == 0) sh[2] = 0;
    __syncthreads();
    int w0, w1;
    dsv4_warp_run<NT>(n, w0, w1);
    dsv4_sweep<8>(rk, w0, w1, [&](int i, const unsigned int* x) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const bool m = i + j < w1 && (x[j] >> 21) == top;
        const unsigned int bal = __ballot_sync(0xffffffffu, m);
        if (bal == 0u) continue;
        int at0 = 0;
        if (lane == 0) at0 = atomicAdd(&sh[2], __popc(bal));
        at0 = __shfl_sync(0xffffffffu, at0, 0);
        const int at = at0 + __popc(bal & ((1u << lane) - 1u));
        if (m && at < CAPL) list[at] = x[j];
      }
    });
    __syncthreads();
    const int c0 = sh[2];
    __syncthreads();
    if (c0 <= CAPL) dsv4_radix_low<NT, false>(list, c0, rem, top, hist, wsum, sh, thr, need_eq);
    else dsv4_radix_low<NT, true>(rk, n, rem, top, hist, wsum, sh, thr, need_eq);
  }
  dsv4_take_ordered<NT>(rk, n, thr, need_eq, wsum, [&](int r, int i, unsigned int) { o[r] = i; });
  for (int i = K + tid; i < TOPK; i += NT) o[i] = -1;
RESET"""
# ONE_WS: the row's workspace zeroed again for the next launch. Every block of the row added to it before
# its ticket, so nothing writes it any more; this thread read ghist[i] (the select's copy) before.
_RESET_WS = r"""  for (int i = tid; i < 2048; i += NT) ghist[b * h_st + i] = 0u;
  if (tid == 0) tickets[b * t_st] = 0u;
"""

# The segment kernel's shared key array `skey` becomes this kernel's shared histogram; `skey` here is
# the block's run of the row's global key plane (where the shared scoring body writes).
_SKEY = "  unsigned int* skey = reinterpret_cast<unsigned int*>(part + HT * CH);  // [SEG]\n"
_HIST = "  unsigned int* hist = skey + SEG;                                       // [2048]\n"
assert _SKEY in PRE and _HIST in PRE
_OWN_HIST = "  unsigned int* hist = reinterpret_cast<unsigned int*>(part + HT * CH);  // [2048]\n"
_NT = "constexpr int NT = 256, NWARP = 8,"
assert _NT in PRE


def one(workspace: bool) -> str:
    """The one-launch kernel's source: scratch in its output (init_value zeroed) or in `workspace`."""
    return (
        PRE.replace(_SKEY, _OWN_HIST).replace(_HIST, "").replace(_NT, "constexpr int NT = NTO, NWARP = NTO / 32,")
        + HEAD_ONE.replace("SCRATCH", _SCRATCH_WS if workspace else _SCRATCH)
        + score().replace("EMIT", EMIT_GLOBAL)
        + TAIL_ONE.replace("RESET", _RESET_WS if workspace else "")
    )


ONE, ONE_WS = one(False), one(True)
