"""CUDA device code of indexer_rows in two launches, score then select (launch plan: kernels/cuda/indexer.py).

1. `SCORE_KEYS`: grid (segments of SEG entries, batch rows), 256 threads. A block scores its segment with
   the shared scoring body (`indexer_src.SCORE`) and writes the order-preserving uint32 keys to the row's
   plane of `skeys` [B][CAPN]. No select in the segment: that was a quarter of the segment kernel's time.
2. `SELECT`: one block of 1024 threads per q-buffer row (rows no batch row names get -1). The histogram
   of the row's keys' top 11 bits (a sweep through L2), then the select of the one-launch kernel's last
   block (`indexer_one_src.SELECT_ROW`): the k-th key's bin, the rest of its bits by radix over that bin's
   keys only, an ordered compaction of the top-k ids ascending (ties to the lowest id). Exact: every key
   of the row takes part. Template constants: TOPK, CAPN, CAPL (keys the shared-memory list holds).
"""

from __future__ import annotations

from kernels.cuda.indexer_one_src import SELECT_ROW
from kernels.cuda.indexer_src import EMIT_SMEM, PRE, score

# `skey`: the block's run of the row's key plane in global memory (PRE's shared one is not used).
_SKEY = "  unsigned int* skey = reinterpret_cast<unsigned int*>(part + HT * CH);  // [SEG]\n"
_HIST = "  unsigned int* hist = skey + SEG;                                       // [2048]\n"
assert _SKEY in PRE and _HIST in PRE

HEAD_KEYS = r"""  const int b = blockIdx.y;
  const int n = dsv4_emitted(positions[b], 4);
  const int s0 = blockIdx.x * SEG;
  const int nv = max(0, min(SEG, n - s0));
  if (nv == 0) return;
  unsigned int* skey = skeys + (size_t)b * CAPN + s0;
"""
SCORE_KEYS = PRE.replace(_SKEY, "").replace(_HIST, "") + HEAD_KEYS + score().replace("EMIT", EMIT_SMEM)

# The row's histogram from its keys: warp-aggregated shared atomics (scores cluster in a few bins).
SELECT_HIST = r"""    for (int i = tid; i < 2048; i += NT) hist[i] = 0u;
    __syncthreads();
    {
      int h0, h1;
      dsv4_warp_run<NT>(n, h0, h1);
      dsv4_sweep<8>(rk, h0, h1, [&](int i, const unsigned int* x) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const bool ok = i + j < h1;
          const unsigned int bin = ok ? x[j] >> 21 : 0xffffffffu;
          const unsigned int peers = __match_any_sync(0xffffffffu, bin);
          if (ok && lane == __ffs(peers) - 1) atomicAdd(&hist[bin], (unsigned int)__popc(peers));
        }
      });
    }
    __syncthreads();
"""
SELECT = (
    r"""
  constexpr int NT = 1024;
  extern __shared__ __align__(16) unsigned char smem_raw[];  // [CAPL] the k-th key's bin
  __shared__ unsigned int hist[2048];
  __shared__ int wsum[32];
  __shared__ int sh[3];
  const int r = blockIdx.x, tid = threadIdx.x, lane = tid & 31;
  const int nb = positions_shape[0];
  int b = -1;
  for (int i0 = 0; i0 < nb; i0 += 32) {  // every warp finds the batch row itself: a load per lane, a ballot
    const unsigned int m = __ballot_sync(0xffffffffu, i0 + lane < nb && q_rows[i0 + lane] == r);
    if (m) b = i0 + 31 - __clz(m);  // the last batch row naming r
  }
  int* o = out + (size_t)r * TOPK;
  const int n = b >= 0 ? dsv4_emitted(positions[b], 4) : 0;  // 0: every id -1
  const unsigned int* rk = skeys + (size_t)max(b, 0) * CAPN;
"""
    + SELECT_ROW.replace("FILL_HIST", SELECT_HIST)
)
