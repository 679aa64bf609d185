"""Source variants of the indexer segment kernel's scoring loop, for bench/phases.py to time (probe only).

Measured on the H200 (session 12, bench/results/session12-h200.md), none beat the kernel's own loop:
- `bulk`: Hopper bulk copies (cp.async.bulk, one per entry, an mbarrier per stage) instead of cp.async:
  the scoring loop took 2x as long (96.7K vs 49.1K cycles at 8 rows, 128K).
- `st5`: five stages in flight instead of four: no change (more bytes in flight did not help).
- diagnostics `compute` (no loads in the loop: computes on stale buffers) and `load` (no mma): each
  alone took ~80% of the loop's time, so the loop was bound by its instruction latency chain.
The launch bound (session 13, `bounds` / `nobounds` against the plan's own choice, `base`):
- `__launch_bounds__(256, 2)` (kernels/cuda/common.launch_bounds: MLX's `cuda_kernel` writes the kernel's
  signature itself, so a header macro adds the bound to the `__global__` that follows it): ptxas then runs
  the 4 entry tiles' mma chains side by side (112 registers, not 57). 8 rows, 128K: segment span 35.7 ->
  32.3 us; 1 row: 24.9 -> 20.7; but 8 rows, 1M: 211 -> 305 us. The plan bounds segments of up to
  indexer.SEG_BOUNDED_MAX entries only.
The select's histograms (session 14): `matchany`, the MATCH.ANY aggregation the kernels had up to session 13.
Session 15: `kthfloor` (dense segments' bound from the first radix pass, not class maxima) and `rawsel` (the
merge's select over its offsets in fixed 11 + 11 + 10-bit passes, not over the span's bits).
"""

from __future__ import annotations

import kernels.cuda.indexer as ki
import kernels.cuda.indexer_src as isrc
from kernels.cuda.common import launch_bounds

# Bulk (Hopper TMA, cp.async.bulk): warp 0 issues one copy per entry (DI * 2 bytes into its padded row)
# and the chunk's mbarrier counts the bytes; every thread waits on that barrier's phase. Rows past nv
# keep stale data: their scores are never emitted.
LOAD_BULK = r"""__shared__ __align__(8) unsigned long long bars[ST];
  if (tid == 0) {
    for (int s = 0; s < ST; ++s) dsv4_mbar_init(&bars[s]);
    dsv4_mbar_fence_init();
  }
  __syncthreads();
  auto load = [&](int c) {
    if (c < nch && warp == 0) {
      T* dst = Ks + (c % ST) * CH * LDK;
      const int ne = min(CH, nv - c * CH);
      if (lane == 0) dsv4_mbar_expect(&bars[c % ST], ne * DI * (int)sizeof(T));
      __syncwarp();
      for (int e = lane; e < ne; e += 32) {
        const int idx = s0 + c * CH + e;
        const T* src = keys + ((size_t)table[(size_t)b * tw + idx / PAGE] * PAGE + idx % PAGE) * DI;
        dsv4_bulk(dst + e * LDK, src, DI * (int)sizeof(T), &bars[c % ST]);
      }
    }
  };"""
WAIT_BULK = "dsv4_mbar_wait(&bars[c % ST], (c / ST) & 1);  // chunk c has landed"
# mbarrier + bulk-copy helpers (sm_90).
BULK_HELPERS = r"""
__device__ __forceinline__ unsigned int dsv4_sa(const void* p) { return (unsigned int)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void dsv4_mbar_init(unsigned long long* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(dsv4_sa(bar)) : "memory");
}
__device__ __forceinline__ void dsv4_mbar_fence_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void dsv4_mbar_expect(unsigned long long* bar, int bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(dsv4_sa(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void dsv4_bulk(void* dst, const void* src, int bytes, unsigned long long* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
               ::"r"(dsv4_sa(dst)), "l"(src), "r"(bytes), "r"(dsv4_sa(bar)) : "memory");
}
__device__ __forceinline__ void dsv4_mbar_wait(unsigned long long* bar, int parity) {
  unsigned int ok = 0;
  while (!ok) {
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(ok) : "r"(dsv4_sa(bar)), "r"(parity) : "memory");
  }
}
"""


# The select helpers' histogram as it was up to session 13: a warp's equal bins aggregated by MATCH.ANY, one
# atomic per distinct bin. Session 14 (`plainhist`, then the kernels' own form) measured one plain shared
# atomic per key as faster: 8 rows, segment select 11.3K -> 9.1K cycles at 128K, 31.6K -> 17.3K at 1M; merge
# select 8.5K -> 7.6K. `matchany` keeps the old form to time against.
PLAIN = "      if (ok[u]) atomicAdd(&hist[(v[u] >> shift) & (unsigned int)(nbins - 1)], 1u);"
AGG = """      const unsigned int lane = threadIdx.x & 31;
      const unsigned int bin = ok[u] ? ((v[u] >> shift) & (unsigned int)(nbins - 1)) : 0xffffffffu;
      const unsigned int peers = __match_any_sync(0xffffffffu, bin);
      if (ok[u] && lane == __ffs(peers) - 1) atomicAdd(&hist[bin], (unsigned int)__popc(peers));"""
assert PLAIN in ki.HELPERS
MATCH_HELPERS = ki.HELPERS.replace(PLAIN, AGG)

# name -> (bulk loader, stages (None: the kernel's), diagnostic). Diagnostics are timing only (unchecked output).
SEG_VARIANTS = {"base": (False, None, ""), "st5": (False, 5, ""), "bulk": (True, None, ""), "bulk5": (True, 5, ""),
                "bounds": (False, None, "bounds"), "nobounds": (False, None, "nobounds"),
                "matchany": (False, None, "matchany"), "kthfloor": (False, None, "kthfloor"),
                "rawsel": (False, None, "rawsel"), "compute": (False, None, "compute"),
                "load": (False, None, "load")}  # fmt: skip


def seg_variant(name: str, seg: int) -> tuple[str, str, int | None, bool]:
    """(source, header, stages, checked) of a segment variant for `seg`-entry segments (the launch bound
    as the kernel's plan picks it, or forced on / off)."""
    bulk, st, diag = SEG_VARIANTS[name]
    src = isrc.segment(LOAD_BULK, WAIT_BULK) if bulk else isrc.SEGMENT
    if diag == "kthfloor":  # dense segments' bound from the first radix pass (session 14), not class maxima
        src = src.replace("nv == SEG && mf <= 32;", "false;")
    elif diag == "compute":
        src = src.replace("    load(c + ST - 1);\n", "    dsv4_cp_commit();\n")
    elif diag == "load":
        src = src.replace("dsv4_mma(acc[j], qa[ks], bf[j][0], bf[j][1], T());",
                          "acc[j][0] += __uint_as_float(bf[j][0]);")
        src = src.replace("dsv4_mma(acc[j], qa[ks + 1], bf[j][2], bf[j][3], T());",
                          "acc[j][1] += __uint_as_float(bf[j][2]);")
    mb = {"bounds": 2, "nobounds": 0}.get(diag, ki.segment_min_blocks(seg))
    helpers = MATCH_HELPERS if diag == "matchany" else ki.HELPERS
    header = helpers + (BULK_HELPERS if bulk else "") + launch_bounds(ki.NT, mb)
    return src, header, st, diag in ("", "bounds", "nobounds", "matchany", "kthfloor", "rawsel")


SPAN_SELECT = "dsv4_radix_kth_span<NT, HB>(ck, n2, K, top - bound, hist, wsum, sh, thr, need_eq);"
assert SPAN_SELECT in ki.MERGE


def merge_variant(name: str) -> tuple[str, str]:
    """(source, header) of the merge that goes with segment variant `name`: `rawsel` selects over the
    offsets with the fixed 11 + 11 + 10-bit passes (as up to session 14: the first pass's atomics on few
    bins); `matchany` with the old histograms."""
    src = ki.MERGE.replace(SPAN_SELECT, "dsv4_radix_kth<NT>(ck, n2, K, hist, wsum, sh, thr, need_eq);") \
        if name == "rawsel" else ki.MERGE  # fmt: skip
    return src, ki.MERGE_HEADER.replace(ki.HELPERS, MATCH_HELPERS) if name == "matchany" else ki.MERGE_HEADER
