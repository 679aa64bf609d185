"""CUDA device code of indexer_rows in one launch with two select levels, for long rows (launch plan:
kernels/cuda/indexer.py, `TWO_LEVEL`; written without device time: off until its gpu test has run).

Grid (blocks of EB entries, batch rows), 256 threads. Every block scores its entries into the row's key
plane (the shared scoring body). Blocks form groups of GB; the last block of a group to finish (fence,
atomic ticket) selects the group's top-k over its keys (radix select over global keys, then an ordered
compaction) and writes them as (key, id) candidates, in id order, padded with key 0 / id -1; the last
group of the row to finish selects the row's top-k among its groups' candidates (in group order, so
ascending ids and ties to the lowest id) and writes the ids. The row's top-k is a subset of the union
of its groups' top-k. The one-block select of `indexer_one_src` sweeps the whole row (latency-bound past
~8K entries); here the groups select in parallel and the last step sees NG x k candidates only.

`scratch` planes (uint32, zeroed by the launch's init_value): row tickets [ceil4(B)], group tickets
[ceil4(B * NG)], keys [B][CAPN], candidate keys [B][LDC], candidate ids [B][LDC] (LDC = ceil4(NG * TOPK)).
Template constants: those of `indexer_one_src.ONE` but CAPL, + GB, NG, LDC. Rows no batch row names:
the extra grid row, as there.
"""

from __future__ import annotations

from kernels.cuda.indexer_one_src import _HIST, _NT, _OWN_HIST, _SKEY, HEAD_ONE
from kernels.cuda.indexer_src import PRE, SCORE

# Scratch planes (see the module doc); the ONE head's `ghist` / `gkeys` names are reused for the
# ticket and key planes, so its q-row fill, row / block bounds and `skey` come unchanged.
_ONE_PLANES = """  unsigned int* tickets = scratch;
  unsigned int* ghist = scratch + ((nb + 3) & ~3);
  unsigned int* gkeys = ghist + (size_t)nb * 2048;
"""
_TWO_PLANES = """  unsigned int* tickets = scratch;
  unsigned int* gtickets = scratch + ((nb + 3) & ~3);
  unsigned int* gkeys = gtickets + (((size_t)nb * NG + 3) & ~(size_t)3);
  unsigned int* ckeys = gkeys + (size_t)nb * CAPN;
  int* cids = reinterpret_cast<int*>(ckeys + (size_t)nb * LDC);
"""
_ONE_HIST_ZERO = """    for (int i = tid; i < 2048; i += NT) hist[i] = 0u;
    __syncthreads();
"""
assert _ONE_PLANES in HEAD_ONE and _ONE_HIST_ZERO in HEAD_ONE
HEAD_TWO = HEAD_ONE.replace(_ONE_PLANES, _TWO_PLANES).replace(_ONE_HIST_ZERO, "")

EMIT_KEYS = r"""if (tid < CH && c * CH + tid < nv) {
      float s = 0.f;
#pragma unroll
      for (int h = 0; h < HT; ++h) s += part[h * CH + tid];
      skey[c * CH + tid] = dsv4_okey(s);
    }"""

TAIL_TWO = r"""  }
  dsv4_cp_wait<0>();
  __threadfence();  // this block's keys are visible before its ticket
  __syncthreads();
  const int grp = blockIdx.x / GB, ngrp = (gridDim.x + GB - 1) / GB;
  const int gblocks = min(GB, (int)gridDim.x - grp * GB);
  if (tid == 0) sh[0] = atomicAdd(gtickets + (size_t)b * NG + grp, 1u) == (unsigned int)(gblocks - 1) ? 1 : 0;
  __syncthreads();
  if (sh[0] == 0) return;
  __threadfence();
  // the group's last block: its top-k as (key, id) candidates, in id order
  const unsigned int* rk = gkeys + (size_t)b * CAPN;
  unsigned int* ck = ckeys + (size_t)b * LDC + (size_t)grp * TOPK;
  int* ci = cids + (size_t)b * LDC + (size_t)grp * TOPK;
  {
    const int g0 = grp * GB * EB;
    const int gn = max(0, min(n, g0 + GB * EB) - g0);
    const int kg = min(TOPK, gn);
    unsigned int thr = 0u;
    int need_eq = gn;
    if (gn > TOPK) dsv4_radix_kth<NT, true>(rk + g0, gn, kg, hist, wsum, sh, thr, need_eq);
    dsv4_take_ordered<NT>(rk + g0, gn, thr, need_eq, wsum,
                          [&](int r, int i, unsigned int v) { ck[r] = v; ci[r] = g0 + i; });
    for (int i = kg + tid; i < TOPK; i += NT) { ck[i] = 0u; ci[i] = -1; }
  }
  __threadfence();  // the candidates are visible before the row ticket
  __syncthreads();
  if (tid == 0) sh[0] = atomicAdd(tickets + b, 1u) == (unsigned int)(ngrp - 1) ? 1 : 0;
  __syncthreads();
  if (sh[0] == 0) return;
  __threadfence();
  // the row's last group: the top-k among its groups' candidates (pads, key 0, stay below every score)
  int* o = out + (size_t)q_rows[b] * TOPK;
  const unsigned int* rc = ckeys + (size_t)b * LDC;
  const int* rid = cids + (size_t)b * LDC;
  const int L = ngrp * TOPK, K = min(TOPK, n);
  unsigned int thr = 0u;
  int need_eq = L;
  if (L > K && K > 0) dsv4_radix_kth<NT, true>(rc, L, K, hist, wsum, sh, thr, need_eq);
  if (K > 0)
    dsv4_take_ordered<NT>(rc, L, thr, need_eq, wsum, [&](int r, int i, unsigned int) { o[r] = __ldcg(rid + i); });
  for (int i = K + tid; i < TOPK; i += NT) o[i] = -1;
"""

TWO = (
    PRE.replace(_SKEY, _OWN_HIST).replace(_HIST, "").replace(_NT, "constexpr int NT = NTO, NWARP = NTO / 32,")
    + HEAD_TWO
    + SCORE.replace("EMIT", EMIT_KEYS)
    + TAIL_TWO
)
